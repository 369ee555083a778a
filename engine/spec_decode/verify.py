"""Verification: a request with k proposed tokens gets k + 1 sampling rows, row j
scoring the token after its context plus the first j proposed tokens. Each row is
sampled from the model's distribution exactly as a step without speculation would
(restrictions, penalties, grammar and temperature seen through a DraftView), and
the proposal is accepted while the sampled token equals the proposed one; the first
sampled token that differs (or the row after the last proposal) ends the step.

Why that is exact: the proposers propose one token per position (a one-hot proposal
q), and the standard rule for such a q (accept with probability p(d), else draw from
p with d taken out, renormalised) is what sampling t ~ p and comparing it with d does:
t = d with probability p(d), and otherwise t is distributed as p without d. Every
emitted token is thus drawn from the target distribution given the tokens before it,
and greedy rows emit the target's argmax, token for token. A seeded request's
generator is rewound to the draws its emitted tokens used, so its n-th token uses its
n-th draw, as without speculation.
"""
from __future__ import annotations

import torch

from engine.core.request import Request


class DraftView:
    """A request seen as if its first `depth` proposed tokens had been appended: what
    the sampler and the grammar read of a request, nothing else."""

    __slots__ = ("request", "drafts")

    def __init__(self, request: Request, depth: int) -> None:
        self.request = request
        self.drafts = request.spec_tokens[:depth]

    @property
    def all_token_ids(self) -> list[int]:
        return self.request.all_token_ids + self.drafts

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + self.drafts

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + len(self.drafts)

    @property
    def num_tokens(self) -> int:
        return self.request.num_tokens + len(self.drafts)

    @property
    def logit_controls(self):
        return self.request.logit_controls

    @logit_controls.setter
    def logit_controls(self, controls) -> None:
        self.request.logit_controls = controls

    def __getattr__(self, name: str):
        return getattr(self.request, name)


def sampling_rows(requests: list[Request]) -> tuple[list, list[tuple[Request, int, int]]]:
    """The sampler's rows for the step's sampling requests (a request with proposals
    appears once per row, consecutively): a view per row, and each request with its
    [start, end) rows."""
    views: list = []
    spans: list[tuple[Request, int, int]] = []
    i = 0
    while i < len(requests):
        request = requests[i]
        rows = 1 + len(request.spec_tokens)
        views.append(request)
        views.extend(DraftView(request, j) for j in range(1, rows))
        spans.append((request, i, i + rows))
        i += rows
    return views, spans


def accepted_count(sampled: list[int], drafts: list[int]) -> int:
    """How many proposed tokens the sampled rows confirm (a prefix)."""
    a = 0
    while a < len(drafts) and sampled[a] == drafts[a]:
        a += 1
    return a


class GeneratorRewind:
    """Seeded requests with proposals: their generators' states before the sampler, so
    that afterwards each advances by the draws of its emitted tokens only."""

    def __init__(self, spans: list[tuple[Request, int, int]]) -> None:
        self.states = {id(r): r.generator.get_state() for r, start, end in spans
                       if r.generator is not None and end - start > 1
                       and not r.params.greedy}

    def rewind(self, request: Request, emitted: int) -> None:
        state = self.states.get(id(request))
        if state is not None:
            request.generator.set_state(state)
            for _ in range(emitted):  # one draw at a time, as the sampler draws them
                torch.rand(1, generator=request.generator, dtype=torch.float64)
