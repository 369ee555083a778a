"""What a reasoning parser takes and gives: reasoning and content deltas, and the two
interfaces every format implements (a stateless parser, a per-choice streamer)."""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

from deployments.apis.common.tool_calls.base import ContentDelta


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


# What a streamer gives: the next piece of the reasoning, or of the answer (the content
# is the tool-call parsers' ContentDelta, so a chain of the two has one content type).
SplitDelta = ReasoningDelta | ContentDelta


class ReasoningStreamer(abc.ABC):
    """Incremental splitter of one choice's generated text."""

    @abc.abstractmethod
    def feed(self, delta: str) -> list[SplitDelta]:
        """New generated text, chunked any way; returns what is now decided."""

    @abc.abstractmethod
    def finish(self) -> list[SplitDelta]:
        """End of generation: decide and return everything still held back."""


class ReasoningParser(abc.ABC):
    """A reasoning format; stateless, so one instance serves any number of requests.

    `start_tag` / `end_tag` open and close the reasoning block. The ingress tokenizes
    `end_tag` to find the token ids that structured outputs wait for before they
    constrain the answer.
    """

    start_tag: ClassVar[str]
    end_tag: ClassVar[str]

    @abc.abstractmethod
    def streamer(self, prompt_text: str) -> ReasoningStreamer:
        """A fresh incremental splitter for one choice; prompt_text: the rendered chat
        prompt, whose end may already open or close the reasoning block."""

    def prompt_opened(self, prompt_text: str) -> bool:
        """The template opened the block: the output starts inside the reasoning."""
        return prompt_text.rstrip().endswith(self.start_tag)

    def prompt_closed(self, prompt_text: str) -> bool:
        """The template closed the block (thinking switched off): all output is content."""
        return prompt_text.rstrip().endswith(self.end_tag)

    def expects_reasoning(self, prompt_text: str) -> bool:
        """Whether the output starts in, or may open, a reasoning block (then structured
        outputs must wait for `end_tag` before constraining)."""
        return not self.prompt_closed(prompt_text)

    def parse(self, text: str, prompt_text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of the whole generated text, split exactly as a stream
        of it would be; None for a part that is empty."""
        streamer = self.streamer(prompt_text)
        deltas = streamer.feed(text) + streamer.finish()
        reasoning = "".join(d.text for d in deltas if isinstance(d, ReasoningDelta))
        content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
        return reasoning or None, content or None
