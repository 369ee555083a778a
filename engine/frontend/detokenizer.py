"""Incremental detokenization: token ids arrive one by one, text comes out in order.

Decoding a growing id list from scratch is quadratic and decoding ids one at a
time breaks multi-byte characters and leading spaces. Instead each update
decodes a short window: the text of ids[prefix:read] (already emitted) is
subtracted from the text of ids[prefix:]; a trailing U+FFFD means a character
is still incomplete, so nothing is emitted until its last byte arrives. The
window starts inside the prompt so the first output token sees its left
context (sentencepiece drops a leading space at the start of a decode).
"""
from __future__ import annotations

import tokenizers
from transformers import PreTrainedTokenizerBase

_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # a fast tokenizer's Rust backend decodes the same text ~4x quicker than the
        # transformers wrapper (two decodes per generated token)
        backend = getattr(tokenizer, "_tokenizer", None)
        self._backend = backend if isinstance(backend, tokenizers.Tokenizer) else None
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.ids = context
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.output_text = ""

    def update(self, new_token_ids: list[int]) -> str:
        """Add tokens; return the text they completed (maybe "", maybe several chars)."""
        delta = []
        for token_id in new_token_ids:
            self.ids.append(token_id)
            prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full_text = self._decode(self.ids[self.prefix_offset:])
            if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
                delta.append(full_text[len(prefix_text):])
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.ids)
        text = "".join(delta)
        self.output_text += text
        return text

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)
