"""Tool calling in the Hermes format: the prompt, the grammar that enforces a call, the parser.

A model whose chat template renders ``tools`` gets them through its template.
One whose template ignores them (the embedded SmolLM2's) gets the Hermes
format, widely used by open models and agent frameworks: the tools as JSON in
the system prompt inside ``<tools></tools>``, each call the model makes as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

earlier calls in the history rendered the same way, and tool results as
``tool`` messages inside ``<tool_response></tool_response>``.

``tool_choice`` ``required`` or a named function is enforced by a grammar
(``call_grammar``): the output is one or more calls (one with
``parallel_tool_calls: false``) to the functions allowed, with arguments
valid against each function's JSON schema. ``auto`` leaves the choice to the
model, but a call it starts is held to the same schemas (``auto_grammar``), and
``parse`` finds the calls it made.

A call identical to one already made in the same answer (the same name and
arguments, compared as parsed JSON) ends the calls there: a small model held to
``call+`` tends to write the same calls again until ``max_tokens``. The repeat
and whatever follows it are dropped (``parse``, ``ToolStream``), and the HTTP
side aborts the rest of that generation and finishes with ``tool_calls``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PARSERS", "Answer", "ToolCall", "ToolStream", "auto_grammar", "call_grammar", "hermes_messages",
           "parse", "parse_answer", "valid_calls"]

PARSERS = ("hermes",)  # --tool-call-parser (vLLM's names)
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)

SYSTEM = (
    "You can call functions to help answer. The functions you may call are given as JSON schemas inside "
    "<tools></tools> tags:\n<tools>\n{tools}\n</tools>\n"
    "To call one, answer with a JSON object holding its name and arguments inside <tool_call></tool_call> "
    "tags, one block per call:\n<tool_call>\n{{\"name\": <function name>, \"arguments\": <arguments object>}}\n"
    "</tool_call>\nDo not invent argument values the user did not give."
)


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out

    def same_as(self, other: ToolCall) -> bool:
        """The same function with the same arguments (as parsed JSON: key order and layout aside)."""
        return self.name == other.name and json.loads(self.arguments) == json.loads(other.arguments)


def _repeats(call: ToolCall, made: list[ToolCall]) -> bool:
    return any(call.same_as(earlier) for earlier in made)


def hermes_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with the tools described in the system prompt and the history's calls and
    results written as Hermes text (for a chat template that ignores ``tools``)."""
    described = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    system = SYSTEM.format(tools=described)
    out: list[dict[str, Any]] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                function = call.get("function") or {}
                arguments = function.get("arguments") or "{}"
                parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
                calls.append(f"{OPEN}\n{json.dumps({'name': function.get('name'), 'arguments': parsed})}\n{CLOSE}")
            content = "\n".join(([content] if content else []) + calls)
        elif role == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{system}"}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out


def valid_calls(calls: Any) -> bool:
    """Whether ``calls`` (a message's ``tool_calls``) each have function.name and function.arguments
    (a JSON object, as text or as an object)."""
    if not isinstance(calls, list):
        return False
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            return False
        arguments = function.get("arguments", "{}")
        try:
            if not isinstance(json.loads(arguments) if isinstance(arguments, str) else arguments, dict):
                return False
        except json.JSONDecodeError:
            return False
    return True


def call_grammar(tools: list[dict[str, Any]], only: str | None = None, parallel: bool = True) -> str:
    """A lark grammar whose sentences are Hermes calls to ``tools`` (or to the one named ``only``)."""
    calls = "call+" if parallel else "call"
    return (f"start: {calls}\n"
            f'call: "{OPEN}\\n" body "\\n{CLOSE}\\n"\n'
            f"body: %json {json.dumps(_call_schema(tools, only))}\n")


def auto_grammar(tools: list[dict[str, Any]], parallel: bool = True) -> str:
    """``tool_choice: auto``: text as the model likes, but once it writes ``<tool_call>`` the
    rest of that block must be a valid call to one of ``tools`` (llguidance's lazy lexeme: it
    ends at the first ``<tool_call>``, so free text cannot swallow a malformed call). With
    ``parallel``, text and calls may alternate; without, the output ends after one call."""
    start = "start: call* TEXT" if parallel else "start: TEXT | call"
    return ("%llguidance {}\n"
            f"{start}\n"
            f'call_open[lazy]: TEXT "{OPEN}"\n'
            f'call: call_open "\\n" body "\\n{CLOSE}\\n"\n'
            f"body: %json {json.dumps(_call_schema(tools, None))}\n"
            "TEXT: /(.|\\n)*/\n")


def _call_schema(tools: list[dict[str, Any]], only: str | None) -> dict[str, Any]:
    shapes = []
    for tool in tools:
        function = tool["function"]
        if only is not None and function["name"] != only:
            continue
        arguments = function.get("parameters") or {"type": "object"}
        shapes.append({"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": arguments},
                       "required": ["name", "arguments"], "additionalProperties": False})
    return {"anyOf": shapes, "x-guidance": {"whitespace_flexible": False}}


@dataclass
class Answer:
    """A Hermes answer taken apart: its text outside the calls (None when there is none beside
    calls), the calls, and whether they ended at a repeated call (dropped with what followed)."""

    content: str | None
    calls: list[ToolCall]
    repeated: bool = False


def parse_answer(text: str) -> Answer:
    """``text`` taken apart. A block whose JSON is not a call is left in the content, as the model
    wrote it; a call identical to an earlier one ends the answer there."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    last, repeated = 0, False
    for match in _CALL.finditer(text):
        call = _call_of(match.group(1))
        if call is None:
            continue
        kept.append(text[last:match.start()])
        if _repeats(call, calls):
            last, repeated = len(text), True
            break
        last = match.end()
        calls.append(call)
    if not calls:
        return Answer(text, [])
    kept.append(text[last:])
    content = "".join(kept).strip()
    return Answer(content or None, calls, repeated)


def parse(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content before the first call or None, the calls) of a Hermes answer (``parse_answer``)."""
    answer = parse_answer(text)
    return answer.content, answer.calls


def _call_of(body: str) -> ToolCall | None:
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models quote them
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(call["name"], json.dumps(arguments, ensure_ascii=False))


class ToolStream:
    """Turns a streamed Hermes answer into OpenAI deltas: content as it comes (holding back what
    may be the start of a call), then each call as it closes — first its id and name, then its
    arguments (the official client accumulates ``delta.tool_calls`` by ``index``). A call that
    repeats an earlier one ends the answer: ``repeated`` turns true, and that call and all that
    follows are dropped."""

    def __init__(self) -> None:
        self.buffer = ""
        self.made: list[ToolCall] = []
        self.in_call = False
        self.repeated = False

    @property
    def calls(self) -> int:
        return len(self.made)

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """(content to send now, tool-call deltas to send now)."""
        if self.repeated:
            return "", []
        self.buffer += text
        content, deltas = [], []
        while True:
            if not self.in_call:
                start = self.buffer.find(OPEN)
                if start < 0:
                    keep = 0 if final else _partial_suffix(self.buffer, OPEN)
                    content.append(self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                content.append(self.buffer[:start])
                self.buffer, self.in_call = self.buffer[start:], True
            end = self.buffer.find(CLOSE)
            if end < 0:
                if final:  # the answer ended inside a call: what is there is text
                    content.append(self.buffer)
                    self.buffer = ""
                break
            block, self.buffer = self.buffer[: end + len(CLOSE)], self.buffer[end + len(CLOSE):]
            if self.calls:  # between calls, whitespace is layout, not content
                content = [piece for piece in content if piece.strip()]
            self.in_call = False
            call = _call_of(block[len(OPEN): -len(CLOSE)].strip())
            if call is None:
                content.append(block)
                continue
            if _repeats(call, self.made):
                self.repeated, self.buffer = True, ""
                break
            head = call.to_openai(self.calls)
            head["function"] = {"name": call.name, "arguments": ""}
            deltas += [head, {"index": self.calls, "function": {"arguments": call.arguments}}]
            self.made.append(call)
        if self.calls:
            content = [piece for piece in content if piece.strip()]
        return "".join(content), deltas


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that starts ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
