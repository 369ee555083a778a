"""The float checkpoint the benchmarks' anchors (vLLM, HF transformers) load.

Flotilla serves the default model from its GGUF blocks; vLLM and HF need float weights.
decoded_default() is the file as transformers decodes it, saved once as a Hugging Face
checkpoint under the cache; float_checkpoint(model) gives it for the default model's
names and the model's own directory otherwise. Benchmarks that compare engines on the
same weights in the same dtype (bench/throughput.py, serve.py, prefill.py) run Flotilla
on it too; bench/quant.py compares the blocks with it. random_checkpoint() saves a
random-weight checkpoint of a config once (the MoE and Gemma 3 benchmarks'), so every
engine loads the same file.
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


def random_checkpoint(name: str, config_class, architecture: str, **shape) -> Path:
    """A random-weight bf16 checkpoint of config_class(**shape) with the default model's
    tokenizer, made once under the cache's bench/<name> (seed 0)."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.model.loader import cache_root, load_tokenizer, resolve_model
    target = cache_root() / "bench" / name
    if target.is_dir():  # renamed into place once complete
        return target
    tokenizer = load_tokenizer(resolve_model("default"))
    config = config_class(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=tokenizer.eos_token_id, **shape)
    config.architectures = [architecture]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = target.with_name(target.name + ".partial")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(target)
    return target
