"""Scripted output for the mock engine: a prompt tells the mock what text to emit.

Why: the HTTP APIs (chat completions, Responses, Anthropic Messages) turn model text
into reasoning, tool calls and stream events through parsers, and a test of that path
needs the model to say something precise. A real model cannot be told to; the mock
(MockConfig.scripted) can: when the prompt holds an emit directive, the request's
output is the directive's text, tokenized by the tokenizer the frontend decodes with,
then EOS. This module holds that logic, so engine/mock/core.py stays about scheduling
and timing.

A directive is EMIT_OPEN + text + EMIT_CLOSE anywhere in the prompt's decoded text (a
chat template's message, a system prompt); the LAST EMIT_OPEN of the prompt wins, its
text runs to the first EMIT_CLOSE after it and is taken verbatim (no trimming), so a
script cannot hold EMIT_OPEN itself. Its tokens are tokenizer.encode(text,
add_special_tokens=False); with structured outputs that name reasoning_end, the first
occurrence of that marker's text is emitted as exactly those ids (as a reasoning model
emits its end marker), so the constraint starts where the request says it does.

Structured outputs are checked, not enforced: the mock has no logits to mask, so a
scripted request with a constraint is accepted only when its script satisfies it (the
tokens after the first reasoning_end, if any, then EOS, are a complete match of the
compiled grammar), else refused. xgrammar (and the tokenizer's vocabulary scan, ~0.25 s)
are loaded on the first constrained request.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from engine.structured.grammar import GrammarCompiler
    from engine.structured.params import StructuredOutputsParams

EMIT_OPEN = "[[emit]]"  # starts a directive: the text the mock emits ...
EMIT_CLOSE = "[[/emit]]"  # ... up to here
_SHOWN_CHARS = 60  # of the script around a refused token, in the error message


def find_script(text: str) -> str | None:
    """The text of the last directive in `text`; None without one."""
    start = text.rfind(EMIT_OPEN)
    if start < 0:
        return None
    body = start + len(EMIT_OPEN)
    end = text.find(EMIT_CLOSE, body)
    if end < 0:
        raise InvalidRequestError(f"mock engine: the prompt's last {EMIT_OPEN} directive "
                                  f"has no {EMIT_CLOSE} after it")
    return text[body:end]


def find_sequence(ids: list[int], sequence: list[int]) -> int | None:
    """Index of the first occurrence of `sequence` in `ids`; None if it never occurs."""
    n = len(sequence)
    for i in range(len(ids) - n + 1):
        if ids[i:i + n] == sequence:
            return i
    return None


def default_tokenizer() -> Any:
    """The default model's tokenizer: the one the served mock's frontends decode with."""
    from engine.model.loader import load_tokenizer, resolve_model
    return load_tokenizer(resolve_model("default"))


class MockScript:
    """A scripted mock's tokenizer work: directives, script tokens, constraint checks."""

    def __init__(self, tokenizer: Any, eos_token_id: int) -> None:
        """tokenizer: an HF tokenizer, the one the frontends decode with; the mock takes
        its vocabulary size and EOS id (eos_token_id: when it names none)."""
        if tokenizer is None:
            raise InvalidRequestError("mock engine: scripted needs the tokenizer its "
                                      "frontends decode with (MockEngineCore(tokenizer=...))")
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        eos = tokenizer.eos_token_id
        self.eos_token_id = eos_token_id if eos is None else eos
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    def find(self, prompt_token_ids: list[int]) -> str | None:
        """The script of a prompt (its last directive's text); None without a directive."""
        return find_script(self.tokenizer.decode(prompt_token_ids))

    def tokens(self, script: str, spec: StructuredOutputsParams | None) -> list[int]:
        """The script's output tokens (EOS not included); InvalidRequestError if the
        request's structured outputs constraint does not accept them."""
        ids = self._encode(script, spec.reasoning_end if spec is not None else None)
        if spec is not None:
            self._check(ids, spec)
        return ids

    def _encode(self, script: str, reasoning_end: list[int] | None) -> list[int]:
        encode = self.tokenizer.encode
        if reasoning_end:
            marker = self.tokenizer.decode(reasoning_end)
            at = script.find(marker) if marker else -1
            if at >= 0:
                return (encode(script[:at], add_special_tokens=False) + list(reasoning_end)
                        + encode(script[at + len(marker):], add_special_tokens=False))
        return encode(script, add_special_tokens=False)

    def _get_compiler(self) -> "GrammarCompiler":
        with self._lock:
            if self._compiler is None:
                from engine.structured.grammar import GrammarCompiler
                self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size,
                                                 [self.eos_token_id])
            return self._compiler

    def _check(self, ids: list[int], spec: StructuredOutputsParams) -> None:
        """The tokens after the first reasoning_end (all of them without one), then EOS,
        must be a complete match of the constraint; a never-ended reasoning leaves the
        constraint unstarted, so nothing is checked. JSON constraints also refuse tokens
        with control characters, as the engine's mask does (grammar.py)."""
        start = 0
        if spec.reasoning_end:
            found = find_sequence(ids, list(spec.reasoning_end))
            if found is None:
                return
            start = found + len(spec.reasoning_end)
        import xgrammar as xgr
        compiler = self._get_compiler()
        matcher = xgr.GrammarMatcher(compiler.compile(spec))
        mask = compiler.no_control_mask if spec.kind in ("json", "json_object") else None
        for i in range(start, len(ids)):
            t = ids[i]
            if not (0 <= t < self.vocab_size and matcher.accept_token(t)) or (
                    mask is not None and not int(mask[t // 32]) >> (t % 32) & 1):
                self._refuse(spec, f"its token {t} ({self.tokenizer.decode([t])!r}) is "
                             f"refused after {self._tail(ids[start:i])!r}")
        if not matcher.accept_token(self.eos_token_id) or not matcher.is_terminated():
            self._refuse(spec, f"it ends before the constraint is complete, after "
                         f"{self._tail(ids[start:])!r}")

    def _tail(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids)
        return text if len(text) <= _SHOWN_CHARS else "..." + text[-_SHOWN_CHARS:]

    @staticmethod
    def _refuse(spec: StructuredOutputsParams, why: str) -> None:
        raise InvalidRequestError(f"mock engine: the script does not satisfy the request's "
                                  f"structured output constraint ({spec.kind}): {why}")
