"""Incremental detokenization: token ids arrive one by one, text comes out in order.

Decoding a growing id list from scratch is quadratic and decoding ids one at a
time breaks multi-byte characters and leading spaces. With a fast tokenizer, the
tokenizers library's DecodeStream does this in Rust, one call per token (2.2 vs
5.9 us per token for the windowed decode below, measured on SmolLM2's tokenizer,
Zen 3): it holds back an incomplete character until its last byte arrives. Other
tokenizers decode a short window: the text of ids[prefix:read] (already emitted)
is subtracted from the text of ids[prefix:]; a trailing U+FFFD means a character
is still incomplete, so nothing is emitted yet. Either way the stream starts
inside the prompt so the first output token sees its left context (sentencepiece
drops a leading space at the start of a decode). The two differ only where the
prompt ends inside a character: the stream emits that character whole with the
output that completes it, the window drops it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import tokenizers
from tokenizers.decoders import DecodeStream

from engine.frontend.text_buffer import TextBuffer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_PROMPT_CONTEXT = 5  # prompt tokens the stream starts with
_MAX_PROMPT_CONTEXT = 16  # how far back to look for a context that decodes cleanly
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = TextBuffer()  # the output so far
        backend = getattr(tokenizer, "_tokenizer", None)
        self._backend = backend if isinstance(backend, tokenizers.Tokenizer) else None
        if self._backend is not None:
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            for token_id in self._stream_context(prompt_token_ids):
                self._stream.step(self._backend, token_id)
            return
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.ids = context
        self.prefix_offset = 0
        self.read_offset = len(context)

    def _stream_context(self, prompt_token_ids: list[int]) -> list[int]:
        """The shortest prompt suffix of at least _PROMPT_CONTEXT tokens that starts on a
        character boundary (a suffix starting inside a character would emit prompt
        bytes as output). A prompt that ends inside a character keeps its partial
        bytes in the stream: the output that completes the character emits it whole."""
        shortest = min(_PROMPT_CONTEXT, len(prompt_token_ids))
        for n in range(shortest, min(_MAX_PROMPT_CONTEXT, len(prompt_token_ids)) + 1):
            suffix = list(prompt_token_ids[-n:])
            text = self._backend.decode(suffix, skip_special_tokens=self.skip_special_tokens)
            if _INCOMPLETE not in text.rstrip(_INCOMPLETE):
                return suffix
        return []

    def update(self, new_token_ids: list[int]) -> str:
        """Add tokens; return the text they completed (maybe "", maybe several chars)."""
        if self._backend is not None:
            # one id per step: a list step withholds every piece of it while its last
            # character is incomplete, which at the end of a stream would lose them
            if len(new_token_ids) == 1:  # the usual case: no generator, no join
                text = self._stream.step(self._backend, new_token_ids[0]) or ""
            else:
                text = "".join(self._stream.step(self._backend, t) or ""
                               for t in new_token_ids)
        else:
            text = self._update_window(new_token_ids)
        self.text.append(text)
        return text

    @property
    def output_text(self) -> str:
        return self.text.value()

    def _update_window(self, new_token_ids: list[int]) -> str:
        delta = []
        for token_id in new_token_ids:
            self.ids.append(token_id)
            prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full_text = self._decode(self.ids[self.prefix_offset:])
            if len(full_text) > len(prefix_text) and not full_text.endswith(_INCOMPLETE):
                delta.append(full_text[len(prefix_text):])
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.ids)
        return "".join(delta)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)
