"""Reasoning output: a model's ``<think>…</think>`` block taken out of its answer.

``--reasoning-parser`` (SGLang's and vLLM's names) says how a model writes
its reasoning:

- ``qwen3``: the answer may open with ``<think>``; what follows up to
  ``</think>`` is reasoning. An answer that does not open with it has no
  reasoning at all (Qwen3 with thinking off, or a model that skipped it).
- ``deepseek-r1``: the chat template opens the block, so the answer starts
  inside it, whether or not the model writes ``<think>`` again; everything up
  to ``</think>`` is reasoning. An answer that never closes the block is all
  reasoning (it ran out of tokens while thinking).

The OpenAI routes put the reasoning in ``message.reasoning_content``
(streamed: ``delta.reasoning_content``) and only the rest in ``content``, and
tool calls are looked for in the rest only. Whitespace around the block is
layout: the reasoning and the content after it are stripped, and a stream
holds back what may be the start of a marker or trailing whitespace, so a
streamed answer concatenates to exactly the whole one.
"""

from __future__ import annotations

__all__ = ["PARSERS", "ReasoningStream", "split_reasoning"]

PARSERS = ("qwen3", "deepseek-r1")
START, END = "<think>", "</think>"


class ReasoningStream:
    """Splits a streamed answer into (reasoning, content) deltas."""

    def __init__(self, parser: str) -> None:
        if parser not in PARSERS:
            raise ValueError(f"reasoning parser: {parser!r} is not one of {', '.join(PARSERS)}")
        self.parser = parser
        self.phase = "opening"  # → "reasoning" → "after" (past </think>, leading whitespace dropped) → "content"
        self.buffer = ""
        self.reasoned = False  # some reasoning was sent (its leading whitespace is dropped before)

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning to send now, content to send now)."""
        self.buffer += text
        reasoning, content = "", ""
        if self.phase == "opening":
            head = self.buffer.lstrip()
            if head.startswith(START):
                self.buffer, self.phase = head[len(START):], "reasoning"
            elif START.startswith(head) and not final:
                return "", ""  # (all whitespace, or the start of <think>: wait)
            else:
                self.phase = "reasoning" if self.parser == "deepseek-r1" else "content"
        if self.phase == "reasoning":
            if not self.reasoned:
                self.buffer = self.buffer.lstrip()
            end = self.buffer.find(END)
            if end < 0:
                keep = 0 if final else _held_back(self.buffer)
                reasoning, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                reasoning = reasoning.rstrip() if final else reasoning
                self.reasoned = self.reasoned or bool(reasoning)
                return reasoning, ""
            reasoning, self.buffer, self.phase = self.buffer[:end].rstrip(), self.buffer[end + len(END):], "after"
            self.reasoned = self.reasoned or bool(reasoning)
        if self.phase == "after":
            self.buffer = self.buffer.lstrip()
            if not self.buffer:
                return reasoning, ""
            self.phase = "content"
        content, self.buffer = self.buffer, ""
        return reasoning, content


def _held_back(text: str) -> int:
    """How much of the end of ``text`` (reasoning) to hold: trailing whitespace (it is dropped if
    ``</think>`` follows) and what may be the start of ``</think>``."""
    size = next((n for n in range(min(len(END) - 1, len(text)), 0, -1) if END.startswith(text[-n:])), 0)
    body = text[: len(text) - size]
    return size + (len(body) - len(body.rstrip()))


def split_reasoning(text: str, parser: str) -> tuple[str | None, str]:
    """(the reasoning, or None when there is none; the content) of a whole answer."""
    stream = ReasoningStream(parser)
    reasoning, content = stream.feed(text, final=True)
    return reasoning or None, content
