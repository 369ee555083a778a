"""Per-request restrictions on the next token, applied to the logits before sampling:
allowed_token_ids, logit_bias, bad_words and the structured-outputs bitmask.

Only the rows that asked for one are touched; a batch without any returns its logits
as they came. The bitmask comes from the engine core's StructuredOutputManager, filled
for the constrained rows only, and xgrammar's CPU kernel applies it to those rows
(0.1 ms for 32 rows of 49,152 logits on Zen 3).
"""
from __future__ import annotations

import torch

from engine.core.request import Request

GrammarMask = tuple[torch.Tensor, list[int]]  # (bitmask [B, ceil(V/32)] int32, its rows)


def rows_that_can_block(requests: list[Request]) -> list[int]:
    """Rows whose restrictions could rule out every token: allowed_token_ids or
    bad_words, alone or with a grammar. A grammar alone always allows a token until it
    is complete (and then the request has finished), and logit_bias adds finite values."""
    return [i for i, r in enumerate(requests)
            if r.params.allowed_token_ids is not None or r.params.bad_words_token_ids]


def apply_logit_controls(logits: torch.Tensor, requests: list[Request],
                         grammar_mask: GrammarMask | None) -> torch.Tensor:
    """logits [B, V] (one row per request, modified in place when contiguous); returns
    the tensor to sample from."""
    rows = [i for i, r in enumerate(requests)
            if r.params.logit_bias or r.params.allowed_token_ids is not None
            or r.params.bad_words_token_ids]
    if not rows and grammar_mask is None:
        return logits
    if not logits.is_contiguous():
        logits = logits.contiguous()
    for i in rows:
        _restrict_row(logits[i], requests[i])
    if grammar_mask is not None:
        import xgrammar as xgr
        bitmask, mask_rows = grammar_mask
        if bitmask.device != logits.device:  # matchers fill on the CPU
            bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1],
                                        indices=mask_rows)
    return logits


def _restrict_row(row: torch.Tensor, request: Request) -> None:
    p = request.params
    if p.allowed_token_ids is not None:
        keep = torch.zeros(row.shape[0], dtype=torch.bool, device=row.device)
        keep[torch.tensor(p.allowed_token_ids, dtype=torch.long, device=row.device)] = True
        row.masked_fill_(~keep, float("-inf"))
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=row.device)
        row.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=row.dtype,
                                            device=row.device))
    banned = banned_bad_word_tokens(p.bad_words_token_ids, request.output_token_ids)
    if banned:
        row[banned] = float("-inf")


def banned_bad_word_tokens(words: list[list[int]], output: list[int]) -> list[int]:
    """The last token of every bad word whose other tokens the output has just produced
    (a one-token word is always banned), so no bad word is ever completed."""
    banned = []
    for seq in words:
        k = len(seq) - 1
        if k == 0 or (len(output) >= k and output[-k:] == seq[:-1]):
            banned.append(seq[-1])
    return banned
