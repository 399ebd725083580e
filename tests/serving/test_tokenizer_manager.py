"""The TokenizerManager alone, its downstream a recording fake (the unit, isolated):
what a resume sends, and what it must not."""

import pytest
import trio
import trio.testing

from actors import CallError
from serving.managers.messages import AbortReq, GenerateReq, SamplingParams
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

    async def call(self, address, msg, timeout):
        raise CallError("no scheduler here")


def manager(tokenizer, ctx):
    tm = TokenizerManager(tokenizer, scheduler="inproc://scheduler")
    tm.ctx = ctx
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
    assert [(m.rid, m.replaces) for m in ctx.sent] == [
        (f"{first}#0.0", None), (f"{first}#0.1", f"{first}#0.0"), (f"{second}#0.0", None), (f"{third}#0.0", None)]


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
