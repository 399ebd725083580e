"""Load generator for any OpenAI-compatible server (like SGLang's bench_serving).

Sends random-token prompts of a set length, streams the answers (SSE), and
reports TTFT, TPOT, ITL and end-to-end latency (mean, std, p50, p99 in ms)
plus request, output-token and total-token throughput. EOS is suppressed
(``ignore_eos``, ``min_tokens``, ``max_tokens``) so each request generates
exactly ``--output-len`` tokens on servers that honour those fields.

    python -m benchmarks.bench_serving --base-url http://127.0.0.1:8000 \\
        --input-len 512 --output-len 128 --num-prompts 200 \\
        --max-concurrency 1 8 32 --json out.json --plot out.png
    python -m benchmarks.bench_serving --smoke [--base-url URL]

Definitions (per successful request; failures are counted, never timed):

- TTFT: request sent -> first chunk that carries a token.
- ITL: SGLang's bench_serving definition. Each chunk after the first gives n
  entries of gap / n, its gap since the previous chunk shared by the n tokens
  it carries (the first chunk's tokens have TTFT, no entries). Tokens per
  chunk come from ``usage.completion_tokens`` deltas when chunks carry usage
  (asked for: ``stream_options.continuous_usage_stats``, vLLM's and tercet's),
  else one per chunk with text. A server
  that sends one token a chunk gets its gaps; one that verifies drafts (several
  tokens a chunk) gets its time per token, comparable with the first.
- Chunk gap: the raw gaps between chunks after the first, one per chunk (what
  a reader of the stream waits; equal to ITL where every chunk has one token).
- E2E: request sent -> last token.
- TPOT: (e2e - ttft) / (output_tokens - 1).
- Output tokens: the final ``usage.completion_tokens`` when the server sends
  it, else the count above. Input tokens likewise from ``usage.prompt_tokens``.

The client is trio with a minimal keep-alive HTTP/1.1 reader (``RawHTTP``)
instead of httpx: on this 2-core box httpx (httpcore + h11 + anyio) cost
about 200 us of client CPU per streamed token, stealing that much from the
server under test; this reader halves that. SSE is split by hand and decoded
with msgspec. Each run reports the client's own CPU seconds
(``client_cpu_s``): the share of a small machine the load generator took.
Each run in a sweep draws fresh prompts (a prefix cache gets no free hits).

``--workload lookup`` sends prompts that contain their answer instead: a passage of
about ``--input-len`` tokens (sentences of prose and code lines, shuffled per
prompt) and the instruction to repeat it word for word -- where speculative
decoding by prompt lookup (n-gram drafts) pays. Its prompts are text.

Before the sweep (the server idle), the speed of light (``roofline.py``): this
machine's read bandwidth and GEMM peak, and the bytes and FLOPs per token of the
model as tercet's runner holds it (``--roofline-model``, default the embedded
SmolLM2; the tiny model with ``--smoke``; ``--roofline-dtype`` as the server's),
K/V read at the mean context (input + half the output). Each run's output tok/s
then stands beside its bandwidth bound (concurrency sequences per step) and
compute bound (the prompt's FLOPs spread over the output tokens), which binds,
and its % of that. A peer that stores its weights otherwise (llama.cpp's Q4_1)
has other bytes: its % is against tercet's bound. ``--no-roofline`` skips it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import msgspec
import numpy as np
import trio
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORDS = ("the of and to in is was for on that with as by at from his her it an were are "
         "which this be or had not but first one their its new after who they have two "
         "time city year world over during more only can three other been into most").split()
METRICS = ("ttft", "tpot", "itl", "e2e")
# --workload lookup: the pieces its passages are shuffled from (about 16 tokens each)
PASSAGE_PIECES = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk.",
    "He wound the clockwork, trimmed the wick and polished the great lens.",
    "Ships passing the rocky point saw the beam sweep across the dark water.",
    "Their captains knew, when they saw it, that they were close to home.",
    "In the spring the river rose over its banks and flooded the low meadows.",
    "The farmers moved their sheep to the hills and waited for the water to fall.",
    "A small library stood at the corner of the market square, built of red brick.",
    "Its shelves held maps of the coast, old almanacs and a history of the town.",
    "def moving_average(values, window):\n    total = sum(values[:window])",
    "    for i in range(window, len(values)):\n        total += values[i] - values[i - window]",
    "class Cache:\n    def __init__(self, size):\n        self.size = size",
    "    def get(self, key, default=None):\n        return self.items.get(key, default)",
    "The committee met on Tuesday to review the budget for the coming year.",
    "After a long discussion they agreed to repair the bridge before the winter.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
    "The baker opened his shop at five, and the smell of bread filled the street.",
)


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunk_gaps: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if the server says


# ---- a minimal HTTP/1.1 client ----------------------------------------------

class HTTPProtocolError(Exception):
    """The server's answer is not HTTP/1.1 this client can read."""


class _Stale(Exception):
    """The connection closed before any byte of the response."""


class Response:
    """Status, headers, and a body read piece by piece (chunked or sized)."""

    def __init__(self, stream: trio.SocketStream, buffer: bytes):
        self.stream, self.buffer = stream, buffer
        head, _, self.buffer = buffer.partition(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
            raise HTTPProtocolError(f"bad status line {status_line!r}")
        self.status = int(parts[1])
        self.headers = {}
        for line in lines:
            name, _, value = line.partition(":")
            self.headers[name.strip().lower()] = value.strip()
        self.chunked = "chunked" in self.headers.get("transfer-encoding", "").lower()
        length = self.headers.get("content-length")
        self.left = int(length) if length is not None and not self.chunked else -1
        self.state = "size" if self.chunked else "sized"  # -> data, crlf, trailer, done
        self.reusable = self.headers.get("connection", "").lower() != "close" and (
            self.chunked or self.left >= 0)

    async def read_some(self) -> bytes:
        """The next piece of body; b"" once it is all read."""
        while True:
            piece = self._take()
            if piece or self.state == "done":
                return piece
            data = await self.stream.receive_some(65536)
            if not data:
                if self.state == "sized" and self.left < 0:  # body ends at close
                    self.state = "done"
                    return b""
                raise HTTPProtocolError("connection closed inside the body")
            self.buffer += data

    async def read_all(self) -> bytes:
        pieces = []
        while piece := await self.read_some():
            pieces.append(piece)
        return b"".join(pieces)

    def _take(self) -> bytes:
        buf, out = self.buffer, []
        if self.state == "sized":
            out.append(buf if self.left < 0 else buf[:self.left])
            buf = b"" if self.left < 0 else buf[self.left:]
            if self.left >= 0:
                self.left -= len(out[0])
                if self.left == 0:
                    self.state = "done"
        while self.chunked and self.state != "done":
            if self.state == "data":
                out.append(buf[:self.left])
                self.left -= len(out[-1])
                buf = buf[len(out[-1]):]
                if self.left:
                    break
                self.state = "crlf"
            if self.state == "crlf":
                if len(buf) < 2:
                    break
                buf, self.state = buf[2:], "size"
            if self.state in ("size", "trailer"):
                end = buf.find(b"\r\n")
                if end < 0:
                    break
                line, buf = buf[:end], buf[end + 2:]
                if self.state == "trailer":
                    if not line:
                        self.state = "done"
                        break
                    continue
                try:
                    self.left = int(line.split(b";")[0], 16)
                except ValueError:
                    raise HTTPProtocolError(f"bad chunk size {line[:20]!r}") from None
                self.state = "data" if self.left else "trailer"
        self.buffer = buf
        return b"".join(out)


class RawHTTP:
    """Keep-alive HTTP/1.1 over trio sockets: far cheaper per SSE event than
    httpx (httpcore + h11 + anyio), which matters when the client shares a
    small machine with the server it measures."""

    def __init__(self, base_url: str, api_key: str | None = None):
        url = urlsplit(base_url)
        if url.scheme != "http":
            raise SystemExit(f"bench_serving: only http:// URLs, not {base_url!r}")
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80
        self.prefix = url.path.rstrip("/")
        self.base_url = base_url
        auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
        self.common = f"Host: {url.netloc}\r\n{auth}Accept: */*\r\n"
        self.idle: list[trio.SocketStream] = []

    async def request(self, method: str, path: str, body: bytes = b"") -> Response:
        head = (f"{method} {self.prefix}{path} HTTP/1.1\r\n{self.common}"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
        message = head.encode() + body
        while self.idle:  # a pooled connection the server may have closed meanwhile
            stream = self.idle.pop()
            try:
                return await self._exchange(stream, message)
            except (OSError, trio.BrokenResourceError, _Stale):
                pass
        stream = await trio.open_tcp_stream(self.host, self.port)
        try:
            return await self._exchange(stream, message)
        except _Stale:
            raise HTTPProtocolError("connection closed before the response") from None

    @staticmethod
    async def _exchange(stream: trio.SocketStream, message: bytes) -> Response:
        try:
            await stream.send_all(message)
            buffer = b""
            while b"\r\n\r\n" not in buffer:
                data = await stream.receive_some(65536)
                if not data:
                    raise _Stale if not buffer else HTTPProtocolError("cut inside the headers")
                buffer += data
            return Response(stream, buffer)
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise

    async def release(self, response: Response) -> None:
        """Back to the pool when the body was read to its end; else close."""
        if response.state == "done" and response.reusable and not response.buffer:
            self.idle.append(response.stream)
        else:
            await trio.aclose_forcefully(response.stream)

    async def get_json(self, path: str):
        response = await self.request("GET", path)
        try:
            body = await response.read_all()
        finally:
            await self.release(response)
        if response.status != 200:
            raise HTTPProtocolError(f"HTTP {response.status}: {body[:120]!r}")
        return msgspec.json.decode(body)

    async def aclose(self) -> None:
        while self.idle:
            await trio.aclose_forcefully(self.idle.pop())


# ---- one request ------------------------------------------------------------

def request_body(args, model: str, prompt, constrained: bool = False) -> dict:
    # continuous_usage_stats (vLLM's, tercet's): usage in every chunk, so ITL knows each chunk's tokens
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_tokens": args.output_len, "min_tokens": args.output_len,
            "ignore_eos": True, "temperature": 0.0}
    if args.eos_bias is not None:  # a server without ignore_eos / min_tokens (transformers serve)
        del body["min_tokens"], body["ignore_eos"], body["stream_options"]["continuous_usage_stats"]
        body["logit_bias"] = {str(args.eos_bias): -100}
    elif args.plain_openai:  # OpenAI's fields only (llama.cpp): EOS may end a request early
        del body["min_tokens"], body["ignore_eos"], body["stream_options"]["continuous_usage_stats"]
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if constrained and args.json_schema:
        schema = json.loads(Path(args.json_schema).read_text())
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}
    elif constrained and args.tools:
        body.update(tools=json.loads(Path(args.tools).read_text()), tool_choice="required")
    return body


def chunk_text(choice: dict) -> str:
    if "text" in choice:
        return choice["text"] or ""
    delta = choice.get("delta") or {}
    return delta.get("content") or delta.get("reasoning_content") or ""


async def send_one(client: RawHTTP, path: str, body: dict, input_len: int,
                   timeout: float = 600.0) -> Result:
    result = Result(prompt_tokens=input_len)
    decode = msgspec.json.decode
    start = time.perf_counter()
    last = start
    counted = 0  # tokens seen in chunks
    usage_done = None  # completion_tokens from the latest usage
    response = None
    try:
        with trio.fail_after(timeout) as scope:
            response = await client.request("POST", path, msgspec.json.encode(body))
            if response.status != 200:
                text = (await response.read_all()).decode(errors="replace")
                result.error = f"HTTP {response.status}: {text[:120]}"
                return result
            buffer = b""
            while data := await response.read_some():
                now = time.perf_counter()
                scope.deadline = trio.current_time() + timeout  # per read, not per request
                buffer += data
                if b"\r" in buffer:
                    buffer = buffer.replace(b"\r\n", b"\n")
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        payload = line[5:].strip()
                        if payload == b"[DONE]":
                            continue
                        message = decode(payload)
                        if "error" in message or message.get("object") == "error":
                            error = message.get("error", message)
                            if isinstance(error, dict):
                                error = error.get("message", error)
                            result.error = f"error event: {str(error)[:120]}"
                            return result
                        usage = message.get("usage") or {}
                        if usage.get("prompt_tokens"):
                            result.prompt_tokens = usage["prompt_tokens"]
                            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                            if cached is not None:
                                result.cached_tokens = cached
                        choices = message.get("choices") or []
                        if "completion_tokens" in usage:
                            # the tokens not yet counted (llama-server's last chunk has the usage of
                            # tokens its earlier chunks brought one a chunk: none new)
                            usage_done = usage["completion_tokens"]
                            if not choices:
                                continue  # the final usage-only chunk
                            n = usage_done - counted
                        else:
                            n = 1 if choices and chunk_text(choices[0]) else 0
                        if n <= 0:
                            continue
                        if counted == 0:
                            result.ttft = now - start
                        else:
                            result.chunk_gaps.append(now - last)
                            result.itl.extend([(now - last) / n] * n)
                        counted += n
                        last = now
    except (OSError, trio.BrokenResourceError, trio.TooSlowError, HTTPProtocolError,
            msgspec.DecodeError, AttributeError, TypeError) as exc:
        result.error = f"{type(exc).__name__}: {str(exc)[:120]}"
        return result
    finally:
        if response is not None:
            await client.release(response)
    result.e2e = last - start
    result.output_tokens = usage_done if usage_done is not None else counted
    if counted == 0:
        result.error = "no tokens in the stream"
        return result
    result.ok = True
    return result


# ---- prompts, runs ----------------------------------------------------------

def make_prompts(rng: np.random.Generator, n: int, args, text: bool) -> list:
    """``n`` random prompts of ``--input-len`` tokens (or words); with ``--system-prompts K``,
    each begins with one of K shared system prompts of ``--system-len`` (drawn at random; the
    same K in every run), then its own random rest. ``--workload lookup``: ``lookup_prompts``."""
    if args.workload == "lookup":
        return lookup_prompts(rng, n, args.input_len, args.endpoint == "chat")
    if not args.system_prompts:
        return random_prompts(rng, n, args.input_len, args, text)
    systems = random_prompts(np.random.default_rng([args.seed, 7]), args.system_prompts, args.system_len, args, text)
    own = random_prompts(rng, n, args.input_len - args.system_len, args, text)
    picks = rng.integers(0, args.system_prompts, size=n)
    return [f"{systems[k]} {rest}" if text else systems[k] + rest for k, rest in zip(picks, own)]


def lookup_prompts(rng: np.random.Generator, n: int, length: int, chat: bool) -> list[str]:
    """``n`` prompts that ask to repeat a passage of about ``length`` tokens they hold (pieces of
    ``PASSAGE_PIECES`` in a fresh order each), as a chat message or a completion prompt."""
    out = []
    for _ in range(n):
        pieces = [PASSAGE_PIECES[i] for i in rng.permutation(len(PASSAGE_PIECES))]
        passage = " ".join(pieces[: max(1, min(len(pieces), round(length / 16)))])
        out.append(f"Repeat the following text word for word.\n\n{passage}" if chat
                   else f"{passage}\n\nThe text above, repeated word for word:\n\n")
    return out


def random_prompts(rng: np.random.Generator, n: int, length: int, args, text: bool) -> list:
    if text:
        words = rng.integers(0, len(WORDS), size=(n, length))
        return [" ".join(WORDS[i] for i in row) for row in words]
    ids = rng.integers(args.token_low, args.token_high, size=(n, length))
    return [row.tolist() for row in ids]


async def run_requests(client, args, model, prompts, concurrency, rate, rng, text, desc, constrained=False):
    """Send all prompts; returns (results, wall seconds, client CPU seconds)."""
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    limiter = trio.CapacityLimiter(concurrency or len(prompts) or 1)
    results: list[Result] = []
    bar = tqdm(total=len(prompts), desc=desc, file=sys.stderr, mininterval=0.5, leave=False)

    async def one(prompt):
        async with limiter:
            results.append(await send_one(client, path, request_body(args, model, prompt, constrained),
                                          args.input_len, args.timeout))
        bar.update(1)

    cpu0, wall0 = time.process_time(), time.perf_counter()
    async with trio.open_nursery() as nursery:
        for prompt in prompts:
            nursery.start_soon(one, prompt)
            if math.isfinite(rate):
                await trio.sleep(rng.exponential(1.0 / rate))
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    bar.close()
    return results, wall, cpu


def stats_ms(samples: list[float]) -> dict:
    if not samples:
        return {"mean": None, "std": None, "p50": None, "p99": None}
    a = np.asarray(samples) * 1e3
    return {"mean": float(a.mean()), "std": float(a.std()),
            "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}


def summarize(results: list[Result], wall: float, cpu: float, concurrency, rate) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    told = [r for r in ok if r.cached_tokens is not None]
    errors = Counter(r.error for r in results if not r.ok)
    return {
        "max_concurrency": concurrency,
        "request_rate": rate if math.isfinite(rate) else "inf",
        "num_prompts": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": dict(errors.most_common(5)),
        "duration_s": wall,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / wall,
        "output_throughput": out_tokens / wall,
        "total_token_throughput": (in_tokens + out_tokens) / wall,
        "client_cpu_s": cpu,
        # prompt tokens served from the server's prefix cache (as its usage says; None if it does not)
        "cache_hit_rate": sum(r.cached_tokens for r in told) / max(1, sum(r.prompt_tokens for r in told))
        if told else None,
        "ttft_ms": stats_ms([r.ttft for r in ok]),
        "tpot_ms": stats_ms([(r.e2e - r.ttft) / (r.output_tokens - 1)
                             for r in ok if r.output_tokens > 1]),
        "itl_ms": stats_ms([gap for r in ok for gap in r.itl]),
        "chunk_gap_ms": stats_ms([gap for r in ok for gap in r.chunk_gaps]),
        "tokens_per_chunk": sum(len(r.itl) for r in ok) / max(1, sum(len(r.chunk_gaps) for r in ok)),
        "e2e_ms": stats_ms([r.e2e for r in ok]),
    }


async def pick_model(client: RawHTTP) -> str:
    try:
        return (await client.get_json("/v1/models"))["data"][0]["id"]
    except (OSError, HTTPProtocolError, msgspec.DecodeError,
            KeyError, IndexError, TypeError) as exc:
        raise SystemExit(f"bench_serving: cannot list models at {client.base_url}: {exc!r}; "
                         "pass --model") from None


async def accepts_token_ids(client, args, model) -> bool:
    """One tiny request with a list-of-ints prompt; a 4xx answer means 'no'."""
    body = request_body(args, model, list(range(args.token_low, args.token_low + 4)))
    body["max_tokens"] = body["min_tokens"] = 1
    result = await send_one(client, "/v1/completions", body, 4)
    return not (result.error.startswith("HTTP 4"))


async def benchmark(args) -> dict:
    """Every run of the sweep against ``args.base_url``; returns the report."""
    rng = np.random.default_rng(args.seed)
    client = RawHTTP(args.base_url, args.api_key)
    try:
        model = args.model or await pick_model(client)
        text = args.text_prompts or args.endpoint == "chat" or args.workload == "lookup"
        if not text and not await accepts_token_ids(client, args, model):
            print("bench_serving: server refuses token-id prompts; sending text", file=sys.stderr)
            text = True
        if args.warmup:
            prompts = make_prompts(rng, args.warmup, args, text)
            await run_requests(client, args, model, prompts, args.max_concurrency[0],
                               math.inf, rng, text, "warmup")
        runs = []
        variants = [False, True] if (args.json_schema or args.tools) else [False]
        for concurrency in args.max_concurrency:
            for constrained in variants:  # the same prompts, free then constrained: a ratio from one run
                prompts = make_prompts(np.random.default_rng([args.seed, concurrency or 0]), args.num_prompts,
                                       args, text) if len(variants) > 1 else make_prompts(rng, args.num_prompts,
                                                                                          args, text)
                results, wall, cpu = await run_requests(
                    client, args, model, prompts, concurrency, args.request_rate, rng, text,
                    f"concurrency {concurrency or 'inf'}{' constrained' if constrained else ''}", constrained)
                runs.append({**summarize(results, wall, cpu, concurrency, args.request_rate),
                             "constrained": constrained})
            if len(variants) > 1:  # constrained / free output tok/s at this concurrency
                free, bound = runs[-2]["output_throughput"], runs[-1]["output_throughput"]
                runs[-1]["throughput_ratio_to_free"] = bound / free if free else None
    finally:
        await client.aclose()
    settings = {k: v for k, v in vars(args).items() if k != "api_key"}
    settings.update(model=model, text_prompts=text, request_rate=str(args.request_rate))
    return {"args": settings, "runs": runs}


# ---- output -----------------------------------------------------------------

def print_table(report: dict) -> None:
    def num(value, width, digits=1):
        return f"{'-' if value is None else f'{value:.{digits}f}':>{width}}"

    groups = "".join(f"{m.upper() + ' ms mean/p50/p99':^27}" for m in METRICS)
    head = f"{'conc':>5} {'ok':>5} {'fail':>4} {'req/s':>7} {'out tok/s':>9} {'tot tok/s':>9} "
    print(f"model {report['args']['model']}  input {report['args']['input_len']}  "
          f"output {report['args']['output_len']}  rate {report['args']['request_rate']}")
    bounds = "roofline" in report
    if bounds:
        from benchmarks import roofline

        print(report["roofline"]["describe"])
    print(" " * len(head) + groups)
    print(head + "".join(f"{'mean':>9}{'p50':>9}{'p99':>9}" for _ in METRICS)
          + (roofline.BOUND_HEAD if bounds else ""))
    for run in report["runs"]:
        if run.get("constrained"):
            ratio = run.get("throughput_ratio_to_free")
            print(f"      constrained ({'tools' if report['args'].get('tools') else 'json_schema'}): "
                  f"{num(ratio, 5, 2)} x the free run's output tok/s")
        line = (f"{run['max_concurrency'] or 'inf':>5} {run['completed']:>5} {run['failed']:>4} "
                f"{num(run['request_throughput'], 7, 2)} {num(run['output_throughput'], 9)} "
                f"{num(run['total_token_throughput'], 9)} ")
        for m in METRICS:
            s = run[f"{m}_ms"]
            line += num(s["mean"], 9, 2) + num(s["p50"], 9, 2) + num(s["p99"], 9, 2)
        if bounds:
            line += roofline.bound_cells(run["bounds"])
        print(line)
        if run.get("tokens_per_chunk", 1) > 1.005:  # drafts verified: the stream's own cadence too
            gaps = run["chunk_gap_ms"]
            print(f"      {num(run['tokens_per_chunk'], 4, 2)} tokens a chunk after the first; chunk gap ms "
                  f"mean/p50/p99 {num(gaps['mean'], 0, 2)} / {num(gaps['p50'], 0, 2)} / {num(gaps['p99'], 0, 2)}")
        if report["args"].get("system_prompts"):
            print(f"      prefix cache hit rate: {num(run['cache_hit_rate'], 5, 3)} "
                  f"({report['args']['system_prompts']} system prompts of {report['args']['system_len']} tokens)")
        for error, count in run["errors"].items():
            print(f"      {count} x {error}")


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    xs = [r["max_concurrency"] or r["num_prompts"] for r in runs]
    fig, (lat, thr) = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    for key, stat, label in (("ttft_ms", "p50", "TTFT p50"), ("ttft_ms", "p99", "TTFT p99"),
                             ("tpot_ms", "p50", "TPOT p50")):
        lat.plot(xs, [r[key][stat] if r[key][stat] is not None else math.nan for r in runs],
                 marker="o", label=label)
    lat.set(xlabel="max concurrency", ylabel="ms", title="latency")
    thr.plot(xs, [r["output_throughput"] for r in runs], marker="o", label="output tok/s")
    thr.plot(xs, [r["total_token_throughput"] for r in runs], marker="s", label="total tok/s")
    thr.set(xlabel="max concurrency", ylabel="tokens/s", title="throughput")
    for ax in (lat, thr):
        if len(xs) > 1 and max(xs) / max(min(xs), 1) >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{report['args']['model']}: input {report['args']['input_len']}, "
                 f"output {report['args']['output_len']}")
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- command line -----------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", help="e.g. http://127.0.0.1:8000 (required unless --smoke)")
    p.add_argument("--model", help="default: the first from GET /v1/models")
    p.add_argument("--api-key")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--input-len", type=int, default=None, help="prompt tokens (default 1024)")
    p.add_argument("--output-len", type=int, default=None, help="tokens to generate (default 128)")
    p.add_argument("--num-prompts", type=int, default=None, help="per run (default 200)")
    p.add_argument("--text-prompts", action="store_true", help="random words, not token ids")
    p.add_argument("--workload", choices=("random", "lookup"), default="random",
                   help="random: random prompts (default); lookup: prompts asking to repeat a passage they "
                   "hold (where n-gram speculative decoding pays; text, up to 16 pieces of ~16 tokens)")
    p.add_argument("--token-low", type=int, default=1000, help="random token ids from here")
    p.add_argument("--token-high", type=int, default=20000, help="... up to here (exclusive)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrivals per second; inf (default) sends all at once")
    p.add_argument("--max-concurrency", type=lambda s: None if s in ("inf", "0") else int(s),
                   nargs="+", default=None, help="one run per value (a sweep); default: no limit")
    p.add_argument("--warmup", type=int, default=None, help="requests before the runs (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--system-prompts", type=int, default=0, metavar="K",
                   help="the shared-prefix workload: every prompt begins with one of K system prompts "
                   "(the same K in every run), then its own tokens; reports the cache hit rate")
    p.add_argument("--system-len", type=int, default=None, help="tokens of each system prompt (default: 3/4 "
                   "of --input-len)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per network read")
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--plot", help="PNG of latency and throughput against concurrency")
    p.add_argument("--json-schema", help="a JSON schema file: each concurrency also runs with every request "
                   "constrained by it (response_format), the output tok/s ratio to the free run reported")
    p.add_argument("--tools", help="a JSON file of OpenAI tools: each concurrency also runs with tool_choice "
                   "required over them (use with --endpoint chat)")
    p.add_argument("--eos-bias", type=int, metavar="TOKEN_ID",
                   help="suppress EOS by logit_bias {TOKEN_ID: -100} instead of ignore_eos/min_tokens "
                   "(for servers that refuse those, e.g. transformers serve; SmolLM2's EOS is 2)")
    p.add_argument("--plain-openai", action="store_true",
                   help="send OpenAI's fields only (llama.cpp's server): EOS is not suppressed, check the "
                   "output token counts")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny sweep; against an in-process stub unless --base-url is given")
    p.add_argument("--roofline-model", metavar="PATH",
                   help="the model whose bytes and FLOPs per token bound the runs (default: the embedded "
                   "SmolLM2; with --smoke the tiny random model)")
    p.add_argument("--roofline-dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="the dtype the server runs (auto: what tercet picks on this CPU)")
    p.add_argument("--no-roofline", dest="roofline", action="store_false",
                   help="no machine figures and bounds (e.g. a model tercet cannot load)")
    args = p.parse_args(argv)
    small = args.smoke
    for name, normal, smoke in (("input_len", 1024, 32), ("output_len", 128, 16),
                                ("num_prompts", 200, 8), ("warmup", 2, 1),
                                ("max_concurrency", [None], [1, 4])):
        if getattr(args, name) is None:
            setattr(args, name, smoke if small else normal)
    if not args.smoke and not args.base_url:
        p.error("--base-url is required unless --smoke")
    if args.system_len is None:
        args.system_len = args.input_len * 3 // 4
    if args.system_prompts < 0 or (args.system_prompts and not 0 < args.system_len < args.input_len):
        p.error("--system-prompts K >= 0, and --system-len must be in 1..input_len - 1")
    return args


async def main_async(args) -> dict:
    if args.base_url:
        args.base_url = args.base_url.rstrip("/").removesuffix("/v1")
        return await benchmark(args)
    from benchmarks._stub_openai import StubConfig, serve_stub

    async with trio.open_nursery() as nursery:
        args.base_url = await nursery.start(serve_stub, StubConfig())
        report = await benchmark(args)
        report["args"]["stub"] = "in-process (client_cpu_s includes the stub)"
        nursery.cancel_scope.cancel()
    return report


def speed_of_light(args):
    """This machine's figures and the model's costs per token (`roofline.py`), measured before the sweep."""
    import torch

    from benchmarks import roofline

    dtype = {"auto": None, "bf16": torch.bfloat16, "fp32": torch.float32}[args.roofline_dtype]
    machine = roofline.measure_machine(smoke=args.smoke)
    costs = roofline.load_costs(args.roofline_model, args.input_len + args.output_len // 2,
                                tiny=args.smoke and not args.roofline_model, dtype=dtype)
    return machine, costs


def add_bounds(report: dict, machine, costs) -> None:
    """Each run's output tok/s beside its bounds (run["bounds"]), the figures under report["roofline"]."""
    from benchmarks import roofline

    report["roofline"] = {**roofline.report(machine, costs),
                          "describe": f"{machine.describe()}\n{costs.describe()}"}
    for run in report["runs"]:
        prompt = run["total_input_tokens"] / run["completed"] if run["completed"] else report["args"]["input_len"]
        batch = max(1, min(run["max_concurrency"] or run["num_prompts"], run["num_prompts"]))
        run["bounds"] = roofline.bound_row(run["output_throughput"], costs, machine, batch,
                                           round(prompt), report["args"]["output_len"])


def main(argv=None) -> None:
    args = parse_args(argv)
    bounds = speed_of_light(args) if args.roofline else None
    report = trio.run(main_async, args)
    if bounds is not None:
        add_bounds(report, *bounds)
    print_table(report)
    if args.json:
        out = report if len(report["runs"]) > 1 else {**report["runs"][0], "args": report["args"]}
        if "roofline" in report:
            out["roofline"] = report["roofline"]
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    if args.plot:
        plot(report, args.plot)


if __name__ == "__main__":
    main()
