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

A constraint (a JSON schema, a regex, choices, a required tool call) binds
what comes after the think block, not the block itself: ``think_first``
writes a lark grammar whose sentences are a think block as the parser expects
it (optional with ``qwen3``; with ``deepseek-r1`` the answer is inside one
until ``</think>``), the whitespace after it, then the constrained answer.
"""

from __future__ import annotations

import json

__all__ = ["PARSERS", "ReasoningStream", "split_reasoning", "think_first"]

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


# the opening of a constrained answer, by parser: (llguidance's lazy rules end at the first </think>)
_OPENINGS = {"qwen3": "(tercet_think TERCET_LAYOUT)?", "deepseek-r1": "tercet_thinking TERCET_LAYOUT"}


def think_first(kind: str, text: str, parser: str) -> str:
    """A lark grammar (the ``grammar`` kind): the think block, then the constraint ``(kind, text)``:
    a ``json_schema``, a ``regex``, or one of tercet's own lark grammars (``grammar``: choices, tool
    calls; its ``start`` rule becomes the answer). ValueError for another kind (``ebnf``)."""
    if kind == "json_schema":
        schema = json.loads(text)
        schema = {} if schema is True else schema
        if isinstance(schema, dict) and "x-guidance" not in schema:
            # compact separators, no free whitespace, as a json_schema constraint compiles alone
            schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
        answer, rules = "%json " + json.dumps(schema), ""
    elif kind == "regex":
        answer, rules = "/" + text.replace("/", "\\/") + "/", ""
    elif kind == "grammar" and text.lstrip().startswith("start:"):
        answer, rules = "tercet_answer", text.lstrip().replace("start:", "tercet_answer:", 1)
        if rules.startswith("%llguidance"):
            raise ValueError("grammar: a grammar of its own llguidance options")
    else:
        raise ValueError(f"{kind}: not combined with a reasoning parser")
    return ("%llguidance {}\n"
            f"start: {_OPENINGS[parser]} tercet_body\n"
            f'tercet_think[lazy]: "{START}" /(.|\\n)*/ "{END}"\n'
            f'tercet_thinking[lazy]: /(.|\\n)*/ "{END}"\n'
            "TERCET_LAYOUT: /[ \\t\\r\\n]*/\n"
            f"tercet_body: {answer}\n"
            f"{rules}\n")
