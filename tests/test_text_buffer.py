"""TextBuffer (engine.frontend.text_buffer): a sequence's output text without the
quadratic `+=` it replaced (issue 40, finding 9)."""
from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.frontend.text_buffer import TextBuffer
from engine.sampling_params import SamplingParams
from tests.test_openai_app import engines, tokenizer  # noqa: F401 - fixtures


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=6), max_size=12), st.integers(0, 40), st.integers(0, 40),
       st.integers(0, 40), st.integers(0, 40))
def test_buffer_reads_like_the_joined_string(pieces, start, end, count, cut):
    buf = TextBuffer()
    for p in pieces:
        buf.append(p)
    whole = "".join(pieces)
    assert len(buf) == len(whole)
    assert buf.slice(start, end) == whole[start:end]
    assert buf.tail(count) == (whole[-count:] if count else "")
    buf.truncate(cut)
    assert buf.value() == whole[:cut] and len(buf) == len(whole[:cut])
    buf.append("z")
    assert buf.value() == whole[:cut] + "z"


def test_a_stream_never_joins_its_whole_text(engines, monkeypatch):  # noqa: F811
    """A streamed request reads only its new text each step (before, the whole output
    was copied every token); the deltas still add up to the text of its tokens."""
    engines.add(itl_s=0.0005)
    joins = []
    original = TextBuffer.value
    monkeypatch.setattr(TextBuffer, "value", lambda self: joins.append(1) or original(self))

    async def main():
        client = await engines.client()
        try:
            text, ids = "", []
            async for out in client.generate("r", "Hello", SamplingParams(
                    max_tokens=400, ignore_eos=True, stop=["never-seen-stop"])):
                text += out.outputs[0].text
                ids += out.outputs[0].token_ids
            return text, ids
        finally:
            await client.shutdown()
    text, ids = asyncio.run(main())
    assert len(ids) == 400 and not joins
    assert text.strip() and text.strip() in engines.tokenizer.decode(ids)
