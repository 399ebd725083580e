"""Topologies: which actors run where, over which links, under what supervision.

A YAML file (see ``configs/``) is validated into ``Topology``; a mistake is a
``TopologyError`` naming the file, line and field. Flags of ``tercet serve``
arrive as dotted overrides (``model.path``, ``server.port``, ...). Each link
is ``inproc://``, ``ipc://`` or ``tcp://`` by its address; ``{runtime_dir}``
in an address is a private temporary directory made at start. This module
is the schema only: it reads and checks, and imports neither torch nor the
managers; ``specs`` says what to start (the scheduler's config among it),
``frontend`` builds the tokenizer manager, ``launch`` starts and supervises.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import yaml

from transports import Address, AddressError, CurveConfig, HubOptions

__all__ = ["ReplicaPlacement", "RouterSection", "Topology", "TopologyError", "load_topology", "parse_size",
           "tokenizer_source"]

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


class TopologyError(ValueError):
    """A topology file or option that cannot be used; the message names the field."""


class ModelSection(msgspec.Struct, forbid_unknown_fields=True):
    path: str | None = None  # None: the embedded SmolLM2; "tiny": a tiny random model (tests)
    tokenizer: str | None = None  # default: the model's
    # auto: bfloat16 on CUDA and on CPUs with bf16 units (AVX512-BF16, AMX), else float32 (an AVX2-only
    # CPU emulates bf16 products: 2-4x slower there; models.runner.default_dtype)
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    # auto: the first CUDA device when torch sees one (in the scheduler's process), else the CPU
    device: Annotated[str, msgspec.Meta(pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$")] = "auto"
    served_model_name: str | None = None
    # int8: the projections whose weights are a GGUF's Q4_1 or Q8_0 block codes multiply activations rounded to
    # int8 per block of 32 (as llama.cpp does): ~2x the exact path's products on CPU, not its outputs (still
    # batch-invariant); needs tercet's CPU kernels and such a GGUF. exact: every product as the weights give it
    activations: Literal["exact", "int8"] = "exact"


class ServerSection(msgspec.Struct, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None  # every route but /health needs it
    admin_api_key: str | None = None  # the admin routes need it (not the api_key) when set
    workers: int = 1  # tokenizer/HTTP worker processes
    request_wait: float = 60.0  # how long a new request waits for a restarting scheduler or a pause
    # a request that hears nothing of its own for this long (starved in the queue, or lost downstream,
    # while others' outputs flow) ends with a 504; None: never. Make it longer than a scheduler restart.
    request_timeout: float | None = None
    max_loop_lag: float = 0.5  # seconds: new requests get 503 while the event loop runs this late
    # bounds on what one request may ask
    max_request_bytes: int | str = "32MiB"  # a larger body is refused with 413, unread
    max_body_bytes_in_flight: int | str | None = None  # bodies read and decoded at once (503 past it);
    # None: twice max_request_bytes
    body_timeout: float = 60.0  # seconds for a whole body to arrive; a slower upload gets 408
    max_batch_size: int = 256  # prompts in one /generate
    max_samples: int = 256  # sub-requests (prompts × n) in one request; each counts as a request in flight
    max_stop_strings: int = 16
    max_stop_length: int = 256  # characters
    # logprob entries one request may ask for: samples × max_new_tokens × (1 + top_logprobs)
    max_logprobs: int = 2_097_152
    # /update_weights_from_disk: paths under the model's own directory or one of these only
    weights_roots: list[str] = []
    weights_drain_timeout: float = 60.0  # requests in flight must finish within this, else 409
    tool_call_parser: Literal["hermes"] = "hermes"  # how tool calls are written and read (vLLM's names)
    # how a model writes its reasoning (<think>…</think>): split into reasoning_content (SGLang's names)
    reasoning_parser: Literal["qwen3", "deepseek-r1"] | None = None
    # who starts the remote replicas: someone else (local: `tercet replica` by hand, Kubernetes), or
    # this server, as actors on a Ray cluster (ray; `pip install tercet[ray]`) at ray_address (None: auto)
    launcher: Literal["local", "ray"] = "local"
    ray_address: str | None = None


class SchedulerSection(msgspec.Struct, forbid_unknown_fields=True):
    # data-parallel replicas (SGLang's --dp-size): each a scheduler with its own model, KV pool and radix
    # cache, and its own detokenizer, supervised as one unit; the router (``router``) spreads requests
    replicas: int = 1
    page_size: int = 1
    kv_budget: int | str = "1GiB"
    max_running_requests: int = 64
    max_queued_requests: int = 1024
    chunked_prefill_size: int = 2048
    schedule_policy: Literal["fcfs", "lpm"] = "fcfs"
    enable_prefix_cache: bool = True
    # send each request's tokens every so many (SGLang's --stream-interval): fewer, larger stream
    # events for less CPU per token; the first token and the last are sent at once
    stream_interval: int = 1
    # batch-invariant kernels (SGLang's --enable-deterministic-inference), on by default where tercet's
    # CPU kernels build (they cost 1-4 %): a request's greedy output is the same whatever else runs,
    # and a resumed stream continues with exactly its text; off on CUDA (not measured there)
    enable_deterministic_inference: bool = True
    # speculative decoding without a draft model (docs/speculative.md): "ngram" drafts a running request's
    # next tokens from its own prompt and output and verifies them in its decode step, the text unchanged
    # (it needs deterministic inference; off without it); "none": one token a step
    speculative: Literal["none", "ngram"] = "ngram"
    speculative_num_draft: int = 4  # draft tokens a request verifies per step, at most
    speculative_max_ngram: int = 3  # the longest suffix of a request looked up in its tokens
    speculative_min_ngram: int = 2  # the shortest
    speculative_max_batch: int = 4  # no drafts while more requests than this run (a larger batch is compute-bound)
    # ...for a sampled request (temperature > 0: its drafts hold less often and were measured to cost): 0, never
    speculative_max_batch_sampled: int = 0
    # torch threads per scheduler; default: torch's (one per core), divided among the replicas run on
    # this host (two schedulers spinning two threads each on two cores run several times slower)
    threads: int | None = None


class SupervisionSection(msgspec.Struct, forbid_unknown_fields=True):
    strategy: Literal["one_for_one", "one_for_all", "rest_for_one"] = "one_for_one"
    max_restarts: int = 3
    within: float = 60.0
    backoff_initial: float = 0.0
    backoff_max: float = 5.0
    shutdown_grace: float = 10.0
    quarantine_after: int = 2  # crashes in the step that died, in a row, before a request resumes on probation
    trial_timeout: float = 60.0  # the longest one group on probation is tried (then it goes on as any request)
    # a replica's scheduler and detokenizer start at once (they need nothing of each other to
    # start; ~5 s less to ready on 2 cores), or one after the other (in_order, OTP's way)
    start: Literal["together", "in_order"] = "together"
    # a spare process for each child process (scheduler, detokenizer), started 2 s after it is ready:
    # torch and transformers imported in idle time, so a restart after a crash takes ~1.5 s, not ~6
    # (SmolLM2 on 2 cores; a spare not warm yet is not waited for); ~260-420 MB of memory a spare
    standby: bool = True


class WatchdogSection(msgspec.Struct, forbid_unknown_fields=True):
    step_timeout: float = 120.0  # one model step
    output_timeout: float = 300.0  # no output while requests are in flight (soft watchdog)
    remote_timeout: float = 10.0  # a remote replica that answers nothing for this long is down
    # a child process (scheduler, detokenizer) to bind its mailbox: imports and binding, nothing long
    start_timeout: float = 120.0
    # a scheduler, from binding its mailbox to serving: it loads the model (its first start may convert
    # a GGUF and build the CPU kernels), answering meanwhile that it is loading; a large model needs more
    load_timeout: float = 1800.0


class CurveSection(msgspec.Struct, forbid_unknown_fields=True):
    """CURVE on every tcp link: ``generate: true`` makes one keypair at start for the
    processes of this server (one host); or ZeroMQ certificate files (``zmq.auth``)."""

    generate: bool = False
    secret_file: str | None = None  # this side's NAME.key_secret
    server_public_file: str | None = None  # the receivers' NAME.key
    authorized_dir: str | None = None  # the NAME.key files of the senders admitted


class TransportSection(msgspec.Struct, forbid_unknown_fields=True):
    max_message_bytes: int | str = "64MiB"  # a peer sending more is disconnected (ipc, tcp)
    curve: CurveSection | None = None
    allow_insecure: bool = False  # tcp on an address other than loopback without CURVE


class Placement(msgspec.Struct, forbid_unknown_fields=True):
    address: str  # where the others reach it
    # main: this process; child: a child process of it; remote (replicas only): started elsewhere
    # (``tercet replica``, a Kubernetes pod, Ray), the front end only connects to it and watches it
    process: Literal["main", "child", "remote"] = "main"
    bind: str | None = None  # where it listens when that is not ``address`` (e.g. tcp://0.0.0.0:PORT in a pod)
    # server.launcher ray, a remote replica's scheduler: the Ray resources its actor asks for (CPU, GPU, custom)
    resources: dict[str, float] = {}
    target: str | None = None  # a child process's factory "module:function" (custom or test actors)
    args: dict[str, Any] = {}  # extra keyword arguments for ``target``


class ReplicaPlacement(msgspec.Struct, forbid_unknown_fields=True):
    scheduler: Placement
    detokenizer: Placement


class RouterSection(msgspec.Struct, forbid_unknown_fields=True):
    """How a request picks its replica (``serving.managers.router``, which takes these as its config)."""

    policy: Literal["cache_aware", "round_robin", "shortest_queue"] = "cache_aware"
    cache_threshold: float = 0.5  # the share of a prompt a replica's prefixes must cover to win it
    balance_abs_threshold: int = 32  # requests in flight: both thresholds passed = imbalanced
    balance_rel_threshold: float = 1.5
    block_tokens: int = 16
    max_blocks: int = 65536  # prefix keys kept per replica (8 bytes and a dict slot each)


class ActorsSection(msgspec.Struct, forbid_unknown_fields=True):
    scheduler: Placement = msgspec.field(default_factory=lambda: Placement("inproc://scheduler"))
    detokenizer: Placement = msgspec.field(default_factory=lambda: Placement("inproc://detokenizer"))
    tokenizer: Placement = msgspec.field(default_factory=lambda: Placement("inproc://tokenizer"))
    # with scheduler.replicas > 1: each replica's placements (required over tcp://, one per replica);
    # without, replica i's addresses are the scheduler's and the detokenizer's with "-i" appended
    replicas: list[ReplicaPlacement] | None = None
    # required with replicas started elsewhere (process: remote): the front end's mailbox for the answers
    # to the heartbeats it sends them, which they dial (tcp://, a port of its own)
    monitor: Placement | None = None


class Topology(msgspec.Struct, forbid_unknown_fields=True):
    model: ModelSection = msgspec.field(default_factory=ModelSection)
    server: ServerSection = msgspec.field(default_factory=ServerSection)
    scheduler: SchedulerSection = msgspec.field(default_factory=SchedulerSection)
    supervision: SupervisionSection = msgspec.field(default_factory=SupervisionSection)
    watchdogs: WatchdogSection = msgspec.field(default_factory=WatchdogSection)
    transport: TransportSection = msgspec.field(default_factory=TransportSection)
    actors: ActorsSection = msgspec.field(default_factory=ActorsSection)
    router: RouterSection = msgspec.field(default_factory=lambda: RouterSection())

    def check(self) -> None:
        problems = [
            (self.server.workers >= 1, "server.workers", "must be >= 1"),
            (self.model.activations == "exact" or not self.model.device.startswith("cuda"), "model.activations",
             "int8 runs on CPU only (model.device is a CUDA device)"),
            (0 < self.server.port < 65536, "server.port", "must be in 1..65535"),
            (self.scheduler.page_size >= 1, "scheduler.page_size", "must be >= 1"),
            (self.scheduler.max_running_requests >= 1, "scheduler.max_running_requests", "must be >= 1"),
            (self.scheduler.chunked_prefill_size >= 1, "scheduler.chunked_prefill_size", "must be >= 1"),
            (1 <= self.scheduler.stream_interval <= 1024, "scheduler.stream_interval", "must be in 1..1024"),
            (1 <= self.scheduler.speculative_num_draft <= 16, "scheduler.speculative_num_draft", "must be in 1..16"),
            (1 <= self.scheduler.speculative_max_ngram <= 8, "scheduler.speculative_max_ngram", "must be in 1..8"),
            (1 <= self.scheduler.speculative_min_ngram <= self.scheduler.speculative_max_ngram,
             "scheduler.speculative_min_ngram", "must be in 1..scheduler.speculative_max_ngram"),
            (self.scheduler.speculative_max_batch >= 1, "scheduler.speculative_max_batch", "must be >= 1"),
            (self.scheduler.speculative_max_batch_sampled >= 0, "scheduler.speculative_max_batch_sampled",
             "must be >= 0"),
            (1 <= self.scheduler.replicas <= 64, "scheduler.replicas", "must be in 1..64"),
            (self.scheduler.threads is None or 1 <= self.scheduler.threads <= 1024, "scheduler.threads",
             "must be in 1..1024 (or null: by the cores)"),
            (0 <= self.router.cache_threshold <= 1, "router.cache_threshold", "must be in 0..1"),
            (self.router.balance_abs_threshold >= 0, "router.balance_abs_threshold", "must be >= 0"),
            (self.router.balance_rel_threshold >= 1, "router.balance_rel_threshold", "must be >= 1"),
            (1 <= self.router.block_tokens <= 4096, "router.block_tokens", "must be in 1..4096"),
            (1 <= self.router.max_blocks <= 2**24, "router.max_blocks", "must be in 1..16777216"),
            (self.supervision.max_restarts >= 0, "supervision.max_restarts", "must be >= 0"),
            (self.supervision.quarantine_after >= 1, "supervision.quarantine_after", "must be >= 1"),
            (self.supervision.trial_timeout > 0, "supervision.trial_timeout", "must be > 0"),
            (1 <= self.server.max_batch_size <= 65536, "server.max_batch_size", "must be in 1..65536"),
            (1 <= self.server.max_samples <= 65536, "server.max_samples", "must be in 1..65536"),
            (0 <= self.server.max_stop_strings <= 1024, "server.max_stop_strings", "must be in 0..1024"),
            (1 <= self.server.max_stop_length <= 65536, "server.max_stop_length", "must be in 1..65536"),
            (1 <= self.server.max_logprobs <= 2**31, "server.max_logprobs", "must be in 1..2147483648"),
            (self.server.body_timeout > 0, "server.body_timeout", "must be > 0"),
            (self.server.weights_drain_timeout > 0, "server.weights_drain_timeout", "must be > 0"),
            (self.server.request_wait > 0, "server.request_wait", "must be > 0"),
            (self.server.request_timeout is None or self.server.request_timeout > 0, "server.request_timeout",
             "must be > 0 (or null: off)"),
            (self.server.max_loop_lag > 0, "server.max_loop_lag", "must be > 0"),
            (self.watchdogs.step_timeout > 0, "watchdogs.step_timeout", "must be > 0"),
            (self.watchdogs.start_timeout > 0, "watchdogs.start_timeout", "must be > 0"),
            (self.watchdogs.load_timeout > 0, "watchdogs.load_timeout", "must be > 0"),
            (self.watchdogs.remote_timeout > 0, "watchdogs.remote_timeout", "must be > 0"),
        ]
        for ok, where, what in problems:
            if not ok:
                raise TopologyError(f"{where}: {what}")
        parse_size(self.scheduler.kv_budget, "scheduler.kv_budget")
        parse_size(self.transport.max_message_bytes, "transport.max_message_bytes")
        self.hub_options(generate=False)
        if parse_size(self.server.max_request_bytes, "server.max_request_bytes") < 1024:
            raise TopologyError("server.max_request_bytes: must be at least 1KiB")
        if self.server.max_body_bytes_in_flight is not None and \
                parse_size(self.server.max_body_bytes_in_flight, "server.max_body_bytes_in_flight") < \
                parse_size(self.server.max_request_bytes, "server.max_request_bytes"):
            raise TopologyError("server.max_body_bytes_in_flight: must be at least server.max_request_bytes")
        placements = [(f"actors.{name}", getattr(self.actors, name))
                      for name in ("scheduler", "detokenizer", "tokenizer")]
        for i, replica in enumerate(self.actors.replicas or []):
            placements += [(f"actors.replicas.{i}.scheduler", replica.scheduler),
                           (f"actors.replicas.{i}.detokenizer", replica.detokenizer)]
        if self.actors.monitor is not None:
            placements.append(("actors.monitor", self.actors.monitor))
        for where, placement in placements:
            for field, value in (("address", placement.address), ("bind", placement.bind)):
                if value is not None and not re.fullmatch(r"(inproc|ipc|tcp)://.+", value):
                    raise TopologyError(f"{where}.{field}: {value!r} is not "
                                        "inproc://NAME, ipc:///PATH or tcp://HOST:PORT")
            if placement.process == "remote" and not (where.startswith("actors.replicas.")
                                                      and placement.address.startswith("tcp://")):
                raise TopologyError(f"{where}.process: remote placements are replicas' (actors.replicas), over tcp://")
            if placement.process == "child" and placement.address.startswith("inproc://"):
                raise TopologyError(f"{where}: a child process cannot be reached over inproc://")
            if any(amount < 0 for amount in placement.resources.values()):
                raise TopologyError(f"{where}.resources: amounts must be >= 0 ({placement.resources})")
            if placement.address.startswith("tcp://") and not _loopback(placement.address, where) \
                    and self.transport.curve is None and not self.transport.allow_insecure:
                raise TopologyError(f"{where}.address: {placement.address} is not a loopback address: "
                                    "secure it with transport.curve, or set transport.allow_insecure: true")
        self._check_replicas()
        self._check_inproc_reach()
        if self.actors.tokenizer.process != "main":
            raise TopologyError("actors.tokenizer.process: the tokenizer manager runs with the HTTP server (main)")
        if self.server.workers > 1:
            for name in ("scheduler", "tokenizer"):
                if getattr(self.actors, name).address.startswith("inproc://"):
                    raise TopologyError(f"actors.{name}.address: with server.workers > 1 the tokenizer workers "
                                        "are processes of their own; use ipc:// or tcp://")
            if self.server.workers > 64:
                raise TopologyError("server.workers: at most 64")

    def _check_inproc_reach(self) -> None:
        """inproc:// reaches the actors of one process only. Where an actor of a request path (a scheduler, its
        detokenizer and the tokenizer manager, which send to one another) runs in another process, the ones in
        main need ipc:// or tcp://: a message to an inproc:// address from a child waits forever (a request
        then hung until the output watchdog, and hung again when resumed)."""
        paths = [("actors", self.actors.scheduler, self.actors.detokenizer)]
        paths += [(f"actors.replicas.{i}", replica.scheduler, replica.detokenizer)
                  for i, replica in enumerate(self.actors.replicas or [])]
        for where, scheduler, detokenizer in paths:
            members = {f"{where}.scheduler": scheduler, f"{where}.detokenizer": detokenizer,
                       "actors.tokenizer": self.actors.tokenizer}
            elsewhere = [name for name, placement in members.items() if placement.process != "main"]
            if not elsewhere:
                continue
            for name, placement in members.items():
                if placement.process == "main" and placement.address.startswith("inproc://"):
                    raise TopologyError(f"{name}.address: {placement.address} cannot be reached from "
                                        f"{' and '.join(elsewhere)} in another process; use ipc:// or tcp://")

    def _check_replicas(self) -> None:
        n, listed = self.scheduler.replicas, self.actors.replicas
        if listed is not None and len(listed) != n:
            raise TopologyError(f"actors.replicas: {len(listed)} placements for scheduler.replicas: {n}")
        for i, replica in enumerate(listed or []):
            if (replica.scheduler.process == "remote") != (replica.detokenizer.process == "remote"):
                raise TopologyError(f"actors.replicas.{i}: its scheduler and detokenizer run together (both remote "
                                    "or neither)")
        remote = any(r.scheduler.process == "remote" for r in listed or [])
        if self.server.launcher == "ray" and not remote:
            raise TopologyError("server.launcher: ray starts the remote replicas (process: remote in actors.replicas); "
                                "this topology has none")
        if not self.replicated:
            return
        if listed is None:
            for name in ("scheduler", "detokenizer"):
                if getattr(self.actors, name).address.startswith("tcp://"):
                    raise TopologyError(f"actors.{name}.address: with scheduler.replicas > 1 over tcp:// give each "
                                        "replica's addresses in actors.replicas")
        if remote and self.transport.curve is not None and self.transport.curve.generate:
            raise TopologyError("transport.curve.generate: replicas started elsewhere cannot share keys made at "
                                "start; give the key files (secret_file, server_public_file, authorized_dir)")
        if self.server.workers > 1:
            raise TopologyError("scheduler.replicas: replica sets with server.workers > 1 are not supported yet; "
                                "use one tokenizer worker")
        addresses = [a for r in self.replica_addresses(Path("/")) for a in r.values()]
        if len(set(addresses)) != len(addresses):
            raise TopologyError(f"actors.replicas: two replicas share an address ({sorted(addresses)})")
        monitor = self.monitor_placement()
        if remote and (monitor is None or not monitor.address.startswith("tcp://")):
            raise TopologyError("actors.monitor: the remote replicas answer the front end's heartbeats there: give it "
                                "a tcp://HOST:PORT address they reach, a port of its own (e.g. actors.monitor: "
                                "{address: \"tcp://FRONTEND:30103\"})")
        if monitor is not None and monitor.process != "main":
            raise TopologyError("actors.monitor.process: the monitor runs with the tokenizer manager (main)")
        if monitor is not None and monitor.address in {self.actors.tokenizer.address, *(
                a for r in self.replica_addresses(Path("/")) for a in r.values())}:
            raise TopologyError(f"actors.monitor.address: {monitor.address} is another actor's; give actors.monitor "
                                "an address of its own")

    def hub_options(self, *, generate: bool = True) -> HubOptions:
        """What every hub of this server opens with (``generate``: make the keys of
        ``curve.generate`` now; False: check the section only)."""
        t = self.transport
        curve = None
        if t.curve is not None:
            try:
                if t.curve.generate:
                    curve = CurveConfig.generate() if generate else None
                else:
                    curve = CurveConfig(secret_file=t.curve.secret_file, server_public_file=t.curve.server_public_file,
                                        authorized_dir=t.curve.authorized_dir)
                    curve.load()  # the files are there and hold keys
            except (ValueError, OSError) as exc:
                raise TopologyError(f"transport.curve: {exc}") from None
        return HubOptions(curve=curve, max_message_bytes=parse_size(t.max_message_bytes, "transport.max_message_bytes"),
                          allow_insecure=t.allow_insecure)

    def addresses(self, runtime_dir: Path) -> dict[str, str]:
        """Each actor's address, ``{runtime_dir}`` filled in."""
        return {name: getattr(self.actors, name).address.replace("{runtime_dir}", str(runtime_dir))
                for name in ("scheduler", "detokenizer", "tokenizer")}

    def replica_placements(self) -> list[ReplicaPlacement]:
        """Each replica's scheduler and detokenizer placement (addresses unfilled)."""
        if self.actors.replicas is not None:
            return list(self.actors.replicas)
        sched, detok, n = self.actors.scheduler, self.actors.detokenizer, self.scheduler.replicas
        if n == 1:
            return [ReplicaPlacement(sched, detok)]
        return [ReplicaPlacement(msgspec.structs.replace(sched, address=f"{sched.address}-{i}"),
                                 msgspec.structs.replace(detok, address=f"{detok.address}-{i}")) for i in range(n)]

    def monitor_placement(self) -> Placement | None:
        """Where the answers to the heartbeats sent to remote replicas come (None without remote replicas)."""
        remote = any(r.scheduler.process == "remote" for r in self.replica_placements())
        return self.actors.monitor if remote else None

    @property
    def replicated(self) -> bool:
        """Served by a replica set (several replicas, or any started elsewhere), not one scheduler."""
        return self.scheduler.replicas > 1 or any(r.scheduler.process == "remote" for r in self.replica_placements())

    def replica_addresses(self, runtime_dir: Path, *, bind: bool = False) -> list[dict[str, str]]:
        """Each replica's ``{"scheduler": ..., "detokenizer": ...}``, ``{runtime_dir}`` filled in
        (``bind``: where each listens, its ``bind`` where given)."""
        return [{name: ((getattr(r, name).bind if bind else None) or getattr(r, name).address)
                 .replace("{runtime_dir}", str(runtime_dir)) for name in ("scheduler", "detokenizer")}
                for r in self.replica_placements()]

    def worker_addresses(self, runtime_dir: Path) -> list[str]:
        """The mailbox of each tokenizer worker: the tokenizer address, numbered when there are several."""
        address = self.actors.tokenizer.address.replace("{runtime_dir}", str(runtime_dir))
        if self.server.workers == 1:
            return [address]
        if address.startswith("tcp://"):
            host, _, port = address.rpartition(":")
            return [f"{host}:{int(port) + i}" if int(port) else address for i in range(self.server.workers)]
        return [f"{address}-{i}" for i in range(self.server.workers)]

    def local_replicas(self) -> int:
        """The replicas whose scheduler starts on this host (not ``process: remote``)."""
        return sum(r.scheduler.process != "remote" for r in self.replica_placements())

    def weights_roots(self) -> list[str]:
        """Where new weights may come from, resolved: the model's own directory and ``server.weights_roots``
        (HTTP checks them, and each scheduler again: a peer on the wire may send any path)."""
        roots = [Path(root) for root in self.server.weights_roots]
        path = self.model.path
        if path not in (None, "tiny"):
            roots.append(Path(path) if Path(path).is_dir() else Path(path).parent)
        return [str(root.resolve()) for root in roots]


def _loopback(address: str, field: str) -> bool:
    try:
        return Address.parse(address).is_loopback
    except AddressError as exc:
        raise TopologyError(f"{field}.address: {exc}") from None


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(value: int | str, field: str) -> int:
    """Bytes from an int or a string like ``512MiB`` / ``2GB``."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
    if match is None or match[2].lower() not in _UNITS:
        raise TopologyError(f"{field}: {value!r} is not a size (e.g. 268435456, 256MiB, 1GB)")
    return int(float(match[1]) * _UNITS[match[2].lower()])


def load_topology(source: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Topology:
    """Read a YAML topology (a path, or a name in configs/); apply dotted overrides."""
    path = _resolve(source)
    text = path.read_text()
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise TopologyError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise TopologyError(f"{path}: the top level must be a mapping of sections")
    for dotted, value in (overrides or {}).items():
        section, _, key = dotted.partition(".")
        data.setdefault(section, {})[key] = value
    try:
        topology = msgspec.convert(data, Topology)
    except msgspec.ValidationError as exc:
        message = str(exc)
        unknown = re.search(r"unknown field `([^`]+)` - at `(\$[^`]*)`", message)
        if unknown:  # point at the unknown key itself
            message = f"unknown field - at `{unknown[2]}.{unknown[1]}`"
        raise TopologyError(f"{path}{_line_of(text, message)}: {_readable(message)}") from None
    try:
        topology.check()
    except TopologyError as exc:
        field = str(exc).split(":", 1)[0]
        raise TopologyError(f"{path}{_line_of(text, '$.' + field)}: {exc}") from None
    return topology


def _resolve(source: str | Path | None) -> Path:
    if source is None:
        return CONFIGS / "default.yaml"
    path = Path(source)
    if not path.exists() and (CONFIGS / f"{source}.yaml").exists():
        path = CONFIGS / f"{source}.yaml"
    if not path.exists():
        raise TopologyError(f"{source}: no such topology file (shipped: "
                            f"{', '.join(sorted(p.stem for p in CONFIGS.glob('*.yaml')))})")
    return path


def _readable(message: str) -> str:
    # msgspec says "... - at `$.scheduler.page_size`"; say the field first, as YAML spells it
    match = re.search(r"at `\$\.?([^`]*)`", message)
    if match is None:
        return message
    field = re.sub(r"\[(\d+)\]", r".\1", match[1])
    return f"{field}: {message[: match.start()].rstrip(' -')}"


def _line_of(text: str, message: str) -> str:
    """``:LINE`` of the YAML node a msgspec error path points at, if found."""
    # msgspec's path is in backticks ("- at `$.model.device`"); the value may hold a "$" too
    match = re.search(r"`\$\.?([\w.\[\]]*)`", message) or re.search(r"\$\.?([\w.\[\]]*)", message)
    if match is None:
        return ""
    node = yaml.compose(text)
    line = None
    for key in filter(None, re.split(r"[.\[\]]", match[1])):
        if not isinstance(node, yaml.MappingNode):
            break
        for key_node, value_node in node.value:
            if key_node.value == key:
                line, node = key_node.start_mark.line + 1, value_node
                break
        else:
            break
    return f":{line}" if line else ""


def tokenizer_source(model: ModelSection) -> str | None:
    if model.tokenizer is not None:
        return model.tokenizer
    return None if model.path in (None, "tiny") else model.path
