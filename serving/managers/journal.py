"""The scheduler's step journal: which requests the step running now holds.

Before each model step the scheduler writes the wire rids of its requests to a
file beside its ipc socket (one ``pwrite``: a length and the rids). When the
process dies in a step (a segfault, a kill, a step watchdog), the file still
says which requests were in that step, and the tokenizer manager that resumes
them blames only those for the crash, not the requests that sat in the queue.
The record stays until the next step (a crash while the outputs of a step are
handled is that step's too) and is emptied when the scheduler goes idle.

Only ipc addresses have a journal: a scheduler in this process or on another
host has none, and then every request in flight is blamed, as before.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

__all__ = ["StepJournal", "journal_path", "read_step"]

_LENGTH = 4  # bytes of the record's length, little-endian


def journal_path(scheduler_address: str) -> str | None:
    """Where the scheduler at ``scheduler_address`` journals its steps (None: it does not)."""
    if not scheduler_address.startswith("ipc://"):
        return None
    return scheduler_address.removeprefix("ipc://") + ".step"


class StepJournal:
    """The writing side (the scheduler). The file is created owner-only, and never truncated
    at start: a restarted scheduler leaves what its predecessor died in for the resume to read."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        self._empty = True  # as far as this incarnation goes: the record left is its predecessor's

    def record(self, rids: Iterable[str]) -> None:
        data = "\n".join(rids).encode()
        os.pwrite(self._fd, len(data).to_bytes(_LENGTH, "little") + data, 0)
        self._empty = not data

    def clear(self) -> None:
        """No step runs (written once per idle spell)."""
        if not self._empty:
            self.record(())

    def close(self) -> None:
        os.close(self._fd)


def read_step(path: str | None) -> set[str] | None:
    """The wire rids of the last step journaled at ``path``; None when there is no readable record."""
    if path is None:
        return None
    try:
        with open(path, "rb") as file:
            raw = file.read()
    except OSError:
        return None
    size = int.from_bytes(raw[:_LENGTH], "little")
    body = raw[_LENGTH:_LENGTH + size]
    if len(raw) < _LENGTH or len(body) < size:
        return None
    try:
        return set(body.decode().split("\n")) if size else set()
    except UnicodeDecodeError:
        return None
