"""Topologies: which actors run where, over which links, under what supervision.

A YAML file (see ``configs/``) is validated into ``Topology``; a mistake is a
``TopologyError`` naming the file, line and field. ``build_children`` turns a
topology into the supervisor's child specs: each actor in this process or in
a child process, each link ``inproc://``, ``ipc://`` or ``tcp://`` by its
address. ``{runtime_dir}`` in an address is a private temporary directory.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml

from actors import ActorChild, Backoff, ChildSpec, Supervisor
from actors.process import ProcessChild

from .scheduler import Scheduler, SchedulerConfig

__all__ = ["Topology", "TopologyError", "build_children", "load_topology", "parse_size"]

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


class TopologyError(ValueError):
    """A topology file or option that cannot be used; the message names the field."""


class ModelSection(msgspec.Struct, forbid_unknown_fields=True):
    path: str | None = None  # None: the embedded SmolLM2; "tiny": a tiny random model (tests)
    tokenizer: str | None = None  # default: the model's
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    served_model_name: str | None = None


class ServerSection(msgspec.Struct, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    workers: int = 1  # tokenizer/HTTP worker processes
    request_wait: float = 60.0  # how long a new request waits for a restarting scheduler


class SchedulerSection(msgspec.Struct, forbid_unknown_fields=True):
    page_size: int = 1
    kv_budget: int | str = "256MiB"
    max_running_requests: int = 64
    max_queued_requests: int = 1024
    chunked_prefill_size: int = 512
    schedule_policy: Literal["fcfs", "lpm"] = "fcfs"
    enable_prefix_cache: bool = True


class SupervisionSection(msgspec.Struct, forbid_unknown_fields=True):
    strategy: Literal["one_for_one", "one_for_all", "rest_for_one"] = "one_for_one"
    max_restarts: int = 3
    within: float = 60.0
    backoff_initial: float = 0.0
    backoff_max: float = 5.0
    shutdown_grace: float = 10.0


class WatchdogSection(msgspec.Struct, forbid_unknown_fields=True):
    step_timeout: float = 120.0  # one model step
    output_timeout: float = 300.0  # no output while requests are in flight (soft watchdog)


class Placement(msgspec.Struct, forbid_unknown_fields=True):
    address: str
    process: Literal["main", "child"] = "main"
    target: str | None = None  # a child process's factory "module:function" (custom or test actors)
    args: dict[str, Any] = {}  # extra keyword arguments for ``target``


class ActorsSection(msgspec.Struct, forbid_unknown_fields=True):
    scheduler: Placement = msgspec.field(default_factory=lambda: Placement("inproc://scheduler"))
    detokenizer: Placement = msgspec.field(default_factory=lambda: Placement("inproc://detokenizer"))
    tokenizer: Placement = msgspec.field(default_factory=lambda: Placement("inproc://tokenizer"))


class Topology(msgspec.Struct, forbid_unknown_fields=True):
    model: ModelSection = msgspec.field(default_factory=ModelSection)
    server: ServerSection = msgspec.field(default_factory=ServerSection)
    scheduler: SchedulerSection = msgspec.field(default_factory=SchedulerSection)
    supervision: SupervisionSection = msgspec.field(default_factory=SupervisionSection)
    watchdogs: WatchdogSection = msgspec.field(default_factory=WatchdogSection)
    actors: ActorsSection = msgspec.field(default_factory=ActorsSection)

    def check(self) -> None:
        problems = [
            (self.server.workers >= 1, "server.workers", "must be >= 1"),
            (0 < self.server.port < 65536, "server.port", "must be in 1..65535"),
            (self.scheduler.page_size >= 1, "scheduler.page_size", "must be >= 1"),
            (self.scheduler.max_running_requests >= 1, "scheduler.max_running_requests", "must be >= 1"),
            (self.scheduler.chunked_prefill_size >= 1, "scheduler.chunked_prefill_size", "must be >= 1"),
            (self.supervision.max_restarts >= 0, "supervision.max_restarts", "must be >= 0"),
            (self.watchdogs.step_timeout > 0, "watchdogs.step_timeout", "must be > 0"),
        ]
        for ok, where, what in problems:
            if not ok:
                raise TopologyError(f"{where}: {what}")
        parse_size(self.scheduler.kv_budget, "scheduler.kv_budget")
        for name in ("scheduler", "detokenizer", "tokenizer"):
            placement = getattr(self.actors, name)
            if not re.fullmatch(r"(inproc|ipc|tcp)://.+", placement.address):
                raise TopologyError(f"actors.{name}.address: {placement.address!r} is not "
                                    "inproc://NAME, ipc:///PATH or tcp://HOST:PORT")
            if placement.process == "child" and placement.address.startswith("inproc://"):
                raise TopologyError(f"actors.{name}: a child process cannot be reached over inproc://")
        if self.actors.tokenizer.process != "main":
            raise TopologyError("actors.tokenizer.process: the tokenizer manager runs with the HTTP server (main)")
        if self.server.workers > 1:
            for name in ("scheduler", "tokenizer"):
                if getattr(self.actors, name).address.startswith("inproc://"):
                    raise TopologyError(f"actors.{name}.address: with server.workers > 1 the tokenizer workers "
                                        "are processes of their own; use ipc:// or tcp://")
            if self.server.workers > 64:
                raise TopologyError("server.workers: at most 64")

    def worker_addresses(self, runtime_dir: Path) -> list[str]:
        """The mailbox of each tokenizer worker: the tokenizer address, numbered when there are several."""
        address = self.actors.tokenizer.address.replace("{runtime_dir}", str(runtime_dir))
        if self.server.workers == 1:
            return [address]
        if address.startswith("tcp://"):
            host, _, port = address.rpartition(":")
            return [f"{host}:{int(port) + i}" if int(port) else address for i in range(self.server.workers)]
        return [f"{address}-{i}" for i in range(self.server.workers)]

    def scheduler_config(self, detokenizer: str) -> SchedulerConfig:
        s = self.scheduler
        return SchedulerConfig(
            model=self.model.path, dtype=self.model.dtype, page_size=s.page_size,
            kv_budget_bytes=parse_size(s.kv_budget, "scheduler.kv_budget"),
            max_running_requests=s.max_running_requests, max_queued_requests=s.max_queued_requests,
            chunked_prefill_size=s.chunked_prefill_size, schedule_policy=s.schedule_policy,
            enable_prefix_cache=s.enable_prefix_cache, step_timeout=self.watchdogs.step_timeout,
            detokenizer=detokenizer,
        )


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
    match = re.search(r"\$\.?([\w.\[\]]*)", message)
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


def build_children(topology: Topology, hub: Any, tokenizer: Any, runtime_dir: Path,
                   frontend: Any) -> tuple[list[ChildSpec], dict[str, str]]:
    """Child specs in start order — scheduler, detokenizer, then what ``frontend(addresses)``
    returns (the tokenizer manager, or the tokenizer workers) — and the addresses."""
    addresses = {
        name: getattr(topology.actors, name).address.replace("{runtime_dir}", str(runtime_dir))
        for name in ("scheduler", "detokenizer", "tokenizer")
    }
    workers = topology.worker_addresses(runtime_dir)
    grace = topology.supervision.shutdown_grace
    config = topology.scheduler_config(addresses["detokenizer"])
    detok_args = {"address": addresses["detokenizer"], "tokenizer": tokenizer_source(topology.model),
                  "workers": workers, "scheduler": addresses["scheduler"]}
    placement = topology.actors.scheduler
    if placement.process == "child":
        scheduler = lambda: ProcessChild(  # noqa: E731
            placement.target or "serving.scheduler:scheduler_child",
            {"address": addresses["scheduler"], "config": msgspec.to_builtins(config), **placement.args},
            name="scheduler", kill_after=grace)
    else:
        scheduler = lambda: ActorChild(lambda: Scheduler(config), addresses["scheduler"], hub)  # noqa: E731
    if topology.actors.detokenizer.process == "child":
        detokenizer = lambda: ProcessChild(  # noqa: E731
            topology.actors.detokenizer.target or "serving.detokenizer:detokenizer_child",
            {**detok_args, **topology.actors.detokenizer.args}, name="detokenizer", kill_after=grace)
    else:
        from .detokenizer import DetokenizerManager

        detokenizer = lambda: ActorChild(  # noqa: E731
            lambda: DetokenizerManager(tokenizer, detok_args["workers"], addresses["scheduler"]),
            addresses["detokenizer"], hub)
    specs = [
        ChildSpec("scheduler", scheduler, shutdown=grace),
        ChildSpec("detokenizer", detokenizer, shutdown=grace),
        *frontend(addresses),
    ]
    return specs, addresses


def tokenizer_source(model: ModelSection) -> str | None:
    if model.tokenizer is not None:
        return model.tokenizer
    return None if model.path in (None, "tiny") else model.path


def make_supervisor(topology: Topology, specs: list[ChildSpec], observer: Any) -> Supervisor:
    s = topology.supervision
    return Supervisor("server", specs, strategy=s.strategy, max_restarts=s.max_restarts, within=s.within,
                      backoff=Backoff(s.backoff_initial, 2.0, s.backoff_max), observer=observer)
