"""The attention backends by name, and `auto`'s choice: what the attention_backend
option consults, in one place.

auto: the native kernels where the CPU kernels are loaded; on CUDA triton where its
kernels run (on an H200 they beat FlexAttention's at every shape timed), else flex
unless the model has sliding windows or sinks (FlexAttention has neither here), else
torch; torch on any other device. That is the first backend of a preference list (the
CUDA one, or the other devices') that does not refuse the model on the device.
"""
from __future__ import annotations

from engine.errors import InvalidRequestError
from engine.model.attention.base import AttentionBackend, AttentionSpec
from engine.model.attention.flex import FlexBackend
from engine.model.attention.names import BACKEND_NAMES
from engine.model.attention.native import NativeBackend
from engine.model.attention.torch_sdpa import TorchBackend
from engine.model.attention.triton import TritonBackend

BACKENDS: dict[str, type[AttentionBackend]] = {
    cls.name: cls for cls in (NativeBackend, FlexBackend, TritonBackend, TorchBackend)}
assert tuple(BACKENDS) == BACKEND_NAMES, "names.py lists the registry's backends"

# auto's preferences, best first (each passed over where it refuses the model)
_CUDA_ORDER = ("native", "triton", "flex", "torch")
_OTHER_ORDER = ("native", "torch")


def auto_backend(spec: AttentionSpec) -> type[AttentionBackend]:
    """What `auto` picks for this model on this device (the module docstring's rule)."""
    order = _CUDA_ORDER if spec.device.type == "cuda" else _OTHER_ORDER
    return next(BACKENDS[name] for name in order if BACKENDS[name].refuses(spec) is None)


def choose_backend(choice: str, spec: AttentionSpec) -> type[AttentionBackend]:
    """The backend the option names (auto: auto_backend's); InvalidRequestError with its
    refusal where it cannot serve the model on the device."""
    if choice == "auto":
        return auto_backend(spec)
    backend = BACKENDS[choice]
    refusal = backend.refuses(spec)
    if refusal is not None:
        raise InvalidRequestError(refusal)
    return backend


def make_backend(choice: str, spec: AttentionSpec) -> AttentionBackend:
    """The chosen backend, built, once it also holds the cache the options ask for."""
    backend = choose_backend(choice, spec)
    refusal = backend.refuses_cache(spec)
    if refusal is not None:
        raise InvalidRequestError(refusal)
    return backend(spec)


__all__ = ["BACKENDS", "auto_backend", "choose_backend", "make_backend"]
