"""Reasoning parsers (deployments/apis/common/reasoning/): whole-text splits, the prompt's
part (a template that opens or closes the block), and the streaming invariant: every
chunking of a text, folded, gives exactly what parse() gives, while only a possible tag
(or whitespace whose fate is open) is held back.

parse() is also checked against a reference split written with str.partition below, on
texts made of tag fragments, whitespace and words.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deployments.apis.common.reasoning import (
    REASONING_PARSERS,
    ContentDelta,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningDelta,
    ReasoningParser,
    get_reasoning_parser,
)

QWEN3 = get_reasoning_parser("qwen3")
R1 = get_reasoning_parser("deepseek_r1")
PARSERS = [QWEN3, R1]
IDS = ["qwen3", "deepseek_r1"]

# prompts as the templates end them: nothing opened, opened, closed (thinking off)
PLAIN = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
OPENED = PLAIN + "<think>\n"
CLOSED = PLAIN + "<think>\n\n</think>\n\n"
PROMPTS = [PLAIN, OPENED, CLOSED]


def stream(parser: ReasoningParser, chunks: list[str], prompt: str) -> list[list]:
    """The deltas each feed() returned, then finish()'s."""
    streamer = parser.streamer(prompt)
    return [streamer.feed(chunk) for chunk in chunks] + [streamer.finish()]


def fold(batches: list[list]) -> tuple[str | None, str | None]:
    reasoning = content = ""
    for batch in batches:
        for d in batch:
            assert d.text, "empty deltas are not sent"
            if isinstance(d, ReasoningDelta):
                assert not content, "reasoning after content"
                reasoning += d.text
            else:
                assert isinstance(d, ContentDelta)
                content += d.text
    return reasoning or None, content or None


def reference(parser: ReasoningParser, text: str,
              prompt: str) -> tuple[str | None, str | None]:
    """The split as the parsers' docstrings state it, whole-text only."""
    if prompt.rstrip().endswith("</think>"):
        return None, text or None
    body = text
    if text.lstrip().startswith("<think>"):
        body, opened = text.lstrip()[len("<think>"):], True
    else:
        opened = parser is R1 or prompt.rstrip().endswith("<think>")
    if not opened:
        return None, text or None
    reasoning, end, content = body.partition("</think>")
    return reasoning or None, (content.lstrip() or None) if end else None


def check_every_chunking(parser: ReasoningParser, text: str, prompt: str) -> None:
    whole = parser.parse(text, prompt)
    assert whole == reference(parser, text, prompt), text
    assert fold(stream(parser, list(text), prompt)) == whole, text
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 3):
            chunks = [text[:i], text[i:j], text[j:]]
            assert fold(stream(parser, chunks, prompt)) == whole, (text, chunks)


# --- whole-text splits ------------------------------------------------------------------

@pytest.mark.parametrize("parser,text,prompt,want", [
    # Qwen3 opens the block itself
    (QWEN3, "<think>\nLet me see.\n</think>\n\nIt is 4.", PLAIN,
     ("\nLet me see.\n", "It is 4.")),
    (QWEN3, "\n <think>a</think>b", PLAIN, ("a", "b")),  # whitespace before the tag
    (QWEN3, "It is 4.", PLAIN, (None, "It is 4.")),  # no block: all content
    (QWEN3, "  It is 4.", PLAIN, (None, "  It is 4.")),  # content kept as written
    (QWEN3, "So </think> then", PLAIN, (None, "So </think> then")),
    (QWEN3, "<think>a</think>", PLAIN, ("a", None)),
    (QWEN3, "<think></think>\n\nx", PLAIN, (None, "x")),  # an empty block
    # the template opened it (Qwen3 Thinking-2507)
    (QWEN3, "Let me see.\n</think>\n\nIt is 4.", OPENED, ("Let me see.\n", "It is 4.")),
    (QWEN3, "\n<think>a</think>b", OPENED, ("a", "b")),  # a repeated opening tag is dropped
    # the template closed it (enable_thinking=false)
    (QWEN3, "It is 4.", CLOSED, (None, "It is 4.")),
    (QWEN3, "<think>a</think>b", CLOSED, (None, "<think>a</think>b")),
    # DeepSeek-R1: always reasoning first
    (R1, "Let me see.\n</think>\n\nIt is 4.", OPENED, ("Let me see.\n", "It is 4.")),
    (R1, "Let me see.</think>It is 4.", PLAIN, ("Let me see.", "It is 4.")),
    (R1, "<think>\nhm</think>x", PLAIN, ("\nhm", "x")),  # older checkpoints open it
    (R1, "  <think>hm</think>x", OPENED, ("hm", "x")),
    (R1, "  hm</think>x", OPENED, ("  hm", "x")),  # no tag: the whitespace is reasoning
    (R1, "It is 4.", CLOSED, (None, "It is 4.")),
    (R1, "", OPENED, (None, None)),
    (R1, "</think>\n\n", OPENED, (None, None)),
])
def test_splits(parser, text, prompt, want):
    assert parser.parse(text, prompt) == want
    check_every_chunking(parser, text, prompt)


@pytest.mark.parametrize("parser,prompt", [(QWEN3, PLAIN), (QWEN3, OPENED), (R1, PLAIN),
                                           (R1, OPENED)])
def test_reasoning_cut_by_max_tokens_is_all_reasoning(parser, prompt):
    text = ("<think>" if prompt == PLAIN else "") + "Step 1: add. Step 2: </th"
    reasoning, content = parser.parse(text, prompt)
    assert (reasoning, content) == ("Step 1: add. Step 2: </th", None)
    check_every_chunking(parser, text, prompt)


def test_deepseek_r1_without_an_end_tag_is_all_reasoning():
    assert R1.parse("It is 4.", PLAIN) == ("It is 4.", None)
    assert QWEN3.parse("It is 4.", PLAIN) == (None, "It is 4.")  # qwen3: no tag, content


@pytest.mark.parametrize("parser", PARSERS, ids=IDS)
def test_think_mentioned_in_the_content_stays_there(parser):
    text = "hm</think>\n\nUse <think> and </think> tags; <think or </thi too."
    want = ("hm", "Use <think> and </think> tags; <think or </thi too.")
    assert parser.parse(text, OPENED) == want
    check_every_chunking(parser, text, OPENED)


@pytest.mark.parametrize("parser", PARSERS, ids=IDS)
def test_a_start_tag_inside_the_reasoning_is_reasoning(parser):
    text = "I could write <think> here</think>done"
    assert parser.parse(text, OPENED) == ("I could write <think> here", "done")


@pytest.mark.parametrize("parser", PARSERS, ids=IDS)
def test_the_prompt_decides_whether_reasoning_is_expected(parser):
    assert parser.expects_reasoning(PLAIN)  # may open
    assert parser.expects_reasoning(OPENED)
    assert parser.expects_reasoning(PLAIN + "<think>")
    assert not parser.expects_reasoning(CLOSED)
    assert not parser.expects_reasoning(PLAIN + "</think>")
    assert (parser.start_tag, parser.end_tag) == ("<think>", "</think>")


# --- streaming --------------------------------------------------------------------------

def test_stream_holds_back_only_a_possible_tag():
    s = QWEN3.streamer(PLAIN)
    assert s.feed("\n ") == []  # whitespace: a <think> may follow
    assert s.feed("<th") == []
    assert s.feed("ink>\nOne") == [ReasoningDelta("\nOne")]
    assert s.feed(" two </th") == [ReasoningDelta(" two ")]
    assert s.feed("ink") == []
    assert s.feed("s> nope") == [ReasoningDelta("</thinks> nope")]  # not the end tag
    assert s.feed("<") == []
    assert s.feed("/think>\n\n") == []  # the end, then whitespace that is dropped
    assert s.feed("\nAnswer <thi") == [ContentDelta("Answer <thi")]  # content: no tags
    assert s.feed("nk") == [ContentDelta("nk")]
    assert s.finish() == []


def test_stream_decides_content_at_its_first_other_character():
    s = QWEN3.streamer(PLAIN)
    assert s.feed("\n\n") == []
    assert s.feed("<b") == [ContentDelta("\n\n<b")]
    assert s.feed("</think>") == [ContentDelta("</think>")]
    s = QWEN3.streamer(PLAIN)
    assert s.feed("<thin") == []
    assert s.finish() == [ContentDelta("<thin")]  # a tag that never came is content
    s = R1.streamer(OPENED)
    assert s.feed("<thin") == []
    assert s.finish() == [ReasoningDelta("<thin")]
    s = QWEN3.streamer(CLOSED)
    assert s.feed("<thin") == [ContentDelta("<thin")]  # nothing held: all is content


def test_reasoning_and_content_in_one_feed():
    s = R1.streamer(OPENED)
    assert s.feed("a</think>  b") == [ReasoningDelta("a"), ContentDelta("b")]
    assert s.finish() == []


PIECES = ["<think>", "</think>", "<", "</", "<th", "<think", "</thi", "think", ">", "\n",
          "\n\n", " ", "a", "b c", "."]


@settings(max_examples=150, deadline=None)
@given(parser=st.sampled_from(PARSERS), prompt=st.sampled_from(PROMPTS),
       pieces=st.lists(st.sampled_from(PIECES), max_size=12), data=st.data())
def test_random_texts_and_chunkings_agree_with_parse_and_the_reference(parser, prompt,
                                                                       pieces, data):
    text = "".join(pieces)
    whole = parser.parse(text, prompt)
    assert whole == reference(parser, text, prompt)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    chunks = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
    assert fold(stream(parser, chunks, prompt)) == whole


# --- the registry -----------------------------------------------------------------------

def test_registry_names_vllms_parsers():
    assert set(REASONING_PARSERS) >= {"qwen3", "deepseek_r1"}
    assert isinstance(get_reasoning_parser("qwen3"), Qwen3ReasoningParser)
    assert isinstance(get_reasoning_parser("deepseek_r1"), DeepSeekR1ReasoningParser)
    with pytest.raises(ValueError, match="unknown reasoning parser 'granite'; known: "
                                         "deepseek_r1, qwen3"):
        get_reasoning_parser("granite")
