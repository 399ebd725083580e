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

import functools
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import trio

from ..managers.messages import SamplingParams
from ..managers.tokenizer_manager import Chunk, GenerateInput, TokenizerManager, fold
from actors import ChildStartError

from .launch import LocalRuntime, open_runtime
from .topology import ActorsSection, ModelSection, Placement, SchedulerSection, Topology

__all__ = ["AsyncEngine", "Engine", "failure_cause", "open_engine", "topology_for"]


def failure_cause(exc: BaseException) -> BaseException:
    """The error that says what went wrong, out of trio's exception groups (their first leaf that is
    not a cancellation) and a child's ``ChildStartError`` (its ``__cause__``: for a child process, an
    ``actors.process.ProcessStartFailed`` with the child's error text)."""
    while True:
        if isinstance(exc, BaseExceptionGroup):
            leaves = [e for e in exc.exceptions if not isinstance(e, trio.Cancelled)]
            if not leaves:
                return exc
            exc = leaves[0]
        elif isinstance(exc, ChildStartError) and exc.__cause__ is not None:
            exc = exc.__cause__
        else:
            return exc


class AsyncEngine:
    """The offline API over a running ``LocalRuntime`` (``runtime``)."""

    def __init__(self, runtime: LocalRuntime) -> None:
        self.runtime = runtime

    @property
    def tokenizer_manager(self) -> TokenizerManager:
        return self.runtime.tokenizer_manager

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


def topology_for(model: str | None, *, processes: bool = False, **scheduler_options: Any) -> Topology:
    """A topology from keyword options: one process (inproc), or three (ipc)."""
    where = "child" if processes else "main"
    scheme = "ipc://{runtime_dir}/" if processes else "inproc://"
    kv = scheduler_options.pop("kv_budget_bytes", None)
    dtype = scheduler_options.pop("dtype", "auto")
    device = scheduler_options.pop("device", "auto")
    activations = scheduler_options.pop("activations", "exact")
    scheduler = msgspec.convert(scheduler_options, SchedulerSection)
    if kv is not None:
        scheduler = msgspec.structs.replace(scheduler, kv_budget=kv)
    actors = ActorsSection(
        Placement(scheme + "scheduler", where), Placement(scheme + "detokenizer", where),
        Placement(scheme + "tokenizer", "main"),
    )
    return Topology(model=ModelSection(path=model, dtype=dtype, device=device, activations=activations),
                    scheduler=scheduler, actors=actors)


@asynccontextmanager
async def open_engine(model: str | None = None, *, processes: bool = False,
                      **scheduler_options: Any) -> AsyncIterator[AsyncEngine]:
    """Start a topology: model None = the embedded SmolLM2, "tiny" = a tiny random model."""
    async with open_runtime(topology_for(model, processes=processes, **scheduler_options)) as runtime:
        yield AsyncEngine(runtime)


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
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread: the cause itself
            self._error = failure_cause(exc)
        finally:
            self._ready.set()

    def generate(self, prompts: Any, sampling_params: dict[str, Any] | None = None,
                 **options: Any) -> list[dict[str, Any]]:
        assert self._engine is not None, "the engine is shut down"
        # (trio.from_thread.run passes positional arguments only)
        return trio.from_thread.run(functools.partial(self._engine.generate, prompts, sampling_params, **options),
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
