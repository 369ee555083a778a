"""Reasoning in generated text: splitting a reasoning model's thinking from its answer,
whole-text and streaming, for /v1/chat/completions (`reasoning_content`).

Reasoning models write their thinking first, between tags, then the answer. A parser
splits what the model generated into reasoning and content. Each parser is a streamer
at heart: `parse(text, prompt_text)` is the fold of one streamer fed the whole text, so
a streamed response and a non-streamed one can never disagree. Streaming holds back
exactly the text whose fate is still open (what may be the start of a tag, whitespace
that may precede the opening tag or follow the closing one) and nothing more.

The rendered prompt is part of the input: a chat template may open the block itself
(the output then starts inside the reasoning) or close it empty (thinking switched
off: the output is all content). `expects_reasoning(prompt_text)` tells the ingress
whether structured outputs must wait for the parser's `end_tag` before constraining.

Formats (pick with `get_reasoning_parser`; the names are vLLM's `--reasoning-parser`):

- "qwen3": `<think>` ... `</think>`, opened by the model or by the template; output
  that opens no block is all content (Qwen3).
- "deepseek_r1": the output starts inside `<think>` (a leading `<think>` is dropped);
  without `</think>` it is all reasoning (DeepSeek-R1 and its distillations).

Content after the block is handed on as text (to a tool-call parser, say): the two
families share `ContentDelta`.
"""
from deployments.apis.common.reasoning.base import (
    ReasoningDelta,
    ReasoningParser,
    ReasoningStreamer,
    SplitDelta,
)
from deployments.apis.common.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from deployments.apis.common.reasoning.qwen3 import Qwen3ReasoningParser
from deployments.apis.common.tool_calls.base import ContentDelta

__all__ = ["REASONING_PARSERS", "ContentDelta", "DeepSeekR1ReasoningParser",
           "Qwen3ReasoningParser", "ReasoningDelta", "ReasoningParser",
           "ReasoningStreamer", "SplitDelta", "get_reasoning_parser"]

_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}
REASONING_PARSERS: tuple[str, ...] = tuple(_PARSERS)


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser for a reasoning format, by the name users pick it with."""
    try:
        return _PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: "
                         f"{', '.join(REASONING_PARSERS)}") from None
