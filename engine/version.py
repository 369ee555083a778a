"""The engine's version, a module of its own: the engine's modules read it here, not
from the engine package's __init__, which imports them (its lazy LLM reaches the engine
core, which read __version__ back from engine: a circle, tests/test_import_graph.py).
pyproject.toml's version is kept equal to it by hand.
"""
__version__ = "0.1.0"
