"""The scheduler's model calls, with a fake runner and a fake batch state: a failing step re-run
request by request (``_isolate``), requests on probation each in a call of their own (``_run``),
and the step journal that names who was in the call that died."""

from types import SimpleNamespace

import pytest

from models.runner import StepOutput
from serving.managers.batching import Batch
from serving.managers.journal import StepJournal, journal_path, read_step
from serving.managers.scheduler import Scheduler, SchedulerConfig


class FakeRunner:
    """Each sequence's next token is its own number; a call with a guilty sequence raises."""

    def __init__(self, guilty=()):
        self.guilty = set(guilty)
        self.calls = []

    def step(self, seqs):
        self.calls.append([s.n for s in seqs])
        if bad := [s.n for s in seqs if s.n in self.guilty]:
            raise RuntimeError(f"CUDA error: an illegal memory access (sequence {bad[0]})")
        return StepOutput([s.n for s in seqs], [-0.5] * len(seqs), [[]] * len(seqs))


class FakeState:
    def __init__(self):
        self.aborted = {}

    def abort(self, rid, reason):
        self.aborted[rid] = reason
        return SimpleNamespace(rid=rid, reason=reason)

    def constrained(self, batch):
        return []


def scheduler(runner, tmp_path=None):
    s = Scheduler(SchedulerConfig(model="tiny"), runner=runner)
    s.state = FakeState()
    if tmp_path is not None:
        s._journal = StepJournal(str(tmp_path / "scheduler.step"))
    return s


def batch(count, alone=()):
    reqs = [SimpleNamespace(rid=f"r{i}#0.0", alone=i in alone, matcher=None) for i in range(count)]
    return Batch(reqs, [SimpleNamespace(n=i) for i in range(count)])


async def test_a_failing_step_is_rerun_request_by_request_and_only_the_guilty_end(tmp_path):
    runner = FakeRunner(guilty={1, 4})
    s = scheduler(runner, tmp_path)
    b = batch(6)
    out = await s._isolate(b, RuntimeError("the step failed"))
    assert runner.calls == [[i] for i in range(6)]  # each alone, in order
    assert out.token_ids == [0, None, 2, 3, None, 5] and out.logprobs == [-0.5, None, -0.5, -0.5, None, -0.5]
    assert set(s.state.aborted) == {"r1#0.0", "r4#0.0"}
    for rid, reason in s.state.aborted.items():
        assert reason.type == "abort" and reason.status_code == 500
        assert "the model failed on this request" in reason.message and "illegal memory access" in reason.message
    assert [o.rid for o in s._pending] == ["r1#0.0", "r4#0.0"]  # their ends go out with the next batch
    assert read_step(str(tmp_path / "scheduler.step")) == {"r5#0.0"}  # each alone call was journaled


async def test_a_step_that_fails_for_every_request_alone_is_nobodys_fault():
    s = scheduler(FakeRunner(guilty={0, 1, 2}))
    error = RuntimeError("the step failed")
    with pytest.raises(RuntimeError) as raised:
        await s._isolate(batch(3), error)
    assert raised.value is error and s.state.aborted == {}  # the scheduler restarts; every request resumes


async def test_requests_on_probation_run_in_a_call_of_their_own(tmp_path):
    runner = FakeRunner()
    s = scheduler(runner, tmp_path)
    out = await s._run(batch(5, alone={1, 3}))
    assert runner.calls == [[0, 2, 4], [1], [3]]
    assert out.token_ids == [0, 1, 2, 3, 4]
    assert read_step(str(tmp_path / "scheduler.step")) == {"r3#0.0"}
    assert await s._run(batch(2)) and runner.calls[-1] == [0, 1]  # none alone: one call
    assert read_step(str(tmp_path / "scheduler.step")) == {"r0#0.0", "r1#0.0"}


def test_the_journal_keeps_the_last_step_until_the_next_and_a_restart_leaves_it(tmp_path):
    path = str(tmp_path / "scheduler.step")
    assert read_step(path) is None and read_step(None) is None
    journal = StepJournal(path)
    journal.record(["a#0.0", "b#0.0", "c#0.0"])
    journal.record(["d#0.1"])  # shorter: the rest of the old record is ignored
    assert read_step(path) == {"d#0.1"}
    journal.close()
    again = StepJournal(path)  # a restarted scheduler: what its predecessor died in stays
    again.clear()
    assert read_step(path) == {"d#0.1"}
    again.record(["e#0.0"])
    again.clear()
    assert read_step(path) == set()
    assert journal_path("ipc:///run/tercet-x/scheduler") == "/run/tercet-x/scheduler.step"
    assert journal_path("inproc://scheduler") is None and journal_path("tcp://10.0.0.2:5000") is None


def test_a_refused_resume_ends_its_rid_and_the_incarnation_it_was_to_replace():
    import numpy as np

    from actors.actor import mailbox_decoder
    from serving.managers.messages import GenerateReq, GenerateReqId, SamplingParams, SchedulerInbox
    from transports import CodecError, Encoder

    refused = GenerateReq("r#0.2", np.array([1, 2], dtype=np.int32), SamplingParams(seed=2**63), worker=3,
                          num_prior_output=1, replaces="r#0.1")
    with pytest.raises(CodecError) as error:
        mailbox_decoder(SchedulerInbox, GenerateReqId).decode(Encoder().encode(refused))
    salvaged = error.value.salvaged
    assert (salvaged.rid, salvaged.worker, salvaged.replaces) == ("r#0.2", 3, "r#0.1")
    s = scheduler(FakeRunner())
    s.state.by_rid = {"r#0.1": object()}
    s.state.refuse = lambda msg, reason: SimpleNamespace(rid=msg.rid, reason=reason)
    s._refused(salvaged, error.value.detail)
    assert [o.rid for o in s._pending] == ["r#0.1", "r#0.2"]
    end = s._pending[1].reason
    assert end.status_code == 400 and "sampling_params.seed" in end.message, end


def test_abort_where_spares_the_requests_of_the_boot_that_asks(tmp_path):
    """A restarted tokenizer manager ends what its earlier incarnation left, not what it sent (N6)."""
    s = scheduler(FakeRunner())
    s.state.by_rid = {rid: SimpleNamespace(rid=rid, worker=worker, boot=boot) for rid, worker, boot in (
        ("old#0.0", 0, "b1"), ("new#0.0", 0, "b2"), ("other#1.0", 1, "b1"))}
    compiling = {rid: SimpleNamespace(rid=rid, worker=0, boot=boot) for rid, boot in (("c1#0.0", "b1"), ("c2#0.0", "b2"))}
    s._compiling = dict(compiling)
    assert s._abort_where(None, 0, "the front end restarted", spare_boot="b2") == 1
    assert set(s.state.aborted) == {"old#0.0"}
    assert list(s._compiling) == ["c2#0.0"]  # a constrained request of the new boot, still compiling, is kept


async def test_nan_logits_end_their_request_even_alone_never_token_0():
    """Issue 29 N19: NaN logits raise NonFiniteLogits (the sampler's argmax skipped NaN: token 0);
    they are the request's answer, so even a step of that request alone ends it instead of a restart."""
    from models.errors import NonFiniteLogits

    class NanRunner(FakeRunner):
        def step(self, seqs):
            self.calls.append([s.n for s in seqs])
            raise NonFiniteLogits([0])

    s = scheduler(NanRunner())
    out = await s._isolate(batch(1), NonFiniteLogits([0]))
    assert out.token_ids == [None] and set(s.state.aborted) == {"r0#0.0"}
    assert "NaN logits" in s.state.aborted["r0#0.0"].message


async def test_a_constrained_request_whose_mask_fails_is_never_sampled_unconstrained():
    """Issue 29 N19: the batch's mask fill raised; alone, each constrained request fills its own mask,
    and one whose fill fails ends with that error without a step (it ran without a mask before)."""
    import torch

    class FakeGrammars:
        def allocate(self, rows):
            return torch.zeros(rows, 2, dtype=torch.int32)

        def fill(self, matchers, masks):
            if matchers[0] == "broken":
                raise RuntimeError("the grammar's mask could not be computed")
            masks[0, 0] = 7

    runner = FakeRunner()
    s = scheduler(runner)
    s.state.grammars = FakeGrammars()
    b = batch(3)
    for i, matcher in ((1, "broken"), (2, "fine")):
        b.reqs[i].matcher = matcher
    for seq in b.seqs:
        seq.sample, seq.allowed = True, None
    out = await s._isolate(b, RuntimeError("fill failed"))
    assert runner.calls == [[0], [2]]  # the broken one never stepped
    assert out.token_ids == [0, None, 2] and set(s.state.aborted) == {"r1#0.0"}
    assert "mask could not be computed" in s.state.aborted["r1#0.0"].message
    assert b.seqs[0].allowed is None and int(b.seqs[2].allowed[0]) == 7


def test_the_runner_refuses_to_sample_nan_logits():
    import torch

    from models.errors import NonFiniteLogits
    from models.loading import tiny_model
    from models.runner import ModelRunner, SeqInput

    runner = ModelRunner(tiny_model(), dtype=torch.float32)
    pages = [runner.kv.allocate(1), runner.kv.allocate(1)]
    logits = runner.model.logits

    def nan_in_row_1(hidden, **options):
        out = logits(hidden, **options)
        out[1] = float("nan")
        return out

    runner.model.logits = nan_in_row_1
    with pytest.raises(NonFiniteLogits) as raised:
        runner.step([SeqInput([5], pages[0]), SeqInput([6], pages[1])])
    assert raised.value.rows == [1]


async def test_a_scheduler_answers_while_it_loads_and_serves_what_came_meanwhile_once_loaded(monkeypatch):
    """Issue 29 N12: the scheduler is bound before its model is in: it answers that it loads (its child
    reports ready only once loaded), and what comes to be scheduled meanwhile waits, in order."""
    import threading

    import numpy as np
    import trio

    from actors import ActorChild
    from actors.testing import open_harness
    from serving.managers import scheduler as scheduler_module
    from serving.managers.messages import (
        AbortReq, AbortWhere, BatchTokenIDOut, GenerateReq, HealthProbe, SamplingParams, ServerInfo, ServerInfoReq,
        UpdateWeightsReq, WeightsResult)

    release = threading.Event()
    real_build = scheduler_module.build_runner

    def slow_build(config):
        release.wait(60.0)  # (the load: as long as the test holds it)
        return real_build(config)

    monkeypatch.setattr(scheduler_module, "build_runner", slow_build)
    config = SchedulerConfig(model="tiny", detokenizer="inproc://detok", device="cpu")
    greedy = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    async with open_harness() as h, trio.open_nursery() as nursery:
        out = await h.probe("inproc://detok", BatchTokenIDOut)
        child = ActorChild(lambda: Scheduler(config), "inproc://sched", h.hub)
        ready = trio.Event()

        async def run() -> None:
            await nursery.start(child.run)
            ready.set()

        nursery.start_soon(run)
        with trio.fail_after(30):
            await child.bound.wait()
        info = await h.call("inproc://sched", ServerInfoReq(), timeout=5.0)
        assert isinstance(info, ServerInfo) and info.loading and info.max_context_len == 0
        assert await h.call("inproc://sched", HealthProbe(), timeout=5.0) is True
        update = await h.call("inproc://sched", UpdateWeightsReq("tiny"), timeout=5.0)
        assert isinstance(update, WeightsResult) and not update.success and update.status == 503
        for rid in ("a#0.0", "b#0.0", "c#0.0"):
            await h.send("inproc://sched", GenerateReq(rid, np.asarray([5, 6, 7], dtype=np.int32), greedy))
        await h.send("inproc://sched", AbortReq("b#0.0", "the client left"))
        assert await h.call("inproc://sched", AbortWhere(rid="c", worker=None, message="moved"), timeout=5.0) == 0
        assert (await h.call("inproc://sched", ServerInfoReq(), timeout=5.0)).waiting == 2  # a and b (c dropped)
        assert not ready.is_set()
        release.set()
        with trio.fail_after(60):
            await ready.wait()
            ended: dict[str, object] = {}
            while "a#0.0" not in ended or "b#0.0" not in ended:
                batch = await out.expect(BatchTokenIDOut, timeout=30.0)
                ended.update((rid, f) for rid, f in zip(batch.rids, batch.finished) if f is not None)
        assert ended["a#0.0"].type == "length" and ended["b#0.0"].type == "abort" and "c#0.0" not in ended
        info = await h.call("inproc://sched", ServerInfoReq(), timeout=5.0)
        assert not info.loading and info.max_context_len > 0
        nursery.cancel_scope.cancel()


def test_nan_rows_finds_every_nan_and_only_nans():
    """The runner's NaN check sums each row first: a row with +inf beside -inf sums to NaN but holds no
    NaN (it is sampled as before), and a NaN anywhere in a row is found."""
    import torch

    from models.runner import nan_rows

    logits = torch.randn(6, 1000)
    logits[1, 999] = float("nan")
    logits[2, 0], logits[2, 500] = float("inf"), float("-inf")  # sums to NaN, no NaN
    logits[3, 7] = float("inf")
    logits[4, 3], logits[4, 4], logits[4, 5] = float("inf"), float("-inf"), float("nan")
    logits[5] = 3e38  # the sum overflows to inf: no NaN
    assert nan_rows(logits).tolist() == [False, True, False, False, True, False]
    assert nan_rows(torch.randn(3, 10)).tolist() == [False] * 3


def test_the_samplers_logsumexp_finds_every_nan_row_for_the_check():
    """On CPU the runner takes the suspects from the sampler's argmax/logsumexp pass instead of a sum:
    every NaN row must be among the rows whose logsumexp is NaN (NaN at any lane or in the tail, a row
    all NaN), and the check then keeps only the true ones (infinities of either sign, a row all -inf)."""
    import torch

    from models import cpu_kernels
    from models.runner import nan_rows

    if not cpu_kernels.load():
        pytest.skip("the CPU kernels do not build here: the runner sums the rows instead")
    logits = torch.randn(9, 1003)  # 1003: a tail past the vector lanes
    logits[1, 999] = float("nan")  # in the tail
    logits[2, 0], logits[2, 500] = float("inf"), float("-inf")
    logits[3, 7] = float("inf")
    logits[4, 3], logits[4, 4], logits[4, 5] = float("inf"), float("-inf"), float("nan")
    logits[5] = float("-inf")
    logits[6] = float("nan")
    logits[7, 16] = float("nan")  # a vector lane
    logits[8] = 3e38
    best, lse = cpu_kernels.argmax_logsumexp(logits)
    suspect = torch.isnan(lse)
    truth = torch.isnan(logits).any(dim=-1)
    assert bool((suspect | ~truth).all())  # every NaN row is a suspect
    assert nan_rows(logits, suspect).tolist() == truth.tolist() == [False, True, False, False, True, False, True,
                                                                     True, False]
