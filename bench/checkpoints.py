"""The float checkpoint the benchmarks' anchors (vLLM, HF transformers) load.

Flotilla serves the default model from its GGUF blocks; vLLM and HF need float weights.
decoded_default() is the file as transformers decodes it, saved once as a Hugging Face
checkpoint under the cache; float_checkpoint(model) gives it for the default model's
names and the model's own directory otherwise. Benchmarks that compare engines on the
same weights in the same dtype (bench/throughput.py, serve.py, prefill.py) run Flotilla
on it too; bench/quant.py compares the blocks with it.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def decoded_default() -> Path:
    from tests.gguf_helpers import decoded_default_model
    return decoded_default_model()


def float_checkpoint(model: str) -> str:
    """A float checkpoint directory for `model` (the default model's names included)."""
    from engine.model.loader import DEFAULT_MODEL_ALIASES, resolve_model
    if model in DEFAULT_MODEL_ALIASES:
        return str(decoded_default())
    return str(resolve_model(model))
