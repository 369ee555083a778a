"""Logprobs in OpenAI's response shapes, from the engine's per-token Logprob dicts.

A choice's logprobs are built from "entries", one per token: its text, its logprob
(None for a prompt's first token, which nothing predicts) and its top alternatives
(None where there are none to give). Completions get the legacy object (tokens,
token_logprobs, top_logprobs, text_offset); chat gets `content`. Prompt logprobs,
vLLM's extension, keep vLLM's shape: one {token id: {logprob, rank, decoded_token}}
per prompt token, null first.
"""
from __future__ import annotations

from typing import Any, Callable

from engine.outputs import CompletionOutput, Logprob

Entry = dict[str, Any]  # {"token": str, "logprob": float | None, "top": list | None}


def _top(position: dict[int, Logprob], top_k: int) -> list[tuple[str, float]]:
    ranked = sorted(((t, lp) for t, lp in position.items()
                     if lp.rank is not None and lp.rank <= top_k), key=lambda x: x[1].rank)
    return [(lp.decoded_token, lp.logprob) for _, lp in ranked]


def completion_entries(completion: CompletionOutput, top_k: int) -> list[Entry]:
    """Per generated token: its logprob and the top_k alternatives."""
    entries = []
    for token_id, position in zip(completion.token_ids, completion.logprobs or []):
        chosen = position.get(token_id)
        entries.append({"token": chosen.decoded_token if chosen else "",
                        "logprob": chosen.logprob if chosen else None,
                        "top": _top(position, top_k)})
    return entries


def prompt_entries(prompt_logprobs: list[dict[int, Logprob] | None], prompt_ids: list[int],
                   top_k: int, decode: Callable[[list[int]], str]) -> list[Entry]:
    """Per prompt token (echo with logprobs): its logprob given the tokens before it;
    the first has none."""
    entries = []
    for token_id, position in zip(prompt_ids, prompt_logprobs):
        if position is None:
            entries.append({"token": decode([token_id]), "logprob": None, "top": None})
            continue
        chosen = position[token_id]
        entries.append({"token": chosen.decoded_token, "logprob": chosen.logprob,
                        "top": _top(position, top_k)})
    return entries


def format_logprobs(entries: list[Entry], chat: bool, offset: int = 0) -> dict[str, Any]:
    """The choice's logprobs object; offset: where the first entry's token starts in the
    choice's text (a stream's later chunks start past the earlier ones)."""
    if chat:
        return {"content": [{
            "token": e["token"], "logprob": e["logprob"],
            "bytes": list(e["token"].encode()),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                             for t, lp in e["top"] or ()]} for e in entries]}
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["top"] is None else dict(e["top"]) for e in entries],
            "text_offset": offsets}


def text_length(entries: list[Entry]) -> int:
    """How far these entries move the next entry's text_offset."""
    return sum(len(e["token"]) for e in entries)


def prompt_logprobs_json(prompt_logprobs: list[dict[int, Logprob] | None]
                         ) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs field: per prompt token, null first."""
    return [None if position is None else {
        str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
        for t, lp in position.items()} for position in prompt_logprobs]
