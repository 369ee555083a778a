"""Sampler: logits of a batch -> next tokens (+ logprobs), each row with its own params.

Work that no request in the batch asked for is skipped (penalties, top-k/top-p
sorting, logprobs). Random draws invert each row's CDF: one uniform per row,
the first token whose cumulative probability reaches it. That samples exactly
from p with one random number per row; the exponential race (argmax(p / E),
E ~ Exp(1) per token) needs one per vocabulary entry, and torch draws those on
one thread: 75 ms for a 32 x 49152 batch against 4.7 ms for the float64 cumsum +
search (Zen 3, 2 threads); the race was a fifth of a served decode step. A seeded request draws
its uniform from its own generator, so its tokens do not depend on what else
is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from engine.core.request import Request
from engine.executor.logit_controls import (
    GrammarMask,
    apply_logit_controls,
    rows_that_can_block,
)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # per row: (token ids, logprobs, ranks) with the sampled token first, then the top-k;
    # None for rows that did not ask for logprobs
    logprobs: list[tuple[list[int], list[float], list[int]] | None]
    # rows whose restrictions left no token at all (allowed_token_ids minus bad words,
    # say): their token is meaningless and the engine fails those requests
    blocked: frozenset[int] = frozenset()


class Sampler:
    def __init__(self, vocab_size: int, native_argmax: Callable | None = None,
                 seed: int = 0, device: torch.device | str = "cpu",
                 native_sample: Callable | None = None) -> None:
        """native_argmax: the compiled CPU argmax (engine.model.kernels), 7x faster than torch's
        on a 64 x 49152 batch, same result (NaN included); used for float32 CPU logits.
        native_sample: the compiled CPU draw (kernels.sample_rows): the same inverse-CDF
        draw at the same uniforms as the torch path, for batches with temperature only (no
        top-k, top-p or min-p), in two passes over the logits instead of five passes and
        two [B, V] temporaries.
        seed: the engine's seed (EngineConfig.seed): requests without a seed of their own
        draw from one generator seeded with it, so a restarted engine repeats itself."""
        self.vocab_size = vocab_size
        self.native_argmax = native_argmax
        self.native_sample = native_sample
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        native = self.native_argmax
        if (native is not None and logits.device.type == "cpu" and logits.is_contiguous()
                and logits.dtype == torch.float32):
            return native(logits)
        return logits.argmax(dim=-1)

    @torch.inference_mode()  # the logits are inference tensors: restrictions edit them in place
    def __call__(self, logits: torch.Tensor, requests: list[Request],
                 grammar_mask: GrammarMask | None = None) -> SamplerOutput:
        """logits: [B, V] float32, one row per request (in order); grammar_mask: the
        structured-outputs bitmask of the constrained rows. Logprobs are the model's,
        before any restriction or penalty (as vLLM returns them by default)."""
        logits = logits[:, :self.vocab_size]
        params = [r.params for r in requests]
        want_logprobs = [p.logprobs is not None for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

        logits = apply_logit_controls(logits, requests, grammar_mask)
        logits = self._apply_penalties(logits, requests)
        blocked: frozenset[int] = frozenset()
        restricted = rows_that_can_block(requests)
        if restricted:
            dead = torch.isneginf(logits[restricted]).all(dim=-1).tolist()
            blocked = frozenset(i for i, d in zip(restricted, dead) if d)
        greedy = [p.greedy for p in params]
        if all(greedy):
            tokens = self._argmax(logits)
        else:
            tokens = self._sample(logits, requests, greedy)
        token_list = tokens.tolist()
        logprob_rows = [None] * len(requests)
        if raw_logprobs is not None:
            logprob_rows = self._gather_logprobs(raw_logprobs, tokens, params)
        return SamplerOutput(token_list, logprob_rows, blocked)

    # ---- penalties --------------------------------------------------------------------
    def _apply_penalties(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        rows = [i for i, r in enumerate(requests)
                if r.params.repetition_penalty != 1.0 or r.params.presence_penalty != 0.0
                or r.params.frequency_penalty != 0.0 or r.num_output_tokens < r.params.min_tokens]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            r, p = requests[i], requests[i].params
            row = logits[i]
            if r.num_output_tokens < p.min_tokens:
                # EOS and stop tokens may not end the request before min_tokens
                blocked = list(p.stop_token_ids)
                if not p.ignore_eos:
                    blocked.extend(r.eos_token_ids)
                blocked = [t for t in blocked if t < self.vocab_size]
                if blocked:
                    row[blocked] = float("-inf")
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(r.all_token_ids)), dtype=torch.long,
                                    device=logits.device)
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                        vals * p.repetition_penalty)
            if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and r.output_token_ids:
                out = torch.tensor(r.output_token_ids, dtype=torch.long, device=logits.device)
                counts = torch.zeros(self.vocab_size, dtype=logits.dtype, device=logits.device)
                counts.scatter_add_(0, out, torch.ones_like(out, dtype=logits.dtype))
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        return logits

    # ---- random sampling --------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, requests: list[Request],
                greedy: list[bool]) -> torch.Tensor:
        params = [r.params for r in requests]
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        top_k = [0 if g else p.top_k for p, g in zip(params, greedy)]
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        top_k_or_p = any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p)
        with_min_p = any(m > 0.0 for m in min_p)
        if (self.native_sample is not None and not (top_k_or_p or with_min_p)
                and logits.device.type == "cpu"
                and logits.dtype == torch.float32 and logits.is_contiguous()):
            inv_temp = torch.tensor([1.0 / t for t in temps], dtype=torch.float32)
            sampled = self.native_sample(logits, inv_temp,
                                         self._uniforms(requests, greedy, logits.device)[:, 0])
        else:
            scaled = logits / torch.tensor(temps, dtype=logits.dtype,
                                           device=logits.device).unsqueeze(1)
            if top_k_or_p:
                scaled = _top_k_top_p(scaled, top_k, top_p)
            probs = torch.softmax(scaled, dim=-1)
            if with_min_p:
                m = torch.tensor(min_p, dtype=probs.dtype, device=probs.device).unsqueeze(1)
                probs = probs.masked_fill(probs < m * probs.max(dim=-1, keepdim=True).values,
                                          0.0)
            sampled = self._inverse_cdf(probs, requests, greedy)
        if any(greedy):
            mask = torch.tensor(greedy, device=logits.device)
            sampled = torch.where(mask, self._argmax(logits), sampled)
        return sampled

    def _inverse_cdf(self, probs: torch.Tensor, requests: list[Request],
                     greedy: list[bool]) -> torch.Tensor:
        """One draw per row from `probs` (rows need not sum to 1).

        The CDF is summed in float64 so that every token's share of [0, total) is its
        probability to ~1e-16, also for tiny ones; u is taken in (0, 1], so the search
        never stops on a zero-probability token (its CDF value equals its predecessor's,
        and the search returns the first index reaching u)."""
        cdf = probs.cumsum(dim=-1, dtype=torch.float64)
        u = self._uniforms(requests, greedy, probs.device)
        target = (1.0 - u) * cdf[:, -1:]
        return torch.searchsorted(cdf, target).squeeze(1).clamp_(max=probs.shape[1] - 1)

    def _uniforms(self, requests: list[Request], greedy: list[bool],
                  device: torch.device) -> torch.Tensor:
        """[B, 1] float64 uniforms in [0, 1), one per row: the engine's generator, or a
        seeded request's own (drawn on the CPU: device-independent)."""
        u = torch.rand((len(requests), 1), generator=self.generator, dtype=torch.float64,
                       device=device)
        for i, r in enumerate(requests):
            if r.generator is not None and not greedy[i]:
                u[i, 0] = torch.rand(1, generator=r.generator, dtype=torch.float64).item()
        return u

    # ---- logprobs ---------------------------------------------------------------------
    @staticmethod
    def _gather_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, params
                         ) -> list[tuple[list[int], list[float], list[int]] | None]:
        return token_logprobs(logprobs, tokens, [p.logprobs for p in params])


def prompt_token_logprobs(logits: torch.Tensor, targets: list[int], tops: list[int]
                          ) -> list[tuple[list[int], list[float], list[int]]]:
    """Prompt logprobs: row j of `logits` scores targets[j] (the prompt token after it),
    with its rank and the tops[j] best alternatives (the model's raw log-softmax, as
    for sampled tokens)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    tokens = torch.tensor(targets, dtype=torch.long, device=logits.device)
    return token_logprobs(logprobs, tokens, tops)


def token_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, counts: list[int | None]
                   ) -> list[tuple[list[int], list[float], list[int]] | None]:
    """Per row: (ids, logprobs, ranks) of tokens[i] first, then the counts[i] most likely
    tokens (None where counts[i] is None)."""
    k = max(c or 0 for c in counts)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    ranks = ((logprobs > chosen.unsqueeze(1)).sum(dim=1) + 1).tolist()
    chosen_vals, token_ids = chosen.tolist(), tokens.tolist()
    top_vals = top_ids = None
    if k:
        vals, ids = logprobs.topk(k, dim=-1)
        top_vals, top_ids = vals.tolist(), ids.tolist()
    rows = []
    for i, c in enumerate(counts):
        if c is None:
            rows.append(None)
            continue
        ids = [token_ids[i]]
        vals = [chosen_vals[i]]
        rk = [ranks[i]]
        if c:
            ids += top_ids[i][:c]
            vals += top_vals[i][:c]
            rk += list(range(1, c + 1))
        rows.append((ids, vals, rk))
    return rows


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p (nucleus) sets with -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    device = logits.device
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_k], device=device).clamp(max=vocab)
    positions = torch.arange(vocab, device=device).unsqueeze(0)
    remove = positions >= k.unsqueeze(1)
    p = torch.tensor(top_p, dtype=logits.dtype, device=device).unsqueeze(1)
    if (p < 1.0).any():
        probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly ahead of each token
        remove |= before > p
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
