"""The offline Engine: a whole topology in this process's hands, no HTTP.

``open_engine`` (async, inside trio) starts the three managers under a
supervisor — all in this process over ``inproc://`` links, or the scheduler
and detokenizer in child processes over ``ipc://`` — and yields an
``AsyncEngine``. ``Engine`` is the synchronous face: it runs the same thing
on a background thread::

    with Engine(model="tiny") as engine:
        print(engine.generate(["Hello"], {"max_new_tokens": 8})[0]["text"])
"""

from __future__ import annotations

import logging
import tempfile
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import trio

from actors import ActorChild, ChildSpec, Strategy, Supervisor, SupervisorEvent
from actors.process import ProcessChild
from transports import Hub, open_hub

from .detokenizer import DetokenizerManager
from .messages import SamplingParams
from .scheduler import Scheduler, SchedulerConfig
from .tokenizer_manager import Chunk, GenerateInput, TokenizerManager, fold

__all__ = ["AsyncEngine", "Engine", "open_engine"]

log = logging.getLogger("serving.engine")


def _tokenizer_source(model: str | None) -> str | None:
    return None if model in (None, "tiny") else model


class AsyncEngine:
    def __init__(self, supervisor: Supervisor, addresses: dict[str, str]) -> None:
        self.supervisor = supervisor
        self.addresses = addresses

    @property
    def tokenizer_manager(self) -> TokenizerManager:
        return self.supervisor.child("tokenizer").actor

    async def stream(self, obj: GenerateInput) -> AsyncIterator[Chunk]:
        async for chunk in self.tokenizer_manager.generate(obj):
            yield chunk

    async def generate(self, prompts: str | list[str] | list[list[int]],
                       sampling_params: dict[str, Any] | SamplingParams | None = None,
                       **options: Any) -> list[dict[str, Any]]:
        """Run prompts (text, or token id lists) to completion; one result per sub-request."""
        params = msgspec.convert(sampling_params or {}, SamplingParams) \
            if not isinstance(sampling_params, SamplingParams) else sampling_params
        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        if batch and isinstance(batch[0], str):
            obj = GenerateInput(text=batch, sampling_params=params, **options)
        else:
            obj = GenerateInput(input_ids=batch, sampling_params=params, **options)
        chunks: dict[int, list[Chunk]] = {}
        async for chunk in self.stream(obj):
            chunks.setdefault(chunk.index, []).append(chunk)
        return [fold(chunks[i]) for i in sorted(chunks)]


def _specs(hub: Hub, model: str | None, processes: bool, runtime_dir: Path,
           scheduler_config: SchedulerConfig, tokenizer: Any) -> tuple[list[ChildSpec], dict[str, str]]:
    if processes:
        addresses = {name: f"ipc://{runtime_dir}/{name}" for name in ("scheduler", "detokenizer", "tokenizer-0")}
    else:
        addresses = {name: f"inproc://{name}" for name in ("scheduler", "detokenizer", "tokenizer-0")}
    config = msgspec.structs.replace(scheduler_config, detokenizer=addresses["detokenizer"])
    detok_args = {"address": addresses["detokenizer"], "tokenizer": _tokenizer_source(model),
                  "workers": [addresses["tokenizer-0"]], "scheduler": addresses["scheduler"]}
    if processes:
        scheduler = lambda: ProcessChild(  # noqa: E731
            "serving.scheduler:scheduler_child",
            {"address": addresses["scheduler"], "config": msgspec.to_builtins(config)}, name="scheduler")
        detokenizer = lambda: ProcessChild(  # noqa: E731
            "serving.detokenizer:detokenizer_child", detok_args, name="detokenizer")
    else:
        scheduler = lambda: ActorChild(lambda: Scheduler(config), addresses["scheduler"], hub)  # noqa: E731
        detokenizer = lambda: ActorChild(  # noqa: E731
            lambda: DetokenizerManager(tokenizer, [addresses["tokenizer-0"]], addresses["scheduler"]),
            addresses["detokenizer"], hub)
    tokenizer_manager = lambda: ActorChild(  # noqa: E731
        lambda: TokenizerManager(tokenizer, scheduler=addresses["scheduler"]), addresses["tokenizer-0"], hub)
    specs = [
        ChildSpec("scheduler", scheduler, shutdown=10.0),
        ChildSpec("detokenizer", detokenizer),
        ChildSpec("tokenizer", tokenizer_manager),
    ]
    return specs, addresses


@asynccontextmanager
async def open_engine(model: str | None = None, *, processes: bool = False,
                      **scheduler_options: Any) -> AsyncIterator[AsyncEngine]:
    """Start a topology: model None = the embedded SmolLM2, "tiny" = a tiny random model."""
    from models.loading import load_tokenizer

    config = msgspec.convert({"model": model, **scheduler_options}, SchedulerConfig)
    tokenizer = await trio.to_thread.run_sync(load_tokenizer, _tokenizer_source(model))
    with tempfile.TemporaryDirectory(prefix="tercet-") as runtime_dir:
        async with open_hub() as hub, trio.open_nursery() as nursery:
            engine: AsyncEngine | None = None

            def on_event(event: SupervisorEvent) -> None:
                # a restarted scheduler or detokenizer lost the requests in flight: resume them
                if event.kind == "started" and event.child in ("scheduler", "detokenizer") and engine is not None \
                        and engine.supervisor.restarts.get(event.child):
                    nursery.start_soon(engine.tokenizer_manager.resubmit_in_flight)

            specs, addresses = _specs(hub, model, processes, Path(runtime_dir), config, tokenizer)
            supervisor = Supervisor("engine", specs, strategy=Strategy.ONE_FOR_ONE, observer=on_event)
            await nursery.start(supervisor.run)
            engine = AsyncEngine(supervisor, addresses)
            try:
                yield engine
            finally:
                await supervisor.stop()
                nursery.cancel_scope.deadline = trio.current_time() + 30.0


class Engine:
    """The synchronous Engine: ``generate`` blocks; ``shutdown`` (or ``with``) stops it."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._engine: AsyncEngine | None = None
        self._thread = threading.Thread(target=self._main, args=(model, options), daemon=True,
                                        name="tercet-engine")
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def _main(self, model: str | None, options: dict[str, Any]) -> None:
        async def main() -> None:
            self._token = trio.lowlevel.current_trio_token()
            self._stop = trio.Event()
            async with open_engine(model, **options) as engine:
                self._engine = engine
                self._ready.set()
                await self._stop.wait()

        try:
            trio.run(main)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            self._error = exc
        finally:
            self._ready.set()

    def generate(self, prompts: Any, sampling_params: dict[str, Any] | None = None,
                 **options: Any) -> list[dict[str, Any]]:
        assert self._engine is not None, "the engine is shut down"
        return trio.from_thread.run(self._engine.generate, prompts, sampling_params, **options,
                                    trio_token=self._token)

    def shutdown(self) -> None:
        if self._stop is not None and self._thread.is_alive():
            trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            self._thread.join()
        self._engine = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
