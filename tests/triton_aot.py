"""Compile every Triton kernel at the engine's launch shapes for an NVIDIA target, on a
machine without a GPU (Triton's bundled ptxas): `python -m tests.triton_aot 90` prints
{kernel config: shared memory bytes} as JSON, or fails with the compiler's error.

Run without TRITON_INTERPRET (the compiler does not work under the interpreter);
tests/test_triton_kernels.py runs it in a child process."""
from __future__ import annotations

import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine.model.layers.triton_paged import BLOCK_N, PREFILL_ROWS
from engine.model.triton_kernels import fused_ops as fo
from engine.model.triton_kernels import paged_attention as pa

_INTS = ("tile_seq_ptr", "tile_q_ptr", "query_start_ptr", "seq_lens_ptr", "tables_ptr")


def compile_kernel(kernel, dtype: str, constexprs: dict, arch: int, fp32=(), ints=(),
                   i64=(), floats=(), fp8=()) -> int:
    """Shared memory bytes of kernel compiled for sm_<arch>: pointers to dtype unless
    named in fp32 / ints (int32) / i64 / fp8 (e4m3), float scalars named in floats,
    other scalars i32."""
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = ("*fp32" if name in fp32 else "*i32" if name in ints
                               else "*i64" if name in i64 else "*fp8e4nv" if name in fp8
                               else f"*{dtype}")
        else:
            signature[name] = "fp32" if name in floats else "i32"
    compiled = triton.compile(ASTSource(kernel, signature, constexprs),
                              target=GPUTarget("cuda", arch, 32))
    assert compiled.asm["cubin"]
    return compiled.metadata.shared


_SCALES = ("scale_log2", "v_scale")
_CACHE = ("k_ptr", "v_ptr")


def _attention(dtype: str, head_dim: int, block_q: int, splits: int, arch: int,
               fp8_cache: bool = False, sinks: bool = False) -> int:
    return compile_kernel(
        pa.paged_attention_kernel, dtype, dict(
            GROUP=4, GROUP_PAD=pa.group_pad(4, block_q), BLOCK_Q=block_q, BLOCK_N=BLOCK_N,
            HEAD_DIM=head_dim, HEAD_PAD=head_dim, PAGE=16, NUM_SPLITS=splits,
            PRECISION="tf32", HAS_SINKS=sinks), arch,
        fp32=("part_out_ptr", "part_lse_ptr", "sinks_ptr"), ints=_INTS,
        floats=_SCALES, fp8=_CACHE if fp8_cache else ())


def _rope_write(arch: int, fp8_cache: bool) -> int:
    return compile_kernel(
        fo.rope_write_kv_kernel, "bf16", dict(
            NUM_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=128, HALF_PAD=64, HEADS_PAD=64, KV_PAD=8,
            FP8=fp8_cache), arch, fp32=("cos_ptr", "sin_ptr"),
        i64=("positions_ptr", "slots_ptr"), floats=("k_scale", "v_scale"),
        fp8=("k_cache_ptr", "v_cache_ptr") if fp8_cache else ())


def main(arch: int) -> dict[str, int]:
    built = {}
    kinds = (("decode", 1, 1), ("decode-split", 1, 4), ("prefill", PREFILL_ROWS // 4, 1))
    for dtype in ("bf16", "fp16"):
        for model, head_dim in (("8b", 128), ("1b", 64)):
            for kind, block_q, splits in kinds:
                built[f"attention {kind} {model} {dtype}"] = _attention(
                    dtype, head_dim, block_q, splits, arch)
        built[f"reduce 8b {dtype}"] = compile_kernel(
            pa.reduce_splits_kernel, dtype, dict(NUM_SPLITS=4, SPLITS_PAD=4, HEAD_DIM=128,
                                                 HEAD_PAD=128, HAS_SINKS=False), arch,
            fp32=("part_out_ptr", "part_lse_ptr", "sinks_ptr"))
    for kind, block_q, splits in kinds:  # gpt-oss: sinks (and a window, a runtime value)
        built[f"attention {kind} gpt-oss bf16 sinks"] = _attention("bf16", 64, block_q,
                                                                   splits, arch, sinks=True)
    built["reduce gpt-oss bf16 sinks"] = compile_kernel(
        pa.reduce_splits_kernel, "bf16", dict(NUM_SPLITS=4, SPLITS_PAD=4, HEAD_DIM=64,
                                              HEAD_PAD=64, HAS_SINKS=True), arch,
        fp32=("part_out_ptr", "part_lse_ptr", "sinks_ptr"))
    for kind, block_q, splits in kinds:  # an fp8 cache under bf16 activations
        built[f"attention {kind} 8b bf16 fp8-cache"] = _attention("bf16", 128, block_q,
                                                                  splits, arch, True)
    built["attention decode 8b fp32"] = compile_kernel(
        pa.paged_attention_kernel, "fp32", dict(
            GROUP=4, GROUP_PAD=16, BLOCK_Q=1, BLOCK_N=BLOCK_N, HEAD_DIM=128, HEAD_PAD=128,
            PAGE=16, NUM_SPLITS=1, PRECISION="ieee", HAS_SINKS=False), arch, ints=_INTS,
        floats=_SCALES)
    built["add + rms norm"] = compile_kernel(
        fo.add_rms_norm_kernel, "bf16", dict(N=4096, BLOCK=4096, HAS_RESIDUAL=True), arch,
        floats=("eps",))
    built["rope + kv write"] = _rope_write(arch, False)
    built["rope + kv write fp8-cache"] = _rope_write(arch, True)
    built["silu x mul"] = compile_kernel(
        fo.silu_and_mul_kernel, "bf16", dict(N=14336, BLOCK=1024), arch)
    return built


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 90)))
