"""A crash resume as the runner sees it: a restarted runner's first steps re-prefill the resumed
streams (prompt + the tokens they had generated), beside one another, chunked, and interleaved
with streams that decode again. Every logits row of every stream must be bitwise what plain
decoding gave (issue 28: the bf16 three-kills test diverged when the resumes went out that way).

What broke it: the rotary tables came from torch's `cos` / `sin`, which on CPU run through MKL's
VML in chunks of 2,048 elements per thread, and a process's first threaded call can give one
thread's chunk other bits. `mkl_first_call` fakes that call (the second thread's half of any
call past 2,048 elements at another accuracy): with it the tables must not change, since the
model takes them from `models.rotary`, a function of the position alone.
"""

import random

import pytest
import torch

from models.loading import tiny_config, tiny_model
from models.rotary import MIN_POSITIONS, RotaryTable, rotary_rows
from models.runner import ModelRunner, SeqInput

DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")]
VML_CHUNK = 2048  # elements per thread of torch's VML-backed unary ops (ATen's IMPLEMENT_FLOAT_KERNEL)
VML_OPS = ("cos", "sin", "exp", "tanh", "sqrt", "log")  # some of them (ATen's vml.h): the fused path takes none


@pytest.fixture
def mkl_first_call(monkeypatch):
    """torch's cos and sin as MKL's VML gave them in a scheduler's first threaded call (seen on the
    2-core AVX512-BF16 Xeon in about one process in five, ~5e-5 relative): past VML_CHUNK elements,
    the second thread's half of the result at another accuracy; the other VML_OPS faked alike."""
    def as_first_call(original):
        def op(x, *args, **kwargs):
            out = original(x, *args, **kwargs)
            if out.dtype == torch.float32 and out.numel() > VML_CHUNK and out.is_contiguous():
                second = out.view(-1)[(out.numel() + 1) // 2 :]
                second.copy_(torch.round(second * 2**14) / 2**14)
            return out
        return op

    for name in VML_OPS:
        monkeypatch.setattr(torch, name, as_first_call(getattr(torch, name)))
        monkeypatch.setattr(torch.Tensor, name, as_first_call(getattr(torch.Tensor, name)))


def test_the_fake_first_call_does_change_torchs_cos(mkl_first_call):
    """The control: the faked call gives a row other bits by the size of the call."""
    angles = torch.arange(200, dtype=torch.float32)[:, None] * torch.linspace(0.01, 1.0, 64)
    assert not torch.equal(angles.cos()[150], angles[150:151].cos()[0])


def decoded(model, dtype, prompts, steps):
    """Each prompt prefilled alone, then the streams decoded together: per stream, its tokens
    (prompt + generated) and the logits row after each of them."""
    runner = ModelRunner(model, dtype=dtype, kv_budget_bytes=8 << 20)
    tokens = [list(p) for p in prompts]
    rows = [[] for _ in prompts]
    pages = [runner.kv.allocate(len(p) + steps) for p in prompts]
    for i, p in enumerate(prompts):
        rows[i].extend(runner.logits([SeqInput(p, pages[i], 0, False)], [0])[0])
        tokens[i].append(int(rows[i][-1].argmax()))
    for _ in range(steps - 1):
        seqs = [SeqInput(t[-1:], pages[i], len(t) - 1, False) for i, t in enumerate(tokens)]
        for i, out in enumerate(runner.logits(seqs, range(len(seqs)))):
            rows[i].append(out[0])
            tokens[i].append(int(out[0].argmax()))
    return tokens, rows


class Restarted:
    """A fresh runner (the restarted scheduler's) and each resumed stream's progress in it."""

    def __init__(self, model, dtype, tokens, rows) -> None:
        self.runner = ModelRunner(model, dtype=dtype, kv_budget_bytes=8 << 20)
        self.tokens, self.rows = tokens, rows
        self.pages = [self.runner.kv.allocate(len(t)) for t in tokens]
        self.done = [0] * len(tokens)  # tokens whose K/V this runner has
        self.differ: list[tuple[int, int]] = []  # (stream, position) whose logits differ

    def step(self, work: dict[int, int]) -> None:
        """One step: stream i computes its next work[i] tokens (1 after its re-prefill: a decode row)."""
        order = list(work)
        seqs = [SeqInput(self.tokens[i][self.done[i] : self.done[i] + work[i]], self.pages[i], self.done[i], False)
                for i in order]
        for i, out in zip(order, self.runner.logits(seqs, range(len(seqs)))):
            for j, row in enumerate(out):
                if not torch.equal(row, self.rows[i][self.done[i] + j]):
                    self.differ.append((i, self.done[i] + j))
            self.done[i] += work[i]


def resume_schedule(rnd, lengths, resumed_at):
    """Steps as a restarted scheduler sends them: 4 streams re-prefilled whole in its first
    step, the others arriving in later steps in chunks (7, 16 or whole) beside the first half's
    decode rows; each stream then decodes to its end."""
    n = len(lengths)
    first = rnd.sample(range(n), 4)
    chunks = {i: rnd.choice([7, 16, None]) for i in range(n) if i not in first}
    arrives = {i: rnd.randrange(1, 3) for i in chunks}
    done = [0] * n
    steps = []
    while any(d < length for d, length in zip(done, lengths)):
        k = len(steps)
        work = {}
        for i in range(n):
            if done[i] >= lengths[i] or (i in arrives and k < arrives[i]):
                continue
            if done[i] < resumed_at[i]:  # re-prefilling
                size = resumed_at[i] - done[i] if i in first else chunks[i] or resumed_at[i]
                work[i] = min(size, resumed_at[i] - done[i])
            else:
                work[i] = 1
        if work:
            keys = list(work)
            rnd.shuffle(keys)
            steps.append({i: work[i] for i in keys})
            for i, size in work.items():
                done[i] += size
        else:
            steps.append({})
    return [s for s in steps if s]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fake", [False, True], ids=["torch", "mkl-first-call"])
def test_a_restarted_runners_resume_steps_give_the_decoded_logits(tiny_llama, dtype, fake, request):
    """6 streams decoded 24 tokens; a fresh runner resumes each after 4-20 of them in three seeded
    schedules (a first step of 150-300 rows, then chunked resumes beside decode rows)."""
    if fake:
        request.getfixturevalue("mkl_first_call")
    assert_resumes_give_the_decoded_logits(tiny_llama, dtype, schedules=3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_unfused_layers_resume_steps_too(mkl_first_call, dtype):
    """Qwen3's q/k norms take the unfused layer path (torch ops around the kernels): its silu too
    must not come from torch's VML-backed exp."""
    model = tiny_model(tiny_config("qwen3", head_dim=16), seed=1)
    assert not ModelRunner(model, dtype=dtype, kv_budget_bytes=1 << 20).model.llama_layers
    assert_resumes_give_the_decoded_logits(model, dtype, schedules=1)


def assert_resumes_give_the_decoded_logits(model, dtype, schedules: int) -> None:
    rnd = random.Random(28)
    prompts = [[rnd.randrange(3, 49000) for _ in range(rnd.randrange(30, 60))] for _ in range(6)]
    steps = 24
    tokens, rows = decoded(model, dtype, prompts, steps)
    for _ in range(schedules):
        resumed_at = [len(p) + rnd.randrange(4, 21) for p in prompts]
        restarted = Restarted(model, dtype, [t[:-1] for t in tokens], rows)
        for work in resume_schedule(rnd, [len(t) - 1 for t in tokens], resumed_at):
            restarted.step(work)
        assert restarted.differ == [], f"logits differ at (stream, position) {restarted.differ[:8]}"


def test_a_rotary_row_is_a_function_of_its_position_alone(mkl_first_call):
    """A position's row is the same fetched alone or among many, from a fresh or a grown table,
    with torch's cos faked as its first threaded call; and within one fp32 rounding of torch's."""
    inv_freq = 1.0 / 100000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)
    table = RotaryTable(inv_freq, 1.0, torch.bfloat16, "cpu")
    many = torch.arange(2 * MIN_POSITIONS + 5)  # grows the table
    cos, sin = table.at(many)
    fresh = RotaryTable(inv_freq, 1.0, torch.bfloat16, "cpu")
    for p in (0, 1, 5, MIN_POSITIONS - 1, MIN_POSITIONS, 2 * MIN_POSITIONS + 4):
        alone = fresh.at(torch.tensor([p]))
        assert torch.equal(alone[0][0], cos[p]) and torch.equal(alone[1][0], sin[p])
    angles = many[:, None].float() * inv_freq  # as the model computed them before: the same fp32 angles
    ours_cos, ours_sin = rotary_rows(range(len(many)), inv_freq)
    assert torch.allclose(ours_cos[:, 0, :32], angles.double().cos().float(), rtol=0, atol=2 ** -23)
    assert torch.allclose(ours_sin[:, 0, :32], angles.double().sin().float(), rtol=0, atol=2 ** -23)
