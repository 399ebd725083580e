"""Actors: a bounded mailbox, a loop that dispatches by message type, and a context.

An actor subclass names the union of messages it accepts (``inbox``) and
implements ``handle``, usually one ``match`` over that union::

    class Counter(Actor):
        inbox = Increment | Get

        async def handle(self, msg):
            match msg:
                case Increment(n):
                    self.total += n
                case Get():
                    return self.total  # the reply, when the sender used call()

An exception escaping ``handle`` crashes the actor ("let it crash"); the
supervisor above it decides what happens next.

What a peer sends never crashes it: a frame that does not decode is dropped
by the mailbox (one that the actor's ``salvage`` type still identifies comes to
``handle`` as a ``Refused``, so the actor can answer for it), and the runtime drops (counts, logs the first of each kind)
a Reply nobody waits for and a Call or Heartbeat it cannot answer. The
counts are in ``ActorChild.stats`` (also ``Context.stats``).
"""

from __future__ import annotations

import functools
import logging
import secrets
import typing
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import msgspec
import trio

from transports import DEFAULT_CAPACITY, Address, AddressError, Decoder, DropCounter, Hub, Sender

from ._errors import CallError, CallTimeout, unwrap

__all__ = ["Actor", "ActorChild", "ActorStats", "Call", "Caller", "Context", "Heartbeat", "Pulse", "Reply"]

log = logging.getLogger("actors")
T = TypeVar("T")

MAX_PEERS = 1024  # the most addresses one actor sends to (a reply to a new one beyond is dropped)
REPLY_PATIENCE_S = 10.0  # how long a reply may wait for its address to take it (a call's default deadline)
HEARTBEAT_PATIENCE_S = 1.0  # ...a heartbeat's reply (the mailbox is not read meanwhile)


class Call(msgspec.Struct, Generic[T], tag="actors.call", array_like=True, gc=False):
    """Envelope of a request that wants a reply (``Context.call``)."""

    id: int
    reply_to: str
    body: T


class Reply(msgspec.Struct, tag="actors.reply", array_like=True, gc=False):
    id: int
    body: Any = None
    error: str | None = None


class Heartbeat(msgspec.Struct, tag="actors.heartbeat", array_like=True, gc=False):
    """Answered by the runtime itself (not ``handle``): a Reply whose body is a ``Pulse``."""

    id: int
    reply_to: str


class Pulse(msgspec.Struct, array_like=True, gc=False):
    """What a heartbeat's answer says of the actor: which start of it answers (``boot``, new each
    time it starts: a restarted actor answers with another) and whether it serves yet (``ready``:
    its ``until_ready`` returned; an actor loading a model answers heartbeats before)."""

    boot: str
    ready: bool


@functools.cache
def mailbox_decoder(inbox: Any, salvage: Any = None) -> Decoder:
    """The decoder of a mailbox for ``inbox``: its messages, calls of them, replies
    (``salvage``: see ``Actor.salvage``)."""
    members = typing.get_args(inbox) if typing.get_origin(inbox) in (typing.Union, _UnionType) else (inbox,)
    return Decoder(typing.Union[(*members, Call[inbox], Reply, Heartbeat)], salvage=salvage)  # type: ignore[misc]


_UnionType = type(int | str)


class Caller:
    """Request/reply over one-way channels: correlation ids, deadlines, replies.

    Replies arrive in the mailbox at ``reply_to``; whoever reads that mailbox
    hands each Reply to ``resolve``.
    """

    def __init__(self, reply_to: str, *, dropped: DropCounter | None = None) -> None:
        self.reply_to = reply_to
        self.dropped = dropped if dropped is not None else DropCounter(reply_to)
        self._last_id = 0  # ids are 1, 2, ...: a reply with another id was never asked for
        self._pending: dict[int, trio.MemorySendChannel[Reply]] = {}

    async def call(self, sender: Sender, msg: Any, *, reply: Any = None,
                   timeout: float = 10.0) -> Any:
        """``msg``'s reply as type ``reply`` (default: what its class declares as ``reply``, else as it came)."""
        if reply is None:
            reply = getattr(type(msg), "reply", Any)
        return await self._request(sender, lambda call_id: Call(call_id, self.reply_to, msg),
                                   type(msg).__name__, reply, timeout)

    async def heartbeat(self, sender: Sender, *, timeout: float) -> Pulse | None:
        """The peer's ``Pulse``; None from a peer of an earlier build (its answer says nothing)."""
        return await self._request(sender, lambda call_id: Heartbeat(call_id, self.reply_to),
                                   "heartbeat", Pulse | None, timeout)

    async def _request(self, sender: Sender, envelope: typing.Callable[[int], Any], what: str,
                       reply: Any, timeout: float) -> Any:
        self._last_id = call_id = self._last_id + 1
        send, receive = trio.open_memory_channel[Reply](1)
        self._pending[call_id] = send
        try:
            with trio.move_on_after(timeout):
                await sender.send(envelope(call_id))
                answer = await receive.receive()
                if answer.error is not None:
                    raise CallError(f"{sender.address} failed handling {what}: {answer.error}")
                try:
                    return _convert(answer.body, reply)
                except msgspec.ValidationError as exc:  # (a peer of another build, say)
                    raise CallError(f"{sender.address} answered {what} with a reply that is not a "
                                    f"{getattr(reply, '__name__', reply)}: {exc}") from None
            raise CallTimeout(f"no reply from {sender.address} to {what} within {timeout:g} s")
        finally:
            self._pending.pop(call_id, None)

    def resolve(self, reply: Reply) -> None:
        """Hand ``reply`` to its waiting caller; drop (count) one nobody waits for."""
        waiter = self._pending.pop(reply.id, None)  # one reply per call: a duplicate finds none
        if waiter is not None:
            waiter.send_nowait(reply)
        elif 0 < reply.id <= self._last_id:
            self.dropped.count("unawaited reply", f"reply {reply.id}, a duplicate or after its caller gave up")
        else:
            self.dropped.count("unknown reply", f"reply {reply.id}, which no call asked for")


def _convert(body: Any, type_: Any) -> Any:
    if type_ is Any or (isinstance(type_, type) and isinstance(body, type_)):
        return body
    return msgspec.convert(body, type_, dec_hook=lambda t, obj: obj)


class ActorStats:
    """What an actor's runtime dropped, for operators; each counter logs the first of a kind.

    ``mailbox``: frames the mailbox could not decode (its ``Receiver.dropped``:
    malformed, truncated, invalid, buffer, oversized). ``runtime``: messages
    that decoded but could not be served: ``unknown reply`` (no call asked
    for it), ``unawaited reply`` (a duplicate, or late: its caller gave up),
    ``unanswerable call`` / ``unanswerable heartbeat`` (its ``reply_to`` is no
    address a reply can be sent to: malformed, it is not handled at all;
    failing to connect, or beyond ``MAX_PEERS``, its reply is dropped),
    ``undelivered reply`` (nobody took it within ``REPLY_PATIENCE_S``, or
    ``HEARTBEAT_PATIENCE_S``).
    """

    def __init__(self, address: str) -> None:
        self.mailbox = DropCounter(address)  # replaced by the mailbox's own when it is bound
        self.runtime = DropCounter(address)

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {"mailbox": dict(self.mailbox.counts), "runtime": dict(self.runtime.counts)}


class Context:
    """What a running actor knows of the world: its address, senders, tasks."""

    def __init__(self, address: str, hub: Hub, nursery: trio.Nursery,
                 capacity: int, child: ActorChild) -> None:
        self.address = address
        self.hub = hub
        self.nursery = nursery  # tasks started here crash the actor when they fail
        self.stats = child.stats
        self._capacity = capacity
        self._senders: dict[str, Sender] = {}
        self._caller = Caller(address, dropped=child.stats.runtime)
        self._child = child
        self.actor = child.actor  # the running actor object (in this process)

    async def sender(self, address: str) -> Sender:
        sender = self._senders.get(address)
        if sender is None:
            sender = self._senders[address] = await self.hub.connect(address, capacity=self._capacity)
        return sender

    async def send(self, address: str, msg: Any) -> None:
        await (await self.sender(address)).send(msg)

    async def _answer(self, request: Call[Any] | Heartbeat, reply: Reply) -> None:
        """Send ``reply`` to ``request.reply_to``, or count why not; never raise, never hang.

        The address comes from a peer: it may fail to connect, be one more of
        endless distinct addresses (each a socket), or have nobody taking
        messages there (an inproc send waits for a binding, an ipc/tcp one
        for room): the reply is then dropped after ``REPLY_PATIENCE_S``
        (``HEARTBEAT_PATIENCE_S`` for a heartbeat, answered by the task that
        reads the mailbox).
        """
        address = request.reply_to
        if address not in self._senders and len(self._senders) >= MAX_PEERS:
            self._unanswerable(request, f"{address}: this actor already sends to {MAX_PEERS} addresses")
            return
        try:
            sender = await self.sender(address)
        except (AddressError, OSError) as exc:
            self._unanswerable(request, str(exc))
            return
        patience = REPLY_PATIENCE_S if isinstance(request, Call) else HEARTBEAT_PATIENCE_S
        with trio.move_on_after(patience):
            await sender.send(reply)
            return
        self.stats.runtime.count("undelivered reply", f"reply {request.id}: {address} took nothing for {patience:g} s")

    def _unanswerable(self, request: Call[Any] | Heartbeat, problem: str) -> None:
        what = "call" if isinstance(request, Call) else "heartbeat"
        self.stats.runtime.count(f"unanswerable {what}", f"{what} {request.id}: {problem}")

    async def call(self, address: str, msg: Any, *, reply: Any = None, timeout: float = 10.0) -> Any:
        """Send ``msg`` and wait for the callee's return value (or CallError), as type ``reply``
        (default: the ``reply`` type ``msg``'s class declares, else as it came)."""
        return await self._caller.call(await self.sender(address), msg, reply=reply, timeout=timeout)

    def stop(self) -> None:
        """Ask this actor to stop after the message being handled."""
        self._child.request_stop()

    async def _close_senders(self) -> None:
        with trio.move_on_after(1.0) as scope:
            scope.shield = True
            for sender in self._senders.values():
                await sender.aclose()
        self._senders.clear()


class Actor:
    """Base class of actors. Override ``handle``; the hooks are optional."""

    inbox: ClassVar[Any]
    # a lenient type that identifies a message of ``inbox`` that the mailbox refuses (its
    # id, say): such a message comes to ``handle`` as a ``transports.Refused`` holding what
    # it read, so the actor can end what its sender waits for instead of leaving it waiting
    salvage: ClassVar[Any] = None

    async def on_start(self, ctx: Context) -> None:
        """Runs after the mailbox is bound and before the actor reports ready."""

    async def until_ready(self) -> None:
        """Returns once the actor serves (the default: when ``on_start`` returned). An actor with
        something long to do first (a model to load) starts it in ``on_start`` and waits for it
        here: its mailbox is read meanwhile (it can answer "not yet"), and its child reports
        ready, to a supervisor or a parent process, only when this returns."""

    async def handle(self, msg: Any) -> Any:
        raise NotImplementedError

    async def on_stop(self) -> None:
        """Runs when the actor is asked to stop (not when it crashes or is killed)."""


class FaultHook(Protocol):
    """Consulted before each dispatch (the test harness injects faults here)."""

    async def before_dispatch(self, msg: Any) -> bool:
        """Return False to drop the message; may raise or block."""


class ActorChild:
    """Runs one actor as a supervisor child: bind, start, dispatch, stop."""

    def __init__(self, factory: typing.Callable[[], Actor], address: str, hub: Hub, *,
                 capacity: int = DEFAULT_CAPACITY, faults: FaultHook | None = None, bind: str | None = None) -> None:
        """``address``: where others reach it (replies to its calls come there); ``bind``: where
        its mailbox listens, when that differs (``tcp://0.0.0.0:PORT`` behind a name others dial)."""
        self.factory = factory
        self.address = address
        self.bind = bind or address
        self.hub = hub
        self.capacity = capacity
        self.faults = faults
        self.actor: Actor | None = None
        self.stats = ActorStats(address)
        self._stop_requested = trio.Event()
        self._waiting: trio.CancelScope | None = None
        self.bound = trio.Event()  # the mailbox is read: set before ``until_ready`` returns
        self.boot = secrets.token_hex(8)  # this start of the actor, as its heartbeats' answers say
        self.ready = False  # it reported ready (``until_ready`` returned)

    def request_stop(self) -> None:
        self._stop_requested.set()
        if self._waiting is not None:
            self._waiting.cancel()

    async def stop(self) -> None:
        self.request_stop()
        await trio.lowlevel.checkpoint()

    async def run(self, *, task_status: trio.TaskStatus[Context] = trio.TASK_STATUS_IGNORED) -> None:
        actor = self.actor = self.factory()
        inbox = await self.hub.bind(self.bind, mailbox_decoder(actor.inbox, actor.salvage), capacity=self.capacity)
        self.stats.mailbox = inbox.dropped
        ctx: Context | None = None
        try:
            async with trio.open_nursery() as nursery:
                ctx = Context(self.address, self.hub, nursery, self.capacity, self)
                handoff_send, handoff_receive = trio.open_memory_channel[Any](self.capacity)
                nursery.start_soon(_route_replies, inbox, ctx, handoff_send)
                await actor.on_start(ctx)
                self.bound.set()
                if type(actor).until_ready is Actor.until_ready:
                    self.ready = True
                    task_status.started(ctx)
                else:  # messages are dispatched while it gets ready
                    nursery.start_soon(_report_ready, actor, ctx, task_status)
                await self._dispatch_until_stopped(actor, ctx, handoff_receive)
                await actor.on_stop()
                nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # A crash that races a cancellation is still a crash: report it.
            _, crash = group.split(trio.Cancelled)
            if crash is None:
                raise
            raise unwrap(crash) from None
        finally:
            with trio.CancelScope(shield=True):
                if ctx is not None:
                    await ctx._close_senders()
                await inbox.aclose()

    async def _dispatch_until_stopped(self, actor: Actor, ctx: Context,
                                      messages: trio.MemoryReceiveChannel[Any]) -> None:
        # A stop interrupts the wait for the next message, never a handler.
        while not self._stop_requested.is_set():
            with trio.CancelScope() as self._waiting:
                msg = await messages.receive()
            if self._waiting.cancelled_caught:
                return
            if self.faults is not None and not await self.faults.before_dispatch(msg):
                continue
            await self._dispatch(actor, ctx, msg)

    async def _dispatch(self, actor: Actor, ctx: Context, msg: Any) -> None:
        if not isinstance(msg, Call):
            await actor.handle(msg)
            return
        try:
            result = await actor.handle(msg.body)
        except Exception as exc:
            with trio.move_on_after(1.0):
                await ctx._answer(msg, Reply(msg.id, error=repr(exc)))
            raise
        await ctx._answer(msg, Reply(msg.id, result))


async def _report_ready(actor: Actor, ctx: Context, task_status: trio.TaskStatus[Context]) -> None:
    await actor.until_ready()
    ctx._child.ready = True
    task_status.started(ctx)


async def _route_replies(inbox: Any, ctx: Context, handoff: trio.MemorySendChannel[Any]) -> None:
    """Read the mailbox; replies go straight to their callers, the rest to ``handle``.

    Separate from the dispatch loop so a handler awaiting ``call`` can still
    receive its reply, and heartbeats are answered while a handler works.
    A call that names no usable reply address is refused here, unhandled.
    """
    async with handoff:
        async for msg in inbox:
            if isinstance(msg, Reply):
                ctx._caller.resolve(msg)
            elif isinstance(msg, Call | Heartbeat) and (problem := _reply_address_problem(msg.reply_to)):
                ctx._unanswerable(msg, problem)
            elif isinstance(msg, Heartbeat):
                await ctx._answer(msg, Reply(msg.id, Pulse(ctx._child.boot, ctx._child.ready)))
            else:
                await handoff.send(msg)


def _reply_address_problem(text: str) -> str | None:
    """Why a reply cannot be sent to ``text`` (None if it is an address to connect to)."""
    try:
        address = Address.parse(text)
    except AddressError as exc:
        return str(exc)
    if address.scheme == "tcp":
        port = address.rest.rpartition(":")[2]
        if address.host == "*" or not port.isdigit() or not 0 < int(port) < 65536:
            return f"reply_to {text!r}: a reply needs tcp://HOST:PORT with a port in 1..65535"
    return None
