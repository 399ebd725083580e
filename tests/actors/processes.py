"""Factories that child processes run in the process-supervision tests."""

import signal

import trio

from actors import ActorChild, Supervisor
from actors.supervisor import ChildSpec

from .messages import Echo


def echo(hub, address: str, reply_to: str, name: str = "echo"):
    return ActorChild(lambda: Echo(reply_to, name), address, hub)


def echo_tree(hub, address: str, reply_to: str):
    """A small supervised subtree inside the child process."""
    return Supervisor("remote", [ChildSpec("echo", lambda: echo(hub, address, reply_to))])


class Stubborn:
    """Ignores the stop request and SIGTERM: only SIGKILL ends it."""

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        task_status.started()
        await trio.sleep_forever()

    async def stop(self):
        await trio.lowlevel.checkpoint()


def stubborn(hub):
    return Stubborn()


class FailsToStart:
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED):
        raise RuntimeError("no model here")

    async def stop(self):
        await trio.lowlevel.checkpoint()


def fails_to_start(hub):
    return FailsToStart()
