"""The mock engine's options: its latency model (MockTiming) and the shape it reports
(MockConfig).

Why apart from the mock itself (core.py): the served app's options (deployments/config.py)
carry MockTiming as its `mock_<name>` options, and reading them needs none of the mock's
machinery (prefix-cache model, stop rule, scripts).
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import InvalidRequestError
from engine.options import option

# Drawn token ids lie in [FIRST_TOKEN_ID, vocab_size): ids below are specials (pad, bos, eos).
FIRST_TOKEN_ID = 3


@dataclass(frozen=True)
class MockTiming:
    """The mock's latency model and output shape: what a benchmark or a test chooses.
    The served app exposes these as mock_<name> (deployments.config.AppArgs)."""

    ttft_s: float = option(0.0, "seconds from admission to the first token, besides the "
                                "prefill time")
    prefill_s_per_token: float = option(0.0, "extra seconds per prompt token before the "
                                             "first token")
    itl_s: float = option(0.0, "seconds between two tokens of one request")
    output_chunk_size: int = option(1, "tokens per engine output message (the last one may "
                                       "hold fewer)")
    emit_eos_after: int | None = option(None, "output index where EOS is drawn (not before "
                                              "min_tokens); none: only stop rules end a request")
    num_blocks: int = option(1024, "KV blocks the mock accounts for (stats and autoscaling)")
    scripted: bool = option(False, "a prompt's last [[emit]]text[[/emit]] directive is its "
                                   "output, then EOS (in the default model's tokens)")

    def __post_init__(self) -> None:
        _check([
            (self.num_blocks >= 1, "num_blocks must be >= 1"),
            (self.output_chunk_size >= 1, "output_chunk_size must be >= 1"),
            (min(self.ttft_s, self.prefill_s_per_token, self.itl_s) >= 0.0,
             "latencies must be >= 0"),
            (self.emit_eos_after is None or self.emit_eos_after >= 0,
             "emit_eos_after must be >= 0"),
        ])


@dataclass(frozen=True)
class MockConfig(MockTiming):
    """Mock engine options: its timing plus the shape a real engine would report (names
    as in EngineConfig where they mean the same)."""

    seed: int = option(0, "seed of the token hash")
    engine_index: int = 0  # part of the token hash: DP ranks answer differently
    vocab_size: int = option(32000, "ids the mock draws tokens from")
    eos_token_id: int = option(2, "the id it draws as EOS")
    max_model_len: int = option(4096, "context length it enforces (prompt + output)")
    block_size: int = option(16, "tokens per KV block it accounts")
    max_num_seqs: int = option(256, "the most running requests (the rest wait)")
    max_waiting_requests: int = option(4096, "the most waiting requests (more: refused, "
                                             "EngineOverloadedError)")
    enable_prefix_caching: bool = option(True, "keep an LRU index of prompt blocks: cached "
                                               "prefixes skip prefill time, KV events")
    serial_prefill: bool = option(False, "prefills run one after another (a compute-bound "
                                         "engine): queued prompts delay the next")
    force_is_sleeping: bool | None = None  # test knob: is_sleeping() answers this
    force_reset_prefix_cache: bool | None = None  # test knob: reset_prefix_cache() answers this

    def __post_init__(self) -> None:
        super().__post_init__()
        _check([
            (0 <= self.eos_token_id < self.vocab_size, "eos_token_id must be in [0, vocab_size)"),
            (self.vocab_size > FIRST_TOKEN_ID + (self.eos_token_id >= FIRST_TOKEN_ID),
             f"vocab_size must leave ids to draw from beyond the specials [0, {FIRST_TOKEN_ID})"),
            (self.max_model_len >= 2, "max_model_len must be >= 2"),
            (self.block_size >= 1, "block_size must be >= 1"),
            (self.max_num_seqs >= 1, "max_num_seqs must be >= 1"),
        ])


def _check(checks: list[tuple[bool, str]]) -> None:
    for ok, message in checks:
        if not ok:
            raise InvalidRequestError(f"mock engine: {message}")

