"""From StructuredOutputsParams to xgrammar grammars: checked in the frontend, compiled
in the engine.

JSON schemas compile without free whitespace (xgrammar's any_whitespace=False: one
space after ':' and ','), so a model cannot wander into an endless run of newlines
inside an object, which small models do. xgrammar is imported on first use: its import
costs ~3.7 s (it loads triton), which no unconstrained server should pay.
"""
from __future__ import annotations

import atexit
import functools
import hashlib
import json
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from engine.errors import InvalidRequestError
from engine.structured.check_limit import run_check
from engine.structured.params import StructuredOutputsParams

if TYPE_CHECKING:  # torch too: the ingress checks grammars without loading it
    import torch
    import xgrammar

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " and may carry a
# "Check failed: (...) is false: " clause; users get the sentence after them.
_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: .*? is false:\s*)?")
COMPILED_CACHE_SIZE = 256


def _clean(exc: Exception) -> str:
    return _CPP_PREFIX.sub("", str(exc)).strip()


def choice_ebnf(choices: list[str]) -> str:
    """One alternative per choice, each an exact string literal."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def build_grammar(spec: StructuredOutputsParams) -> "xgrammar.Grammar":
    """The spec as an xgrammar Grammar (tokenizer-independent); InvalidRequestError if
    it does not compile, with xgrammar's reason."""
    import xgrammar as xgr
    try:
        if spec.json is not None:
            try:
                json.loads(spec.json)
            except ValueError as exc:
                raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}") from None
            return xgr.Grammar.from_json_schema(spec.json, any_whitespace=False)
        if spec.json_object:
            return xgr.Grammar.builtin_json_grammar()
        if spec.regex is not None:
            return xgr.Grammar.from_regex(spec.regex)
        if spec.choice is not None:
            return xgr.Grammar.from_ebnf(choice_ebnf(spec.choice))
        return xgr.Grammar.from_ebnf(spec.grammar)
    except (RuntimeError, ValueError, TypeError) as exc:
        if isinstance(exc, InvalidRequestError):
            raise
        raise InvalidRequestError(
            f"structured outputs {spec.kind} does not compile: {_clean(exc)}") from None


_CHECKED_SIZE = 4096
_checked: OrderedDict[bytes, None] = OrderedDict()  # digests of specs that built
_checked_lock = threading.Lock()


def check_structured_outputs(spec: StructuredOutputsParams) -> None:
    """Raise InvalidRequestError unless spec compiles (the frontend's check, so a bad
    schema is answered before it reaches a scheduler), within a time limit inside the
    request's deadline (engine/structured/check_limit.py). A spec that built before is
    not rebuilt; only its digest is kept, so large schemas do not pile up in memory."""
    digest = hashlib.sha256(spec.cache_key()).digest()
    with _checked_lock:
        if digest in _checked:
            _checked.move_to_end(digest)
            return
    run_check(digest, functools.partial(_build_and_mark, spec, digest))


def _build_and_mark(spec: StructuredOutputsParams, digest: bytes) -> None:
    """On the check's thread: a build that ends after its request gave up still marks
    the spec checked."""
    build_grammar(spec)
    with _checked_lock:
        _checked[digest] = None
        while len(_checked) > _CHECKED_SIZE:
            _checked.popitem(last=False)


_IMPORT_WAIT_AT_EXIT_S = 60.0
_loader: threading.Thread | None = None


def preload_xgrammar() -> None:
    """Import xgrammar on a daemon thread (once per process), so the first constrained
    request does not stall a frontend's event loop for the ~3.7 s import. Frontends
    start it before their engines load and wait_for_xgrammar before they report ready:
    an import still running beside the first requests held the GIL and a core from them
    (a fresh engine's first single-sequence decode ran at 0.80-0.88 of its second, 2
    cores, Zen 4 held to AVX2)."""
    global _loader
    if _loader is not None:
        return
    # The names xgrammar takes from lazily importing packages, resolved here first: a
    # transformers attribute first asked for on this thread while the caller's thread
    # imported other parts of transformers (the model's load) raised ImportError there.
    import pydantic  # noqa: F401
    import torch  # noqa: F401
    from pydantic import BaseModel, Field, TypeAdapter  # noqa: F401
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast  # noqa: F401

    def _load() -> None:
        try:
            import xgrammar  # noqa: F401
        except ImportError:  # reported by the first request that needs it
            pass
    _loader = threading.Thread(target=_load, name="xgrammar-import", daemon=True)
    _loader.start()
    # A process that is done before the import is (a short `flotilla generate`) must not
    # tear the interpreter down under it: a C++ extension half-loaded on a daemon thread
    # at exit aborted the process ("terminate called without an active exception").
    atexit.register(_loader.join, _IMPORT_WAIT_AT_EXIT_S)


def wait_for_xgrammar(timeout_s: float = _IMPORT_WAIT_AT_EXIT_S) -> bool:
    """Block until preload_xgrammar's import has ended (at once if it never started);
    False if it is still running after timeout_s."""
    loader = _loader
    if loader is None:
        return True
    loader.join(timeout_s)
    return not loader.is_alive()


def _no_control_mask(vocab: list[bytes], vocab_size: int) -> torch.Tensor:
    """Token bitmask (xgrammar's layout: token t is bit t % 32 of int32 word t // 32) of
    the tokens with no byte below 0x20. JSON never needs one once free whitespace is
    off, and xgrammar 0.2.8 lets them into strings that have a maxLength (its bounded
    string rule drops the control-character exclusion), which makes the output
    unparseable; JSON constraints AND their mask with this one."""
    import torch
    words = (vocab_size + 31) // 32
    ok = torch.zeros(words * 32, dtype=torch.bool)
    ok[:len(vocab)] = torch.tensor([not any(b < 0x20 for b in tok) for tok in vocab])
    bits = ok.view(words, 32).to(torch.int64) << torch.arange(32, dtype=torch.int64)
    packed = bits.sum(dim=1)
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


class GrammarCompiler:
    """Compiles specs against one tokenizer; keeps the last COMPILED_CACHE_SIZE results,
    so a schema that many requests share compiles once. Thread-safe: the engine compiles
    on a worker thread while its loop steps."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids) or None)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.no_control_mask = _no_control_mask(info.decoded_vocab, vocab_size)
        self._cache: OrderedDict[bytes, Any] = OrderedDict()
        self._lock = threading.Lock()

    def cached(self, spec: StructuredOutputsParams) -> "xgrammar.CompiledGrammar | None":
        """The compiled grammar if this constraint was compiled before (no waiting in
        line behind another request's compile)."""
        key = spec.cache_key()
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
            return compiled

    def compile(self, spec: StructuredOutputsParams) -> "xgrammar.CompiledGrammar":
        """InvalidRequestError if xgrammar cannot compile it for this tokenizer."""
        compiled = self.cached(spec)
        if compiled is not None:
            return compiled
        grammar = build_grammar(spec)
        try:
            compiled = self._compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as exc:
            raise InvalidRequestError(f"structured outputs {spec.kind} does not compile "
                                      f"for this tokenizer: {_clean(exc)}") from None
        key = spec.cache_key()
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > COMPILED_CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled
