"""`AsyncEngine`: one `Engine` stepped continuously on a thread of its own, driven from asyncio.

The HTTP handlers never touch the engine: they send it commands (add a request, abort one, load or unload an
adapter), which the engine thread runs between two steps, and they read each request's outputs from an
`asyncio.Queue` the thread feeds (``loop.call_soon_threadsafe``). A request that arrives while others decode
joins the running batch at the next step (continuous batching online). The thread sleeps when nothing is
running and wakes on the next command.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from scute.outputs import RequestOutput


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an unexpected error; the server cannot serve more requests."""


class AsyncEngine:
    def __init__(self, engine, on_step: Callable[[Any, list[RequestOutput]], None] | None = None) -> None:
        self.engine = engine
        self.on_step = on_step  # called on the engine thread after every step (metrics)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stopping = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="scute-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)

    # ------------------------------------------------------------------ the engine thread
    def _loop(self) -> None:
        try:
            while not self._stopping:
                self._run_commands()
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self._deliver(outputs)
                    if self.on_step is not None:
                        self.on_step(self.engine, outputs)
                else:
                    self._wake.wait(0.1)
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 - reported to every waiting request, then the thread ends
            self.error = e
            for loop, q in list(self._streams.values()):
                loop.call_soon_threadsafe(q.put_nowait, e)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams: one `call_soon_threadsafe` per event loop, not per output (each
        call takes the loop's lock and writes to its wake-up pipe: a system call per running request per step)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                batches.setdefault(stream[0], []).append((stream[1], out))
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _run_commands(self) -> None:
        while True:
            try:
                fn, loop, future = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                result = fn()
            except Exception as e:  # noqa: BLE001 - the caller's error, raised in the caller
                loop.call_soon_threadsafe(_settle, future, None, e)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

    # ------------------------------------------------------------------ asyncio side
    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread between two steps; returns its result (or raises its error)."""
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error!r}")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put((fn, loop, future))
        self._wake.set()
        return await future

    async def generate(self, request_id: str, prompt, sampling_params, adapter) -> AsyncIterator[RequestOutput]:
        """The outputs of one request as the engine produces them, the last one finished. Closing the iterator
        before that (a client that went away) aborts the request, which frees its KV blocks."""
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        finished = False
        try:
            await self.call(lambda: self.engine.add_request(request_id, prompt, sampling_params, adapter))
            while not finished:
                out = await q.get()
                if isinstance(out, BaseException):
                    raise EngineDeadError(f"the engine stopped: {out!r}")
                finished = out.finished
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished and self.error is None:
                self._commands.put((lambda: self.engine.abort_request(request_id), _NoLoop, None))
                self._wake.set()


class _NoLoop:
    """Stands in for the loop of a command whose result nobody awaits (an abort from a closed stream)."""

    @staticmethod
    def call_soon_threadsafe(*args) -> None:
        return None


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:  # unbounded queues: never full
        q.put_nowait(out)


def _settle(future: asyncio.Future, result, error) -> None:
    if future.done():  # the awaiting handler was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
