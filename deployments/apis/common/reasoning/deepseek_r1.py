"""The "deepseek_r1" format: DeepSeek-R1 always reasons first, in a `<think>` block that
its template opens (`<think>\\n` ends the generation prompt) or that older checkpoints
open themselves."""
from __future__ import annotations

from deployments.apis.common.reasoning.base import ReasoningParser, ReasoningStreamer
from deployments.apis.common.reasoning.think_tags import TagStreamer


class DeepSeekR1ReasoningParser(ReasoningParser):
    """The output starts inside the reasoning (a leading `<think>`, after whitespace, is
    dropped), which ends at the first `</think>`; the whitespace after it is dropped.
    Without an end tag everything is reasoning, as vLLM's deepseek_r1 parser has it,
    unless the prompt closed the block: then everything is content."""

    start_tag = "<think>"
    end_tag = "</think>"

    def streamer(self, prompt_text: str) -> ReasoningStreamer:
        closed = self.prompt_closed(prompt_text)
        return TagStreamer(self.start_tag, self.end_tag, may_open=not closed,
                           in_reasoning=not closed)
