"""The Starlette app of `specdec serve`: routes, streaming, and an OpenAI-shaped error for anything that
goes wrong. starlette is imported only when an app is built."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from specdec.reply import ReplySplit
from specdec.sampling import SamplingParams
from specdec.serve.anthropic import MessageStream, message_body, stop_reason, to_openai
from specdec.serve.anthropic import error_body as anthropic_error_body
from specdec.serve.metrics import prometheus
from specdec.serve.protocol import (
    RequestError,
    chunk,
    error_body,
    finish_reason,
    logprobs_body,
    parse_request,
    response_body,
    usage,
)
from specdec.serve.worker import Job, Worker
from specdec.stream import StreamingEngine

__all__ = ["BYTES_PER_POSITION", "build_app", "request_bytes_for"]

#: the default request-body cap, per position of the context: a JSON-escaped non-ASCII character takes
#: up to 12 bytes (a surrogate pair) and is at least a token's share, so a prompt that fits the context
#: fits this, with room for the fields around it (`request_bytes_for`)
BYTES_PER_POSITION = 16


def request_bytes_for(max_context: int) -> int:
    """The default `--max-request-bytes` for a context of `max_context` positions: at least 1 MiB."""
    return max(1 << 20, BYTES_PER_POSITION * max_context + (64 << 10))


def build_app(
    engine: StreamingEngine | Sequence[StreamingEngine],
    *,
    model_name: str | None = None,
    max_queue: int = 16,
    default_max_tokens: int = 512,
    sampling: SamplingParams | None = None,
    on_death: Callable[[BaseException], None] | None = None,
    max_request_bytes: int | None = None,
    tool_parser: str | None = None,
) -> Any:
    """The Starlette app; `app.state.worker` is the Worker (its threads start here; `on_death` as there).
    Several engines (on sequences of one batch: `specdec.batch.batch_of`) serve as many requests at once,
    their verifies together. A request body past `max_request_bytes` (default `request_bytes_for` the
    engine's context) is refused (413) as it arrives, before it is parsed or tokenized. `tool_parser`:
    the model's tool call syntax (`specdec.tools.SYNTAXES`; None: detected from its chat template)."""
    from starlette.applications import Starlette
    from starlette.routing import Route

    worker = Worker(
        engine,
        max_queue=max_queue,
        default_max_tokens=default_max_tokens,
        on_death=on_death,
        tool_parser=tool_parser,
    )
    limit = max_request_bytes or request_bytes_for(worker.engine.max_context)
    r = _Routes(worker, model_name or worker.engine.verifier.model_name, sampling or SamplingParams(), limit)

    @contextlib.asynccontextmanager
    async def lifespan(app: Any):
        yield
        await asyncio.to_thread(worker.stop)

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", r.chat_completions, methods=["POST"]),
            Route("/v1/completions", r.text_completions, methods=["POST"]),
            Route("/v1/messages", r.messages, methods=["POST"]),
            Route("/v1/models", r.models, methods=["GET"]),
            Route("/health", r.health, methods=["GET"]),
            Route("/metrics", r.metrics, methods=["GET"]),
        ],
        exception_handlers={404: r.not_found, 405: r.method_not_allowed, Exception: r.internal_error},
        lifespan=lifespan,
    )
    app.state.worker = worker
    return app


def _error(message: str, status: int, param: str | None = None, code: str | None = None) -> Any:
    from starlette.responses import JSONResponse

    headers = {"Retry-After": "1"} if status == 503 else None
    return JSONResponse(error_body(message, status, param, code), status_code=status, headers=headers)


def _anthropic_error(message: str, status: int, param: str | None = None, code: str | None = None) -> Any:
    from starlette.responses import JSONResponse

    headers = {"Retry-After": "1"} if status == 503 else None
    return JSONResponse(anthropic_error_body(message, status), status_code=status, headers=headers)


async def _watch_disconnect(request: Any, cancel: threading.Event) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            cancel.set()
            return


async def _body(request: Any, limit: int) -> bytes:
    """The request's body, read as it arrives; a RequestError (413) as soon as it passes `limit` bytes (by
    its Content-Length, before reading any), so a huge prompt costs neither memory nor tokenizing."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    parts, size = [], 0
    async for piece in request.stream():
        size += len(piece)
        if size > limit:
            raise _too_large(None, limit)
        parts.append(piece)
    return b"".join(parts)


def _too_large(size: int | None, limit: int) -> RequestError:
    got = f"is {size} bytes," if size is not None else "runs"
    return RequestError(
        f"the request body {got} over this server's {limit} bytes (--max-request-bytes): a prompt that "
        "long does not fit the model's context",
        status=413,
    )


def _delta(chunk: dict, delta: dict) -> dict:
    chunk["choices"][0]["delta"] = delta
    return chunk


class _Routes:
    """The app's handlers, over one worker."""

    def __init__(self, worker: Worker, model: str, defaults: SamplingParams, limit: int) -> None:
        self.worker, self.model, self.defaults, self.limit = worker, model, defaults, limit

    async def chat_completions(self, request: Any) -> Any:
        return await self._completions(request, chat=True)

    async def text_completions(self, request: Any) -> Any:
        return await self._completions(request, chat=False)

    async def _job(self, request: Any, chat: bool, *, messages: bool = False) -> Job | Any:
        """The request's job, queued; or the error response that refuses it. `messages`: an Anthropic
        Messages request (translated; errors in its shape)."""
        metrics = self.worker.metrics
        metrics.add("requests_total")
        _error = _anthropic_error if messages else globals()["_error"]
        try:
            body = json.loads(await _body(request, self.limit))
            if messages:
                body = to_openai(body)
        except RequestError as e:
            metrics.add("requests_invalid")
            return _error(str(e), e.status)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            metrics.add("requests_invalid")
            return _error(f"the request body is not valid JSON: {e}", 400)
        except RecursionError:  # json's decoder recurses per nesting level
            metrics.add("requests_invalid")
            return _error("the request body nests too deeply to parse", 400)
        try:
            params = parse_request(body, chat=chat, model=self.model, defaults=self.defaults)
        except RequestError as e:
            metrics.add("requests_invalid")
            return _error(str(e), e.status, e.param, e.code)
        job = Job(params=params, loop=asyncio.get_running_loop())
        if not self.worker.alive:
            return _error("the engine worker died (see /health); restart the server", 503)
        if not self.worker.submit(job):
            metrics.add("requests_rejected_busy")
            n = self.worker.max_queue
            msg = (
                f"server busy: {n} requests are already waiting for the engine (--max-queue {n}); retry later"
            )
            return _error(msg, 503)
        return job

    async def _start(self, request: Any, chat: bool, *, messages: bool = False) -> Any:
        """(the request's job, its disconnect watcher, the prompt's length) once the run started; or the
        response that refuses or ends it."""
        job = await self._job(request, chat, messages=messages)
        if not isinstance(job, Job):
            return job
        error = _anthropic_error if messages else _error
        watcher = asyncio.create_task(_watch_disconnect(request, job.cancel))
        try:
            kind, payload = await job.events.get()
        except BaseException:
            watcher.cancel()
            job.cancel.set()
            raise
        if kind in ("error", "cancelled"):
            watcher.cancel()
            if kind == "cancelled":
                return error("cancelled: the client disconnected", 499)
            return error(payload["error"]["message"], payload["status"], payload["error"]["param"])
        return job, watcher, payload

    async def _completions(self, request: Any, chat: bool) -> Any:
        from starlette.responses import JSONResponse, StreamingResponse

        started = await self._start(request, chat)
        if not isinstance(started, tuple):
            return started
        job, watcher, payload = started
        try:
            if job.params.stream:
                watcher.cancel()  # StreamingResponse listens for the disconnect itself from here on
                headers = {"Cache-Control": "no-cache"}
                return StreamingResponse(
                    self._sse(job, chat), media_type="text/event-stream", headers=headers
                )
            text, entries, tokens = [], [], []
            while True:
                kind, payload = await job.events.get()
                if kind == "event":
                    text.append(payload.delta)
                    entries += self._logprobs_of(job, payload)
                    tokens += payload.tokens
                elif kind == "error":
                    return JSONResponse({"error": payload["error"]}, status_code=payload["status"])
                elif kind == "done":
                    break
            result, stats = payload
            lp = logprobs_body(chat, entries, self.worker.spell) if job.params.logprobs is not None else None
            split = self._split(job, chat)
            reasoning, content = split.push("".join(text), tokens)
            more_r, more_c, calls = split.finish()
            body = response_body(chat, self.model, content + more_c, result, stats, lp)
            if chat and split.reasoning is not None:
                body["choices"][0]["message"]["reasoning_content"] = (reasoning + more_r) or None
            if calls:  # the model's calls
                msg = body["choices"][0]["message"]
                msg["content"] = msg["content"] or None
                msg["tool_calls"] = [c.to_openai() for c in calls]
                body["choices"][0]["finish_reason"] = "tool_calls"
            return JSONResponse(body)
        finally:
            watcher.cancel()
            if not job.params.stream:
                job.cancel.set()  # no-op when finished; stops the run if this handler was cancelled

    async def _sse(self, job: Job, chat: bool) -> AsyncIterator[str]:
        job_id, created = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, int(time.time())

        def data(obj: dict) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        def piece(delta: str | None, finish: str | None, lp: dict | None = None) -> dict:
            return chunk(job_id, chat, created, self.model, delta, finish, lp)

        offset = 0  # completions' text_offset: the text streamed before
        split = self._split(job, chat)

        try:
            if chat:
                first = piece("", None)
                first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                yield data(first)
            while True:
                kind, payload = await job.events.get()
                if kind == "event":
                    entries = self._logprobs_of(job, payload)
                    # a call's text held back until it parses
                    thought, delta = split.push(payload.delta, payload.tokens)
                    if thought:
                        yield data(_delta(piece(None, None), {"reasoning_content": thought}))
                    if entries:  # a step's tokens, with their text as soon as it is final
                        yield data(
                            piece(delta, None, logprobs_body(chat, entries, self.worker.spell, offset))
                        )
                    elif delta:
                        yield data(piece(delta, None))
                    offset += len(delta)
                elif kind == "error":
                    yield data({"error": payload["error"]})
                    break
                elif kind == "done":
                    result, stats = payload
                    finish = finish_reason(result)
                    thought, rest, calls = split.finish()
                    if thought:
                        yield data(_delta(piece(None, None), {"reasoning_content": thought}))
                    if rest:
                        yield data(piece(rest, None))
                    for i, call in enumerate(calls):  # each call whole, in one delta
                        yield data(_delta(piece(None, None), {"tool_calls": [call.to_openai(index=i)]}))
                    finish = "tool_calls" if calls else finish
                    yield data(piece(None, finish) | {"specdec": stats})
                    if job.params.include_usage:
                        yield data(piece(None, None) | {"choices": [], "usage": usage(result)})
                    break
            yield "data: [DONE]\n\n"
        finally:
            job.cancel.set()  # the client left (or we are done: then a no-op)

    def _split(self, job: Job, chat: bool) -> ReplySplit:
        """The splitter of the job's reply into reasoning, content and tool calls."""
        p = job.params
        return self.worker.format.split(tools=p.tools is not None, opened=p.reasoning_opened, chat=chat)

    def _logprobs_of(self, job: Job, ev: Any) -> list:
        """The logprobs of an event's tokens where the request asked (a stop token that ended it left out:
        it is not part of the text)."""
        if job.params.logprobs is None or ev.step is None or not ev.step.logprobs:
            return []
        entries = ev.step.logprobs
        if ev.step.finish_reason == "stop" and entries[-1].token in self.worker.format.stop_ids:
            entries = entries[:-1]
        return entries

    async def messages(self, request: Any) -> Any:
        """Anthropic's Messages API over the same engine."""
        from starlette.responses import JSONResponse, StreamingResponse

        started = await self._start(request, True, messages=True)
        if not isinstance(started, tuple):
            return started
        job, watcher, payload = started
        try:
            split, stream = self._split(job, True), None
            thought, text = [], []
            if job.params.stream:
                watcher.cancel()
                stream = MessageStream(self.model, payload)
                events = self._message_events(job, split, stream)
                headers = {"Cache-Control": "no-cache"}
                return StreamingResponse(events, media_type="text/event-stream", headers=headers)
            while True:
                kind, payload = await job.events.get()
                if kind == "event":
                    r, c = split.push(payload.delta, payload.tokens)
                    thought.append(r)
                    text.append(c)
                elif kind == "error":
                    return _anthropic_error(payload["error"]["message"], payload["status"])
                elif kind == "done":
                    break
            result, _ = payload
            r, c, calls = split.finish()
            reason = stop_reason(finish_reason(result), calls, result.stop_string)
            thinking, content = "".join(thought) + r, "".join(text) + c
            body = message_body(self.model, thinking, content, calls, reason, usage(result))
            return JSONResponse(body)
        finally:
            watcher.cancel()
            if not job.params.stream:
                job.cancel.set()

    async def _message_events(self, job: Job, split: ReplySplit, ms: MessageStream) -> AsyncIterator[str]:
        try:
            yield ms.start()
            while True:
                kind, payload = await job.events.get()
                if kind == "event":
                    r, c = split.push(payload.delta, payload.tokens)
                    yield (ms.thinking(r) if r else "") + (ms.text(c) if c else "")
                elif kind == "error":
                    yield ms.event(
                        "error", anthropic_error_body(payload["error"]["message"], payload["status"])
                    )
                    break
                elif kind == "done":
                    result, _ = payload
                    r, c, calls = split.finish()
                    yield (ms.thinking(r) if r else "") + (ms.text(c) if c else "")
                    yield "".join(ms.tool_use(call) for call in calls)
                    reason = stop_reason(finish_reason(result), calls, result.stop_string)
                    yield ms.end(reason, len(result.output_tokens))
                    break
        finally:
            job.cancel.set()

    async def models(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        card = {"id": self.model, "object": "model", "created": int(self.worker.metrics.started)}
        return JSONResponse({"object": "list", "data": [card | {"owned_by": "specdec"}]})

    async def health(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        w = self.worker
        body = {"status": "ok", "model": self.model, "queue_depth": len(w.waiting), "busy": w.busy}
        if not w.alive:  # never "ok" with no one to serve the requests
            why = f"{type(w.error).__name__}: {w.error}" if w.error else "stopped"
            return JSONResponse({**body, "status": "error", "error": f"engine worker died ({why})"}, 503)
        return JSONResponse(body)

    async def metrics(self, request: Any) -> Any:
        from starlette.responses import JSONResponse, PlainTextResponse

        w = self.worker
        snap = w.metrics.snapshot(len(w.waiting), len(w.running))
        accept = request.headers.get("accept", "")
        if request.query_params.get("format") == "prometheus" or (
            "text/plain" in accept and "json" not in accept
        ):
            text = prometheus(snap, list(w.metrics.c))
            return PlainTextResponse(text, media_type="text/plain; version=0.0.4")
        return JSONResponse(snap)

    async def not_found(self, request: Any, exc: Exception) -> Any:
        return _error(f"no route {request.method} {request.url.path}; see /v1/models", 404)

    async def method_not_allowed(self, request: Any, exc: Exception) -> Any:
        return _error(f"{request.method} is not allowed on {request.url.path}", 405)

    async def internal_error(self, request: Any, exc: Exception) -> Any:  # a bug of ours, not a 4xx
        return _error(f"internal error: {type(exc).__name__}: {exc}", 500)
