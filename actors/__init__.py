"""A small trio actor runtime: actors, supervision trees, watchdogs.

Nothing here knows about language models.
"""

from ._errors import CallError, CallTimeout, ChildStartError, RestartIntensityExceeded
from .actor import Actor, ActorChild, ActorStats, Call, Caller, Context, Reply
from .supervisor import Backoff, Child, ChildSpec, Restart, Strategy, Supervisor, SupervisorEvent
from .watchdog import SoftWatchdog, StepWatchdog, WatchdogTimeout, format_task_stack

__all__ = [
    "Actor",
    "ActorChild",
    "ActorStats",
    "Backoff",
    "Call",
    "CallError",
    "CallTimeout",
    "Caller",
    "Child",
    "ChildSpec",
    "ChildStartError",
    "Context",
    "Reply",
    "Restart",
    "RestartIntensityExceeded",
    "SoftWatchdog",
    "StepWatchdog",
    "Strategy",
    "Supervisor",
    "SupervisorEvent",
    "WatchdogTimeout",
    "format_task_stack",
]
