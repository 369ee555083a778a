"""The stop rule EngineCore and the mock engine share (engine/core/stop_rule.py): each
rule, min_tokens masking EOS and stop tokens, and which rule wins when several apply."""
from __future__ import annotations

import pytest

from engine.core.stop_rule import StopRule, check_stop
from engine.sampling_params import SamplingParams

EOS = 2
STOP = 9
PROMPT = 10  # prompt tokens of every request here
MAX_LEN = 100  # max_model_len


def stop(token: int, num_output: int, max_model_len: int = MAX_LEN,
         **params) -> StopRule | None:
    """check_stop for the num_output-th token of a PROMPT-token request."""
    return check_stop(token, num_output, PROMPT + num_output, SamplingParams(**params),
                      (EOS,), max_model_len)


def test_a_plain_token_goes_on():
    assert stop(5, 1, max_tokens=None) is None
    assert stop(5, 3, max_tokens=4) is None


def test_eos_ends_unless_ignored():
    assert stop(EOS, 1) is StopRule.EOS
    assert stop(EOS, 1, ignore_eos=True) is None
    # any of the model's EOS ids
    assert check_stop(7, 1, PROMPT + 1, SamplingParams(), (EOS, 7), MAX_LEN) is StopRule.EOS


def test_a_stop_token_ends_even_with_ignore_eos():
    assert stop(STOP, 1, stop_token_ids=[STOP]) is StopRule.STOP_TOKEN
    assert stop(STOP, 1, stop_token_ids=[STOP], ignore_eos=True) is StopRule.STOP_TOKEN
    assert stop(STOP, 1) is None  # not asked for


def test_max_tokens_and_max_model_len_end_with_length():
    assert stop(5, 4, max_tokens=4) is StopRule.MAX_TOKENS
    assert stop(5, 4, max_tokens=None, max_model_len=PROMPT + 4) is StopRule.MAX_MODEL_LEN
    assert stop(5, 3, max_tokens=None, max_model_len=PROMPT + 4) is None


@pytest.mark.parametrize("token,params", [
    (EOS, {}),
    (STOP, {"stop_token_ids": [STOP]}),
])
def test_min_tokens_masks_eos_and_stop_tokens(token, params):
    assert stop(token, 2, min_tokens=3, **params) is None
    assert stop(token, 3, min_tokens=3, **params) is not None  # this token is the third


def test_min_tokens_does_not_mask_the_length_rules():
    assert stop(5, 3, min_tokens=3, max_tokens=3) is StopRule.MAX_TOKENS
    assert stop(EOS, 2, min_tokens=2, max_tokens=2, max_model_len=PROMPT + 1) \
        is StopRule.EOS
    assert stop(EOS, 1, min_tokens=2, max_tokens=2, max_model_len=PROMPT + 1) \
        is StopRule.MAX_MODEL_LEN


def test_the_first_rule_that_applies_wins():
    """EOS, then a stop token, then max_tokens, then max_model_len."""
    both = {"stop_token_ids": [EOS], "max_tokens": 1}
    assert stop(EOS, 1, max_model_len=PROMPT + 1, **both) is StopRule.EOS
    assert stop(EOS, 1, max_model_len=PROMPT + 1, ignore_eos=True, **both) \
        is StopRule.STOP_TOKEN
    assert stop(STOP, 1, stop_token_ids=[STOP], max_tokens=1,
                max_model_len=PROMPT + 1) is StopRule.STOP_TOKEN
    assert stop(5, 1, max_tokens=1, max_model_len=PROMPT + 1) is StopRule.MAX_TOKENS


def test_finish_reasons():
    assert [r.finish_reason for r in StopRule] == ["stop", "stop", "length", "length"]
