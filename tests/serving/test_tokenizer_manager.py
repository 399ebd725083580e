"""The TokenizerManager alone, its downstream a recording fake (the unit, isolated):
what a resume sends, and what it must not."""

import pytest
import trio
import trio.testing

from actors import CallError
from serving.managers.messages import AbortReq, GenerateReq, SamplingParams
from serving.managers.replica_pool import ReplicaPool
from serving.managers.tokenizer_manager import GenerateInput, TokenizerManager


class RecordingContext:
    """Stands in for the actor context: records sends; the ``block``-th send waits for ``unblock``."""

    def __init__(self, nursery, block=None):
        self.nursery = nursery
        self.sent = []
        self.block = block
        self.unblock = trio.Event()

    async def send(self, address, msg):
        self.sent.append(msg)
        if len(self.sent) == self.block:
            await self.unblock.wait()

    async def call(self, address, msg, timeout, reply=None):
        raise CallError("no scheduler here")


def manager(tokenizer, ctx):
    tm = TokenizerManager(tokenizer, scheduler="inproc://scheduler")
    tm.ctx = tm.replicas.ctx = ctx
    return tm


async def drain(stream, into):
    async for chunk in stream:
        into.append(chunk)


@pytest.fixture
def batch():
    return GenerateInput(input_ids=[[5, 6], [7, 8], [9, 10]], sampling_params=SamplingParams(max_new_tokens=3))


async def test_a_resume_while_a_batch_is_being_sent_resumes_only_what_was_sent(nursery, tokenizer, batch):
    ctx = RecordingContext(nursery, block=1)  # the first sub-request's send hangs
    tm = manager(tokenizer, ctx)
    nursery.start_soon(drain, tm.generate(batch), [])
    await trio.testing.wait_all_tasks_blocked()
    assert len(ctx.sent) == 1 and len(tm.rid_to_state) == 3
    assert await tm.resubmit_in_flight("the scheduler crashed") == 1  # the other two were never sent
    ctx.unblock.set()
    await trio.testing.wait_all_tasks_blocked()
    first, second, third = list(tm.rid_to_state)
    assert [(type(m), m.rid) for m in ctx.sent] == [
        (GenerateReq, f"{first}#0.0"), (GenerateReq, f"{first}#0.1"), (AbortReq, f"{first}#0.0"),  # (N5)
        (GenerateReq, f"{second}#0.0"), (GenerateReq, f"{third}#0.0")]
    assert ctx.sent[1].replaces == f"{first}#0.0"


class AddressedContext(RecordingContext):
    """Records ``(address, message)``; the ``block``-th send waits for ``unblock``."""

    async def send(self, address, msg):
        self.sent.append((address, msg))
        if len(self.sent) == self.block:
            await self.unblock.wait()


REPLICAS = ["inproc://s0", "inproc://s1", "inproc://s2"]


async def test_a_migration_sends_the_resume_first_and_the_old_replica_abort_after(nursery, tokenizer):
    ctx = AddressedContext(nursery)
    tm = TokenizerManager(tokenizer, scheduler=REPLICAS[:2])
    tm.ctx = tm.replicas.ctx = ctx
    nursery.start_soon(drain, tm.generate(GenerateInput(input_ids=[5, 6], rid="m")), [])
    await trio.testing.wait_all_tasks_blocked()
    (first, _), = ctx.sent
    assert await tm.replica_down(REPLICAS.index(first), "replica lost") == 1
    other = REPLICAS[1 - REPLICAS.index(first)]
    assert [(a, type(m), m.rid) for a, m in ctx.sent[1:]] == [
        (other, GenerateReq, "m#0.1"), (first, AbortReq, "m#0.0")]
    assert ctx.sent[1][1].resume and ctx.sent[1][1].replaces is None  # (N4: the queue bound lets it in)


async def consume(tm, obj, task_status=trio.TASK_STATUS_IGNORED):
    """A client of ``tm.generate(obj)`` that leaves when the scope it hands back is cancelled."""
    with trio.CancelScope() as scope:
        task_status.started(scope)
        await drain(tm.generate(obj), [])


async def test_a_client_that_leaves_while_its_resume_is_sent_leaves_nothing_running(nursery, tokenizer):
    """Issue 29 N5(b): the resume's send waits; the client leaves meanwhile; its new incarnation is
    aborted where it went once the send is done."""
    ctx = AddressedContext(nursery, block=2)  # the resume's GenerateReq
    tm = TokenizerManager(tokenizer, scheduler=REPLICAS[:2])
    tm.ctx = tm.replicas.ctx = ctx
    client = await nursery.start(consume, tm, GenerateInput(input_ids=[5, 6], rid="gone"))
    await trio.testing.wait_all_tasks_blocked()
    (first, _), = ctx.sent
    nursery.start_soon(tm.replica_down, REPLICAS.index(first), "replica lost")
    await trio.testing.wait_all_tasks_blocked()
    client.cancel()
    await trio.testing.wait_all_tasks_blocked()
    ctx.unblock.set()
    await trio.testing.wait_all_tasks_blocked()
    other = REPLICAS[1 - REPLICAS.index(first)]
    sent = [(a, type(m).__name__, m.rid) for a, m in ctx.sent[1:]]
    assert sent[0] == (other, "GenerateReq", "gone#0.1")
    assert (other, "AbortReq", "gone#0.1") in sent[1:]  # nothing left running on the new replica
    assert (first, "AbortReq", "gone#0.0") in sent[1:]
    assert tm.rid_to_state == {}


async def test_one_wire_rid_never_runs_on_two_replicas(nursery, tokenizer):
    """Issue 29 N5(a): while a migration's send waits, the replica it goes to is lost too; the second
    resume sends the next incarnation elsewhere, and the first aborts its own once sent."""
    ctx = AddressedContext(nursery, block=2)
    tm = TokenizerManager(tokenizer, scheduler=REPLICAS)
    tm.ctx = tm.replicas.ctx = ctx
    nursery.start_soon(drain, tm.generate(GenerateInput(input_ids=[5, 6], rid="r")), [])
    await trio.testing.wait_all_tasks_blocked()
    (first, _), = ctx.sent
    nursery.start_soon(tm.replica_down, REPLICAS.index(first), "replica lost")
    await trio.testing.wait_all_tasks_blocked()
    second, resumed = ctx.sent[1]
    assert resumed.rid == "r#0.1"
    assert await tm.replica_down(REPLICAS.index(second), "replica lost") == 1
    ctx.unblock.set()
    await trio.testing.wait_all_tasks_blocked()
    runs = {}
    for address, msg in ctx.sent:
        if isinstance(msg, GenerateReq):
            runs.setdefault(msg.rid, []).append(address)
    assert runs == {"r#0.0": [first], "r#0.1": [second], "r#0.2": [runs["r#0.2"][0]]}
    assert runs["r#0.2"][0] not in (first, second)
    aborted = {(a, m.rid) for a, m in ctx.sent if isinstance(m, AbortReq)}
    assert {(first, "r#0.0"), (second, "r#0.1")} <= aborted


async def test_a_client_that_leaves_marks_every_sub_request_finished_before_any_abort(nursery, tokenizer, batch):
    """L3: the client's aborts wait (a full socket); a resume meanwhile resumes none of its sub-requests."""
    ctx = RecordingContext(nursery, block=4)  # the first abort's send
    tm = manager(tokenizer, ctx)
    client = await nursery.start(consume, tm, batch)
    await trio.testing.wait_all_tasks_blocked()
    assert len(ctx.sent) == 3
    client.cancel()
    await trio.testing.wait_all_tasks_blocked()
    assert [type(m) for m in ctx.sent] == [GenerateReq] * 3 + [AbortReq]
    assert await tm.resubmit_in_flight("the scheduler crashed") == 0
    ctx.unblock.set()
    await trio.testing.wait_all_tasks_blocked()
    assert [type(m) for m in ctx.sent] == [GenerateReq] * 3 + [AbortReq] * 3 and tm.rid_to_state == {}


async def test_an_abort_ends_the_request_here_and_a_resume_skips_it(nursery, tokenizer):
    ctx = RecordingContext(nursery)
    tm = manager(tokenizer, ctx)
    chunks = []
    obj = GenerateInput(input_ids=[5, 6], rid="gone", sampling_params=SamplingParams(max_new_tokens=3))
    nursery.start_soon(drain, tm.generate(obj), chunks)
    await trio.testing.wait_all_tasks_blocked()
    assert await tm.abort("gone") is True
    await trio.testing.wait_all_tasks_blocked()
    assert chunks[-1].finished.type == "abort" and tm.rid_to_state == {}
    assert await tm.resubmit_in_flight("the scheduler crashed") == 0
    assert [type(m) for m in ctx.sent] == [GenerateReq, AbortReq]


def test_sample_seeds_are_seed_plus_k_wrapped_like_an_int64():
    from serving.managers.inputs import sample_seed

    assert [sample_seed(7, k) for k in range(3)] == [7, 8, 9]
    assert sample_seed(-5, 0) == -5
    assert [sample_seed(2**63 - 2, k) for k in range(3)] == [2**63 - 2, 2**63 - 1, -(2**63)]


def test_prompts_times_n_is_checked_before_tokenizing():
    from serving.managers.inputs import InvalidRequest, RequestLimits, check_samples

    limits = RequestLimits(max_batch_size=4, max_samples=6)
    assert check_samples(GenerateInput(text=["a", "b"], sampling_params=SamplingParams(n=3)), limits) == 6
    assert check_samples(GenerateInput(input_ids=[[1], [2]], sampling_params=[SamplingParams(n=2),
                                                                                SamplingParams(n=4)]), limits) == 6
    for obj, field in ((GenerateInput(text="a", sampling_params=SamplingParams(n=7)), "sampling_params.n"),
                       (GenerateInput(text=["a"] * 5), "text"), (GenerateInput(input_ids=[[1]] * 5), "input_ids")):
        with pytest.raises(InvalidRequest, match=f"^{field}: "):
            check_samples(obj, limits)


async def test_duplicate_rids_in_one_request_are_refused(nursery, tokenizer):
    from serving.managers.inputs import DuplicateRequestError

    tm = manager(tokenizer, RecordingContext(nursery))
    obj = GenerateInput(input_ids=[[5], [6]], rid=["same", "same"], sampling_params=SamplingParams(max_new_tokens=1))
    with pytest.raises(DuplicateRequestError, match=r"rid: duplicate request id\(s\) \['same'\]"):
        async for _ in tm.generate(obj):
            pass


# -- probation (issue 29, N3) ------------------------------------------------------------

CRASH = "the scheduler crashed: ChildExited('process scheduler was killed by SIGKILL')"


def prober(nursery, tokenizer, tmp_path, **kwargs):
    """A tokenizer manager whose scheduler journals its steps at ``tm.journal``."""
    from serving.managers.journal import StepJournal

    path = str(tmp_path / "scheduler.step")
    tm = TokenizerManager(tokenizer, replicas=ReplicaPool.of("ipc:///nowhere", journals=[path]), **kwargs)
    tm.ctx = tm.replicas.ctx = RecordingContext(nursery)
    tm.journal = StepJournal(path)
    return tm


async def start(nursery, tm, count, prefix="r"):
    """``count`` single requests in flight; their ReqStates."""
    for i in range(count):
        obj = GenerateInput(input_ids=[5, 6], rid=f"{prefix}{i}", sampling_params=SamplingParams(max_new_tokens=50))
        nursery.start_soon(drain, tm.generate(obj), [])
    await trio.testing.wait_all_tasks_blocked()
    return [tm.rid_to_state[f"{prefix}{i}"] for i in range(count)]


def progress(tm, state, tokens=8):
    from serving.managers.messages import BatchStrOut

    tm._handle_batch_output(BatchStrOut([state.wire_rid], ["x" * tokens], [[1] * tokens], [None], [2], [tokens], [0]))


async def crash(tm, step, cause=CRASH):
    """The scheduler died in a step holding ``step`` (their current incarnations); resume."""
    tm.journal.record(s.wire_rid for s in step)
    await tm.resubmit_in_flight(cause)
    await trio.testing.wait_all_tasks_blocked()


async def test_a_crash_counts_only_against_the_requests_in_the_step_that_died(nursery, tokenizer, tmp_path):
    tm = prober(nursery, tokenizer, tmp_path)
    states = await start(nursery, tm, 8)
    running, queued = states[:2], states[2:]
    for _ in range(2):
        await crash(tm, running)
    assert [s.crashes for s in running] == [2, 2] and {s.crashes for s in queued} == {0}
    assert set(tm._on_trial) == set(running) and not tm._no_probation.is_set()  # one group: the two that ran
    assert all(s.replica is not None for s in queued)  # the queued ones resumed at once


@pytest.mark.parametrize("cause", [
    "the detokenizer crashed: ChildExited('process detokenizer exited with status 1')",
    "the scheduler crashed: WatchdogTimeout('tokenizer manager receive', 300.0)",  # outputs stalled
    "the scheduler crashed: OutputStalled('tokenizer worker 1: no output for 300 s')",
    "replica 0 does not answer in 10 s: no reply",
    "replica 0 restarted",
])
async def test_losses_that_are_not_a_crash_of_a_step_blame_nobody(nursery, tokenizer, tmp_path, cause):
    tm = prober(nursery, tokenizer, tmp_path)
    states = await start(nursery, tm, 3)
    for _ in range(3):
        await crash(tm, states, cause)
    assert {s.crashes for s in states} == {0} and tm._no_probation.is_set() and not tm._suspects


async def test_without_a_journal_every_request_in_flight_is_blamed(nursery, tokenizer):
    tm = manager(tokenizer, RecordingContext(nursery))
    assert tm.replicas[0].journal is None  # inproc: no journal
    obj = GenerateInput(input_ids=[[5], [6]], sampling_params=SamplingParams(max_new_tokens=5))
    nursery.start_soon(drain, tm.generate(obj), [])
    await trio.testing.wait_all_tasks_blocked()
    await tm.resubmit_in_flight(CRASH)
    assert [s.crashes for s in tm.rid_to_state.values()] == [1, 1]


async def test_suspects_are_tried_in_groups_halved_down_to_the_culprit(nursery, tokenizer, tmp_path, autojump_clock):
    tm = prober(nursery, tokenizer, tmp_path)
    states = await start(nursery, tm, 10)
    for _ in range(2):
        await crash(tm, states)
    group = list(tm._on_trial)
    assert len(group) == 4 and [len(g) for g in tm._suspects] == [4, 2]
    poison = group[2]
    await crash(tm, group)  # the group of four dies together: halves, each tried first
    assert tm._on_trial == group[:2] and [len(g) for g in tm._suspects] == [2, 4, 2]
    for state in group[:2]:  # the first half makes progress: cleared
        progress(tm, state)
    await trio.testing.wait_all_tasks_blocked()
    assert tm._on_trial == group[2:]
    await crash(tm, group[2:])
    assert tm._on_trial == [poison]
    await crash(tm, [poison])  # alone in the step that died: the culprit
    assert poison.finished.status_code == 500 and "not resumed again" in poison.finished.message
    assert tm._on_trial == [group[3]] and tm.quarantined == 1
    while tm._on_trial:  # the rest make progress, group by group
        for state in list(tm._on_trial):
            progress(tm, state)
        await trio.testing.wait_all_tasks_blocked()
    assert tm._no_probation.is_set() and not tm._suspects
    assert [s.finished for s in states if s is not poison] == [None] * 9


async def test_a_trial_ends_at_its_deadline_and_new_requests_wait_at_most_the_hold(nursery, tokenizer, tmp_path,
                                                                                  autojump_clock):
    tm = prober(nursery, tokenizer, tmp_path, trial_timeout=30.0, hold_timeout=5.0)
    lost = await start(nursery, tm, 2)
    for _ in range(2):
        await crash(tm, lost)
    assert set(tm._on_trial) == set(lost)
    sent = len(tm.ctx.sent)
    await start(nursery, tm, 1, prefix="new")  # held while the lost ones (no output ever) are on trial
    assert len(tm.ctx.sent) == sent
    await trio.sleep(4.9)
    assert len(tm.ctx.sent) == sent
    await trio.sleep(0.2)  # the hold (server.request_wait) is over: it goes, probation or not
    assert tm.ctx.sent[-1].rid.startswith("new0#") and not tm._no_probation.is_set()
    await trio.sleep(25.0)  # past the trial's deadline: it ends, the requests go on (nothing ends them)
    assert tm._no_probation.is_set() and not tm._on_trial
    assert [s.finished for s in lost] == [None, None]


async def test_two_poisons_in_one_group_each_end_at_the_first_crash_that_names_them(nursery, tokenizer, tmp_path,
                                                                                   autojump_clock):
    """Requests on trial run in calls of their own: the journal names one culprit per crash, and
    the rest of its group stays on trial (with a deep queue of innocents that go on meanwhile)."""
    tm = prober(nursery, tokenizer, tmp_path)
    states = await start(nursery, tm, 4)
    queue = await start(nursery, tm, 40, prefix="q")
    for _ in range(2):
        await crash(tm, states)
    group = list(tm._on_trial)
    assert set(group) == set(states) and not tm._suspects
    assert all(m.alone for m in tm.ctx.sent[-4:]) and {s.crashes for s in queue} == {0}
    first, second = group[1], group[3]
    await crash(tm, [first])
    assert first.finished.status_code == 500 and tm._on_trial == [group[0], group[2], second]
    await crash(tm, [second])
    assert second.finished.status_code == 500 and tm._on_trial == [group[0], group[2]]
    for state in tm._on_trial:
        progress(tm, state)
    await trio.testing.wait_all_tasks_blocked()
    assert tm._no_probation.is_set() and tm.quarantined == 2
    assert all(s.finished is None and s.replica is not None for s in queue)


# -- a restart of the front end (issue 29 N6) ----------------------------------------------


class AnsweringContext(AddressedContext):
    """Records calls too, and answers each with ``answer(address, msg)``."""

    def __init__(self, nursery, answer):
        super().__init__(nursery)
        self.answer = answer
        self.calls = []

    async def call(self, address, msg, timeout, reply=None):
        self.calls.append((address, msg))
        return self.answer(address, msg)


def server_info(**fields):
    """A scheduler's ServerInfo, with ``fields`` as given."""
    from serving.managers.messages import ServerInfo, Weights

    return ServerInfo(**{
        "boot": "b", "scheduler": {}, "device": "cpu", "deterministic_inference": True, "invariance": None,
        "max_context_len": 8192, "weights": Weights("m"), "waiting": 0, "running": 0, "requests_by_worker": {},
        "kv_pages_total": 1, "kv_pages_free": 1, "kv_page_size": 16, "cached_pages": 0, "retracted": 0,
        "aborted": 0, "steps": 0, **fields})


async def test_a_restarted_tokenizer_manager_ends_what_its_earlier_incarnation_left_on_every_replica(
        nursery, tokenizer):
    from serving.managers.messages import AbortWhere

    def answer(address, msg):
        if not isinstance(msg, AbortWhere):
            raise CallError("no scheduler here")
        return 2

    ctx = AnsweringContext(nursery, answer)
    tm = TokenizerManager(tokenizer, replicas=ReplicaPool.of(REPLICAS, serving={0, 2}), worker=1)
    await tm.on_start(ctx)
    await trio.testing.wait_all_tasks_blocked()
    assert sorted(a for a, _ in ctx.calls) == [REPLICAS[0], REPLICAS[2]]  # the replicas up
    assert all(m == AbortWhere(worker=1, message=m.message, spare_boot=tm.boot) for _, m in ctx.calls)
    nursery.start_soon(drain, tm.generate(GenerateInput(input_ids=[5, 6], rid="new")), [])
    await trio.testing.wait_all_tasks_blocked()
    (_, sent), = ctx.sent
    assert sent.boot == tm.boot  # what it sends itself is spared
    tm.replica_up(1)  # a replica that comes back (a remote one may still run an earlier front end's)
    await trio.testing.wait_all_tasks_blocked()
    assert ctx.calls[-1] == (REPLICAS[1], AbortWhere(worker=1, message=ctx.calls[-1][1].message,
                                                      spare_boot=tm.boot))
    other = TokenizerManager(tokenizer, scheduler=REPLICAS, worker=1)
    assert other.boot != tm.boot


async def test_the_old_tokenizer_managers_streams_end_when_its_actor_restarts(nursery, tokenizer):
    from serving.runtime.interface import TokenizerManagerSlot

    slot = TokenizerManagerSlot(lambda: TokenizerManager(tokenizer, scheduler="inproc://scheduler"))
    old = slot.build()
    old.ctx = old.replicas.ctx = RecordingContext(nursery)
    chunks = []
    nursery.start_soon(drain, old.generate(GenerateInput(input_ids=[5, 6], rid="r")), chunks)
    await trio.testing.wait_all_tasks_blocked()
    assert slot.build() is not old and slot.current is not old
    await trio.testing.wait_all_tasks_blocked()
    assert chunks[-1].finished.status_code == 503 and "restarted" in chunks[-1].finished.message
    assert old.rid_to_state == {}


async def test_the_health_monitor_survives_any_exception_from_a_probe(autojump_clock):
    from types import SimpleNamespace

    from serving.http.state import HealthMonitor

    class Unstarted:
        async def call_scheduler(self, msg, timeout):
            return self.ctx  # a manager probed before its on_start: AttributeError

    monitor = HealthMonitor(SimpleNamespace(replicated=False, runtime=SimpleNamespace(tokenizer_manager=Unstarted())))
    with trio.move_on_after(3.0):
        await monitor.run()
    assert "AttributeError" in monitor.last_problem


async def test_the_context_window_is_the_smallest_of_the_replicas_up(nursery, tokenizer):
    """N16: a request may migrate to any replica, so it is checked against the smallest window."""
    windows = {REPLICAS[0]: 8192, REPLICAS[1]: 2048, REPLICAS[2]: 1024}
    tm = TokenizerManager(tokenizer, replicas=ReplicaPool.of(REPLICAS, serving={0, 1}))
    tm.ctx = tm.replicas.ctx = AnsweringContext(nursery, lambda address, msg: server_info(
        max_context_len=windows[address]))
    assert (await tm.expander()).limits.context_len == 2048
    tm.replica_up(2)  # one that comes up later counts from the next request on
    assert (await tm.expander()).limits.context_len == 1024


async def test_only_a_repeat_crash_by_a_known_suspect_is_not_counted(nursery, tokenizer, tmp_path, autojump_clock):
    """``suspect_crashed``: the runtime counts a crash against the restart intensity once per culprit, at
    its first crash, not at each repeat (issue 29: two poisons cost two counted crashes, like one)."""
    tm = prober(nursery, tokenizer, tmp_path)
    states = await start(nursery, tm, 6)
    poison_a, poison_b, innocents = states[0], states[1], states[2:]
    tm.journal.record([poison_a.wire_rid])
    assert not tm.suspect_crashed(0)  # its first crash: counted
    await crash(tm, [poison_a])
    tm.journal.record([poison_a.wire_rid, innocents[0].wire_rid])
    assert tm.suspect_crashed(0) and not tm.suspect_crashed(1)  # a repeat
    await crash(tm, [poison_a, innocents[0]])
    assert tm._on_trial == [poison_a]
    tm.journal.record([poison_b.wire_rid, *(s.wire_rid for s in innocents[1:])])
    assert not tm.suspect_crashed(0)  # another culprit's first: counted
    await crash(tm, [poison_b, *innocents[1:]])
    tm.journal.record([])  # idle: counted
    assert not tm.suspect_crashed(0)
    tm.journal.record([poison_a.wire_rid])  # on trial, alone: the crash that convicts it
    assert tm.suspect_crashed(0)
    await crash(tm, [poison_a])
    assert poison_a.finished.status_code == 500
    tm.journal.record([poison_b.wire_rid])  # the other's repeat
    assert tm.suspect_crashed(0)
    progress(tm, innocents[-1])  # an innocent that made progress since its crash
    tm.journal.record([innocents[-1].wire_rid])
    assert not tm.suspect_crashed(0)


def test_replicas_info_is_merged_counts_added_up_the_rest_the_firsts():
    from serving.http.state import merged_info

    merged = merged_info([
        server_info(waiting=1, running=2, requests_by_worker={"0": 3}, speculative_draft_tokens=8,
                    speculative_accepted_tokens=6),
        server_info(boot="c", waiting=4, running=1, requests_by_worker={"0": 1, "1": 4}, speculative_draft_tokens=4,
                    speculative_accepted_tokens=1)])
    assert (merged.waiting, merged.running, merged.requests_by_worker) == (5, 3, {"0": 4, "1": 4})
    assert (merged.speculative_draft_tokens, merged.speculative_accepted_tokens) == (12, 7)
    assert merged.boot == "b"
