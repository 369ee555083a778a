"""Detokenization and stop strings, on the default model's real tokenizer."""
import random

import pytest

from engine import LLM, SamplingParams
from engine.core_messages import EngineCoreOutput, EngineCoreRequest
from engine.frontend.detokenizer import IncrementalDetokenizer
from engine.frontend.output_processor import OutputProcessor
from engine.frontend.stop_strings import find_stop_string
from engine.model.loader import load_tokenizer
from engine.outputs import OutputKind

TEXTS = ["naïve café — 東京 🚀 emoji, ℝ² and ΔΩ", "  leading spaces\tand\nnewlines ",
         "Hello world! Привет, мир. こんにちは"]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenization_round_trips_non_ascii(tokenizer, text):
    prompt = tokenizer.encode("Say:")
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detok.update([t]) for t in ids]
    assert "".join(pieces) == text
    assert detok.output_text == text
    assert all("\ufffd" not in p for p in pieces)  # no half characters ever emitted


class _WithoutRustBackend:
    """A tokenizer as the detokenizer sees a slow one: decode() only."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_streamed_detokenization_matches_the_windowed_decode(tokenizer, skip_special_tokens):
    """The Rust DecodeStream path emits what the windowed decode emits, for random ids
    (byte tokens that split characters, specials) after random prompts fed in random
    groups; where the prompt ends inside a character, the stream emits that
    character whole before the same text, and never a half character."""
    rng = random.Random(0)
    vocab = len(tokenizer)
    text_ids = tokenizer.encode("".join(TEXTS), add_special_tokens=False)
    straddling = 0
    for trial in range(300):
        if trial % 2:
            cut = rng.randrange(0, len(text_ids))  # may cut a character in two
            prompt, out = text_ids[:cut], text_ids[cut:cut + rng.randrange(1, 30)]
        else:
            prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 20))]
            out = [rng.randrange(vocab) for _ in range(40)]
        fast = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens)
        slow = IncrementalDetokenizer(_WithoutRustBackend(tokenizer), prompt,
                                      skip_special_tokens)
        assert fast._backend is not None and slow._backend is None
        i = 0
        while i < len(out):
            k = rng.randrange(1, 5)
            fast.update(out[i:i + k])
            slow.update(out[i:i + k])
            i += k
        if tokenizer.decode(prompt, skip_special_tokens=skip_special_tokens).endswith(
                "\ufffd"):
            straddling += 1
            assert fast.output_text.endswith(slow.output_text)
            if trial % 2:  # real text: the character is completed, never half
                whole = tokenizer.decode(text_ids)
                assert "\ufffd" not in fast.output_text and fast.output_text in whole
        else:
            assert fast.output_text == slow.output_text, (prompt, out)
    assert straddling > 5  # the case was exercised


def test_find_stop_string_spanning_tokens():
    text = "abc STO"
    assert find_stop_string(text, 3, ["STOP"]) is None
    text += "P tail"
    assert find_stop_string(text, 6, ["STOP", "tail"]) == ("STOP", 4)


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32")


def _free_text(llm, prompt, n=24):
    return llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]


def test_stop_string_spanning_token_boundary_is_cut(tiny_llm):
    prompt = list(range(3000, 3010))
    free = _free_text(tiny_llm, prompt)
    tok = tiny_llm.get_tokenizer()
    # a stop string made of the end of token 4's text and the start of token 5's text
    t4, t5 = tok.decode(free.token_ids[4:5]), tok.decode(free.token_ids[5:6])
    stop = t4[-2:] + t5[:2]
    assert len(stop) >= 2
    out = tiny_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, stop=[stop],
                                                     ignore_eos=True), use_tqdm=False)
    completion = out[0].outputs[0]
    index = free.text.find(stop)
    assert completion.text == free.text[:index]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert len(completion.token_ids) < 24
    kept = tiny_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24,
                                                      stop=[stop], include_stop_str_in_output=True,
                                                      ignore_eos=True), use_tqdm=False)
    assert kept[0].outputs[0].text == free.text[:index + len(stop)]
    kv = tiny_llm.llm_engine.engine_core.kv
    assert kv.num_free_blocks == kv.num_blocks  # the stop string aborted it at the engine


def test_streamed_deltas_add_up_and_hold_back_partial_stops(tiny_llm):
    prompt = list(range(3100, 3110))
    free = _free_text(tiny_llm, prompt)
    engine = tiny_llm.llm_engine
    stop = free.text[len(free.text) // 2:len(free.text) // 2 + 3]
    engine.add_request("s", prompt, SamplingParams(temperature=0.0, max_tokens=24, stop=[stop],
                                                   ignore_eos=True), OutputKind.DELTA)
    deltas = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.outputs[0].text)
            assert stop not in "".join(deltas)
    assert "".join(deltas) == free.text[:free.text.find(stop)]


def test_chat_uses_template(default_model_dir):
    llm = LLM("default", dtype="float32", max_model_len=256)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0]
    assert "<|im_start|>assistant" in out.prompt
    assert "Paris" in out.outputs[0].text


def test_output_processor_reports_when_asked_one_output_for_many_steps(tokenizer):
    """update() folds steps in; take_output() returns everything since the last take
    (DELTA) or nothing until the end (FINAL_ONLY); a finished request is forgotten."""
    ids = tokenizer.encode(" one two three four", add_special_tokens=False)
    params = SamplingParams(max_tokens=len(ids))
    proc = OutputProcessor(tokenizer)
    for rid, kind in (("d", OutputKind.DELTA), ("f", OutputKind.FINAL_ONLY)):
        proc.add_request(rid, None, [EngineCoreRequest(rid, [1, 2], params)], kind)

    def step(i, last=False):
        return proc.update([EngineCoreOutput(r, [ids[i]], "length" if last else None)
                            for r in ("d", "f")])

    assert step(0).request_ids == ["d"]  # FINAL_ONLY: nothing to report yet
    step(1)
    first = proc.take_output("d")
    assert first.outputs[0].token_ids == ids[:2] and not first.finished
    assert proc.take_output("f") is None
    for i in range(2, len(ids) - 1):
        step(i)
    assert step(len(ids) - 1, last=True).request_ids == ["d", "f"]
    rest = proc.take_output("d")
    assert rest.finished and rest.outputs[0].token_ids == ids[2:]
    assert first.outputs[0].text + rest.outputs[0].text == " one two three four"
    final = proc.take_output("f")
    assert final.finished and final.outputs[0].text == " one two three four"
    assert not proc.has_unfinished_requests()
    assert proc.take_output("d") is None
