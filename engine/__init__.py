"""Flotilla's inference engine: paged KV cache, continuous batching, offline LLM API.

Never imports ray: it runs in a plain process, in any actor, or behind the
engine-core server.
"""
from engine.version import __version__  # set before the modules below load

from engine.config import EngineConfig
from engine.errors import (
    DuplicateRequestError,
    EngineDeadError,
    FlotillaError,
    InvalidRequestError,
    ModelNotFoundError,
    PromptTooLongError,
    UnsupportedModelError,
)
from engine.lora.request import LoRARequest
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import SamplingParams


def __getattr__(name: str):
    # LLM pulls in torch and transformers: import it only when asked for.
    if name == "LLM":
        from engine.frontend.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "LoRARequest", "EngineConfig", "RequestOutput", "CompletionOutput",
           "Logprob", "FlotillaError", "InvalidRequestError", "PromptTooLongError",
           "DuplicateRequestError", "ModelNotFoundError", "UnsupportedModelError",
           "EngineDeadError"]
