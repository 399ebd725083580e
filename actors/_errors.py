"""Exceptions the runtime raises, and unwrapping of trio's exception groups."""

from __future__ import annotations


class CallError(Exception):
    """A ``call`` failed: the callee raised, or no reply came before the deadline."""


class CallTimeout(CallError, TimeoutError):
    pass


class RestartIntensityExceeded(Exception):
    """A supervisor restarted its children too often and gave up (escalates)."""

    def __init__(self, supervisor: str, restarts: int, within: float,
                 last_reason: BaseException | None) -> None:
        super().__init__(
            f"supervisor {supervisor!r}: more than {restarts} restarts within {within:g} s;"
            f" last cause: {last_reason!r}"
        )
        self.supervisor = supervisor
        self.last_reason = last_reason


class ChildStartError(Exception):
    """A child failed before it reported ready."""


def unwrap(exc: BaseException) -> BaseException:
    """The single leaf of nested one-exception groups, else ``exc`` itself."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        inner = exc.exceptions[0]
        if not isinstance(inner, Exception):
            break
        exc = inner
    return exc
