"""A chat answer taken apart: its reasoning (``<think>…</think>``, with a reasoning parser), its
content, and the tool calls in that content (with tools), whole or as it streams.

The order is fixed: the think block comes out first, so a ``<tool_call>`` the
model writes while reasoning is reasoning, not a call; the calls are read from
the content that follows. A call that repeats an earlier one ends the answer
(``repeated``): the route aborts the rest of its generation and finishes it
with ``tool_calls``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..managers.reasoning import ReasoningStream, split_reasoning
from ..managers.tools import ToolCall, ToolStream, parse_answer

__all__ = ["AnswerStream", "WholeAnswer", "take_apart"]


@dataclass
class WholeAnswer:
    reasoning: str | None
    content: str | None
    calls: list[ToolCall]
    repeated: bool = False  # the calls ended at a repeated one


def take_apart(text: str, *, reasoning: str | None, tools: bool) -> WholeAnswer:
    """A whole answer: ``reasoning`` names the reasoning parser (None: no think block is looked
    for); ``tools``: look for calls."""
    thought, content = split_reasoning(text, reasoning) if reasoning is not None else (None, text)
    if not tools:
        return WholeAnswer(thought, content, [])
    answer = parse_answer(content)
    if not answer.calls:
        return WholeAnswer(thought, content, [])
    return WholeAnswer(thought, answer.content, answer.calls, answer.repeated)


class AnswerStream:
    """One streamed choice: each piece of text in, (reasoning, content, tool-call deltas) out."""

    def __init__(self, *, reasoning: str | None, tools: bool) -> None:
        self.reasoning = ReasoningStream(reasoning) if reasoning is not None else None
        self.tools = ToolStream() if tools else None

    @property
    def calls(self) -> int:
        return self.tools.calls if self.tools is not None else 0

    @property
    def repeated(self) -> bool:
        return self.tools is not None and self.tools.repeated

    def feed(self, text: str, final: bool = False) -> tuple[str, str, list[dict[str, Any]]]:
        thought, content = self.reasoning.feed(text, final) if self.reasoning is not None else ("", text)
        if self.tools is None:
            return thought, content, []
        content, calls = self.tools.feed(content, final)
        return thought, content, calls
