"""Children in other OS processes: a subtree with its own trio loop and Hub.

``ProcessChild("pkg.module:factory", args)`` runs ``factory(hub, **args)`` — a
function returning a Child (an ActorChild, a Supervisor, ...) — in a fresh
Python process, and is itself a Child, so a supervisor treats it like any
other:

- readiness crosses the boundary: ``run`` reports ready only once the
  subtree in the child process has reported ready (its endpoints are bound);
  a child that binds first and then gets ready (an actor loading a model:
  ``Actor.until_ready``) says ``bound`` first, so the parent bounds the two
  apart: ``ready_timeout`` until it is bound (an import or a bind that hangs
  is caught soon), ``load_timeout`` from then until it is ready (a large
  load is not mistaken for a hang; the child answers its mailbox meanwhile);
- a child that fails before it is ready says why: the error's type and text
  come up the ready pipe, and the parent raises a ``ChildStartError`` whose
  ``__cause__`` is a ``ProcessStartFailed`` carrying them (the traceback is
  printed by the child only at DEBUG);
- death is noticed at once (the process's exit wakes ``Process.wait``,
  which waits on a pidfd), and the exit status becomes the crash reason;
- stopping asks first (a line on the child's stdin), then, when the
  supervisor's grace period runs out, SIGTERM, then SIGKILL after
  ``kill_after`` seconds;
- the child exits by itself when its parent dies (it waits on the parent's
  pidfd), so a crashed server leaves no orphans;
- a ``Standby`` (``standby=``, shared by the starts of one child) keeps a
  spare process for the next start: spawned once a start is ready, it
  imports what the child will need (``preload``) on a thread at the lowest
  CPU priority, says ``warm`` and waits for its spec, so a restart after a
  crash skips the interpreter's start and those imports (seconds, for
  torch). A spare not warm yet is not used (it would finish its imports at
  the lowest priority): the start spawns a fresh process, as without one, and
  the spare stays for the start after it.
  Its owner closes it when no start will come (a supervisor:
  ``ChildSpec.close``); a spare whose parent dies exits (its stdin closes).

The spec travels as JSON on stdin; nothing is pickled. It carries the
options of the child's hub (``hub=``, a ``transports.HubOptions``: CURVE
keys or key files, the message size bound, ``allow_insecure``), so the child
secures its channels the way its parent does: ``ProcessChild(...,
hub=hub.options)``. Without it the child's hub has the defaults.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import site
import subprocess
import sys
import threading
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import trio

from transports import HubOptions, open_hub

from ._errors import ChildStartError, unwrap

__all__ = ["ProcessChild", "ProcessExited", "ProcessStartFailed", "Standby", "end_kept_spares", "keep_spares"]

log = logging.getLogger("actors.process")

EXIT_CRASHED = 70  # the subtree in the child raised
EXIT_ORPHANED = 71  # the parent died


class ProcessExited(Exception):
    """A child process ended without being asked to."""

    def __init__(self, name: str, returncode: int) -> None:
        if returncode < 0:
            how = f"was killed by {_signal_name(-returncode)}"
        elif returncode == EXIT_CRASHED:
            how = "crashed (its subtree raised)"
        else:
            how = f"exited with status {returncode}"
        super().__init__(f"process {name!r} {how}")
        self.returncode = returncode

    @property
    def faulted(self) -> bool:
        """Whether the child failed by itself: a fault signal (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT)
        or its own code raised; not when it was killed or stopped from outside (SIGKILL, SIGTERM: an
        operator, the OOM killer, a watchdog) or exited with some other status."""
        return self.returncode == EXIT_CRASHED or -self.returncode in FAULT_SIGNALS


class ProcessStartFailed(Exception):
    """What made a child process fail before it reported ready: its error's text (``str``) and
    type name (``kind``), as the child reported them (an exception does not cross the boundary)."""

    def __init__(self, message: str, kind: str = "Exception") -> None:
        super().__init__(message)
        self.kind = kind


class _Failure(msgspec.Struct):
    """The ready pipe's other line: ``failed <json>``."""
    kind: str
    message: str


FAULT_SIGNALS = frozenset(int(s) for s in (signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGABRT))


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # (a real-time signal has no name)
        return f"signal {number}"


class _Spec(msgspec.Struct):
    target: str
    args: dict[str, Any]
    parent_pid: int
    name: str
    log_level: int
    hub: HubOptions | None = None


class ProcessChild:
    """A supervisor child that runs ``target(hub, **args)`` in a child process."""

    def __init__(self, target: str, args: dict[str, Any] | None = None, *,
                 name: str | None = None, kill_after: float = 5.0,
                 ready_timeout: float = 120.0, load_timeout: float = 1800.0, env: dict[str, str] | None = None,
                 pass_fds: tuple[int, ...] = (), hub: HubOptions | None = None,
                 standby: Standby | None = None) -> None:
        self.target = target
        self.args = args or {}
        self.name = name or target
        self.kill_after = kill_after
        self.ready_timeout = ready_timeout
        self.load_timeout = load_timeout  # from ``bound`` to ``ready`` (a child that says it is bound)
        self.env = env
        self.pass_fds = pass_fds  # inherited by the child under the same numbers (e.g. a listening socket)
        self.hub = hub  # the options of the child's hub (None: the defaults)
        self.standby = standby  # a spare process for this start and the next (shared by the starts)
        self.process: trio.Process | None = None

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    async def stop(self) -> None:
        """Ask the child process to stop its subtree and exit."""
        process = self.process
        if process is None or process.returncode is not None or process.stdin is None:
            await trio.lowlevel.checkpoint()
            return
        try:
            await process.stdin.send_all(b"stop\n")
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        spec = _Spec(self.target, self.args, os.getpid(), self.name, logging.getLogger().level, self.hub)
        env = dict(os.environ if self.env is None else self.env)
        if path := import_path(env.pop("PYTHONPATH", None)):
            env["PYTHONPATH"] = path
        spare = None if self.standby is None else await self.standby.take(env, self.pass_fds)
        if spare is not None:
            log.info("process %s starts in its spare process (pid %d)", self.name, spare.process.pid)
            process, ready_read = spare.process, spare.ready
        else:
            process, ready_read = await _spawn((), env, self.pass_fds)
            if self.standby is not None and self.standby.starts > 1:
                # a restart from a bare interpreter (crashes in a row, say): the next spare gets warm
                # meanwhile, on the core this start's imports leave idle
                await self.standby.fill(env, self.pass_fds)
        self.process = process
        try:
            assert process.stdin is not None
            async with trio.lowlevel.FdStream(ready_read) as ready:  # closes ready_read however this ends
                await process.stdin.send_all(msgspec.json.encode(spec) + b"\n")
                pipe = _LineReader(ready)
                line, waited = await pipe.line(self.ready_timeout), f"within {self.ready_timeout:g} s"
                if line == b"bound\n":
                    log.info("process %s (pid %d) is bound; waiting up to %g s for it to be ready",
                             self.name, process.pid, self.load_timeout)
                    line = await pipe.line(self.load_timeout)
                    waited = f"within {self.load_timeout:g} s of binding its mailbox (it was still getting ready)"
                if line is None or not line.startswith(b"ready"):
                    code = await _exit_status(process, 1.0)
                    failure = _reported_failure(line or b"")
                    raise ChildStartError(
                        f"process {self.name!r} did not report ready"
                        + (f" {waited}" if line is None else
                           f": {failure.kind}: {failure}" if failure is not None else f" (exit status {code})")
                    ) from failure
            log.info("process %s (pid %d) is ready", self.name, process.pid)
            task_status.started(self)
            async with trio.open_nursery() as nursery:
                if self.standby is not None:
                    nursery.start_soon(self.standby.fill_later, env, self.pass_fds)
                returncode = await process.wait()
                nursery.cancel_scope.cancel()
            if returncode != 0:
                raise ProcessExited(self.name, returncode)
        finally:
            with trio.CancelScope(shield=True):
                await _terminate(process, self.kill_after, self.name)


async def _spawn(preload: Sequence[str], env: dict[str, str], pass_fds: tuple[int, ...]) -> tuple[trio.Process, int]:
    """A child process that reads its spec on stdin (after importing ``preload``), and the read
    end of its ready pipe."""
    ready_read, ready_write = os.pipe()
    try:
        process = await trio.lowlevel.open_process(
            # -P: the working directory is not put first on sys.path (a module planted in a
            # shared directory the server was started from is never imported)
            [sys.executable, "-P", "-m", "actors.process", str(ready_write), *preload],
            stdin=subprocess.PIPE, pass_fds=(ready_write, *pass_fds), env=env,
        )
    except BaseException:
        os.close(ready_read)  # (no child: nobody will read it)
        raise
    finally:
        os.close(ready_write)
    return process, ready_read


@dataclass
class _Spare:
    process: trio.Process
    ready: int  # the read end of its ready pipe (its first line: ``warm``, once it preloaded)
    env: dict[str, str]
    pass_fds: tuple[int, ...]
    said: bytes = b""  # its first line, once it came

    def fits(self, env: dict[str, str], pass_fds: tuple[int, ...]) -> bool:
        """Whether a start with ``env`` and ``pass_fds`` may run in it (``keep_spares``' ``ignore_env``
        aside, the same environment and descriptors)."""
        if self.pass_fds != pass_fds:
            return False
        return ({k: v for k, v in self.env.items() if k not in _ignored_env}
                == {k: v for k, v in env.items() if k not in _ignored_env})

    def check(self) -> bool:
        """Whether it said ``warm`` (a read that does not wait; the line is atomic: < PIPE_BUF)."""
        if not self.said:
            os.set_blocking(self.ready, False)
            try:
                self.said = os.read(self.ready, len(WARM))
            except BlockingIOError:
                pass
            finally:
                os.set_blocking(self.ready, True)
            if self.said == COLD:
                log.warning("spare process %d: an import started a thread while it preloaded at the lowest "
                            "priority; not used (restarts start fresh processes)", self.process.pid)
        return self.said == WARM


WARM = b"warm\n"  # a spare's first line on its ready pipe: it preloaded and waits for its spec
COLD = b"cold\n"  # or: it preloaded, but an import started a thread at the spare's priority (never used)


class Standby:
    """One spare process, kept for the next start of a ProcessChild (``ProcessChild(...,
    standby=)``). Each start that gets ready spawns the next spare ``after`` seconds later (a
    restart that found no warm one spawns it at once), which imports ``preload`` (module names;
    ``module:function`` also calls the function) on a thread at the lowest CPU priority (it takes
    only idle time from what runs), then says ``warm`` and waits for its spec.

    A start takes the spare when it is warm and was spawned with the same environment and
    inherited descriptors. A start that comes before it is warm spawns a fresh process (on a busy
    host the spare could take minutes to get there, and the start would wait on it); the spare
    stays, for the start after.

    The spare holds what it imported (hundreds of MB with torch) and costs nothing else.
    ``aclose`` ends it; a closed Standby spawns again at the next start that gets ready."""

    def __init__(self, preload: Sequence[str] = (), *, after: float = 2.0) -> None:
        self.preload = tuple(preload)
        # seconds from a start's ready to its spare's spawn: the spare's first moments (the interpreter,
        # this module's imports) run at the normal priority, and what a restart resumes runs first
        self.after = after
        self._spare: _Spare | None = None
        self._spawned = trio.Event()  # (replaced once set: the next spawn sets the next one)
        self.starts = 0  # starts that asked for a spare (``take``)
        self.spawned = 0  # spares spawned
        self.taken = 0  # starts that ran in a spare
        self.cold = 0  # starts that came before the spare was warm (a fresh process ran them; the spare stayed)

    @property
    def pid(self) -> int | None:
        """The spare's process id (None: no spare now)."""
        return None if self._spare is None else self._spare.process.pid

    async def fill_later(self, env: dict[str, str], pass_fds: tuple[int, ...]) -> None:
        """``fill``, ``after`` seconds from now."""
        await trio.sleep(self.after)
        await self.fill(env, pass_fds)

    async def fill(self, env: dict[str, str], pass_fds: tuple[int, ...]) -> None:
        """Spawn a spare unless there is one (it gets warm in the background), or adopt one kept
        (``keep_spares``). A spare that cannot be spawned is logged and skipped: the next start
        spawns its own process, as without one."""
        if self._spare is not None:
            return
        if (kept := _adopt(self.preload, env, pass_fds, warm=False)) is not None:
            self._hold(kept)
            return
        try:
            process, ready = await _spawn(self.preload, env, pass_fds)
        except OSError as exc:
            log.warning("no spare process (%s): the next start spawns its own", exc)
            return
        log.debug("spare process (pid %d) spawned to preload %s", process.pid, ", ".join(self.preload))
        self.spawned += 1
        self._hold(_Spare(process, ready, env, pass_fds))

    def _hold(self, spare: _Spare) -> None:
        """``spare`` is the spare now; who waits for one (``until_spawned``) hears of it."""
        self._spare = spare
        self._spawned.set()
        self._spawned = trio.Event()

    async def until_spawned(self) -> int:
        """Wait until there is a spare (a start that got ready spawns one ``after`` seconds later); its pid."""
        while self._spare is None:
            await self._spawned.wait()
        return self._spare.process.pid

    async def until_warm(self) -> bool:
        """Wait until there is a spare and it said ``warm``; False when it said ``cold``, exited, or was
        taken or ended first."""
        await self.until_spawned()
        spare = self._spare
        while spare is not None and spare is self._spare and not spare.check():
            if spare.process.poll() is not None or spare.said:
                return False
            with trio.move_on_after(1.0):  # (a spare that dies says nothing: look again)
                await trio.lowlevel.wait_readable(spare.ready)
        return spare is not None and spare is self._spare

    async def take(self, env: dict[str, str], pass_fds: tuple[int, ...]) -> _Spare | None:
        """The spare, for a start with ``env`` and ``pass_fds``, or a warm one kept (``keep_spares``);
        None when there is none usable. A spare still importing stays, for the start after this one
        (it goes on in the time this start leaves idle: a fresh start imports on one core); one that
        exited, said ``cold`` or was spawned for another environment is ended."""
        self.starts += 1
        spare, self._spare = self._spare, None
        if spare is not None:
            if spare.process.poll() is None and spare.fits(env, pass_fds):
                if spare.check():
                    self.taken += 1
                    return spare
                if not spare.said:
                    self.cold += 1
                    log.info("the spare process (pid %d) is not warm yet: a fresh process starts (the spare "
                             "stays, for the start after it)", spare.process.pid)
                    self._spare, spare = spare, None
            if spare is not None:
                await _end_spare(spare)
        if (spare := _adopt(self.preload, env, pass_fds, warm=True)) is not None:
            self.taken += 1
        return spare

    async def aclose(self) -> None:
        """End the spare, if any (waits for it to exit), unless this process keeps it (``keep_spares``)."""
        spare, self._spare = self._spare, None
        if spare is not None:
            with trio.CancelScope(shield=True):
                if not await _keep(self.preload, spare):
                    await _end_spare(spare)


# -- spares kept past their Standby ------------------------------------------------------

_kept: list[tuple[tuple[str, ...], _Spare]] = []  # oldest first
_keep_limit = 0
_ignored_env: frozenset[str] = frozenset()


def keep_spares(limit: int, ignore_env: Sequence[str] = ()) -> int:
    """Keep up to ``limit`` spares of each preload past the end of their Standby, for the next
    Standby of this process with the same preload, environment and inherited descriptors (none):
    a program that opens and closes runtimes again and again (a test suite) starts each one's
    children in processes that imported what they need while it idled. 0 (the default): a
    Standby's end ends its spare. ``end_kept_spares`` ends those kept (a kept spare also exits
    when this process does: its stdin closes). ``ignore_env``: variables that may differ between
    a spare and the start that runs in it (they keep the spare's values: ones nothing started reads,
    like a test runner's name of the current test). Returns the limit it replaces."""
    global _keep_limit, _ignored_env
    previous, _keep_limit, _ignored_env = _keep_limit, limit, frozenset(ignore_env)
    return previous


async def end_kept_spares() -> None:
    """End every spare kept (``keep_spares``)."""
    with trio.CancelScope(shield=True):
        while _kept:
            await _end_spare(_kept.pop()[1])


async def _keep(preload: tuple[str, ...], spare: _Spare) -> bool:
    spare.check()
    if _keep_limit <= 0 or spare.pass_fds or spare.process.poll() is not None or spare.said == COLD:
        return False
    _kept.append((preload, spare))
    log.debug("spare process (pid %d) kept (%s)", spare.process.pid, "warm" if spare.said == WARM else "not warm yet")
    for old in [k for k in _kept if k[0] == preload][:-_keep_limit]:  # the oldest beyond the limit
        _kept.remove(old)
        await _end_spare(old[1])
    return True


def _adopt(preload: tuple[str, ...], env: dict[str, str], pass_fds: tuple[int, ...], *, warm: bool) -> _Spare | None:
    """A kept spare for a Standby of ``preload`` starting with ``env`` and ``pass_fds`` (``warm``:
    only one that said so), the newest first; taken out of the kept ones."""
    for entry in reversed(_kept):
        kept_preload, spare = entry
        if (kept_preload == preload and spare.fits(env, pass_fds)
                and spare.process.poll() is None and (spare.check() or not warm and not spare.said)):
            _kept.remove(entry)
            return spare
    return None


async def _end_spare(spare: _Spare) -> None:
    """A spare ends when its stdin closes (without its spec it exits 0); SIGKILL if it does not soon."""
    os.close(spare.ready)
    if spare.process.stdin is not None:
        await spare.process.stdin.aclose()
    await _terminate_after(spare.process, 5.0, "spare")


class _LineReader:
    """Lines of the ready pipe, each within its own deadline."""

    MAX_LINE = 1 << 16  # bytes: a failure line is bounded by the child (its text, JSON-escaped)

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self.stream = stream
        self.buffer = b""

    async def line(self, timeout: float) -> bytes | None:
        """The next line (what came before the pipe closed, when it closed first: ``b""`` for
        nothing); None when it did not come within ``timeout``."""
        with trio.move_on_after(timeout):
            while b"\n" not in self.buffer and len(self.buffer) < self.MAX_LINE:
                part = await self.stream.receive_some()
                if not part:
                    break
                self.buffer += part
            line, newline, self.buffer = self.buffer.partition(b"\n")
            return line + newline
        return None


def _reported_failure(line: bytes) -> ProcessStartFailed | None:
    if not line.startswith(b"failed "):
        return None
    try:
        failure = msgspec.json.decode(line[len(b"failed "):], type=_Failure)
    except msgspec.ValidationError:  # (DecodeError is one)
        return None
    return ProcessStartFailed(failure.message, failure.kind)


def _package_root() -> str | None:
    """Where ``actors`` and its siblings are (a source checkout: its test and custom actors too),
    unless that is a site-packages directory, which the child has anyway (and which, put on
    PYTHONPATH, would come before the standard library)."""
    root = Path(__file__).resolve().parents[1]
    sites = {Path(p).resolve() for p in [*site.getsitepackages(), site.getusersitepackages()]}
    return None if root in sites else str(root)


PACKAGE_ROOT = _package_root()


def import_path(inherited: str | None) -> str:
    """A child's PYTHONPATH: the directory tercet's packages are in, then the absolute entries
    inherited (a relative or empty one would mean the working directory)."""
    entries = [PACKAGE_ROOT or "", *(inherited or "").split(os.pathsep)]
    return os.pathsep.join(dict.fromkeys(e for e in entries if os.path.isabs(e)))


async def _exit_status(process: trio.Process, wait: float) -> int | None:
    with trio.move_on_after(wait):
        return await process.wait()
    return None


async def _terminate(process: trio.Process, kill_after: float, name: str) -> None:
    if process.returncode is not None:
        return
    process.terminate()
    await _terminate_after(process, kill_after, name)


async def _terminate_after(process: trio.Process, kill_after: float, name: str) -> None:
    """Wait ``kill_after`` seconds for ``process`` (asked to end) to exit, then SIGKILL it."""
    with trio.move_on_after(kill_after):
        await process.wait()
        return
    log.warning("process %s (pid %d) did not exit within %g s of being asked; killing it", name, process.pid,
                kill_after)
    process.kill()
    await process.wait()


# -- the child side -------------------------------------------------------------


def _load(target: str) -> Any:
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


class _ReadyPipe:
    """The child's end of the ready pipe: ``bound`` (optional), then one last line, ``ready``
    or ``failed <json>``, then closed."""

    MAX_MESSAGE = 2000  # characters of the error's text: a bounded line (the parent reads to its end)

    def __init__(self, fd: int) -> None:
        self.fd: int | None = fd

    def warm(self, usable: bool) -> None:
        """A spare's first line: it preloaded (the parent reads it before it sends the spec), or it
        cannot be used (``cold``)."""
        if self.fd is not None:
            try:
                os.write(self.fd, WARM if usable else COLD)
            except OSError:  # (the parent ended; stdin's end tells the main thread)
                pass

    def bound(self) -> None:
        if self.fd is not None:
            try:
                os.write(self.fd, b"bound\n")
            except OSError:  # (the parent gave up on us; the last line finds it so too)
                pass

    def report(self, line: bytes) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            try:
                os.write(fd, line)
            except OSError:  # (the parent gave up on us)
                pass
            os.close(fd)

    def ready(self) -> None:
        self.report(b"ready\n")

    def failed(self, exc: BaseException) -> None:
        text = " ".join((str(exc) or type(exc).__name__).split())[:self.MAX_MESSAGE]
        self.report(b"failed " + msgspec.json.encode(_Failure(type(exc).__name__, text)) + b"\n")


async def _child_main(spec: _Spec, ready: _ReadyPipe) -> None:
    factory = _load(spec.target)
    async with open_hub(spec.hub) as hub, trio.open_nursery() as nursery:
        nursery.start_soon(_exit_when_parent_dies, spec.parent_pid)
        child = factory(hub, **spec.args)
        nursery.start_soon(_stop_when_asked, child)
        done = trio.Event()

        async def run_child(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            try:
                await child.run(task_status=task_status)
            finally:
                done.set()

        if isinstance(bound := getattr(child, "bound", None), trio.Event):
            nursery.start_soon(_say_bound, bound, ready)
        await nursery.start(run_child)
        ready.ready()
        await done.wait()
        nursery.cancel_scope.cancel()


async def _say_bound(bound: trio.Event, ready: _ReadyPipe) -> None:
    await bound.wait()
    ready.bound()


async def _stop_when_asked(child: Any) -> None:
    stdin = trio.lowlevel.FdStream(os.dup(0))
    async with stdin:
        async for chunk in stdin:
            if b"stop" in chunk:
                await child.stop()
                return
    # stdin closed: the parent is gone or gave up on us
    await child.stop()


async def _exit_when_parent_dies(parent_pid: int) -> None:
    if os.getppid() != parent_pid:
        os._exit(EXIT_ORPHANED)
    pidfd = os.pidfd_open(parent_pid)
    await trio.lowlevel.wait_readable(pidfd)
    os._exit(EXIT_ORPHANED)


def _read_line(fd: int) -> bytes:
    """One line from ``fd``, unbuffered: what follows it is the control stream."""
    line = bytearray()
    while not line.endswith(b"\n"):
        byte = os.read(fd, 1)
        if not byte:
            break
        line += byte
    return bytes(line)


def _first_leaf(exc: BaseException) -> BaseException:
    """The error inside nested exception groups (the first that is not a cancellation)."""
    exc = unwrap(exc)
    while isinstance(exc, BaseExceptionGroup):
        leaves = [e for e in exc.exceptions if not isinstance(e, trio.Cancelled)]
        if not leaves:
            break
        exc = unwrap(leaves[0])
    return exc


def _preload(items: Sequence[str], ready: _ReadyPipe) -> threading.Thread:
    """Import ``items`` (``module:function`` also calls it) on a thread at the lowest CPU priority
    (a Linux thread has its own nice value; the threads the main thread starts later do not inherit
    it), then say ``warm`` on the ready pipe (``cold`` where an import started a thread, which has
    the lowest priority too). An item that fails is skipped: the start imports it again and says
    what fails."""

    def run() -> None:
        me = threading.get_native_id()
        before = set(os.listdir("/proc/self/task"))
        try:
            os.setpriority(os.PRIO_PROCESS, me, 19)
        except OSError:
            pass
        for item in items:
            module, _, function = item.partition(":")
            try:
                loaded = importlib.import_module(module)
                if function:
                    getattr(loaded, function)()
            except Exception:  # noqa: BLE001, S112 - see above
                continue
        # a thread an import started (a BLAS pool, say) kept this one's priority: such a spare is not used
        started = set(os.listdir("/proc/self/task")) - before - {str(me)}
        ready.warm(not started)

    thread = threading.Thread(target=run, name="preload", daemon=True)
    thread.start()
    return thread


def main() -> None:
    ready = _ReadyPipe(int(sys.argv[1]))
    preloading = _preload(sys.argv[2:], ready) if len(sys.argv) > 2 else None
    line = _read_line(0)
    if not line.endswith(b"\n"):  # a spare that was not used: its parent closed stdin (or died)
        os._exit(0)
    spec = msgspec.json.decode(line, type=_Spec)
    if preloading is not None:
        preloading.join()
    logging.basicConfig(level=spec.log_level or logging.WARNING,
                        format=f"%(asctime)s {spec.name}[%(process)d] %(levelname)s %(name)s: %(message)s")
    try:
        trio.run(_child_main, spec, ready)
    except BaseException as exc:  # noqa: BLE001 - report, then exit with a status the parent reads
        if ready.fd is not None:  # it failed to start: the parent says why; the traceback is for DEBUG
            ready.failed(_first_leaf(exc))
            if logging.getLogger().isEnabledFor(logging.DEBUG):
                traceback.print_exc()
        else:
            traceback.print_exc()
        sys.stderr.flush()
        os._exit(EXIT_CRASHED)


if __name__ == "__main__":
    main()
