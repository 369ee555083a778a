"""Write a tiny Hugging Face llama checkpoint as a GGUF file, as llama.cpp's converter
does: llama.cpp's tensor names, the q/k rows permuted for its rotary layout, the
weights quantized in a chosen block format, and the default model's tokenizer fields.

Q8_0, Q4_0 and Q4_1 are quantized with the gguf package's own quantizers. It has none
for the K-quants, so a Q4_K or Q6_K weight is random blocks with realistic scales (the
model's weights are then those blocks' values, which is all a reference needs)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

from engine.model.loader import default_model_gguf
from engine.sampling_params import SamplingParams
from engine.quant.gguf_blocks import BLOCK_FORMATS

_LAYER_NAMES = {"input_layernorm.weight": "attn_norm.weight",
                "post_attention_layernorm.weight": "ffn_norm.weight",
                "self_attn.q_proj.weight": "attn_q.weight",
                "self_attn.k_proj.weight": "attn_k.weight",
                "self_attn.v_proj.weight": "attn_v.weight",
                "self_attn.o_proj.weight": "attn_output.weight",
                "mlp.gate_proj.weight": "ffn_gate.weight",
                "mlp.up_proj.weight": "ffn_up.weight",
                "mlp.down_proj.weight": "ffn_down.weight"}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order: each head's rows [2, dim/2] as [dim/2, 2]."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_blocks(fmt: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """K-quant blocks of random bytes with finite, realistic half-precision scales."""
    f = BLOCK_FORMATS[fmt]
    raw = rng.integers(0, 256, size=(rows, cols // f.weights, f.nbytes), dtype=np.uint8)
    # weights of a trained model's size (|w| up to ~0.4): Q4_K's d * 63 * 15 and dmin * 63,
    # Q6_K's d * 128 * 32
    scale = 1e-4 if fmt == "Q6_K" else 5e-4
    for at in {"Q4_K": (0, 2), "Q6_K": (208,)}[fmt]:
        raw[:, :, at:at + 2] = rng.uniform(0.2 * scale, scale, raw.shape[:2]).astype(
            np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def write_gguf(hf_dir: Path, out: Path, formats: dict[str, str] | str,
               seed: int = 0) -> Path:
    """The llama checkpoint in hf_dir as a GGUF file at out. formats: one block format
    for every 2-D weight, or {llama.cpp name suffix: format} (e.g. {"attn_v.weight":
    "Q6_K"}) with "*" for the rest; "F32" keeps a tensor as floats."""
    from safetensors.torch import load_file
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(hf_dir)
    state = {k.removeprefix("model."): v for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    if isinstance(formats, str):
        formats = {"*": formats}
    rng = np.random.default_rng(seed)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    writer = GGUFWriter(str(out), "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(getattr(config, "rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.hidden_size // heads)
    writer.add_vocab_size(config.vocab_size)
    _copy_tokenizer(writer)

    def add(name: str, value: torch.Tensor, permute_heads: int | None = None) -> None:
        w = value.float().numpy()
        if permute_heads:
            w = llama_cpp_permute(w, permute_heads)
        fmt = next((f for k, f in formats.items() if k != "*" and name.endswith(k)),
                   formats.get("*", "F32"))
        if w.ndim == 1 or fmt == "F32":
            writer.add_tensor(name, np.ascontiguousarray(w))
            return
        kind = GGMLQuantizationType[fmt]
        if fmt in ("Q8_0", "Q4_0", "Q4_1"):
            raw = quants.quantize(w, kind)
        else:
            raw = random_blocks(fmt, *w.shape, rng)
        writer.add_tensor(name, raw, raw_dtype=kind)

    add("token_embd.weight", state["embed_tokens.weight"])
    for i in range(config.num_hidden_layers):
        for hf, gg in _LAYER_NAMES.items():
            heads_of = heads if gg == "attn_q.weight" else kv_heads if gg == "attn_k.weight" else None
            add(f"blk.{i}.{gg}", state[f"layers.{i}.{hf}"], heads_of)
    add("output_norm.weight", state["norm.weight"])
    if not config.tie_word_embeddings:
        add("output.weight", state["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _copy_tokenizer(writer: GGUFWriter) -> None:
    """The default model's tokenizer fields: the tiny models share its vocabulary."""
    reader = GGUFReader(str(default_model_gguf()))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kind, sub_type=sub)


def save_decoded(model, out: Path) -> Path:
    """A transformers model read from a GGUF file, saved as a plain float checkpoint
    (transformers refuses to save a model it marks as GGUF-quantized)."""
    import json

    from safetensors.torch import save_file
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def check_against(llm, ref, prompts, tokens=8, tolerance=0.15, tie=0.1, exact_share=0.75,
                   **generate):
    """Teacher-forced on the engine's own greedy tokens: each is the reference's argmax or
    within `tie` of it, at least exact_share of them are its argmax exactly, and each chosen token's
    logprob is within `tolerance` of the reference's. The activations' rounding to int8
    runs (the decode kernels') moves these random tiny models' logprobs by up to ~0.1
    (measured 0.096), and their top two are often closer than that."""
    out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=tokens,
                                               ignore_eos=True, logprobs=0),
                       use_tqdm=False, **generate)
    exact = total = 0
    for prompt, o in zip(prompts, out):
        got = list(o.outputs[0].token_ids)
        with torch.no_grad():
            lp = torch.log_softmax(ref(torch.tensor([prompt + got])).logits[0], -1)
        rows = lp[len(prompt) - 1:len(prompt) - 1 + len(got)]
        for row, token, entry in zip(rows, got, o.outputs[0].logprobs):
            assert row[token].item() >= row.max().item() - tie, (row[token].item(), row.max().item(), entry[token].logprob)
            assert abs(entry[token].logprob - row[token].item()) < tolerance, (entry[token].logprob, row[token].item())
            exact += int(row.argmax().item() == token)
            total += 1
    assert exact >= exact_share * total, (exact, total)
    return out


def decoded_default_model() -> Path:
    """The default model as transformers reads its GGUF (decoded to float32), saved once as
    a Hugging Face checkpoint under the cache, keyed by the file's content: what HF
    references (tests) and the float anchors of benchmarks (vLLM, HF) load."""
    import os
    import shutil

    from transformers import AutoModelForCausalLM

    from engine.model.loader import cache_root, content_digest, load_tokenizer, resolve_model
    gguf = default_model_gguf()
    target = cache_root() / "reference" / f"{gguf.stem}-{content_digest(gguf)}"
    if not (target / "model.safetensors").exists():
        tmp = target.with_name(f".{target.name}.{os.getpid()}")
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=torch.float32)
        save_decoded(model, tmp)
        load_tokenizer(resolve_model("default")).save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:  # made by another process meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def check_tp2_equals_one_rank(model) -> None:
    """Greedy tokens of `model` under tensor parallelism (2 ranks) equal one engine's:
    each rank reads only its rows or columns of a quantized checkpoint."""
    from engine import LLM
    prompts = [list(range(200, 230)), list(range(500, 509))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    single = [o.outputs[0].token_ids for o in
              LLM(str(model), dtype="float32").generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(model), dtype="float32", tensor_parallel_size=2)
    try:
        assert [o.outputs[0].token_ids for o in
                llm.generate(prompts, params, use_tqdm=False)] == single
    finally:
        llm.shutdown()
