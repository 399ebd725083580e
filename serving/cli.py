"""``tercet serve``: start a topology and its HTTP server.

Flags override the topology file; their names follow SGLang and vLLM. With
one tokenizer manager, hypercorn serves the app here and its lifespan starts
the topology (``serving.runtime.launch``); with tokenizer workers, this
process binds the port and supervises, and the workers serve it
(``serving.runtime.workers``).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import trio
from hypercorn.trio import serve as hypercorn_serve
from starlette.applications import Starlette

from .http.app import build_app, hypercorn_config
from .runtime.engine import failure_cause
from .runtime.launch import open_runtime
from .runtime.replicas import run_replica
from .runtime.topology import Topology, TopologyError, load_topology
from .runtime.workers import open_worker_pool

__all__ = ["main", "serve", "serve_workers", "serving_app"]

log = logging.getLogger(__name__)

# flag → dotted topology field
OVERRIDES = {
    "model": "model.path",
    "tokenizer": "model.tokenizer",
    "dtype": "model.dtype",
    "device": "model.device",
    "activations": "model.activations",
    "served_model_name": "model.served_model_name",
    "host": "server.host",
    "port": "server.port",
    "api_key": "server.api_key",
    "admin_api_key": "server.admin_api_key",
    "max_request_bytes": "server.max_request_bytes",
    "weights_root": "server.weights_roots",
    "tokenizer_worker_num": "server.workers",
    "max_running_requests": "scheduler.max_running_requests",
    "max_queued_requests": "scheduler.max_queued_requests",
    "chunked_prefill_size": "scheduler.chunked_prefill_size",
    "stream_interval": "scheduler.stream_interval",
    "kv_budget": "scheduler.kv_budget",
    "page_size": "scheduler.page_size",
    "schedule_policy": "scheduler.schedule_policy",
    "enable_deterministic_inference": "scheduler.enable_deterministic_inference",
    "speculative": "scheduler.speculative",
    "speculative_num_draft": "scheduler.speculative_num_draft",
    "speculative_max_ngram": "scheduler.speculative_max_ngram",
    "speculative_min_ngram": "scheduler.speculative_min_ngram",
    "speculative_max_batch": "scheduler.speculative_max_batch",
    "speculative_max_batch_sampled": "scheduler.speculative_max_batch_sampled",
    "tool_call_parser": "server.tool_call_parser",
    "reasoning_parser": "server.reasoning_parser",
    "dp_size": "scheduler.replicas",
    "router_policy": "router.policy",
    "launcher": "server.launcher",
    "ray_address": "server.ray_address",
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tercet", description="tercet: an LLM server on a trio actor runtime")
    sub = p.add_subparsers(dest="command", required=True)
    serve_p = sub.add_parser("serve", help="serve a model over HTTP (OpenAI-compatible and SGLang's /generate)")
    serve_p.add_argument("--config", help="a topology YAML file, or the name of one in configs/ (default: default)")
    serve_p.add_argument("--model", "--model-path", dest="model",
                         help="a local HF directory or GGUF file (default: the embedded SmolLM2)")
    serve_p.add_argument("--tokenizer", "--tokenizer-path", dest="tokenizer")
    serve_p.add_argument("--served-model-name")
    serve_p.add_argument("--host")
    serve_p.add_argument("--port", type=int)
    serve_p.add_argument("--api-key", help="every route but /health needs 'Authorization: Bearer KEY' (every "
                         "local user reads a command line: prefer --api-key-file or TERCET_API_KEY)")
    serve_p.add_argument("--api-key-file", help="read the API key from this file (e.g. a mounted Secret); "
                         "or set TERCET_API_KEY")
    serve_p.add_argument("--admin-api-key", help="the admin routes need this key instead (pause, continue, "
                         "flush, abort, update weights, server info); prefer --admin-api-key-file or "
                         "TERCET_ADMIN_API_KEY")
    serve_p.add_argument("--admin-api-key-file", help="read the admin API key from this file; or set "
                         "TERCET_ADMIN_API_KEY")
    serve_p.add_argument("--max-request-bytes", help="a larger request body gets 413 (default 32MiB)")
    serve_p.add_argument("--weights-root", action="append",
                         help="a directory /update_weights_from_disk may load from (besides the model's own); repeatable")
    serve_p.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"])
    serve_p.add_argument("--device", help="auto (CUDA when torch sees a GPU), cpu, cuda or cuda:N")
    serve_p.add_argument("--activations", choices=["exact", "int8"],
                         help="int8: a Q4_1 / Q8_0 GGUF's projections multiply int8 activations, as llama.cpp does "
                              "(~2x the products on CPU; not the exact outputs, still deterministic); default exact")
    serve_p.add_argument("--max-running-requests", type=int)
    serve_p.add_argument("--max-queued-requests", type=int)
    serve_p.add_argument("--chunked-prefill-size", type=int)
    serve_p.add_argument("--stream-interval", type=int,
                         help="send tokens every N (default 1): fewer stream events, less CPU per token")
    serve_p.add_argument("--kv-budget", help="KV cache memory, e.g. 512MiB")
    serve_p.add_argument("--page-size", type=int)
    serve_p.add_argument("--schedule-policy", choices=["fcfs", "lpm"])
    serve_p.add_argument("--tokenizer-worker-num", type=int)
    serve_p.add_argument("--dp-size", type=int, help="data-parallel scheduler replicas, each with its own model "
                         "and KV cache (scheduler.replicas)")
    serve_p.add_argument("--router-policy", choices=["cache_aware", "round_robin", "shortest_queue"],
                         help="which replica a request goes to (router.policy; default cache_aware)")
    serve_p.add_argument("--launcher", choices=["local", "ray"], help="ray: start the remote replicas as actors "
                         "on a Ray cluster (server.launcher; pip install tercet[ray])")
    serve_p.add_argument("--ray-address", help="the Ray cluster (server.ray_address; default: auto)")
    serve_p.add_argument("--tool-call-parser", help="the format of tool calls: hermes (<tool_call> JSON blocks)")
    serve_p.add_argument("--reasoning-parser", help="split a model's <think>...</think> block into reasoning_content: "
                         "qwen3 (the answer may open one) or deepseek-r1 (the answer starts inside one)")
    serve_p.add_argument("--enable-deterministic-inference", action=argparse.BooleanOptionalAction, default=None,
                         help="batch-invariant kernels (the default on CPU): greedy output independent of batching, "
                              "prefix cache, chunking and crash resume")
    serve_p.add_argument("--disable-deterministic-inference", dest="enable_deterministic_inference",
                         action="store_false", default=argparse.SUPPRESS,
                         help="the kernels that may round a row differently with the batch (1-4 %% faster)")
    serve_p.add_argument("--speculative", choices=["none", "ngram"],
                         help="ngram: speculative decoding by prompt lookup, the text unchanged (docs/speculative.md)")
    serve_p.add_argument("--speculative-num-draft", type=int, help="draft tokens a request verifies per step (1..16)")
    serve_p.add_argument("--speculative-max-ngram", type=int, help="the longest suffix looked up (default 3)")
    serve_p.add_argument("--speculative-min-ngram", type=int, help="the shortest suffix looked up (default 2)")
    serve_p.add_argument("--speculative-max-batch", type=int, help="no drafts while more requests run (default 4)")
    serve_p.add_argument("--speculative-max-batch-sampled", type=int,
                         help="...for a sampled request (default 0: sampled requests do not draft)")
    serve_p.add_argument("--log-level", default="info")
    replica_p = sub.add_parser("replica", help="run one replica of a topology whose replicas are remote "
                               "(a Kubernetes pod, a host of its own): its scheduler and detokenizer")
    replica_p.add_argument("--config", required=True, help="the topology YAML the front end serves")
    replica_p.add_argument("--index", type=int, required=True, help="which of actors.replicas this is")
    replica_p.add_argument("--log-level", default="info")
    return p


# the keys' other sources, besides the flags: a file (a mounted Secret), then the environment
KEY_SOURCES = {"api_key": ("api_key_file", "TERCET_API_KEY"),
               "admin_api_key": ("admin_api_key_file", "TERCET_ADMIN_API_KEY")}


def topology_from(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> Topology:
    overrides: dict[str, Any] = {}
    for flag, dotted in OVERRIDES.items():
        value = getattr(args, flag, None)
        if value is not None:
            overrides[dotted] = value
    overrides.update(api_keys(args, environ))
    return load_topology(args.config, overrides)


def api_keys(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, str]:
    """``server.api_key`` / ``admin_api_key`` from ``--*-file`` or ``TERCET_*API_KEY``, where no other
    local user can read them (a command line is world-readable in /proc); the flag itself wins."""
    found = {}
    for key, (file_flag, variable) in KEY_SOURCES.items():
        path = getattr(args, file_flag, None)
        if getattr(args, key, None) is not None:
            if path is not None:
                raise TopologyError(f"--{key.replace('_', '-')} and --{file_flag.replace('_', '-')}: give one")
            log.warning("--%s on the command line is readable by every local user; use --%s or %s",
                        key.replace("_", "-"), file_flag.replace("_", "-"), variable)
        elif path is not None:
            found[f"server.{key}"] = _read_key(path, f"--{file_flag.replace('_', '-')}")
        elif environ.get(variable):
            found[f"server.{key}"] = _check_key(environ[variable], variable)
    return found


def _read_key(path: str, source: str) -> str:
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise TopologyError(f"{source}: cannot read {path}: {exc.strerror if isinstance(exc, OSError) else exc}") \
            from None
    return _check_key(text.strip("\r\n"), f"{source} {path}")  # (a file usually ends with a newline)


def _check_key(key: str, source: str) -> str:
    if not key or not key.isprintable() or key != key.strip():
        raise TopologyError(f"{source}: the key is empty, or has spaces at its ends or unprintable characters")
    return key


async def _until_signal_or(failed: trio.Event, failure_grace: float) -> None:
    async with trio.open_nursery() as nursery:

        async def on_failure() -> None:
            await failed.wait()
            await trio.sleep(failure_grace)  # the error responses reach their clients
            nursery.cancel_scope.cancel()

        async def on_signal() -> None:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    return

        nursery.start_soon(on_failure)
        nursery.start_soon(on_signal)


def listening_socket(host: str, port: int) -> socket.socket:
    """The HTTP socket the tokenizer workers share (they inherit it: the port stays open while one restarts)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host.strip("[]"), port), family=family, backlog=2048)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)  # each worker accepts from it in its own event loop
    return sock


async def serve_workers(topology: Topology, *, failure_grace: float = 1.0,
                        task_status: Any = trio.TASK_STATUS_IGNORED) -> BaseException | None:
    """``server.workers > 1``: the supervisor here, HTTP in the worker processes."""
    with listening_socket(topology.server.host, topology.server.port) as sock:
        async with open_worker_pool(topology, sock.fileno()) as pool:
            host, port = sock.getsockname()[:2]
            log.info("ready on http://%s:%d: %s, %d tokenizer workers", host, port, describe(topology),
                     topology.server.workers)
            task_status.started(pool)
            await _until_signal_or(pool.status.failed, failure_grace)
        return pool.status.failure


def serving_app(topology: Topology) -> Starlette:
    """The HTTP app of a server with one tokenizer manager: its lifespan starts ``topology``."""
    return build_app(topology, lambda: open_runtime(topology))


async def serve(topology: Topology, *, failure_grace: float = 1.0) -> BaseException | None:
    """Serve until SIGINT/SIGTERM, or until the runtime fails for good (returned)."""
    if topology.server.workers > 1:
        return await serve_workers(topology, failure_grace=failure_grace)
    # the first start converts the GGUF weights: allow for it
    config = hypercorn_config(f"{topology.server.host}:{topology.server.port}", startup_timeout=900)
    app = serving_app(topology)

    ready_or_failed = trio.Event()

    async def shutdown_trigger() -> None:
        async with trio.open_nursery() as nursery:

            async def relay_failure() -> None:
                await app.state.ready.wait()
                await app.state.server.runtime.status.failed.wait()
                ready_or_failed.set()

            nursery.start_soon(relay_failure)
            await _until_signal_or(ready_or_failed, failure_grace)
            nursery.cancel_scope.cancel()
        if app.state.ready.is_set():  # end what is in flight with a 503 (streams: an error event), as a
            # tokenizer worker does when it stops: hypercorn's grace period then delivers it, never a cut stream
            app.state.server.runtime.tokenizer_manager.fail_all("the server is shutting down")

    try:
        await hypercorn_serve(app, config, shutdown_trigger=shutdown_trigger)
    except BaseException as exc:
        failed = getattr(app.state, "startup_error", None)
        if failed is not None:  # hypercorn wraps it in a traceback dump: hand on the error itself
            raise StartupError(cause_of(failed)) from failed
        raise
    return app.state.server.runtime.status.failure if app.state.ready.is_set() else None


class StartupError(Exception):
    """The server could not start; the message is one line naming the cause."""


def check_model(topology: Topology) -> None:
    """Before anything starts: the model named exists (a TopologyError naming the field)."""
    from models.errors import ModelLoadError
    from models.loading import embedded_gguf_path

    path = topology.model.path
    if path == "tiny":
        return
    if path is None:
        try:
            embedded_gguf_path()
        except ModelLoadError as exc:
            raise TopologyError(f"model.path: {exc}") from None
        return
    if not os.path.exists(path):
        raise TopologyError(f"model.path: {path} does not exist (give a local Hugging Face model directory "
                            "or a .gguf file; nothing is downloaded)")
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "config.json")):
        raise TopologyError(f"model.path: {path} has no config.json (not a Hugging Face model directory)")
    if os.path.isfile(path) and not path.endswith(".gguf"):
        raise TopologyError(f"model.path: {path} is a file but not a .gguf model")


def cause_of(exc: BaseException) -> str:
    """One line for a failure: the innermost error that says what went wrong."""
    exc = failure_cause(exc)
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())[:1000]


def describe(topology: Topology) -> str:
    m = topology.model
    model = "the embedded SmolLM2-135M-Instruct" if m.path is None else m.path
    replicas = topology.scheduler.replicas
    dp = f", {replicas} replicas routed {topology.router.policy}" if replicas > 1 else ""
    return f"{model} ({m.dtype}, device {m.device}{dp})"


async def serve_replica(topology: Topology, index: int) -> None:
    """``tercet replica``: until SIGINT/SIGTERM, or past the restart intensity (raises)."""
    async with trio.open_nursery() as nursery:
        await nursery.start(run_replica, topology, index)
        log.info("replica %d serving: scheduler %s, detokenizer %s", index,
                 *topology.replica_addresses(Path("."))[index].values())
        await _until_signal_or(trio.Event(), 0.0)
        nursery.cancel_scope.cancel()


def replica_main(args: argparse.Namespace) -> int:
    try:
        topology = load_topology(args.config)
        check_model(topology)
        trio.run(serve_replica, topology, args.index)
    except TopologyError as exc:
        print(f"tercet: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    except Exception as exc:  # noqa: BLE001 - past the restart intensity, or it could not start
        print(f"tercet replica {args.index}: {cause_of(exc)}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    debug = args.log_level.lower() == "debug"
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "replica":
        return replica_main(args)
    try:
        topology = topology_from(args)
        check_model(topology)
    except TopologyError as exc:
        print(f"tercet: {exc}", file=sys.stderr)
        return 2
    log.info("loading %s; %s", describe(topology), f"{topology.server.workers} tokenizer worker processes"
             if topology.server.workers > 1 else "one tokenizer manager")
    try:
        failure = trio.run(serve, topology)
    except KeyboardInterrupt:
        return 0
    except Exception as exc:  # noqa: BLE001 - a runtime that failed to start: one line, exit non-zero
        log.debug("start-up failed", exc_info=exc)
        print(f"tercet: could not start: {cause_of(exc)}" + ("" if debug else " (--log-level debug shows the "
              "traceback)"), file=sys.stderr)
        return 1
    if failure is not None:
        log.critical("exiting: %s", failure)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
