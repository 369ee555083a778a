"""gpt-oss (issue 43): attention sinks, local / global layers in turn, biased router and
experts with the clamped SwiGLU, YaRN RoPE, stacked interleaved expert tensors, on a
tiny random-weight checkpoint against transformers; the native kernel's sinks against a
reference."""
import pytest
import torch

from engine import LLM
from engine.errors import InvalidRequestError
from tests.conftest import build_tiny_model
from tests.family_checks import (check_chunked_prefill_and_prefix_hit, check_n2_and_preemption,
                                 check_tp2_matches_tp1)
from tests.test_attention import _each_bf16_kernel, _native, _problem, _reference

WINDOW = 16


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory, tiny_tokenizer_dir):
    """Two layers (local, global), four experts of which two a token, a 16-token window;
    weights drawn wide enough (std 0.2) that the SwiGLU's clamps bite."""
    return build_tiny_model(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss", tiny_tokenizer_dir,
                            num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                            swiglu_limit=1.0)


def test_gpt_oss_checkpoint_stacks_interleaved_experts_and_matches_hf(tiny_gpt_oss):
    from safetensors import safe_open
    with safe_open(str(tiny_gpt_oss / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_slice("model.layers.0.mlp.experts.gate_up_proj").get_shape() == [4, 64, 256]
    assert {"model.layers.0.self_attn.sinks", "model.layers.0.mlp.router.bias",
            "model.layers.0.mlp.experts.down_proj_bias"} <= names
    model = check_chunked_prefill_and_prefix_hit(tiny_gpt_oss)
    assert [layer.self_attn.window for layer in model.layers] == [WINDOW, 0]


def test_gpt_oss_on_the_torch_path_matches_hf(tiny_gpt_oss):
    check_chunked_prefill_and_prefix_hit(tiny_gpt_oss, attention_backend="torch")


def test_gpt_oss_with_n2_and_preemption_matches_hf(tiny_gpt_oss):
    check_n2_and_preemption(tiny_gpt_oss)


def test_gpt_oss_tp2_matches_tp1(tiny_gpt_oss):
    check_tp2_matches_tp1(tiny_gpt_oss)


def test_attention_backends_without_sinks_are_refused(tiny_gpt_oss):
    with pytest.raises(InvalidRequestError, match="does not serve attention sinks"):
        LLM(str(tiny_gpt_oss), dtype="float32", attention_backend="flex")


def test_gpt_oss_on_the_triton_kernels_matches_hf(tiny_gpt_oss):
    """attention_backend triton (interpreted on CPU): sinks and the local layer's window
    in the Triton kernel; greedy tokens are HF's."""
    from engine.model.triton_kernels import availability
    from tests.conftest import hf_greedy
    from tests.family_checks import greedy
    from tests.test_parity import _prompts
    if availability(torch.device("cpu")) is not None:
        pytest.skip(f"Triton kernels: {availability(torch.device('cpu'))}")
    prompts = _prompts([30, 9])
    llm = LLM(str(tiny_gpt_oss), dtype="float32", attention_backend="triton", device="cpu",
              max_num_batched_tokens=16, block_size=8)
    try:
        assert llm.llm_engine.engine_core.runner.attention.name == "triton"
        assert greedy(llm, prompts, 8) == hf_greedy(tiny_gpt_oss, prompts, 8)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("splits,block_q", [(1, 1), (3, 1), (1, 8)])
def test_triton_kernel_sinks_join_each_softmax(splits, block_q):
    """The Triton kernel (interpreted on CPU) with sinks far above and below the scores:
    decodes with and without split-KV (the reduce adds the sink), prefill tiles."""
    from engine.model.triton_kernels import availability
    from tests.test_triton_kernels import DEVICE, _launch, _paged_case
    if availability(DEVICE) is not None:
        pytest.skip(f"Triton kernels: {availability(DEVICE)}")
    from engine.model.triton_kernels.paged_attention import SplitScratch, attend
    page, dim, kv_heads, group = 16, 32, 2, 2
    seqs = [(40, 1), (100, 1), (0, 1)] if block_q == 1 else [(32, 9), (0, 37)]
    cache, q, tables = _paged_case(splits, seqs, 0, page, kv_heads, group, dim, torch.float32)
    k_cache, v_cache = cache[0], cache[1]
    sinks = torch.tensor([0.5, 30.0, -30.0, -1.0])
    out = torch.zeros_like(q)
    attend(q, k_cache, v_cache, out, _launch(seqs, tables, block_q, splits), 0.3, page, 16,
           SplitScratch.allocate(8, q.shape[1], dim, DEVICE), sinks=sinks)
    heads = q.shape[1]
    ref, row = torch.empty(q.shape), 0
    for (ctx, n), table in zip(seqs, tables):
        slots = [table[p // page] * page + p % page for p in range(ctx + n)]
        keys = k_cache[:, slots].repeat_interleave(group, 0)
        values = v_cache[:, slots].repeat_interleave(group, 0)
        for j in range(n):
            p = ctx + j
            scores = torch.einsum("hd,hkd->hk", q[row], keys[:, :p + 1]) * 0.3
            probs = torch.cat([scores, sinks.view(heads, 1)], 1).softmax(-1)[:, :-1]
            ref[row] = torch.einsum("hk,hkd->hd", probs, values[:, :p + 1])
            row += 1
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 19])
def test_native_kernel_sinks_join_each_softmax(kernels, dtype, window):
    """Decodes and prefill chunks, GQA: with a sink per query head (some far above the
    scores, some far below) the output is the reference's softmax over [scores, sink]
    with the sink's column dropped."""
    heads, kv_heads, d, bs = 8, 2, 64, 16
    lens, query_lens = [90, 7, 64, 70], [1, 1, 64, 21]
    q, kc, vc, tables, lens, starts = _problem(dtype, heads, kv_heads, d, bs, 40, 6, lens,
                                               query_lens, seed=9)
    sinks = torch.tensor([0.0, 3.0, -2.0, 40.0, -40.0, 1.5, 0.5, -0.5])
    scale = d ** -0.5
    plain = _reference(q, kc, vc, tables, lens, starts, scale, window)
    # the sink scales each row's output by sum / (sum + exp(sink)): from the reference's
    # log-sum-exp of the same scores
    lse = _reference(q, kc, vc, tables, lens, starts, scale, window, lse=True)
    expected = plain * torch.sigmoid(lse - sinks).unsqueeze(-1)
    kc_t = kc.transpose(2, 3).contiguous()
    call = kernels.paged_attention
    for name in _each_bf16_kernel(kernels, dtype):
        try:
            kernels.paged_attention = lambda *a: call(*a, 1.0, 1.0, window, sinks)
            got = _native(kernels, q, kc_t, vc, tables, lens, starts, scale).float()
        finally:
            kernels.paged_attention = call
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, expected, atol=tol, rtol=tol, msg=name)
