"""Factories that child processes run in the process-supervision tests."""

import signal

import trio

from actors import Actor, ActorChild, Supervisor
from actors.supervisor import ChildSpec

from .messages import Echo, Ping, Pong


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


class Loader(Actor):
    """Binds, then "loads" for ``load_s`` seconds (None: never done) before it is ready; meanwhile
    it answers a ``Ping`` with a ``Pong`` (to ``reply_to``) that says what it is doing."""

    inbox = Ping

    def __init__(self, reply_to: str, load_s: float | None) -> None:
        self.reply_to = reply_to
        self.load_s = load_s
        self.loaded = trio.Event()

    async def on_start(self, ctx) -> None:
        self.ctx = ctx
        ctx.nursery.start_soon(self._load)

    async def _load(self) -> None:
        if self.load_s is None:
            await trio.sleep_forever()
        await trio.sleep(self.load_s)  # (the work a model load would do)
        self.loaded.set()

    async def until_ready(self) -> None:
        await self.loaded.wait()

    async def handle(self, msg):
        await self.ctx.send(self.reply_to, Pong(msg.n, "ready" if self.loaded.is_set() else "loading"))


def loader(hub, address: str, reply_to: str, load_s: float | None = None):
    return ActorChild(lambda: Loader(reply_to, load_s), address, hub)


def say_preloaded() -> None:
    """A spare's preload: writes "<pid> <nice of this thread>" to the descriptor in PRELOAD_FD."""
    import os
    import threading

    nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    os.write(int(os.environ["PRELOAD_FD"]), f"{os.getpid()} {nice}\n".encode())


def never_warm() -> None:
    """A spare's preload that never ends (the spare never says warm)."""
    import threading

    threading.Event().wait()


def starts_a_thread() -> None:
    """A spare's preload that starts a thread (which would keep the preload's lowest priority)."""
    import threading

    threading.Thread(target=threading.Event().wait, daemon=True).start()
