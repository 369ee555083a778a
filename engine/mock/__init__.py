"""The mock engine: a model-free engine core (core.py) that implements the engine-core
interface as EngineCore does, its options (config.py), its scripted output (script.py)
and its server processes (serve.py, `python -m engine.mock`). Frontend tests and
benchmarks run against it; it is no part of the wire it is served over."""
