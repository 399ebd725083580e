"""Constrained decoding: grammars from JSON schemas, regexes and EBNF/lark, through llguidance.

A request's constraint travels in its ``SamplingParams`` (SGLang's
``json_schema``, ``regex``, ``ebnf``; ``grammar`` for a lark grammar, which
is what tool calling and ``choice`` build). ``Grammars`` compiles it (cached
by its text), hands out one ``LLMatcher`` per request and fills the
next-token bitmasks of a whole step at once (llguidance's parallel API).
The scheduler applies the masks in the sampler; EOS is allowed only where
the grammar can end, and a matcher that can go no further ends the request.

A resumed request (crash recovery) replays its matcher over the tokens the
client already has before it generates more, so the continuation still
matches; a retracted or prefix-cached request keeps its matcher as it is
(the grammar state depends on the tokens, not on the KV cache).

Why llguidance (``benchmarks/bench_grammar.py``, SmolLM2's 49,152-token
vocabulary, a 6-field JSON schema, batch 32, this 2-core machine): compile
0.7 ms (xgrammar 16.5 ms: it precomputes masks per schema), a mask 15.6 µs
per request per token (xgrammar 1.9 µs) — 0.5 ms for a batch-32 step, under
1 % of a SmolLM2 step — no dependencies (xgrammar pulls torch, triton and
tvm-ffi), lark grammars, and JSON schemas compiled on the fly: a request
with a schema nobody sent before pays 1 ms, not 17.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import llguidance
import llguidance.gbnf_to_lark
import llguidance.hf
import torch

# (not llguidance.torch: it compiles a kernel with torch.compile when imported, which pulls in
# inductor; the masks are filled through the executor directly and applied in models/sampling.py)

__all__ = ["GrammarCache", "GrammarError", "Grammars", "compile_grammar", "constraint_of"]

KINDS = ("json_schema", "regex", "ebnf", "grammar")


class GrammarError(ValueError):
    """A constraint that does not compile; the message starts with its field."""


def constraint_of(sampling: Any) -> tuple[str, str] | None:
    """(kind, text) of the one constraint in ``sampling`` (a SamplingParams), or None."""
    given = [(kind, getattr(sampling, kind)) for kind in KINDS if getattr(sampling, kind, None) is not None]
    if len(given) > 1:
        raise GrammarError(f"{given[1][0]}: give at most one of {', '.join(KINDS)}")
    return given[0] if given else None


def compile_grammar(kind: str, text: str, tokenizer: Any = None) -> str:
    """The llguidance grammar of a constraint; GrammarError naming ``kind`` when it is invalid
    (checked without a tokenizer when none is given: what the HTTP side can do, cheaply)."""
    grammar = _build(kind, text)
    problem = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if problem:
        raise GrammarError(f"{kind}: {' '.join(problem.split())}")
    return grammar


def _build(kind: str, text: str) -> str:
    try:
        if kind == "json_schema":
            schema = json.loads(text)
            if not isinstance(schema, dict | bool):
                raise GrammarError("json_schema: a schema is a JSON object")
            # compact separators, no free whitespace: no run of spaces or newlines a model can loop in
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                                 defaults={"whitespace_flexible": False})
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(text)
        if kind == "ebnf":
            return llguidance.LLMatcher.grammar_from_lark(llguidance.gbnf_to_lark.any_to_lark(text))
        return llguidance.LLMatcher.grammar_from_lark(text)
    except GrammarError:
        raise
    except json.JSONDecodeError as exc:
        raise GrammarError(f"json_schema: not valid JSON: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the library's parse errors vary
        raise GrammarError(f"{kind}: {' '.join(str(exc).split())}") from None


class GrammarCache:
    """Compiled grammars by (kind, text), least recently used first out, bounded by the characters
    held (the texts and what they compile to), not by their count: 512 entries of up to 1 MiB each
    would be half a GiB. Safe to share between threads."""

    def __init__(self, max_chars: int = 32 << 20) -> None:
        self.max_chars = max_chars
        self.chars = 0
        self._entries: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: tuple[str, str]) -> bool:
        with self._lock:
            return key in self._entries

    def get(self, kind: str, text: str, compile: Callable[[], str]) -> str:
        """The cached grammar of (kind, text), else ``compile()`` (outside the lock), kept if it fits."""
        key = (kind, text)
        with self._lock:
            grammar = self._entries.get(key)
            if grammar is not None:
                self._entries.move_to_end(key)
                return grammar
        grammar = compile()
        size = len(kind) + len(text) + len(grammar)
        if size > self.max_chars:
            return grammar
        with self._lock:
            if key not in self._entries:
                self._entries[key] = grammar
                self.chars += size
            while self.chars > self.max_chars:
                (k, t), g = self._entries.popitem(last=False)
                self.chars -= len(k) + len(t) + len(g)
        return grammar


class Grammars:
    """Compiled grammars (cached by text) and their matchers, for one tokenizer.

    ``vocab_size``: the model's (its logits may be wider than the tokenizer's
    vocabulary; the extra ids are never allowed)."""

    def __init__(self, tokenizer: Any, vocab_size: int | None = None, cache_chars: int = 32 << 20) -> None:
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.vocab_size = self.tokenizer.vocab_size
        self.executor = llguidance.LLExecutor()
        self._cache = GrammarCache(cache_chars)

    def compile(self, kind: str, text: str) -> str:
        return self._cache.get(kind, text, lambda: compile_grammar(kind, text, self.tokenizer))

    def compiled(self, kind: str, text: str) -> bool:
        """Whether ``compile(kind, text)`` would answer from the cache (at once)."""
        return (kind, text) in self._cache

    def matcher(self, kind: str, text: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.tokenizer, self.compile(kind, text))
        if matcher.is_error():
            raise GrammarError(f"{kind}: {matcher.get_error()}")
        return matcher

    def allocate(self, rows: int) -> torch.Tensor:
        """Bitmask rows for ``rows`` matchers: int32 words, bit j of word w is token 32 * w + j."""
        return torch.zeros(rows, (self.vocab_size + 31) // 32, dtype=torch.int32)

    def fill(self, matchers: list[llguidance.LLMatcher], bitmask: torch.Tensor) -> None:
        """Row i of ``bitmask`` := the next-token mask of ``matchers[i]`` (all at once, in parallel)."""
        assert bitmask.dtype == torch.int32 and bitmask.is_contiguous() and len(bitmask) >= len(matchers)
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                              bitmask.shape[1] * 4, len(matchers))
