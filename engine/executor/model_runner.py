"""ModelRunner: owns the model weights and the KV cache tensor of one worker.

prepare() turns a SchedulerOutput into a StepInput: plain lists (token ids,
positions, cache slots, query and context lengths, block tables) that are cheap to encode,
so a tensor-parallel driver can send the same step to its workers. run() makes
the tensors, runs the forward pass, and computes logits only for the rows that
sample this step.
"""
from __future__ import annotations

import logging
import time

import torch
from torch import nn

from engine.config import EngineConfig
from engine.core.scheduler import SchedulerOutput
from engine.errors import UnsupportedQuantizationError
from engine.executor.allocator import keep_freed_memory
from engine.executor.cuda_graphs import DecodeGraphs, capture_sizes
from engine.executor.parallel import ShardPlan, TPGroup
from engine.executor.sampler import prompt_token_logprobs
from engine.executor.kv_budget import KVBudget
from engine.executor.step_inputs import (
    StepInput,
    StepMetadataBuilder,
    StepResult,
    StepRows,
    token_slots,
)
from engine.lora.adapter import load_adapter
from engine.lora.manager import AdapterCache
from engine.lora.request import LoRARequest
from engine.lora.slots import LoRASlots
from engine.model.attention.base import AttentionSpec
from engine.model.attention.registry import make_backend
from engine.model.hugepages import (
    BackgroundPopulate,
    anonymous_regions,
    collapse_new_regions,
    lazily_zeroed,
    populate_now,
)
from engine.model.kernels import cpu_kernels, native_enabled
from engine.model.layers.linear import can_pack, pack_linears
from engine.model.registry import model_class
from engine.model.shape import ModelShape
from engine.model.loader import is_gguf_checkpoint, iter_weights
from engine.quant import checkpoint_quantization, quant_format
from engine.quant.native_holder import NativeHolder
from engine.core.kv_groups import KVGroups
from engine.model.stack import build_stack

logger = logging.getLogger(__name__)

# Prompt-logprob rows computed at once: 256 x a 128k vocabulary is 128 MiB of logits.
_PROMPT_LOGIT_ROWS = 256


class ModelRunner(StepMetadataBuilder, KVBudget):
    def __init__(self, config: EngineConfig, shape: ModelShape, hf_config, checkpoint,
                 max_model_len: int, device: torch.device, dtype: torch.dtype,
                 plan: ShardPlan | None = None, tp: TPGroup | None = None) -> None:
        """plan / tp: this rank's shard and its group under tensor parallelism."""
        self.config = config
        self.shape = shape
        self.plan = plan or ShardPlan.build(shape, 0, 1)
        self.tp = tp
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.kv_groups = KVGroups.of(shape)  # layers sharing block tables; P layers a block
        self.checkpoint = checkpoint
        self.hf_config = hf_config
        self.max_model_len = max_model_len
        self.max_pages = -(-max_model_len // self.block_size)  # the longest block table
        self.decode_sizes = capture_sizes(config.max_num_seqs)  # graphs' / static shapes
        self.kernels = None
        if device.type == "cpu":
            self.kernels = cpu_kernels()
            keep_freed_memory()  # steps reuse their freed activations: no page faults
        # engine.model.attention's backend: what every attention-dependent choice asks
        self.attention = make_backend(config.attention_backend, AttentionSpec(
            shape, device, self.kernels, config.kv_cache_dtype, self.block_size,
            self.plan.num_heads, self.plan.num_kv_heads, tuple(self.decode_sizes),
            self.max_pages))
        self.kv_dtype = self.attention.cache_dtype(dtype)
        self.graphs: DecodeGraphs | None = None
        self.model = self._load_model()
        self.lora_slots: LoRASlots | None = None
        self.lora_cache: AdapterCache | None = None
        if config.enable_lora:
            self._enable_lora()
        self.kv_caches: torch.Tensor | None = None
        # False: the KV pool's pages are backed after ready, in the background (an engine
        # joining a server already serving; hugepages.BackgroundPopulate says why)
        self.kv_pages_before_ready = True
        self._populating: BackgroundPopulate | None = None
        self.layer_caches: list[tuple[torch.Tensor, torch.Tensor]] = []  # views, per layer
        self.num_blocks = 0
        # an EAGLE-3 head's input (model.aux_layers): the last step's kept streams and
        # whose rows they are, (request, first position, first row, rows) each
        self.last_aux: tuple[torch.Tensor, list] | None = None
        self._aux_spans: list | None = None

    def _use_graphs(self) -> bool:
        """Decode steps replay CUDA graphs unless enforce_eager, LoRA (its per-step adapter
        runs are host data) or tensor parallelism (every rank would have to replay
        together) rules them out."""
        return (self.device.type == "cuda" and self.attention.graphs
                and not self.config.enforce_eager and self.lora_slots is None
                and self.tp is None and self._experts_capturable()
                and self.shape.mamba is None  # its states are gathered by host-side slots
                and not getattr(self.model, "aux_layers", ())  # an EAGLE-3 head reads them
                and self.kv_groups.count == 1)  # the graphs hold one group's tables

    def _experts_capturable(self) -> bool:
        """An MoE model's experts in a graph need the grouped matmul (its offsets stay on
        the device; the per-expert fallback reads them on the host)."""
        if self.shape.moe is None:
            return True
        from engine.model.layers.moe import grouped_mm_available, grouped_shapes_ok
        return (grouped_mm_available(self.device, self.dtype)
                and grouped_shapes_ok(self.shape.hidden_size, self.plan.expert_intermediate_size))

    def _capture_graphs(self) -> None:
        if self._use_graphs() and self.model is not None and self.kv_caches is not None:
            self.graphs = DecodeGraphs(self.model, self.layer_caches,
                                       self.attention.graph_metadata(),
                                       self.num_blocks, self.block_size, self.decode_sizes,
                                       self.max_pages, self.device)
            self.graphs.capture()

    def _drop_graphs(self) -> None:
        """Before the weights or the cache move or go: the graphs point at them."""
        if self.graphs is not None:
            self.graphs = None
            torch.cuda.empty_cache()

    def _load_model(self) -> nn.Module:
        start = time.perf_counter()
        regions = anonymous_regions() if self.device.type == "cpu" else set()
        layer_ops = self.attention.layer_ops(self.kernels)  # the layers' element-wise ops
        with torch.device("meta"):
            model = model_class(self.shape.architecture)(
                self.shape, self.hf_config, self.max_model_len, layer_ops, self.plan, self.tp)
        model = model.to_empty(device=self.device)
        # Buffers (the RoPE table) are not in the checkpoint: rebuild them for real.
        model.make_rotary(self.hf_config, self.max_model_len, self.device)
        if self.shape.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        fmt = checkpoint_quantization(self.hf_config)
        if self.config.load_format == "dummy" and fmt is None:
            _random_weights(model)
        else:  # a dummy load of a quantized config: its format's bytes, loaded as a file's
            method = quant_format(fmt)  # what the format reads and holds (engine.quant)
            scheme = method.scheme(self.hf_config, str(self.checkpoint))
            weights = method.dummy(self.shape, scheme) if self.config.load_format == "dummy" \
                else iter_weights(self.checkpoint)
            held = model.load_weights(method.read(weights, scheme),
                                      holder=self._weight_holder(),
                                      fp8_block=method.scale_block(scheme))
            if held == 0 and method.needs_quantized_tensors:
                raise UnsupportedQuantizationError(
                    f"model {str(self.checkpoint)!r} declares {fmt!r} quantization, but none "
                    "of its linear weights is int8 or float8_e4m3fn: a float checkpoint "
                    "with a quantization_config is not quantized at load; remove the "
                    "config's quantization_config to serve it in its own dtype")
        if self.kv_dtype == torch.float8_e4m3fn:
            self._set_kv_scales(model)
        elif any(layer.self_attn is not None and layer.self_attn.checkpoint_kv_scales
                 for layer in model.layers):  # (a hybrid's Mamba layers have none)
            logger.info("the checkpoint carries fp8 KV cache scales (k_scale / v_scale); "
                        "the cache holds the activation dtype, kv_cache_dtype fp8 would use "
                        "them")
        model = model.to(self.dtype).eval()
        model.requires_grad_(False)
        if (native_enabled() and not self.attention.own_layer_kernels
                and can_pack(self.device, self.dtype, self.kernels)):
            pack_linears(model, keep_dense={id(model.embed_tokens.weight)}, kernels=self.kernels)
        if self.device.type == "cpu" and self.attention.runs_stack:
            model.stack = build_stack(model, self.kernels)
        if self.kv_groups.count > 1:
            model.layer_groups = [self.kv_groups.layer_group(i)
                                  for i in range(self.shape.num_layers)]
        if self.device.type == "cpu":
            collapse_new_regions(regions)
        logger.info("loaded %s in %.2fs", self.shape.architecture, time.perf_counter() - start)
        return model

    def _set_kv_scales(self, model) -> None:
        """An fp8 cache's per-layer scales: the checkpoint's k_scale / v_scale, else 1.0
        (vLLM's default; said in the log, since values past +-448 then saturate)."""
        found = 0
        for layer in model.layers:
            attn = layer.self_attn
            attn.k_scale = attn.checkpoint_kv_scales.get("k_scale", 1.0)
            attn.v_scale = attn.checkpoint_kv_scales.get("v_scale", 1.0)
            found += len(attn.checkpoint_kv_scales)
        if not found:
            logger.warning("kv_cache_dtype %s: the checkpoint has no k_scale / v_scale; the "
                           "cache stores keys and values unscaled (1.0), saturating past "
                           "+-448", self.config.kv_cache_dtype)

    def _weight_holder(self):
        """Who multiplies a quantized checkpoint's weights (GGUF blocks, AWQ and GPTQ read
        as such, int8 W8A8, fp8) as stored: the native CPU kernels, the attention
        backend's own (engine.quant.held.WeightHolder), or None: they are then decoded to
        the activation dtype (said in the log, not silently; int8's activations are then
        not quantized either)."""
        fmt = "gguf" if is_gguf_checkpoint(self.checkpoint) \
            else checkpoint_quantization(self.hf_config)
        if fmt is None:
            return None
        if (self.device.type == "cpu" and self.kernels is not None and native_enabled()
                and not self.attention.own_layer_kernels):
            return NativeHolder(self.kernels)
        holder = self.attention.weight_holder(fmt, self.dtype)
        if holder is not None:
            return holder
        logger.warning("no kernel here reads %s weights (device %s, attention backend %s, "
                       "native kernels %s): the weights are decoded to %s at load", fmt,
                       self.device, self.attention.name, "on" if self.kernels is not None else "off",
                       self.dtype)
        return None

    # ---- LoRA -------------------------------------------------------------------------
    def _enable_lora(self) -> None:
        c = self.config
        self.lora_slots = LoRASlots(self.shape, self.plan, c.max_loras, c.max_lora_rank,
                                    self.device, self.dtype)
        self.model.attach_lora(self.lora_slots)
        self.lora_cache = AdapterCache(
            c.max_cpu_loras or c.max_loras,
            lambda r: load_adapter(r.lora_name, r.lora_path, self.shape, self.plan,
                                   c.max_lora_rank, self.dtype))

    def check_lora(self, request: LoRARequest) -> None:
        """Read (and so validate) an adapter into the host cache; raises LoRAError."""
        self.lora_cache.get(request)

    def load_lora(self, slot: int, request: LoRARequest) -> None:
        """Put an adapter in a device slot (from the host cache, else from disk)."""
        self.lora_slots.load(slot, request.lora_int_id, self.lora_cache.get(request))

    def drop_lora(self, lora_id: int) -> None:
        self.lora_cache.drop(lora_id)

    # ---- KV cache ---------------------------------------------------------------------
    def allocate_kv_cache(self, num_blocks: int, capture: bool = True) -> None:
        """The cache, in the attention backend's layout; then (CUDA) the decode graphs."""
        self.num_blocks = num_blocks
        shape = self.attention.cache_shape(self.kv_groups.slots, num_blocks)
        # zeros, not garbage: masked-out slots still enter the matmuls, and 0 * NaN = NaN
        if self.device.type == "cpu" and self.attention.lazy_cpu_pool:
            self.kv_caches = lazily_zeroed(shape, self.kv_dtype)
            self._prefault_kv(num_blocks)
        else:
            self.kv_caches = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self.layer_caches = [self.attention.cache_views(self._layer_cache(i))  # once
                             for i in range(self.shape.num_layers)]
        self.attention.cache_allocated(num_blocks)
        self._state_views()
        if capture:
            self._capture_graphs()

    def _layer_cache(self, layer: int) -> torch.Tensor:
        """The cache tensor a layer's blocks are in: its slot's (each block of the pool
        holds the KV of P layers, one of each group's; all layers' with one group)."""
        return self.kv_caches[self.kv_groups.layer_slot(layer)]

    def _state_views(self) -> None:
        """A hybrid's Mamba layers read their cache tensors as state blocks instead."""
        if self.shape.mamba is None:
            return
        for i in self.shape.mamba.layers:
            self.layer_caches[i] = self.model.state_views(i, self.kv_caches[i], self.num_blocks)

    def _prefault_kv(self, num_blocks: int) -> None:
        """Back the pool's first blocks with memory, as many as a full batch can hold at
        once (max_num_seqs sequences of max_model_len; the rest only extends the prefix
        cache), as vLLM's torch.zeros writes its whole pool: a page's first write is a
        fault (and, in a VM, often the host's too), and taken during decode each one
        stalls a step. W1 (Zen 5 VM, bf16): 1,627-1,649 -> 1,853-1,866 tok/s, system
        time 0.25-0.65 -> 0.00-0.04 s. Done before the engine reports ready, so its first
        requests run as fast as later ones (hugepages.populate_now has the figures);
        after, in the background, for an engine joining a server that already serves."""
        blocks = min(num_blocks, self.config.max_num_seqs * self.max_pages)
        spans = [slot[:blocks] for slot in self.kv_caches]  # each slot's blocks: one span
        what = f"KV cache: the first {blocks} of {num_blocks} blocks"
        if self.kv_pages_before_ready:
            populate_now(spans, what)
        else:
            self._populating = BackgroundPopulate(spans, what)

    def free_kv_cache(self) -> None:
        if self._populating is not None:
            self._populating.stop()
            self._populating = None
        self._drop_graphs()
        self.kv_caches = None
        self.attention.cache_freed()
        self.layer_caches = []

    # ---- sleep mode -------------------------------------------------------------------
    def has_weights(self) -> bool:
        return self.model is not None and _on(next(self.model.parameters()), self.device)

    def offload_weights(self) -> None:
        """Move the weights to host memory (sleep level 1 on an accelerator)."""
        self._drop_graphs()
        self.model.to("cpu")

    def free_weights(self) -> None:
        """Drop the weights (sleep level 2); restore_weights reloads the checkpoint."""
        self._drop_graphs()
        self.model = None

    def restore_weights(self) -> None:
        if self.model is None:
            self.model = self._load_model()
            if self.lora_slots is not None:
                self.model.attach_lora(self.lora_slots)
        elif not self.has_weights():
            self.model.to(self.device)
        if self.graphs is None:
            self._capture_graphs()

    def memory_usage(self) -> dict[str, int]:
        weights = 0
        if self.model is not None:
            weights = sum(p.numel() * p.element_size() for p in self.model.parameters()
                          if _on(p, self.device))
            weights += sum(m.packed_bytes() for m in self.model.modules()
                           if callable(getattr(m, "packed_bytes", None))
                           and getattr(m, "quant", None) is None)
            # weights held quantized (engine.quant.held: the linears' and the
            # embedding's), a shared one (a tied LM head's) once
            held = {id(g): g for m in self.model.modules()
                    if (g := getattr(m, "quant", None)) is not None}
            weights += sum(g.nbytes for g in held.values())
        kv = 0 if self.kv_caches is None else self.kv_caches.numel() * self.kv_caches.element_size()
        return {"weights_bytes": weights, "kv_cache_bytes": kv}

    # ---- one step ---------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> StepResult:
        """Run the forward pass: logits [S, V] of the batch rows that sample, the hidden
        states of the embedding requests' tokens and the logits of the prompt positions
        that prompt logprobs need, this step."""
        step, rows = self.prepare(sched)
        return StepResult.build(step, rows, *self.run(step))

    def prepare(self, sched: SchedulerOutput) -> tuple[StepInput, StepRows]:
        """The step's inputs as lists, and which requests its outputs belong to: the
        rows that sample, those that pool (embedding requests, every chunk) and those
        whose prompt positions need logits. Decodes come first in the flat batch, then
        the prefill chunks."""
        bs = self.block_size
        # decodes first; within each kind, one adapter's tokens together (LoRA runs)
        order = sorted(range(len(sched.requests)), key=lambda i: (
            sched.num_new_tokens[i] != 1, sched.requests[i].lora_slot))
        step = StepInput([], [], [], [], [], [], [])
        step.generated_only = all(r.num_computed_tokens == r.num_tokens - 1
                                  and r.num_output_tokens > 0 for r in sched.requests)
        ids, positions, slots = step.ids, step.positions, step.slots
        rows = StepRows()
        aux_spans = [] if getattr(self.model, "aux_layers", ()) else None
        for i in order:
            request, n = sched.requests[i], sched.num_new_tokens[i]
            start = request.num_computed_tokens
            end = start + n
            spec = request.spec_tokens  # proposed tokens after its last (spec_decode)
            tokens = request.all_token_ids + spec if spec else request.all_token_ids
            ids.extend(tokens[start:end])
            positions.extend(range(start, end))
            blocks = request.block_ids
            slots.extend(token_slots(blocks, start, end, bs))
            step.query_lens.append(n)
            step.seq_lens.append(end)
            step.block_tables.append(blocks[:-(-end // bs)])
            for g, table in enumerate(request.group_blocks[1:]):
                if g == len(step.group_tables):
                    step.group_tables.append([])
                    step.group_slots.append([])
                step.group_slots[g].extend(token_slots(table, start, end, bs))
                step.group_tables[g].append(table[:-(-end // bs)])
            if request.state_block >= 0:
                step.state_slots.append(request.state_block)
            base = len(ids) - n  # flat index of position `start`
            if aux_spans is not None:
                aux_spans.append((request, start, base, n))
            slot = request.lora_slot
            if slot >= 0:
                runs = step.lora_segments
                if runs and runs[-1][2] == slot and runs[-1][1] == base:
                    runs[-1][1] = len(ids)
                else:
                    runs.append([base, len(ids), slot])
            if request.pooling is not None:
                rows.pool.append(i)
                step.pool_spans.append([base, len(ids)])
                continue
            if request.needs_prompt_logits:
                # position p's logits give the logprob of prompt token p + 1
                first = max(start, len(request.prompt_logprobs))
                last = min(end, request.num_prompt_tokens - 1)
                if last > first:
                    rows.prompt.append((i, first))
                    step.prompt_spans.append([base + first - start, base + last - start,
                                              request.params.prompt_logprobs])
                    step.prompt_targets.extend(request.prompt_token_ids[first + 1:last + 1])
            if end == request.num_tokens + len(spec):  # a row for each proposed token too
                rows.sample.extend([i] * (1 + len(spec)))
                step.logit_positions.extend(range(len(ids) - 1 - len(spec), len(ids)))
        self._aux_spans = aux_spans
        return step, rows

    @torch.inference_mode()
    def run(self, step: StepInput) -> tuple[torch.Tensor | None, list[torch.Tensor],
                                             list | None]:
        """Forward pass of one step: logits [S, V] of its sampling rows, the final hidden
        states (float32) of each pool span, and the (ids, logprobs, ranks) of every
        prompt-span position (logits and logprobs are None on TP ranks other than 0)."""
        dev = self.device
        if self.lora_slots is not None:
            self.lora_slots.segments = [tuple(run) for run in step.lora_segments]
        if self._replayable(step):
            hidden = self.graphs.run(step.ids, step.positions, step.slots, step.seq_lens,
                                     step.block_tables)
        else:
            meta = self._attention_metadata(step)
            meta.generated_only = step.generated_only
            if step.state_slots:
                meta.state = self._state_metadata(step, meta.num_decodes)
            if step.group_tables:  # each group's own blocks, for its layers
                meta.groups = [meta] + [
                    self._attention_metadata(step, tables, slots)
                    for tables, slots in zip(step.group_tables, step.group_slots)]
            input_ids = torch.tensor(step.ids, dtype=torch.long, device=dev)
            pos = torch.tensor(step.positions, dtype=torch.long, device=dev)
            self.attention.prepare_step(meta, pos)
            hidden = self.model(input_ids, pos, self.layer_caches, meta)
            if self._aux_spans is not None:
                self.last_aux, self._aux_spans = (self.model.aux_hidden, self._aux_spans), None
        pooled = [hidden[start:end].float() for start, end in step.pool_spans]
        prompt_rows = self._prompt_logprobs(hidden, step) if step.prompt_spans else []
        if not step.logit_positions:
            empty = hidden.new_empty((0, self.shape.vocab_size), dtype=torch.float32)
            return empty, pooled, prompt_rows
        index = torch.tensor(step.logit_positions, dtype=torch.long, device=dev)
        return self.model.compute_logits(hidden.index_select(0, index)), pooled, prompt_rows

    def _replayable(self, step: StepInput) -> bool:
        """A decode-only step (one new token each, nothing pooled or scored) that a
        captured graph holds."""
        return (self.graphs is not None and len(step.ids) == len(step.query_lens)
                and not step.pool_spans and not step.prompt_spans
                and self.graphs.fits(len(step.ids), max(map(len, step.block_tables))))

    def _prompt_logprobs(self, hidden: torch.Tensor, step: StepInput) -> list | None:
        """Prompt logprobs of the step's prompt spans, a slice of rows at a time, so a
        long prompt never holds [prompt, vocabulary] logits (None off TP rank 0)."""
        positions: list[int] = []
        tops: list[int] = []
        for start, end, top in step.prompt_spans:
            positions.extend(range(start, end))
            tops.extend([top] * (end - start))
        out: list | None = []
        for at in range(0, len(positions), _PROMPT_LOGIT_ROWS):
            index = torch.tensor(positions[at:at + _PROMPT_LOGIT_ROWS], dtype=torch.long,
                                 device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, index))
            if logits is None:  # a TP worker: it only takes part in the gather
                out = None
                continue
            out.extend(prompt_token_logprobs(
                logits, step.prompt_targets[at:at + len(index)], tops[at:at + len(index)]))
        return out


def _random_weights(model: torch.nn.Module) -> None:
    """load_format dummy: every parameter uniform in [-1e-3, 1e-3], as vLLM's dummy
    format (what runs is all that matters: speed benchmarks at a model's real shapes)."""
    generator = torch.Generator(device=next(model.parameters()).device)
    generator.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.uniform_(-1e-3, 1e-3, generator=generator)


def _on(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether tensor lives on device; "cuda" names the current GPU, which tensors call
    "cuda:0" (torch.device("cuda") != torch.device("cuda:0"))."""
    if tensor.device.type != device.type:
        return False
    return device.index is None or tensor.device.index == device.index
