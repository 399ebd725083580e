"""Actors in child processes: readiness, death noticed at once, restarts, no orphans."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import trio
import zmq
import zmq.auth

from actors import ChildSpec, ChildStartError, RestartIntensityExceeded, Strategy
from actors.process import ProcessChild, ProcessExited, ProcessStartFailed, Standby, end_kept_spares, keep_spares
from actors.testing import open_harness
from transports import CurveConfig, Encoder, HubOptions

from ..conftest import free_tcp_port, until_no_thread_niced
from ..transports.monitors import REFUSED_KEY, events_of
from .messages import Ping, Pong


def process_spec(child, target, **args):
    return ChildSpec(child, lambda: ProcessChild(f"tests.actors.processes:{target}", args, name=child))


async def wait_pong(out, name, n):
    msg = await out.expect(Pong, timeout=10.0)
    assert (msg.n, msg.by) == (n, name)


@pytest.fixture
def ipc(tmp_path):
    return lambda name: f"ipc://{tmp_path}/{name}.sock"


async def test_process_actor_serves_once_ready(ipc):
    async with open_harness() as h:
        out = await h.probe(ipc("out"), Pong)
        sup = await h.start_supervisor("sup", [process_spec("echo", "echo", address=ipc("echo"), reply_to=ipc("out"))])
        # ready means bound: the first message is not lost
        await h.send(ipc("echo"), Ping(1))
        await wait_pong(out, "echo", 1)
        assert sup.child("echo").pid != os.getpid()


@pytest.mark.parametrize("strategy", [Strategy.ONE_FOR_ONE, Strategy.REST_FOR_ONE])
async def test_killed_process_is_noticed_and_restarted(ipc, strategy):
    async with open_harness() as h:
        out = await h.probe(ipc("out"), Pong)
        specs = [
            process_spec("a", "echo", address=ipc("a"), reply_to=ipc("out"), name="a"),
            process_spec("b", "echo_tree", address=ipc("b"), reply_to=ipc("out")),
        ]
        sup = await h.start_supervisor("sup", specs, strategy=strategy)
        pid_a, pid_b = sup.child("a").pid, sup.child("b").pid
        os.kill(pid_a, signal.SIGKILL)
        t0 = trio.current_time()
        crash = await h.wait_event(lambda e: e.kind == "crashed", timeout=10)
        assert trio.current_time() - t0 < 0.5  # noticed at once, not by polling
        assert isinstance(crash.reason, ProcessExited) and "SIGKILL" in str(crash.reason)
        assert not crash.reason.faulted  # (killed from outside)
        await h.wait_event(lambda e: h.count("started", "a") == 2, timeout=30)
        expected_b = pid_b if strategy == Strategy.ONE_FOR_ONE else None
        if expected_b is None:
            await h.wait_event(lambda e: h.count("started", "b") == 2, timeout=30)
            assert sup.child("b").pid != pid_b
        else:
            assert sup.child("b").pid == pid_b
        assert sup.child("a").pid != pid_a
        # the new process rebound the same address: old senders reach it
        for n, name in ((1, "a"), (2, "echo")):
            await h.send(ipc("a" if name == "a" else "b"), Ping(n))
            await wait_pong(out, name, n)


@pytest.mark.parametrize("signum, faulted", [(signal.SIGSEGV, True), (signal.SIGABRT, True),
                                             (signal.SIGTERM, False), (signal.SIGKILL, False)])
async def test_a_process_that_faults_is_told_from_one_killed_from_outside(ipc, signum, faulted):
    async with open_harness() as h:
        sup = await h.start_supervisor("sup", [process_spec("a", "echo", address=ipc("a"), reply_to=ipc("out"))])
        os.kill(sup.child("a").pid, signum)
        crash = await h.wait_event(lambda e: e.kind == "crashed", timeout=10)
        assert isinstance(crash.reason, ProcessExited) and crash.reason.returncode == -signum
        assert crash.reason.faulted is faulted and signum.name in str(crash.reason)


async def test_crashing_processes_exceed_intensity_and_escalate(ipc):
    async with open_harness() as h:
        sup = await h.start_supervisor(
            "sup", [process_spec("a", "echo", address=ipc("a"), reply_to=ipc("out"))], max_restarts=1, within=60.0
        )
        for k in (1, 2):
            os.kill(sup.child("a").pid, signal.SIGKILL)
            await h.wait_event(lambda e, k=k: h.count("crashed", "a") == k, timeout=30)
            if k == 1:
                await h.wait_event(lambda e: h.count("started", "a") == 2, timeout=30)
        failed = await h.wait_event(lambda e: e.kind == "failed", timeout=30)
        assert isinstance(failed.reason, RestartIntensityExceeded)


async def test_a_process_that_fails_to_start_is_a_start_error_that_says_why():
    async with open_harness() as h:
        with pytest.raises(ChildStartError, match="did not report ready: RuntimeError: no model here") as failed:
            await h.start_supervisor("sup", [process_spec("x", "fails_to_start")])
    cause = failed.value.__cause__.__cause__  # the supervisor's start error, then the process child's
    assert isinstance(cause, ProcessStartFailed) and str(cause) == "no model here" and cause.kind == "RuntimeError"


async def test_a_process_that_binds_then_loads_answers_meanwhile_and_has_its_own_load_bound(ipc):
    """Readiness in two parts: ``ready_timeout`` bounds the time until the child is bound (an import
    or a bind that hangs), ``load_timeout`` the time from then until it is ready, so a long load is
    not taken for a hang; the child answers its mailbox while it loads."""
    ready_timeout = 4.0
    spec = ChildSpec("slow", lambda: ProcessChild(
        "tests.actors.processes:loader", {"address": ipc("slow"), "reply_to": ipc("out"), "load_s": ready_timeout + 1.0},
        name="slow",
        ready_timeout=ready_timeout, load_timeout=60.0))
    async with open_harness() as h, trio.open_nursery() as nursery:
        out = await h.probe(ipc("out"), Pong)
        started = trio.Event()
        t0 = trio.current_time()

        async def start() -> None:
            await h.start_supervisor("sup", [spec])
            started.set()

        nursery.start_soon(start)
        # bound long before it is ready, it answers (a message sent before it binds waits for it)
        await h.send(ipc("slow"), Ping(1))
        assert (await out.expect(Pong, timeout=ready_timeout)).by == "loading"
        assert not started.is_set()
        with trio.fail_after(30.0):
            await started.wait()
        assert trio.current_time() - t0 > ready_timeout  # (ready after the first bound had passed)
        await h.send(ipc("slow"), Ping(2))
        assert await out.expect(Pong, timeout=5.0) == Pong(2, "ready")
        assert h.count("started", "slow") == 1

    never = ChildSpec("never", lambda: ProcessChild(
        "tests.actors.processes:loader", {"address": ipc("never"), "reply_to": ipc("out")}, name="never",
        ready_timeout=30.0, load_timeout=0.5))
    async with open_harness() as h:
        with pytest.raises(ChildStartError, match="within 0.5 s of binding its mailbox"):
            with trio.fail_after(30.0):
                await h.start_supervisor("sup", [never])


async def test_shutdown_escalates_ask_sigterm_sigkill(ipc):
    async with open_harness() as h:
        spec = ChildSpec(
            "stubborn",
            lambda: ProcessChild("tests.actors.processes:stubborn", name="stubborn", kill_after=0.5),
            shutdown=0.5,
        )
        sup = await h.start_supervisor("sup", [spec])
        process = sup.child("stubborn").process
        t0 = trio.current_time()
        await sup.stop()
        await h.wait_event(lambda e: e.kind == "stopped", timeout=10)
        assert process.returncode == -signal.SIGKILL
        assert 1.0 <= trio.current_time() - t0 < 5.0


async def test_graceful_stop_lets_the_process_exit_cleanly(ipc):
    async with open_harness() as h:
        sup = await h.start_supervisor("sup", [process_spec("a", "echo_tree", address=ipc("a"), reply_to=ipc("out"))])
        process = sup.child("a").process
        await sup.stop()
        await h.wait_event(lambda e: e.kind == "stopped", timeout=10)
        assert process.returncode == 0


@pytest.fixture
def curve_files(tmp_path):
    """zmq.auth certificates: the server's keypair (every process shares it), its admitted keys, an intruder's."""
    public, secret = zmq.auth.create_certificates(tmp_path, "tercet")
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    (authorized / "tercet.key").write_bytes((tmp_path / "tercet.key").read_bytes())
    intruder_public, intruder_secret = zmq.auth.create_certificates(tmp_path, "intruder")
    config = CurveConfig(secret_file=secret, server_public_file=public, authorized_dir=authorized)
    return config, zmq.auth.load_certificate(public)[0], zmq.auth.load_certificate(intruder_secret)


async def test_a_child_process_over_tcp_with_curve_from_key_files(curve_files):
    curve, server_public, (intruder_public, intruder_secret) = curve_files
    echo, out = f"tcp://127.0.0.1:{free_tcp_port()}", f"tcp://127.0.0.1:{free_tcp_port()}"
    async with open_harness(HubOptions(curve=curve)) as h:
        pongs = await h.probe(out, Pong)
        spec = ChildSpec("echo", lambda: ProcessChild(
            "tests.actors.processes:echo", {"address": echo, "reply_to": out}, name="echo",
            hub=h.hub.options,  # the child's hub is secured as the parent's
        ))
        await h.start_supervisor("sup", [spec])
        await h.send(echo, Ping(1))  # parent -> child, then child -> parent: both CURVE
        await wait_pong(pongs, "echo", 1)

        context = zmq.Context()
        intruder = context.socket(zmq.DEALER)
        intruder.curve_serverkey, intruder.curve_publickey = server_public, intruder_public
        intruder.curve_secretkey = intruder_secret
        try:
            async with events_of(intruder) as next_outcome:
                intruder.connect(echo)
                for frame in Encoder().encode(Ping(99)):
                    intruder.send(frame, zmq.NOBLOCK)
                with trio.fail_after(10):  # a bound that fails; the wait is on the child's answer
                    assert await next_outcome() == REFUSED_KEY  # the child's ZAP handler said 400
            await h.send(echo, Ping(2))
            await wait_pong(pongs, "echo", 2)  # the next Pong: the intruder's Ping never arrived
        finally:
            intruder.close(linger=0)
            context.term()


PARENT = textwrap.dedent(
    """
    import sys, trio
    from actors import ChildSpec, Supervisor
    from actors.process import ProcessChild
    from transports import open_hub

    async def main():
        async with open_hub() as hub:
            spec = ChildSpec("a", lambda: ProcessChild("tests.actors.processes:stubborn", name="a"))
            sup = Supervisor("sup", [spec])
            async with trio.open_nursery() as nursery:
                await nursery.start(sup.run)
                print(sup.child("a").pid, flush=True)
                await trio.sleep_forever()

    trio.run(main)
    """
)


async def test_children_exit_when_their_parent_dies():
    parent = await trio.lowlevel.open_process([sys.executable, "-c", PARENT], stdout=subprocess.PIPE)
    try:
        line = b""
        while not line.endswith(b"\n"):
            line += await parent.stdout.receive_some()
        child_pid = int(line)
        child = os.pidfd_open(child_pid)
        parent.kill()
        with trio.fail_after(5):
            await trio.lowlevel.wait_readable(child)  # the orphan noticed and exited
        os.close(child)
    finally:
        parent.kill()
        await parent.wait()


async def test_a_process_that_cannot_be_spawned_leaves_no_descriptor_open(monkeypatch):
    """L8: the ready pipe's read end is closed when the child cannot be started."""
    def refuse(*args, **kwargs):
        raise OSError("no processes left")

    monkeypatch.setattr(trio.lowlevel, "open_process", refuse)
    before = set(os.listdir("/proc/self/fd"))
    for _ in range(3):
        with pytest.raises(OSError, match="no processes left"):
            await ProcessChild("tests.actors.processes:echo", {}, name="x").run()
    assert set(os.listdir("/proc/self/fd")) <= before


async def test_a_restart_after_a_crash_runs_in_the_spare_that_preloaded_at_the_lowest_priority(ipc):
    read, write = os.pipe()
    standby = Standby(["tests.actors.processes:say_preloaded"], after=0)
    env = {**os.environ, "PRELOAD_FD": str(write)}
    spec = ChildSpec("a", lambda: ProcessChild("tests.actors.processes:echo", {"address": ipc("a"), "reply_to": ipc("out")},
                                                name="a", env=env, pass_fds=(write,), standby=standby),
                     close=standby.aclose)
    async with trio.lowlevel.FdStream(read) as preloads:
        lines = [b""]

        async def preloaded() -> tuple[int, int]:
            with trio.fail_after(30):
                while not lines[0].count(b"\n"):
                    lines[0] += await preloads.receive_some()
            line, _, lines[0] = lines[0].partition(b"\n")
            pid, nice = map(int, line.split())
            return pid, nice

        async with open_harness() as h:
            out = await h.probe(ipc("out"), Pong)
            sup = await h.start_supervisor("sup", [spec])
            first = sup.child("a").pid
            spare, nice = await preloaded()  # spawned once the first start was ready; it preloaded
            assert spare != first and spare == standby.pid and nice == 19
            assert await standby.until_warm()
            os.kill(first, signal.SIGKILL)
            await h.wait_event(lambda e: h.count("started", "a") == 2, timeout=30)
            assert sup.child("a").pid == spare and standby.taken == 1  # the restart ran in the spare
            await until_no_thread_niced(spare)  # and nothing of it runs at the spare's priority
            await h.send(ipc("a"), Ping(1))
            await wait_pong(out, "echo", 1)
            second, _ = await preloaded()  # the next spare
            assert second not in (first, spare) and standby.pid == second and standby.spawned == 2
            pidfd = os.pidfd_open(second)
        try:  # the supervisor ended: so did the spare (its ChildSpec's close)
            with trio.fail_after(5):
                await trio.lowlevel.wait_readable(pidfd)
            assert standby.pid is None
        finally:
            os.close(pidfd)
            os.close(write)


async def test_a_spare_spawned_for_another_environment_is_ended_not_used():
    standby = Standby()
    env = dict(os.environ)
    await standby.fill(env, ())
    pidfd = os.pidfd_open(standby.pid)
    try:
        assert await standby.take({**env, "OTHER": "1"}, ()) is None and standby.pid is None
        with trio.fail_after(5):
            await trio.lowlevel.wait_readable(pidfd)  # (ended and reaped)
        assert standby.taken == 0
    finally:
        os.close(pidfd)


@pytest.mark.parametrize("preload", ["never_warm", "starts_a_thread"])
async def test_a_start_before_the_spare_is_warm_runs_in_a_fresh_process(ipc, preload):
    """Still importing when the start came (``never_warm``): it stays the spare, for the start after; or
    an import started a thread, which kept the spare's lowest priority (``starts_a_thread``: it says
    ``cold``, is never used, and is ended)."""
    standby = Standby([f"tests.actors.processes:{preload}"], after=0)
    spec = ChildSpec("a", lambda: ProcessChild("tests.actors.processes:echo", {"address": ipc("a"), "reply_to": ipc("out")},
                                                name="a", standby=standby), close=standby.aclose)
    async with open_harness() as h:
        out = await h.probe(ipc("out"), Pong)
        sup = await h.start_supervisor("sup", [spec])
        first = sup.child("a").pid
        with trio.fail_after(10):
            spare = await standby.until_spawned()  # (just after the start reported ready)
        pidfd = os.pidfd_open(spare)
        try:
            if preload == "starts_a_thread":
                assert await standby.until_warm() is False  # (it said cold)
            os.kill(first, signal.SIGKILL)
            await h.wait_event(lambda e: h.count("started", "a") == 2, timeout=30)
            assert sup.child("a").pid not in (first, spare) and standby.taken == 0
            if preload == "never_warm":
                assert standby.pid == spare and standby.cold == 1 and standby.spawned == 1  # it stays
            else:
                with trio.fail_after(5):
                    await trio.lowlevel.wait_readable(pidfd)  # the cold spare was ended
        finally:
            os.close(pidfd)
        await h.send(ipc("a"), Ping(1))
        await wait_pong(out, "echo", 1)


def test_a_spare_kept_past_its_runtime_starts_the_next_ones_child(ipc):
    """keep_spares: a supervisor's end keeps its warm spare (not ended), and the next runtime of this
    process (another trio.run, a new Standby of the same preload) starts its child in it."""
    args = {"address": ipc("a"), "reply_to": ipc("out")}

    async def run_once() -> tuple[int, int | None, Standby]:
        standby = Standby(["tests.actors.processes:echo"], after=0)
        spec = ChildSpec("a", lambda: ProcessChild("tests.actors.processes:echo", args, name="a", standby=standby),
                         close=standby.aclose)
        async with open_harness() as h:
            out = await h.probe(ipc("out"), Pong)
            sup = await h.start_supervisor("sup", [spec])
            await h.send(ipc("a"), Ping(1))
            await wait_pong(out, "echo", 1)
            with trio.fail_after(30):
                assert await standby.until_warm()
            return sup.child("a").pid, standby.pid, standby

    previous = keep_spares(1)
    try:
        _, kept, _ = trio.run(run_once)
        pid, _, standby = trio.run(run_once)
        assert pid == kept and standby.taken == 1 and standby.spawned == 1  # (its own next spare: spawned)
    finally:
        keep_spares(previous)
        trio.run(end_kept_spares)
