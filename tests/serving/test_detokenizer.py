"""The DetokenizerManager and its IncrementalDecoder, on the real SmolLM2 tokenizer."""

from __future__ import annotations

import random

import pytest
import trio

from actors import ActorChild
from actors.testing import open_harness
from models.loading import load_tokenizer
from serving.managers.detokenizer import DetokenizerManager, IncrementalDecoder, batch_decode, detokenizer_child
from serving.managers.messages import BatchStrOut, BatchTokenIDOut, DecodeInit, FinishReason, StopStringHit

ENGLISH = "The quick brown fox jumps over the lazy dog, then naps in the sun."
CHINESE = "我们今天去公园散步，天气很好。"
EMOJI = "👍🏽🎉 done"
MIXED = "Hi 你好! 👋🏻 café naïve — “quotes” 天气很好 🎉🎉 ok."
TEXTS = [ENGLISH, CHINESE, EMOJI, MIXED]
LENGTH = FinishReason("length")

W0, W1, SCHED, DETOK = "inproc://tm-0", "inproc://tm-1", "inproc://scheduler", "inproc://detok"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def decoder(tok, *stop: str, **options) -> IncrementalDecoder:
    return IncrementalDecoder(DecodeInit("r", 0, list(stop), **options), tok)


def chunks(ids: list[int], rng: random.Random | None) -> list[list[int]]:
    """One id at a time, or random chunk sizes (1..5)."""
    out, i = [], 0
    while i < len(ids):
        n = 1 if rng is None else rng.randint(1, 5)
        out.append(ids[i:i + n])
        i += n
    return out


def stream(dec: IncrementalDecoder, pieces: list[list[int]], finished=LENGTH):
    """Push chunks until a stop string ends the request, else finish; the deltas."""
    deltas = []
    for piece in pieces:
        deltas.append(dec.push(piece))
        if dec.finished is not None:
            return deltas
    return [*deltas, dec.push([], finished)]


# -- streaming ---------------------------------------------------------------------


@pytest.mark.parametrize("seed", [None, 0, 1, 2, 3])
@pytest.mark.parametrize("text", TEXTS, ids=["english", "chinese", "emoji", "mixed"])
def test_streamed_text_equals_decode_and_ids_travel_with_text(tok, text, seed):
    ids = tok.encode(text)
    dec = decoder(tok)
    emitted_text, emitted_ids = "", []
    for piece in chunks(ids, None if seed is None else random.Random(seed)):
        delta = dec.push(piece)
        assert "\ufffd" not in delta.text
        emitted_text += delta.text
        emitted_ids += delta.ids
        assert tok.decode(emitted_ids) == emitted_text  # the ids-with-text invariant
        assert emitted_ids == ids[:len(emitted_ids)]
    last = dec.push([], LENGTH)
    assert last.finished == LENGTH and "\ufffd" not in last.text
    assert emitted_text + last.text == tok.decode(ids) == text
    assert emitted_ids + last.ids == ids


def test_cjk_streaming_emits_each_character_exactly_once(tok):
    """SGLang once re-sent half-printed CJK text: '我我们' for '我们'."""
    ids = tok.encode(CHINESE)
    deltas = stream(decoder(tok), chunks(ids, None))
    texts = [d.text for d in deltas if d.text]
    assert "".join(texts) == CHINESE
    assert all(len(t) == 1 for t in texts)  # one character per delta, none split or repeated
    assert [ch for t in texts for ch in t] == list(CHINESE)


def test_finish_flushes_an_incomplete_character(tok):
    ids = tok.encode(EMOJI)[:2]  # half of 👍
    dec = decoder(tok)
    assert dec.push(ids) .text == ""
    last = dec.push([], LENGTH)
    assert last.text == tok.decode(ids) and last.ids == ids


def test_decode_windows_stay_small(tok):
    """No re-decoding of the whole sequence per token: windows stay a few ids long."""
    longest = 0

    class Counting:
        def batch_decode(self, seqs, **options):
            nonlocal longest
            longest = max(longest, *map(len, seqs))
            return tok.batch_decode(seqs, **options)

    ids = tok.encode(" ".join([ENGLISH, MIXED] * 20))
    deltas = stream(IncrementalDecoder(DecodeInit("r", 0, []), Counting()), chunks(ids, None))
    assert "".join(d.text for d in deltas) == tok.decode(ids)
    assert longest <= 8 < len(ids)


# -- stop strings ------------------------------------------------------------------


def test_stop_string_spanning_tokens_is_trimmed_and_never_streamed(tok):
    ids = tok.encode("Hello world peace and more")  # Hello | world | peace | ...
    dec = decoder(tok, "lo wor")
    deltas = stream(dec, chunks(ids, None))
    assert "".join(d.text for d in deltas) == "Hel"
    assert deltas[-1].finished == FinishReason("stop", matched="lo wor")
    assert deltas[-1].stop_hit
    assert sum(d.finished is not None for d in deltas) == 1
    assert [i for d in deltas for i in d.ids] == ids[:2]  # the ids pushed, none lost


def test_stop_string_across_single_character_tokens(tok):
    ids = tok.encode("say STOP now")  # say | ST | OP | now
    deltas = stream(decoder(tok, "STOP"), chunks(ids, None))
    assert "".join(d.text for d in deltas) == "say "
    assert deltas[-1].finished.matched == "STOP"


def test_held_back_tail_is_released_when_it_is_not_a_stop(tok):
    ids = tok.encode("Hello world peace and more")
    dec = decoder(tok, "world war")
    hello, world, peace = (dec.push([i]) for i in ids[:3])
    assert (hello.text, hello.ids) == ("Hello", ids[:1])
    assert (world.text, world.ids) == ("", [])  # " world" may begin "world war"
    assert (peace.text, peace.ids) == (" world peace", ids[1:3])
    rest = stream(dec, chunks(ids[3:], None))
    assert "".join(d.text for d in [hello, world, peace, *rest]) == tok.decode(ids)
    assert rest[-1].finished == LENGTH and not rest[-1].stop_hit


def test_held_back_tail_is_flushed_at_finish(tok):
    ids = tok.encode("Hello world")
    deltas = stream(decoder(tok, "world war"), chunks(ids, None), finished=FinishReason("stop", matched=2))
    assert "".join(d.text for d in deltas) == "Hello world"
    assert deltas[-1].finished == FinishReason("stop", matched=2)


def test_no_stop_trim_keeps_the_stop_string(tok):
    ids = tok.encode("Hello world peace and more")
    deltas = stream(decoder(tok, "lo wor", no_stop_trim=True), chunks(ids, None))
    assert "".join(d.text for d in deltas) == "Hello wor"
    assert deltas[-1].finished.matched == "lo wor"


@pytest.mark.parametrize("seed", [None, 0, 1])
def test_the_earliest_stop_string_wins(tok, seed):
    ids = tok.encode("the dog and the cat")
    rng = None if seed is None else random.Random(seed)
    for pieces in (chunks(ids, rng), [ids]):
        deltas = stream(decoder(tok, "cat", "dog"), pieces)
        assert "".join(d.text for d in deltas) == "the "
        assert deltas[-1].finished == FinishReason("stop", matched="dog")


@pytest.mark.parametrize("text", TEXTS, ids=["english", "chinese", "emoji", "mixed"])
@pytest.mark.parametrize("seed", [None, 0, 1])
def test_streamed_stop_trim_equals_unstreamed(tok, text, seed):
    ids = tok.encode(text)
    stops = [text[len(text) // 2:len(text) // 2 + 3], "zzz"]
    whole = stream(decoder(tok, *stops), [ids])
    streamed = stream(decoder(tok, *stops), chunks(ids, None if seed is None else random.Random(seed)))
    assert "".join(d.text for d in streamed) == "".join(d.text for d in whole) == text[:len(text) // 2]
    assert streamed[-1].finished == whole[-1].finished == FinishReason("stop", matched=stops[0])
    assert all("\ufffd" not in d.text for d in streamed)


def test_a_stop_string_the_scheduler_already_finished_on_needs_no_hit(tok):
    ids = tok.encode("say STOP now")
    delta = decoder(tok, "STOP").push(ids, FinishReason("length"))
    assert delta.text == "say " and delta.finished.matched == "STOP" and not delta.stop_hit


def test_pushing_after_finish_is_an_error(tok):
    dec = decoder(tok)
    dec.push(tok.encode("hi"), LENGTH)
    with pytest.raises(RuntimeError, match="already finished"):
        dec.push([1])


# -- special tokens and resume -----------------------------------------------------


def test_skip_special_tokens_per_request(tok):
    ids = tok.encode("<|im_start|>assistant\nHi there<|im_end|>")
    skipped = stream(decoder(tok), chunks(ids, None))
    kept = stream(decoder(tok, skip_special_tokens=False), chunks(ids, None))
    assert "".join(d.text for d in skipped) == "assistant\nHi there"
    assert "".join(d.text for d in kept) == "<|im_start|>assistant\nHi there<|im_end|>"


def test_fast_tokenizer_ignores_spaces_between_special_tokens(tok):
    """Documented behaviour: only slow tokenizers put spaces around special tokens."""
    assert tok.is_fast
    ids = tok.encode("a<|im_start|>b<|im_end|>c")
    texts = {"".join(d.text for d in stream(
        decoder(tok, skip_special_tokens=False, spaces_between_special_tokens=spaces), [ids]))
        for spaces in (True, False)}
    assert texts == {"a<|im_start|>b<|im_end|>c"}


@pytest.mark.parametrize("text", TEXTS, ids=["english", "chinese", "emoji", "mixed"])
def test_resume_emits_only_new_text(tok, text):
    ids = tok.encode(text)
    # What a client received before the crash: the ids of some whole deltas.
    first = decoder(tok)
    received: list[int] = []
    for i in ids[:len(ids) // 2]:
        received += first.push([i]).ids
    resumed = IncrementalDecoder(DecodeInit("r", 0, [], prior_ids=received), tok)
    deltas = stream(resumed, chunks(ids[len(received):], None))
    assert tok.decode(received) + "".join(d.text for d in deltas) == text
    assert [i for d in deltas for i in d.ids] == ids[len(received):]
    assert all("\ufffd" not in d.text for d in deltas)


# -- the actor ---------------------------------------------------------------------


def batch(rows, inits=(), logprobs=False, boot="") -> BatchTokenIDOut:
    """rows: (rid, ids, finished)."""
    return BatchTokenIDOut(
        rids=[r[0] for r in rows],
        new_token_ids=[list(r[1]) for r in rows],
        finished=[r[2] for r in rows],
        prompt_tokens=[7] * len(rows),
        completion_tokens=[len(r[1]) for r in rows],
        cached_tokens=[3] * len(rows),
        inits=list(inits),
        logprobs=[[-float(i) for i in r[1]] for r in rows] if logprobs else None,
        boot=boot,
    )


async def start_detokenizer(h, tok):
    managers: list[DetokenizerManager] = []

    def make():
        managers.append(DetokenizerManager(tok, [W0, W1], SCHED))
        return managers[-1]

    sup = await h.start_actor("detok", make, DETOK)
    return sup, managers


def test_manager_batches_one_decode_per_step_per_options(tok):
    calls = []

    class Counting:
        def batch_decode(self, seqs, **options):
            calls.append(options["skip_special_tokens"])
            return tok.batch_decode(seqs, **options)

    manager = DetokenizerManager(Counting(), [W0, W1], SCHED)
    ids = tok.encode(MIXED)
    inits = [DecodeInit(f"r{i}", i % 2, [], skip_special_tokens=i < 3) for i in range(5)]
    manager.detokenize(batch([(f"r{i}", ids[:1], None) for i in range(5)], inits))
    assert sorted(calls) == [False, True]


async def test_outputs_are_routed_per_worker(autojump_clock, tok):
    async with open_harness() as h:
        tm0, tm1 = await h.probe(W0, BatchStrOut), await h.probe(W1, BatchStrOut)
        await start_detokenizer(h, tok)
        hi, yo = tok.encode("Hi"), tok.encode("Yo")
        inits = [DecodeInit("a", 0, []), DecodeInit("b", 1, []), DecodeInit("c", 0, [])]
        await h.send(DETOK, batch([("a", hi, None), ("b", yo, None), ("c", yo, None)], inits))
        out0, out1 = await tm0.expect(BatchStrOut), await tm1.expect(BatchStrOut)
        assert (out0.rids, out0.texts, out0.new_token_ids) == (["a", "c"], ["Hi", "Yo"], [hi, yo])
        assert (out1.rids, out1.texts) == (["b"], ["Yo"])
        assert out0.prompt_tokens == [7, 7] and out0.cached_tokens == [3, 3]
        assert out0.completion_tokens == [len(hi), len(yo)]
        assert out0.logprobs is None and out0.finished == [None, None]


async def test_skip_special_tokens_differs_per_request_in_one_batch(autojump_clock, tok):
    async with open_harness() as h:
        tm0 = await h.probe(W0, BatchStrOut)
        await start_detokenizer(h, tok)
        ids = tok.encode("<|im_start|>Hi<|im_end|>")
        inits = [DecodeInit("skip", 0, []), DecodeInit("keep", 0, [], skip_special_tokens=False)]
        await h.send(DETOK, batch([("skip", ids, LENGTH), ("keep", ids, LENGTH)], inits))
        out = await tm0.expect(BatchStrOut)
        assert out.texts == ["Hi", "<|im_start|>Hi<|im_end|>"]


async def test_stop_string_notifies_the_scheduler_and_later_output_is_counted(autojump_clock, tok):
    async with open_harness() as h:
        tm0, sched = await h.probe(W0, BatchStrOut), await h.probe(SCHED, StopStringHit)
        sup, managers = await start_detokenizer(h, tok)
        ids = tok.encode("say STOP now")
        await h.send(DETOK, batch([("r", ids[:3], None)], [DecodeInit("r", 0, ["STOP"])]))
        assert await sched.expect(StopStringHit) == StopStringHit("r", "STOP")
        out = await tm0.expect(BatchStrOut)
        assert out.texts == ["say "] and out.finished == [FinishReason("stop", matched="STOP")]
        assert out.new_token_ids == [ids[:3]]
        # The scheduler generated one more step before it heard of the stop.
        await h.send(DETOK, batch([("r", ids[3:], None)]))
        await h.send(DETOK, batch([("s", ids[:1], LENGTH)], [DecodeInit("s", 0, [])]))
        assert (await tm0.expect(BatchStrOut)).rids == ["s"]
        assert managers[-1].unknown_rids == 1
        assert managers[-1].states == {}
        assert sup.restarts == {"detok": 0}


async def test_logprobs_are_held_back_with_their_ids(autojump_clock, tok):
    async with open_harness() as h:
        tm0 = await h.probe(W0, BatchStrOut)
        await start_detokenizer(h, tok)
        ids = tok.encode(EMOJI)  # 👍 is three ids
        await h.send(DETOK, batch([("r", ids[:1], None)], [DecodeInit("r", 0, [])], logprobs=True))
        await h.send(DETOK, batch([("r", ids[1:2], None)], logprobs=True))
        await h.send(DETOK, batch([("r", ids[2:3], None)], logprobs=True))
        out = await tm0.expect(BatchStrOut)  # held-back steps send nothing
        assert out.texts == ["👍"] and out.new_token_ids == [ids[:3]]
        assert out.logprobs == [[-float(i) for i in ids[:3]]]
        await h.send(DETOK, batch([("r", ids[3:], LENGTH)], logprobs=True))
        out = await tm0.expect(BatchStrOut)
        assert "".join(out.texts) == tok.decode(ids[3:])
        assert out.logprobs == [[-float(i) for i in ids[3:]]]


async def test_states_are_dropped_on_every_finish_and_replaced_on_resume(autojump_clock, tok):
    async with open_harness() as h:
        tm0, tm1 = await h.probe(W0, BatchStrOut), await h.probe(W1, BatchStrOut)
        sup, managers = await start_detokenizer(h, tok)
        ids = tok.encode(ENGLISH)
        inits = [DecodeInit(rid, 0, []) for rid in "abcd"]
        await h.send(DETOK, batch([(rid, ids[:2], None) for rid in "abcd"], inits))
        await tm0.expect(BatchStrOut)
        assert set(managers[-1].states) == set("abcd")
        # d resumes on worker 1: its state is replaced, and only new text comes out.
        resume = DecodeInit("d", 1, [], prior_ids=ids[:2])
        await h.send(DETOK, batch([("d", ids[2:3], None)], [resume]))
        assert (await tm1.expect(BatchStrOut)).texts == [tok.decode(ids[2:3])]
        await h.send(DETOK, batch([
            ("a", ids[2:3], FinishReason("stop", matched=2)),
            ("b", [], FinishReason("abort", message="client went away")),
            ("c", ids[2:4], LENGTH),
            ("d", ids[3:4], LENGTH),
        ]))
        out0, out1 = await tm0.expect(BatchStrOut), await tm1.expect(BatchStrOut)
        assert out0.rids == ["a", "b", "c"] and out1.rids == ["d"]
        assert out0.finished[1] == FinishReason("abort", message="client went away")
        assert managers[-1].states == {} and managers[-1].unknown_rids == 0


async def test_malformed_frames_are_dropped(autojump_clock, tok):
    async with open_harness() as h:
        tm0 = await h.probe(W0, BatchStrOut)
        sup, managers = await start_detokenizer(h, tok)
        await h.send_frames(DETOK, [b"\xc1"])
        await h.send_frames(DETOK, [b"\x92\xafBatchTokenIDOut\x01"])
        await h.send(DETOK, batch([("r", tok.encode("ok"), LENGTH)], [DecodeInit("r", 0, [])]))
        assert (await tm0.expect(BatchStrOut)).texts == ["ok"]
        assert sup.restarts == {"detok": 0}
        assert not [e for e in h.events if e.kind == "crashed"]


async def test_an_init_naming_no_worker_is_dropped(autojump_clock, tok):
    async with open_harness() as h:
        tm0 = await h.probe(W0, BatchStrOut)
        sup, managers = await start_detokenizer(h, tok)
        await h.send(DETOK, batch([("x", tok.encode("no"), None)], [DecodeInit("x", 5, [])]))
        await h.send(DETOK, batch([("r", tok.encode("ok"), LENGTH)], [DecodeInit("r", 0, [])]))
        assert (await tm0.expect(BatchStrOut)).rids == ["r"]
        assert managers[-1].unknown_rids == 1 and managers[-1].states == {}
        assert sup.restarts == {"detok": 0}


async def test_detokenizer_child_runs_with_the_embedded_tokenizer(autojump_clock, tok):
    async with open_harness() as h:
        tm1 = await h.probe(W1, BatchStrOut)
        child = detokenizer_child(h.hub, address=DETOK, tokenizer=None, workers=[W0, W1],
                                  scheduler=SCHED)
        assert isinstance(child, ActorChild)
        await h.nursery.start(child.run)
        await h.send(DETOK, batch([("r", tok.encode(CHINESE), LENGTH)], [DecodeInit("r", 1, [])]))
        assert (await tm1.expect(BatchStrOut)).texts == [CHINESE]
        await child.stop()
        await trio.lowlevel.checkpoint()


def test_resume_with_stop_strings(tok):
    ids = tok.encode("Hello world peace and more")
    resumed = IncrementalDecoder(DecodeInit("r", 0, ["world war", "peace"], prior_ids=ids[:1]), tok)
    deltas = stream(resumed, chunks(ids[1:], None))
    assert "".join(d.text for d in deltas) == " world "
    assert deltas[-1].finished == FinishReason("stop", matched="peace") and deltas[-1].stop_hit


def test_text_that_never_completes_a_character_is_emitted_not_redecoded_from_its_start(tok):
    """Issue 29 N18: continuation bytes only (a logit_bias can force them) were held to the end and
    re-decoded from their start at every step (quadratic); past MAX_HELD_IDS ids they go out as decoded,
    and a resume's context walks back at most that far."""
    from serving.managers.detokenizer import MAX_HELD_IDS

    tail = tok.encode(EMOJI[0])[-1]  # the last piece of 👍: continuation bytes alone
    assert tok.decode([tail]).endswith("\ufffd")
    longest = 0

    class Counting:
        def batch_decode(self, seqs, **options):
            nonlocal longest
            longest = max(longest, *map(len, seqs))
            return tok.batch_decode(seqs, **options)

    dec = IncrementalDecoder(DecodeInit("r", 0, []), Counting())
    deltas = stream(dec, chunks([tail] * 200, None))
    assert longest <= 2 * MAX_HELD_IDS + 1  # a constant, whatever the length (200 here)
    assert sum(len(d.ids) for d in deltas[:-1]) >= 200 - MAX_HELD_IDS  # emitted along the way, not at the end
    assert [t for d in deltas for t in d.ids] == [tail] * 200
    longest = 0
    IncrementalDecoder(DecodeInit("r", 0, [], prior_ids=[tail] * 1000), Counting())
    assert longest <= 5 + MAX_HELD_IDS


async def test_a_scheduler_restart_sweeps_the_states_its_earlier_incarnation_opened(autojump_clock, tok):
    """L4: requests that ended while their scheduler was down (or were quarantined after a crash)
    never hear their finish here; the new incarnation's first step drops them, and a late step of
    the old one is skipped, not decoded into states the new one opened."""
    async with open_harness() as h:
        tm0 = await h.probe(W0, BatchStrOut)
        sup, managers = await start_detokenizer(h, tok)
        ids = tok.encode(ENGLISH)
        await h.send(DETOK, batch([(rid, ids[:2], None) for rid in "abc"],
                                  [DecodeInit(rid, 0, []) for rid in "abc"], boot="boot-1"))
        await tm0.expect(BatchStrOut)
        assert set(managers[-1].states) == set("abc")
        # the scheduler restarts: "c" resumes as c.1 (replacing c), "a" and "b" ended meanwhile
        await h.send(DETOK, batch([("c.1", ids[2:3], None)],
                                  [DecodeInit("c.1", 0, [], prior_ids=ids[:2], replaces="c")], boot="boot-2"))
        assert (await tm0.expect(BatchStrOut)).rids == ["c.1"]
        assert set(managers[-1].states) == {"c.1"} and managers[-1].swept == 3  # (c too: replaced anyway)
        await h.send(DETOK, batch([("c.1", ids[3:4], None)], boot="boot-1"))  # late, from the dead one
        await h.send(DETOK, batch([("c.1", ids[3:4], LENGTH)], boot="boot-2"))
        out = await tm0.expect(BatchStrOut)
        assert out.rids == ["c.1"] and out.texts == [tok.decode(ids[:4])[len(tok.decode(ids[:3])):]]
        assert managers[-1].states == {} and managers[-1].unknown_rids == 1


def test_batch_decode_decodes_each_window_alone(tok):
    """Never the backend's decode_batch (rayon's pool, whatever TOKENIZERS_PARALLELISM says); the same texts."""
    backend = tok.backend_tokenizer

    class OneAtATime:
        def decode(self, ids, skip_special_tokens):
            return backend.decode(ids, skip_special_tokens=skip_special_tokens)

        def decode_batch(self, seqs, skip_special_tokens):
            raise AssertionError("decode_batch called")

    class Wrapped:
        backend_tokenizer = OneAtATime()
        clean_up_tokenization_spaces = False

    seqs = [tok.encode(ENGLISH)[:5], tok.encode(MIXED)[:7], [], tok.encode(ENGLISH)[3:4]]
    assert batch_decode(Wrapped(), seqs, True, True) == tok.batch_decode(seqs, skip_special_tokens=True)
