"""eagle3: an EAGLE-3 head (engine/spec_decode/eagle3_head.py) proposes from the target's
own hidden states.

The target keeps, at each step, the residual streams entering three of its layers
(LlamaForCausalLM.aux_layers) for every token it computes; after the step they are
kept here per request, by position. Before the next step the head catches up: each
position the target has computed since the head last ran is fed as (that position's
streams, the token after it), writing the head's KV cache and giving the first proposed
token at the last one; then one pass per further token feeds back the head's own output.
Streams of rejected positions are dropped when the target computes those positions
again. The head's cache uses the target's block ids (scratch blocks after the pool for
proposed positions past a request's blocks), as the draft model's does.

Positions a request took from the prefix cache have no streams here: the head's cache
holds what the request that computed them wrote (or stale values, which only lower
acceptance: every proposal is verified).
"""
from __future__ import annotations

import torch

from engine.errors import InvalidRequestError
from engine.executor.step_inputs import token_slots
from engine.spec_decode.proposers.base import ModelProposer


class Eagle3Proposer(ModelProposer):
    def __init__(self, config, context) -> None:
        super().__init__(config, context)
        from engine.model.families.llama import LlamaForCausalLM
        from engine.model.loader import iter_weights, load_hf_config, resolve_model
        from engine.spec_decode.eagle3_head import Eagle3Head, aux_layer_ids
        target = context.target_runner
        shape = context.target_shape
        c = context.engine_config
        model = target.model
        if type(model).forward is not LlamaForCausalLM.forward:
            raise InvalidRequestError(
                f"speculative_config eagle3: {shape.architecture} does not expose the "
                "hidden states an EAGLE-3 head reads (served for the Llama-layout families)")
        if any(shape.layer_windows) or shape.mamba is not None:
            raise InvalidRequestError("speculative_config eagle3: the target has sliding-"
                                      "window or Mamba layers, whose blocks the head cannot share")
        if c.tensor_parallel_size > 1:
            raise InvalidRequestError("speculative_config eagle3 is not served with "
                                      "tensor_parallel_size > 1 yet (the head reads the "
                                      "target's sharded embedding)")
        checkpoint = resolve_model(config.model)
        hf_config = load_hf_config(checkpoint)
        model.aux_layers = aux_layer_ids(hf_config, shape.num_layers)
        target_hidden = getattr(hf_config, "target_hidden_size", None) or shape.hidden_size
        self.head = Eagle3Head(hf_config, target_hidden,
                               context.max_model_len + config.num_speculative_tokens)
        self.head.load(iter_weights(checkpoint), shape.vocab_size)
        self.head = self.head.to(device=context.device, dtype=context.dtype).eval()
        self.head.rotary.to(context.device)
        self.target = target
        self.dtype = context.dtype
        self.device = context.device
        self.cache: torch.Tensor | None = None
        # request id -> (first position, the target's kept streams from there on)
        self.streams: dict[str, tuple[int, torch.Tensor]] = {}

    def bytes_per_block(self) -> int:
        h = self.head
        return (2 * h.num_kv_heads * self.block_size * h.head_dim
                * torch.empty((), dtype=self.dtype).element_size())

    def start(self, num_blocks: int) -> None:
        h = self.head
        self.num_blocks = num_blocks
        self.cache = torch.zeros(num_blocks + self.max_seqs * self.spare, 2, h.num_kv_heads,
                                 self.block_size, h.head_dim, dtype=self.dtype,
                                 device=self.device)

    def sleep(self, level: int) -> None:
        self.cache = None  # (its requests were aborted: their streams went with them)

    def wake(self) -> None:
        if self.cache is None:
            self.start(self.num_blocks)

    def finish(self, request) -> None:
        super().finish(request)
        self.streams.pop(request.request_id, None)

    def after_step(self) -> None:
        """Keep the step's streams of each request that may speculate."""
        last, self.target.last_aux = self.target.last_aux, None
        if last is None:
            return
        aux, spans = last
        for request, start, base, n in spans:
            if request.pooling is not None or not request.params.speculative_decoding:
                continue
            rows = aux[base:base + n]
            held = self.streams.get(request.request_id)
            if held is None or not held[0] <= start <= held[0] + held[1].shape[0]:
                self.streams[request.request_id] = (start, rows.clone())
            else:  # from `start` on, these replace what was kept (rejected positions)
                first, kept = held
                self.streams[request.request_id] = (first, torch.cat([kept[:start - first],
                                                                      rows]))

    @torch.inference_mode()
    def propose_batch(self, requests, rooms: list[int]) -> list[list[int]]:
        bs = self.block_size
        rows = []  # (request, room, first position fed, last known position, table)
        for slot, (r, k) in enumerate((r, k) for r, k in zip(requests, rooms) if k > 0):
            held = self.streams.get(r.request_id)
            if held is None:
                continue
            first, kept = held
            done = max(self.written(r), first)
            last = r.num_tokens - 1  # the newest token's position: no stream for it yet
            if done >= last or first + kept.shape[0] < last:
                continue
            rows.append((r, k, done, last, self.table(r, slot)))
            self.mark_written(r, last)
        drafts: dict[int, list[int]] = {}
        fed_back: dict[int, torch.Tensor] = {}
        for j in range(max((row[1] for row in rows), default=0)):
            live = [row for row in rows if row[1] > j]
            hidden, tokens, positions, spans = [], [], [], []
            for r, _, done, last, table in live:
                if j == 0:  # the target's streams of [done, last), each with the next token
                    first, kept = self.streams[r.request_id]
                    hidden.append(kept[done - first:last - first])
                    tokens.extend(r.all_token_ids[done + 1:last + 1])
                    span = range(done, last)
                else:  # the head's own output, with the token it proposed
                    hidden.append(fed_back[id(r)])
                    tokens.append(drafts[id(r)][-1])
                    span = range(last + j - 1, last + j)
                positions.extend(span)
                end = span[-1] + 1
                spans.append((len(span), end, torch.tensor(table[:-(-end // bs)],
                                                           device=self.device)))
            slots = [s for row, (n, end, _) in zip(live, spans)
                     for s in token_slots(row[4], end - n, end, bs)]
            ids = torch.tensor(tokens, device=self.device)
            embeds = (self.head.embed_tokens(ids).to(self.dtype)
                      if self.head.embed_tokens is not None else self.target.model.embed(ids))
            out = self.head(torch.cat(hidden).to(self.dtype), embeds,
                            torch.tensor(positions, device=self.device), self.cache,
                            torch.tensor(slots, device=self.device), spans)
            ends = torch.tensor([sum(n for n, _, _ in spans[:i + 1]) - 1
                                 for i in range(len(spans))], device=self.device)
            last_rows = out.index_select(0, ends)
            for (r, *_), token, state in zip(live, self.head.logits_to_target(last_rows).tolist(),
                                             last_rows):
                drafts.setdefault(id(r), []).append(token)
                fed_back[id(r)] = state.unsqueeze(0)
        for r, _, _, last, _ in rows:  # streams before the newest position are used up
            first, kept = self.streams[r.request_id]
            self.streams[r.request_id] = (last, kept[last - first:])
        return [drafts.get(id(r), []) for r in requests]
