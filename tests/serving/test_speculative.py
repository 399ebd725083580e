"""Speculative decoding (n-gram drafts, serving/managers/speculative.py): the drafts, and that a
request's tokens, logprobs, finish reason and streamed pieces with drafts verified are exactly those
of plain decoding, its KV pages all come back and the prefix cache holds only accepted tokens."""

import json
import random

import msgspec
import numpy as np
import pytest
import torch

from models.runner import ModelRunner
from serving.managers.batching import BatchState, Limits
from serving.managers.messages import FinishReason, GenerateReq, SamplingParams
from serving.managers.radix_cache import RadixCache
from serving.managers.speculative import MAX_COOLDOWN, Drafter, SpeculativeConfig, propose

# (sampled requests draft beside others here too: their verification is what the bitwise tests check)
NGRAM = SpeculativeConfig("ngram", num_draft=4, max_ngram=3, min_ngram=1, max_batch=8, max_batch_sampled=8)
GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.95, top_k=40, seed=7, ignore_eos=True)
PENALISED = SamplingParams(max_new_tokens=24, temperature=0.7, seed=3, repetition_penalty=1.3,
                           frequency_penalty=0.4, presence_penalty=0.2, ignore_eos=True)


# -- drafting -------------------------------------------------------------------------------

def draft(tokens, k=4, hi=3, lo=1):
    return propose(np.asarray(tokens), num_draft=k, max_ngram=hi, min_ngram=lo)


def test_the_tokens_after_the_longest_earlier_match_are_proposed():
    assert draft([5, 6, 7, 8, 9, 1, 2, 6, 7]) == [8, 9, 1, 2]  # [6, 7] seen before: what followed it
    assert draft([5, 6, 7, 8, 9, 1, 2, 6, 7], k=2) == [8, 9]
    assert draft([1, 2, 3, 4, 9, 3, 5, 2, 3]) == [4, 9, 3, 5]  # "2 3" (2 tokens) beats the later "3"
    assert draft([1, 2, 3, 4, 9, 3, 5, 3]) == [5, 3]  # the most recent of equal matches; ends at the end
    assert draft([1, 2, 3, 4, 5]) == []  # nothing repeats
    assert draft([3, 4, 5, 3], lo=2) == []  # a one-token match is too short here
    assert draft([3, 4, 5, 3], lo=1) == [4, 5, 3]
    assert draft([7]) == [] and draft([]) == []
    assert draft([7, 7, 7, 7]) == [7]  # the match ending just before the suffix: one token follows it


def test_a_longer_ngram_than_the_sequence_is_fine():
    assert draft([1, 2, 1, 2], hi=8) == [1, 2]
    assert draft([9, 1, 2, 1, 2], hi=8, lo=2) == [1, 2]


def test_the_drafter_follows_a_growing_sequence_and_backs_off_after_misses():
    d = Drafter(NGRAM)
    tokens = list(range(300)) + [10, 11]  # grows past the first buffer
    assert d.draft(tokens, 8) == [12, 13, 14, 15]
    assert d.draft(tokens, 2) == [12, 13]
    tokens += [12]
    assert d.draft(tokens, 8) == [13, 14, 15, 16]
    waits = []
    for _ in range(8):  # misses: 1, 2, 4, 8, 16, 16 ... steps without a draft
        d.verified(4, 0)
        n = 0
        while not d.draft(tokens, 8):
            n += 1
        waits.append(n)
    assert waits == [1, 2, 4, 8, 16, 16, 16, 16] and MAX_COOLDOWN == 16
    assert d.draft(tokens, 8) == [13]  # after a miss: one token
    d.verified(1, 1)  # accepted whole: num_draft again
    assert d.draft(tokens, 8) == [13, 14, 15, 16]
    d.verified(4, 2)  # accepted up to its third token: three
    assert d.draft(tokens, 8) == [13, 14, 15]
    assert (d.proposed, d.accepted) == (37, 3)
    d.verified(3, 1)  # less than half held (a sampled request's drafts): two tokens, after a wait
    assert d.draft(tokens, 8) == [] and d.draft(tokens, 8) == [13, 14]


@pytest.mark.parametrize("field, value, named", [
    ("method", "eagle", "speculative:"), ("num_draft", 0, "speculative_num_draft"),
    ("num_draft", 17, "speculative_num_draft"), ("min_ngram", 4, "speculative_min_ngram"),
    ("max_batch", 0, "speculative_max_batch"), ("max_batch_sampled", -1, "speculative_max_batch_sampled"),
])
def test_a_bad_config_is_refused_naming_the_field(field, value, named):
    with pytest.raises(ValueError, match=named):
        SpeculativeConfig(**{"method": "ngram", field: value})


@pytest.mark.parametrize("text, named", [
    ("speculative: eagle", "scheduler.speculative: Invalid enum value 'eagle'"),
    ("speculative_num_draft: 0", "scheduler.speculative_num_draft: must be in 1..16"),
    ("speculative_num_draft: 17", "scheduler.speculative_num_draft: must be in 1..16"),
    ("speculative_max_ngram: 9", "scheduler.speculative_max_ngram: must be in 1..8"),
    ("speculative_min_ngram: 4", "scheduler.speculative_min_ngram: must be in 1..scheduler.speculative_max_ngram"),
    ("speculative_max_batch: 0", "scheduler.speculative_max_batch: must be >= 1"),
    ("speculative_max_batch_sampled: -1", "scheduler.speculative_max_batch_sampled: must be >= 0"),
])
def test_a_bad_topology_value_is_refused_naming_the_field(tmp_path, text, named):
    from serving.runtime.topology import TopologyError, load_topology

    path = tmp_path / "t.yaml"
    path.write_text(f"scheduler:\n  {text}\n")
    with pytest.raises(TopologyError, match=named):
        load_topology(path)


def test_the_flags_reach_the_topology():
    from serving.cli import parser, topology_from
    from serving.managers.scheduler import speculative_config
    from serving.runtime.specs import scheduler_config

    args = parser().parse_args(["serve", "--speculative", "ngram", "--speculative-num-draft", "6",
                                "--speculative-max-ngram", "4", "--speculative-min-ngram", "1",
                                "--speculative-max-batch", "2", "--speculative-max-batch-sampled", "2"])
    s = topology_from(args).scheduler
    assert (s.speculative, s.speculative_num_draft, s.speculative_max_ngram, s.speculative_min_ngram,
            s.speculative_max_batch, s.speculative_max_batch_sampled) == ("ngram", 6, 4, 1, 2, 2)
    default = topology_from(parser().parse_args(["serve"])).scheduler
    assert (default.speculative, default.speculative_max_batch, default.speculative_max_batch_sampled) == (
        "ngram", 4, 0)
    config = scheduler_config(topology_from(args), "inproc://d")
    assert speculative_config(config, deterministic=True) == SpeculativeConfig("ngram", 6, 4, 1, 2, 2)
    # without deterministic inference a verified draft could change the text: none
    assert speculative_config(config, deterministic=False) == SpeculativeConfig()


# -- through the scheduler's state, with the tiny model ------------------------------------------

class Oracle:
    """A drafter that knows the plain output (``truth``, the tokens after the prompt) and proposes it,
    with the token at each output index in ``wrong`` changed; ``ignore_limit`` proposes past what the
    request may still emit (the stop checks must cut it)."""

    def __init__(self, num_prompt, truth, wrong=(), k=4, ignore_limit=False):
        self.num_prompt, self.truth, self.wrong, self.k, self.ignore_limit = num_prompt, truth, set(wrong), k, ignore_limit
        self.proposed = self.accepted = 0

    def draft(self, tokens, limit):
        g = len(tokens) - self.num_prompt  # the next draw is truth[g]
        n = self.k if self.ignore_limit else min(self.k, limit)
        out = [t if g + j not in self.wrong else (t + 1) % 1000 for j, t in enumerate(self.truth[g : g + n])]
        return out + [5] * (n - len(out)) if self.ignore_limit else out

    def verified(self, proposed, accepted):
        self.proposed += proposed
        self.accepted += accepted


def make_runner(loaded, dtype=torch.float32, page_size=1):
    return ModelRunner(loaded, dtype=dtype, page_size=page_size, kv_budget_bytes=64 << 20)


def make_state(runner, speculative=None, eos=None, **limits):
    cache = RadixCache(runner.kv.free, page_size=runner.kv.page_size)
    return BatchState(runner.kv, cache, runner.eos_token_ids if eos is None else eos, Limits(**limits),
                      speculative=speculative)


def run(state, runner, reqs, drafters=None, clean=True):
    """Drain ``state`` of ``reqs``; per rid: ids, logprobs, top logprobs, finish, completion tokens, pieces.
    ``clean``: then empty the prefix cache and check that the pool has every page back."""
    for r in reqs:
        assert state.add(r) is None
    for rid, drafter in (drafters or {}).items():
        state.by_rid[rid].drafter = drafter
    out = {}
    for n in range(10_000):
        if state.idle:
            if clean:
                assert_clean(state)
            return out
        batch = state.schedule()
        for o in state.postprocess(batch, runner.step(batch.seqs)):
            e = out.setdefault(o.req.rid, {"ids": [], "logprobs": [], "top": [], "pieces": []})
            e["ids"] += o.new_ids
            e["logprobs"] += o.logprobs
            e["top"] += o.top_logprobs
            e["pieces"].append(len(o.new_ids))
            e["finished"], e["completion"] = o.req.finished, o.req.num_generated
    raise AssertionError("did not finish")


def req(rid, ids, sampling=GREEDY, logprobs=True):
    return GenerateReq(rid, np.asarray(ids, dtype=np.int32), sampling, return_logprob=logprobs,
                       top_logprobs_num=3 if logprobs else 0)


def prompts(n, seed=0, lengths=(4, 40)):
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def without_pieces(results):
    return {rid: {k: v for k, v in e.items() if k != "pieces"} for rid, e in results.items()}


def assert_clean(state):
    state.cache.reset()
    assert state.kv.num_free == state.kv.num_pages


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def runner(request, tiny_loaded):
    return make_runner(tiny_loaded, getattr(torch, request.param))


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED, PENALISED], ids=["greedy", "seeded", "penalties"])
def test_verified_drafts_give_plain_decoding_bitwise(runner, sampling):
    """Six requests together: random prompts (the n-gram drafts miss) and repeating ones, and three with
    oracle drafts that are partly wrong (accepted up to the first wrong token, the rest rejected)."""
    ps = prompts(4, seed=1) + [p * 3 for p in prompts(2, seed=2, lengths=(3, 6))]
    plain = run(make_state(runner), runner, [req(f"r{i}", p, sampling) for i, p in enumerate(ps)])
    assert_all = without_pieces(plain)
    spec = make_state(runner, NGRAM)
    oracles = {f"r{i}": Oracle(len(ps[i]), plain[f"r{i}"]["ids"], wrong=wrong)
               for i, wrong in ((0, ()), (1, (3, 4, 11)), (4, (2, 9, 10, 15, 19)))}
    got = run(spec, runner, [req(f"r{i}", p, sampling) for i, p in enumerate(ps)], oracles)
    assert without_pieces(got) == assert_all
    assert oracles["r0"].accepted == oracles["r0"].proposed > 0
    assert 0 < oracles["r4"].accepted < oracles["r4"].proposed
    assert max(got["r0"]["pieces"]) > 1  # several tokens a step
    assert spec.draft_tokens > 0


@pytest.mark.parametrize("case", ["stop_token", "eos", "max_new_tokens", "context", "stop_token_limitless"])
def test_a_stop_inside_an_accepted_draft_ends_it_as_plain_decoding(runner, case):
    p = prompts(1, seed=5)[0]
    truth = run(make_state(runner), runner, [req("a", p, GREEDY)])["a"]["ids"]
    at = next(i for i in range(5, len(truth)) if truth[i] not in truth[:i])  # its first occurrence
    sampling, eos, limits = GREEDY, None, {}
    if case.startswith("stop_token"):
        sampling = SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=[truth[at]], ignore_eos=True)
    elif case == "eos":
        sampling = SamplingParams(max_new_tokens=24, temperature=0.0, min_new_tokens=2)
        eos = frozenset({truth[at]})
    elif case == "max_new_tokens":
        sampling = SamplingParams(max_new_tokens=at + 1, temperature=0.0, ignore_eos=True)
    else:
        limits = {"max_context_len": len(p) + at + 1}
    plain = run(make_state(runner, eos=eos, **limits), runner, [req("a", p, sampling)])["a"]
    assert len(plain["ids"]) == at + 1
    state = make_state(runner, NGRAM, eos=eos, **limits)
    oracle = Oracle(len(p), truth, k=6, ignore_limit=case in ("max_new_tokens", "stop_token_limitless"))
    got = run(state, runner, [req("a", p, sampling)], {"a": oracle}, clean=False)["a"]
    assert without_pieces({"a": got}) == without_pieces({"a": plain})
    assert got["finished"] == plain["finished"] and got["completion"] == at + 1
    assert oracle.accepted > 0 and len(got["pieces"]) < len(plain["pieces"])
    # the prefix cache holds the prompt and every token kept but the last (its K/V never computed), no more
    assert state.cache.cached_pages == len(p) + at
    assert state.cache.match_prefix(p + got["ids"] + [0]).num_tokens == len(p) + at
    assert_clean(state)


def test_rejected_positions_never_reach_the_prefix_cache(tiny_loaded):
    """Every draft wrong after its first token, pages of 4 tokens: the cache ends up with the whole pages
    of prompt + output (accepted tokens only) and the pool gets every page back."""
    runner = make_runner(tiny_loaded, page_size=4)
    p = prompts(1, seed=6, lengths=(13, 13))[0]
    truth = run(make_state(runner), runner, [req("a", p)])["a"]["ids"]
    state = make_state(runner, NGRAM)
    oracle = Oracle(len(p), truth, wrong=range(1, 24, 2), k=4)
    got = run(state, runner, [req("a", p)], {"a": oracle}, clean=False)["a"]
    assert got["ids"] == truth and 0 < oracle.accepted < oracle.proposed
    kept = p + truth[:-1]
    assert state.cache.cached_pages == len(kept) // 4
    assert state.cache.match_prefix(kept + [0]).num_tokens == len(kept) // 4 * 4
    assert_clean(state)


def test_an_abort_while_a_draft_runs_gives_every_page_back(runner):
    ps = prompts(2, seed=8)
    long = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    truths = run(make_state(runner), runner, [req(f"r{i}", p, long) for i, p in enumerate(ps)])
    state = make_state(runner, NGRAM)
    for i, p in enumerate(ps):
        state.add(req(f"r{i}", p, long))
        state.by_rid[f"r{i}"].drafter = Oracle(len(p), truths[f"r{i}"]["ids"])
    got = {"r0": [], "r1": []}
    for step in range(100):
        if state.idle:
            break
        batch = state.schedule()
        sampled = runner.step(batch.seqs)
        if step == 4:
            assert any(s.num_draft for s in batch.seqs)
            assert state.abort("r0", FinishReason("abort", message="bye")) is not None
        for o in state.postprocess(batch, sampled):
            got[o.req.rid] += o.new_ids
    assert got["r1"] == truths["r1"]["ids"]
    assert got["r0"] == truths["r0"]["ids"][: len(got["r0"])] and len(got["r0"]) < 40
    assert_clean(state)


def test_no_drafts_while_a_big_batch_runs_nor_for_a_single_token_left(runner):
    ps = [p * 3 for p in prompts(3, seed=9, lengths=(3, 5))]
    state = make_state(runner, SpeculativeConfig("ngram", min_ngram=1, max_batch=2))
    for i, p in enumerate(ps):
        state.add(req(f"r{i}", p))
    for _ in range(6):
        batch = state.schedule()
        assert not any(s.num_draft for s in batch.seqs)  # three run, two may draft
        state.postprocess(batch, runner.step(batch.seqs))
    one = make_state(runner, NGRAM)
    one.add(req("a", ps[0], SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)))
    batch = one.schedule()
    assert batch.seqs[0].num_draft == 0
    one.postprocess(batch, runner.step(batch.seqs))
    assert one.idle
    for rid in list(state.by_rid):
        state.abort(rid, FinishReason("abort"))
    one.cache.reset()
    assert_clean(state)


class Always:
    """A drafter that always proposes two tokens (they are verified, and mostly rejected)."""

    def draft(self, tokens, limit):
        return [5, 6][: max(limit, 0)]

    def verified(self, proposed, accepted):
        pass


def test_a_sampled_request_drafts_only_while_it_runs_alone_and_a_greedy_one_beside_others(runner):
    state = make_state(runner, SpeculativeConfig("ngram", max_batch_sampled=1))
    ps = prompts(2, seed=9)
    state.add(req("greedy", ps[0]))
    state.add(req("sampled", ps[1], msgspec.structs.replace(SEEDED, max_new_tokens=48)))
    for r in state.by_rid.values():
        r.drafter = Always()
    drafted = {"greedy": 0, "sampled": 0}
    while "greedy" in state.by_rid:  # together: the greedy one drafts, the sampled one does not
        batch = state.schedule()
        for r, seq in zip(batch.reqs, batch.seqs, strict=True):
            drafted[r.rid] += seq.num_draft
        state.postprocess(batch, runner.step(batch.seqs))
    assert drafted["greedy"] > 0 and drafted["sampled"] == 0
    while not state.idle:  # alone, it drafts
        batch = state.schedule()
        drafted["sampled"] += sum(s.num_draft for s in batch.seqs)
        state.postprocess(batch, runner.step(batch.seqs))
    assert drafted["sampled"] > 0
    assert_clean(state)
    by_default = make_state(runner, SpeculativeConfig("ngram"))  # max_batch_sampled 0: a sampled request never drafts
    by_default.add(req("alone", ps[1], SEEDED))
    by_default.by_rid["alone"].drafter = Always()
    while not by_default.idle:
        batch = by_default.schedule()
        assert not any(s.num_draft for s in batch.seqs)
        by_default.postprocess(batch, runner.step(batch.seqs))
    assert_clean(by_default)


def test_stream_interval_with_several_tokens_a_step_sends_what_plain_decoding_sends(runner):
    p = prompts(1, seed=10)[0]
    truth = run(make_state(runner), runner, [req("a", p)])["a"]["ids"]
    plain = run(make_state(runner, stream_interval=3), runner, [req("a", p)])["a"]
    state = make_state(runner, NGRAM, stream_interval=3)
    got = run(state, runner, [req("a", p)], {"a": Oracle(len(p), truth, wrong=(7,), k=5)})["a"]
    assert without_pieces({"a": got}) == without_pieces({"a": plain})
    assert got["pieces"][0] == 1  # the first token at once
    assert len(got["pieces"]) < len(plain["pieces"])


def test_nan_logits_past_a_draft_token_reject_the_draft_there_and_before_it_end_the_request(
        tiny_loaded, monkeypatch):
    from models.errors import NonFiniteLogits
    from models.runner import SeqInput

    runner = make_runner(tiny_loaded)
    real = runner.model.logits
    poisoned = []

    def logits(hidden, **options):
        out = real(hidden, **options)
        for row in poisoned:
            out[row] = float("nan")
        return out

    monkeypatch.setattr(runner.model, "logits", logits)
    pages = runner.kv.allocate(16)
    seq = lambda: SeqInput([5, 6, 7, 8, 9], pages, 0, num_draft=3)  # noqa: E731 - draws after 6, 7, 8, 9
    clean = runner.step([seq()])
    poisoned[:] = [3]  # after the draft's third token: two draws stand
    cut = runner.step([seq()])
    assert cut.token_ids == clean.token_ids and cut.drafts[0].token_ids == clean.drafts[0].token_ids[:2]
    poisoned[:] = [0]  # where plain decoding draws: the request's own error
    with pytest.raises(NonFiniteLogits):
        runner.step([seq()])
    runner.kv.free(pages)


async def test_a_step_split_for_a_request_on_probation_keeps_the_others_draws():
    """Scheduler._run with a request on probation: two model calls, and the draws after the drafts of the
    other call reach postprocess (a lost one would only count as a rejected draft, but a wasted one)."""
    from types import SimpleNamespace

    from models.runner import Draws, StepOutput
    from serving.managers.batching import Batch
    from serving.managers.scheduler import Scheduler, SchedulerConfig

    class Runner:
        def step(self, seqs):
            return StepOutput([s.n for s in seqs], [0.0] * len(seqs), [[]] * len(seqs),
                              [Draws([10 * s.n], [0.0], [[]]) if s.draft else None for s in seqs])

    s = Scheduler(SchedulerConfig(model="tiny"), runner=Runner())
    s.state = SimpleNamespace(constrained=lambda batch: [])
    reqs = [SimpleNamespace(rid=f"r{i}", alone=i == 1, matcher=None) for i in range(3)]
    out = await s._run(Batch(reqs, [SimpleNamespace(n=i, draft=i == 2) for i in range(3)]))
    assert out.token_ids == [0, 1, 2] and out.drafts[2].token_ids == [20] and out.drafts[0] is None


# -- SmolLM2, the embedded model ------------------------------------------------------------------

PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He wound the clockwork, "
           "trimmed the wick and polished the great lens until it shone. Ships passing the rocky point "
           "saw the beam sweep across the water, and their captains knew they were close to home.")


@pytest.fixture(scope="module")
def smollm2():
    from models.loading import load_model

    loaded = load_model(None)
    tokenizer = loaded.tokenizer

    def chat(question):
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                             add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False).input_ids

    return loaded, chat


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_with_drafts_gives_plain_decoding_bitwise(smollm2, dtype):
    """A passage to repeat and one to edit (the drafts hit), and random tokens (they miss), greedy and
    seeded-sampled, all together: the same tokens, logprobs and finish reasons as plain decoding."""
    loaded, chat = smollm2
    runner = ModelRunner(loaded, dtype=getattr(torch, dtype), kv_budget_bytes=64 << 20)
    repeat = chat(f"Repeat this passage word for word:\n\n{PASSAGE}")
    edit = chat(f"Rewrite this passage in the past perfect tense, changing nothing else:\n\n{PASSAGE}")
    noise = prompts(1, seed=11, lengths=(40, 40))[0]
    long = {"max_new_tokens": 64, "ignore_eos": False}
    reqs = lambda: [req("repeat", repeat, SamplingParams(temperature=0.0, **long)),  # noqa: E731
                    req("edit", edit, SamplingParams(temperature=0.0, **long)),
                    req("sampled", repeat, SamplingParams(temperature=0.7, top_p=0.9, seed=5, **long)),
                    req("noise", noise, SamplingParams(temperature=0.0, **long))]
    plain = run(make_state(runner), runner, reqs())
    state = make_state(runner, SpeculativeConfig("ngram"))
    got = run(state, runner, reqs())
    assert without_pieces(got) == without_pieces(plain)
    assert state.accepted_tokens > 32  # the passage repeats: most drafts hold
    assert max(got["repeat"]["pieces"]) > 1


# -- through real HTTP ----------------------------------------------------------------------------

async def test_through_http_the_text_is_plain_decoding(nursery, tiny_loaded, tokenizer):
    """A server with --speculative ngram: /generate streams and /v1/completions answer exactly the
    runner's own plain greedy tokens and logprobs, and /server_info counts the drafts verified."""
    import httpx

    from models.runner import generate

    from .test_http import start_server

    url, _ = await start_server(nursery, "single-process", **{"scheduler.speculative": "ngram",
                                                               "scheduler.speculative_min_ngram": 1})
    ids = [p * 4 for p in prompts(3, seed=12, lengths=(2, 4))]  # repeating prompts: drafts to verify
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        info = (await client.get("/server_info")).json()
        runner = ModelRunner(tiny_loaded, dtype=getattr(torch, info["scheduler"]["dtype"])
                             if info["scheduler"]["dtype"] != "auto" else None)
        greedy = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
        for p in ids:
            expected = generate(runner, [p], 24)[0]
            r = await client.post("/generate", json={"input_ids": p, "sampling_params": greedy,
                                                     "return_logprob": True, "stream": True})
            events = [json.loads(line[5:]) for line in r.text.splitlines()
                      if line.startswith("data:") and line[5:].strip() != "[DONE]"]
            assert events[-1]["output_ids"] == expected
            assert events[-1]["meta_info"]["completion_tokens"] == 24
            assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
            body = (await client.post("/v1/completions", json={
                "model": "tiny", "prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                "logprobs": 1})).json()
            assert body["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
            assert body["usage"]["completion_tokens"] == 24
        info = (await client.get("/server_info")).json()
    assert info["scheduler"]["speculative"] == "ngram"
    assert info["speculative_draft_tokens"] > 0
