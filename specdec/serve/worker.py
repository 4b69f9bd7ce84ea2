"""The one thread that runs the engine for `specdec serve`: requests queue as `Job`s and are served one at
a time, in arrival order; each job's events go back to its request's event loop."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specdec.serve.metrics import Metrics, request_stats
from specdec.serve.protocol import Params, RequestError, error_body
from specdec.stream import StreamingEngine

__all__ = ["Job", "Worker"]


@dataclass
class Job:
    params: Params
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)

    def emit(self, kind: str, payload: Any = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is gone (server shutting down)
            self.cancel.set()


class Worker:
    """One thread runs the engine; at most `max_queue` requests wait for it (0: none wait, only the one
    running). Every exception of a request becomes that request's error; should the thread itself ever end
    for another reason, `error` says why, /health answers 503 and `on_death` runs (the CLI server exits 1)."""

    def __init__(
        self,
        engine: StreamingEngine,
        *,
        max_queue: int = 16,
        default_max_tokens: int = 512,
        on_death: Callable[[BaseException], None] | None = None,
    ) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        if default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {default_max_tokens}")
        self.engine, self.default_max_tokens = engine, default_max_tokens
        self.jobs: queue.Queue[Job | None] = queue.Queue()  # bounded by `submit`
        self.max_queue = max_queue
        self.metrics = Metrics()
        self.busy = False
        self.current: Job | None = None
        self.error: BaseException | None = None
        self._on_death = on_death
        self._lock = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="specdec-worker", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, job: Job) -> bool:
        """Queue `job`; False when the queue is full (or the worker is gone)."""
        with self._lock:
            waiting = self.jobs.qsize()
            if self._stopping or not self.alive or (waiting >= self.max_queue and (self.busy or waiting)):
                return False
            self.jobs.put_nowait(job)
        return True

    def stop(self) -> None:
        """Cancel what runs and waits, then end the thread (never blocks for long)."""
        with self._lock:
            self._stopping = True
            while True:
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job.cancel.set()
                    job.emit("cancelled")
            if self.current is not None:
                self.current.cancel.set()
            self.jobs.put_nowait(None)
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        try:
            while (job := self.jobs.get()) is not None:
                if job.cancel.is_set():  # the client left while queued
                    self.metrics.add("requests_cancelled")
                    job.emit("cancelled")
                    continue
                self.busy, self.current = True, job
                try:
                    self._serve(job)
                except Exception as e:  # a bug of ours: that request's 500, the next one is served
                    self.metrics.add("requests_failed")
                    job.emit(
                        "error",
                        error_body(f"internal error: {type(e).__name__}: {e}", 500) | {"status": 500},
                    )
                finally:
                    self.busy, self.current = False, None
        except BaseException as e:
            self.error = e
            if self._on_death is not None:
                self._on_death(e)
            raise

    def _serve(self, job: Job) -> None:
        p, eng = job.params, self.engine
        try:
            ids = eng.encode(p.prompt)
            limit = eng.max_context
            if len(ids) >= limit:
                raise RequestError(
                    f"this model's maximum context length is {limit} tokens; the prompt has "
                    f"{len(ids)} tokens: shorten it",
                    param="messages" if p.chat else "prompt",
                )
            room = limit - len(ids)
            if p.max_tokens is not None and p.max_tokens > room:
                raise RequestError(
                    f"this model's maximum context length is {limit} tokens; you requested "
                    f"{len(ids) + p.max_tokens} tokens ({len(ids)} in the prompt, {p.max_tokens} for the "
                    "completion): lower max_tokens or shorten the prompt",
                    param="max_tokens",
                )
            max_tokens = p.max_tokens if p.max_tokens is not None else min(self.default_max_tokens, room)
            stream = eng.stream(
                ids, max_tokens=max_tokens, sampling=p.sampling, stop=p.stop, cancel=job.cancel
            )
        except ValueError as e:  # what the client sent (bad ids, a template that rejects the messages, ...)
            self.metrics.add("requests_invalid")
            status = e.status if isinstance(e, RequestError) else 400
            job.emit("error", error_body(str(e), status, getattr(e, "param", None)) | {"status": status})
            return
        job.emit("start", len(ids))
        try:
            for ev in stream:
                job.emit("event", ev)
        except Exception as e:  # a runtime failure: report it, keep serving
            self.metrics.add("requests_failed")
            job.emit("error", error_body(f"{type(e).__name__}: {e}", 500) | {"status": 500})
            return
        r = stream.result
        assert r is not None
        stats = request_stats(r)
        self.metrics.record(r, stats)
        job.emit("done", (r, stats))
