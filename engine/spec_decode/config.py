"""SpeculativeConfig: vLLM's speculative_config (a JSON object), checked once at start.

Unknown keys and methods this engine does not serve are refused by name, never
accepted and ignored.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from engine.errors import InvalidRequestError
from engine.spec_decode.registry import PROPOSERS

# vLLM's method names that name a model-based proposer; not served by this engine yet
_NOT_SERVED = ("eagle", "medusa", "mlp_speculator", "mtp", "deepseek_mtp")
_WITH_MODEL = ("draft_model", "eagle3")  # the methods that read a checkpoint


@dataclass(frozen=True)
class SpeculativeConfig:
    """How a request's next tokens are proposed (vLLM's field names and defaults)."""

    method: str
    num_speculative_tokens: int = 5  # the most tokens proposed a step
    # ngram: the longest and shortest suffix of the context that is looked up earlier
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 2
    # suffix (Arctic Inference's suffix decoding): the longest suffix matched, responses
    # of finished requests kept for matching, tokens proposed per matched token, and the
    # lowest estimated probability of a whole proposal
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # no speculation in a step whose batch has more running requests than this
    disable_by_batch_size: int | None = None
    # Flotilla's: a request whose proposals were rejected outright this many times in a
    # row rests (1, 2, 4, then 8 steps without proposals) until one is accepted again;
    # where nothing can be copied, verification rows are then rarely paid for. 0: never
    backoff_after_misses: int = 1
    # draft_model: the draft checkpoint (same vocabulary), and its ranks (1: it runs in
    # the engine process beside rank 0 of the target); eagle3: the head's checkpoint
    model: str | None = None
    draft_tensor_parallel_size: int | None = None

    @classmethod
    def from_dict(cls, spec: dict[str, Any] | None) -> "SpeculativeConfig | None":
        """The config from its JSON form; None when speculation is off."""
        if spec is None:
            return None
        if not isinstance(spec, dict):
            raise InvalidRequestError("speculative_config must be a JSON object")
        if spec.get("method") in _NOT_SERVED:
            cls._refuse_unserved(spec["method"])
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise InvalidRequestError(
                f"speculative_config: unknown or unsupported keys {unknown} (known: "
                f"{sorted(known)})")
        method = spec.get("method")
        if method is None and spec.get("model") is not None:  # vLLM's inference
            spec = {**spec, "method": "eagle3" if "eagle3" in str(spec["model"]).lower()
                    else "draft_model"}
        elif method is None:
            raise InvalidRequestError("speculative_config needs a method (ngram, suffix, or "
                                      "draft_model with a model)")
        if spec.get("method") == "suffix" and "num_speculative_tokens" not in spec:
            spec = {**spec, "num_speculative_tokens": spec.get(
                "suffix_decoding_max_tree_depth", cls.suffix_decoding_max_tree_depth)}
        try:
            return cls(**spec)
        except TypeError as exc:
            raise InvalidRequestError(f"speculative_config: {exc}") from None

    @staticmethod
    def _refuse_unserved(method: str) -> None:
        raise InvalidRequestError(
            f"speculative_config method {method!r} is not served by this engine; served: "
            f"{sorted(PROPOSERS)}")

    def __post_init__(self) -> None:
        if self.method in _NOT_SERVED:
            self._refuse_unserved(self.method)
        checks = [
            (self.method in PROPOSERS,
             f"speculative_config method must be one of {sorted(PROPOSERS)}, got "
             f"{self.method!r}"),
            (_int(self.num_speculative_tokens) and 1 <= self.num_speculative_tokens <= 64,
             "num_speculative_tokens must be an int in [1, 64]"),
            (_int(self.prompt_lookup_min) and _int(self.prompt_lookup_max)
             and 1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
             "prompt_lookup_min and prompt_lookup_max must be ints, 1 <= min <= max"),
            (_int(self.suffix_decoding_max_tree_depth)
             and 1 <= self.suffix_decoding_max_tree_depth <= 1024,
             "suffix_decoding_max_tree_depth must be an int in [1, 1024]"),
            (_int(self.suffix_decoding_max_cached_requests)
             and self.suffix_decoding_max_cached_requests >= 0,
             "suffix_decoding_max_cached_requests must be an int >= 0"),
            (isinstance(self.suffix_decoding_max_spec_factor, (int, float))
             and self.suffix_decoding_max_spec_factor > 0,
             "suffix_decoding_max_spec_factor must be > 0"),
            (isinstance(self.suffix_decoding_min_token_prob, (int, float))
             and 0 <= self.suffix_decoding_min_token_prob <= 1,
             "suffix_decoding_min_token_prob must be in [0, 1]"),
            ((self.method in _WITH_MODEL) == (self.model is not None),
             "speculative_config: a model is given with method draft_model or eagle3, and "
             "only then"),
            (self.draft_tensor_parallel_size in (None, 1),
             "draft_tensor_parallel_size: the draft runs on one rank (1)"),
            (_int(self.backoff_after_misses) and self.backoff_after_misses >= 0,
             "backoff_after_misses must be an int >= 0"),
            (self.disable_by_batch_size is None
             or (_int(self.disable_by_batch_size) and self.disable_by_batch_size >= 1),
             "disable_by_batch_size must be an int >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
