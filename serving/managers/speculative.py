"""Speculative decoding without a draft model: prompt lookup (n-gram) drafts.

A running request's last n tokens (n from ``max_ngram`` down to ``min_ngram``) are looked
for earlier in its prompt + output; the k tokens that followed the most recent earlier
occurrence are its draft (vLLM's ``ngram`` proposer, llama.cpp's lookup decoding). The
scheduler runs the last sampled token and the draft as one extend of 1 + k tokens, the
runner draws a token after each of them (``SeqInput.num_draft``), and the draft is
accepted while each draw equals the draft token it follows; what is emitted is always
the draws, so the text is what plain decoding gives whenever a position's logits do not
depend on how many tokens a step computes (the deterministic mode).

A draft that misses costs a step of 1 + k rows for one token, so a request drafts only
as far as its drafts have been holding, and backs off when they miss: after a draft
accepted whole, the next may be ``num_draft`` long; after one accepted up to token a, a + 1
long; after a draft with less than half of it accepted (nothing, or a sampled request's
drafts holding now and then) the request also waits 1, 2, 4 ... up to ``MAX_COOLDOWN`` steps
before it drafts again; a draft at least half accepted resets that. Nobody drafts while more than
``max_batch`` requests run, and a sampled request only while at most ``max_batch_sampled`` do (0,
the default: never): its drafts hold a third of the time or less, and cost 3 % alone (8 % held) and
5-9 % at four requests as measured (docs/speculative.md).

Pure Python and numpy, per request a growing int32 copy of its tokens (``Drafter``): the
lookup compares whole arrays, tens of microseconds for a context of thousands of tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["MAX_COOLDOWN", "NGRAM", "NONE", "Drafter", "SpeculativeConfig", "propose"]

NONE, NGRAM = "none", "ngram"
METHODS = (NONE, NGRAM)
MAX_COOLDOWN = 16  # steps a request waits, at most, after drafts that missed
MAX_DRAFT = 16  # the most draft tokens a step verifies per request


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = NONE  # "none" or "ngram"
    num_draft: int = 4  # k: draft tokens proposed per step (at most)
    max_ngram: int = 3  # the longest suffix looked up
    min_ngram: int = 2  # the shortest
    max_batch: int = 4  # no drafts while more requests than this run (a big batch is compute-bound)
    max_batch_sampled: int = 0  # ...a sampled request's (its drafts hold less often; 0: it never drafts)

    def __post_init__(self) -> None:
        problem = check(self)
        if problem is not None:
            raise ValueError(problem)

    @property
    def enabled(self) -> bool:
        return self.method != NONE


def check(config: SpeculativeConfig) -> str | None:
    """What is wrong with ``config``, naming the field; None when nothing is."""
    if config.method not in METHODS:
        return f"speculative: {config.method!r} is not one of {', '.join(METHODS)}"
    if not 1 <= config.num_draft <= MAX_DRAFT:
        return f"speculative_num_draft: {config.num_draft} is not in 1..{MAX_DRAFT}"
    if not 1 <= config.min_ngram <= config.max_ngram <= 8:
        return (f"speculative_min_ngram / speculative_max_ngram: {config.min_ngram} / {config.max_ngram} "
                "must satisfy 1 <= min <= max <= 8")
    if config.max_batch < 1:
        return f"speculative_max_batch: {config.max_batch} must be >= 1"
    if config.max_batch_sampled < 0:
        return f"speculative_max_batch_sampled: {config.max_batch_sampled} must be >= 0"
    return None


def propose(tokens: np.ndarray, *, num_draft: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The draft after ``tokens`` (1-D ints): the up to ``num_draft`` tokens that followed the most
    recent earlier occurrence of its longest suffix of ``max_ngram`` .. ``min_ngram`` tokens; [] if
    none occurs. A longer match wins over a more recent shorter one."""
    end = len(tokens)
    if end < min_ngram + 1:
        return []
    # q: where an earlier occurrence of the suffix ends (q < end - 1, so something follows it)
    candidates = np.flatnonzero(tokens[: end - 1] == tokens[end - 1])
    best: np.ndarray = candidates
    matched = 1
    for j in range(1, max_ngram):
        if not len(candidates) or j >= end:
            break
        candidates = candidates[candidates >= j]
        candidates = candidates[tokens[candidates - j] == tokens[end - 1 - j]]
        if len(candidates):
            best, matched = candidates, j + 1
    if matched < min_ngram or not len(best):
        return []
    start = int(best[-1]) + 1
    return tokens[start : start + num_draft].tolist()


class Drafter:
    """One request's drafts: its tokens as a growing array, and its back-off after misses."""

    __slots__ = ("config", "_buf", "_len", "_cooldown", "_wait", "_k", "proposed", "accepted")

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._buf = np.empty(256, dtype=np.int64)
        self._len = 0
        self._cooldown = 0  # steps to wait after the next miss (0: none yet)
        self._wait = 0  # steps left before drafting again
        self._k = config.num_draft  # the next draft's length, at most
        self.proposed = 0  # draft tokens verified, and accepted (for acceptance rates)
        self.accepted = 0

    def draft(self, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to ``min(limit, num_draft)`` tokens to verify after ``tokens`` (all the request's, the
        last one sampled and not in the cache yet); [] while backing off or when nothing matches."""
        if self._wait > 0:
            self._wait -= 1
            return []
        limit = min(limit, self._k)
        if limit <= 0:
            return []
        self._sync(tokens)
        c = self.config
        return propose(self._buf[: self._len], num_draft=limit, max_ngram=c.max_ngram, min_ngram=c.min_ngram)

    def verified(self, proposed: int, accepted: int) -> None:
        """A draft of ``proposed`` tokens had its first ``accepted`` accepted."""
        self.proposed += proposed
        self.accepted += accepted
        self._k = self.config.num_draft if accepted == proposed else accepted + 1
        if 2 * accepted >= proposed > 0:
            self._cooldown = 0
        else:
            self._cooldown = min(MAX_COOLDOWN, max(1, 2 * self._cooldown))
            self._wait = self._cooldown

    def _sync(self, tokens: Sequence[int]) -> None:
        n = len(tokens)
        if n < self._len:  # (a request's tokens only grow; start over if not)
            self._len = 0
        if n > len(self._buf):
            grown = np.empty(max(n, 2 * len(self._buf)), dtype=np.int64)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        if n > self._len:
            self._buf[self._len : n] = tokens[self._len : n]
            self._len = n
