"""The "qwen3" format: Qwen3's `<think>` ... `</think>` reasoning, which the model opens
itself (Qwen3's template) or the template opens for it (Qwen3 Thinking-2507), and which
the template closes empty when thinking is switched off (enable_thinking=false)."""
from __future__ import annotations

from deployments.apis.common.reasoning.base import ReasoningParser, ReasoningStreamer
from deployments.apis.common.reasoning.think_tags import TagStreamer


class Qwen3ReasoningParser(ReasoningParser):
    """Reasoning is the output's `<think>` block: opened by the prompt's end, or by the
    output's start (after whitespace); output that opens none is all content, and so
    is everything after a prompt that closed the block. The block ends at the first
    `</think>`; the whitespace after it is dropped; one cut by max_tokens is all
    reasoning. Tags are never shown."""

    start_tag = "<think>"
    end_tag = "</think>"

    def streamer(self, prompt_text: str) -> ReasoningStreamer:
        if self.prompt_closed(prompt_text):
            return TagStreamer(self.start_tag, self.end_tag, may_open=False,
                               in_reasoning=False)
        return TagStreamer(self.start_tag, self.end_tag, may_open=True,
                           in_reasoning=self.prompt_opened(prompt_text))
