"""Messages and small actors shared by the runtime's tests."""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec
import trio

from actors import Actor, Context


class Ping(msgspec.Struct, tag=True, array_like=True, gc=False):
    n: int


class Pong(msgspec.Struct, tag=True, array_like=True, gc=False):
    n: int
    by: str = ""


class Boom(msgspec.Struct, tag=True, array_like=True, gc=False):
    pass


class Get(msgspec.Struct, tag=True, array_like=True, gc=False):
    pass


class Count(msgspec.Struct):
    """The reply that ``GetCount`` declares."""

    seen: int


class GetCount(msgspec.Struct, tag=True, array_like=True, gc=False):
    """``Get`` with a declared reply type (``reply``): a call returns a ``Count``."""

    reply: ClassVar[Any] = Count


class GetWrong(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Declares a ``Count`` reply; the actor answers a string."""

    reply: ClassVar[Any] = Count


class Ask(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Makes the actor call another actor from inside its handler."""

    address: str


EchoInbox = Ping | Boom | Get | Ask | GetCount | GetWrong


class Echo(Actor):
    """Answers Ping with Pong at ``reply_to``; Boom crashes it; Get returns a count."""

    inbox = EchoInbox

    def __init__(self, reply_to: str, name: str = "echo", log: list | None = None) -> None:
        self.reply_to = reply_to
        self.name = name
        self.seen = 0
        self.log = log if log is not None else []

    async def on_start(self, ctx: Context) -> None:
        self.ctx = ctx
        self.log.append(("start", self.name))

    async def handle(self, msg):
        match msg:
            case Ping(n):
                self.seen += 1
                await self.ctx.send(self.reply_to, Pong(n, self.name))
            case Boom():
                raise RuntimeError(f"{self.name} told to crash")
            case Get():
                return self.seen
            case GetCount():
                return Count(self.seen)
            case GetWrong():
                return "not a count"
            case Ask(address):
                return await self.ctx.call(address, Get(), reply=int) + 1000

    async def on_stop(self) -> None:
        self.log.append(("stop", self.name))


class Slow(Echo):
    """An Echo whose stop hook never finishes (for the grace period)."""

    async def on_stop(self) -> None:
        self.log.append(("stopping", self.name))
        await trio.sleep_forever()


class Quit(msgspec.Struct, tag=True, array_like=True, gc=False):
    pass


class Work(msgspec.Struct, tag=True, array_like=True, gc=False):
    seconds: float


class Begin(msgspec.Struct, tag=True, array_like=True, gc=False):
    pass


class Progress(msgspec.Struct, tag=True, array_like=True, gc=False):
    pass


class End(msgspec.Struct, tag=True, array_like=True, gc=False):
    pass


class Quitter(Echo):
    """An Echo that exits normally on Quit and may fail to start."""

    inbox = Ping | Quit | Boom

    def __init__(self, *args, fail_start: bool = False, ready_after: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.fail_start = fail_start
        self.ready_after = ready_after

    async def on_start(self, ctx):
        await trio.sleep(self.ready_after)
        if self.fail_start:
            raise RuntimeError(f"{self.name} cannot start")
        await super().on_start(ctx)

    async def handle(self, msg):
        if isinstance(msg, Quit):
            self.ctx.stop()
            return None
        return await super().handle(msg)


class Guarded(Actor):
    """Runs a StepWatchdog around Work and a SoftWatchdog fed by Progress."""

    inbox = Work | Begin | Progress | End

    def __init__(self, step_timeout: float = 10.0, soft_timeout: float = 30.0):
        from actors import SoftWatchdog, StepWatchdog

        self.in_flight = 0
        self.step = StepWatchdog("step", step_timeout)
        self.soft = SoftWatchdog("soft", soft_timeout, busy=lambda: self.in_flight > 0)

    async def on_start(self, ctx):
        await ctx.nursery.start(self.step.run)
        await ctx.nursery.start(self.soft.run)
        self.soft.feed()

    async def handle(self, msg):
        self.soft.feed()
        match msg:
            case Work(seconds):
                with self.step.step():
                    await stuck_in_the_model(seconds)
            case Begin():
                self.in_flight += 1
            case End():
                self.in_flight -= 1
            case Progress():
                pass


async def stuck_in_the_model(seconds: float) -> None:
    await trio.sleep(seconds)
