"""`specdec serve`: an OpenAI-compatible HTTP server over one `specdec.stream.Engine`.

Endpoints: POST /v1/chat/completions and /v1/completions (SSE with "stream": true), GET /v1/models,
/health, /metrics (JSON; Prometheus text with ?format=prometheus or Accept: text/plain).

Contract:
- One engine serves requests one at a time, in arrival order, on one worker thread; at most `max_queue`
  requests wait behind the running one. Past that a request gets 503 with a message saying so (and a
  Retry-After header). All model and tokenizer work happens on the worker thread.
- The engine keeps its cache between requests, so a chat client that resends the conversation only pays
  for the new tokens (longest-common-prefix reuse, exact: see `specdec.stream`).
- A client that disconnects (streaming or not, running or still queued) cancels its generation within one
  engine step; the next request is served normally.
- Request fields: messages | prompt, max_tokens (or max_completion_tokens), temperature, top_p, top_k,
  min_p, seed, stop (string or list), stream, stream_options.include_usage, n (1 only). Unknown fields are
  ignored. max_tokens policy (as vLLM): max_tokens must be >= 1 and prompt + max_tokens must fit the
  context (--max-context, default the model's), else 400 naming the sizes; without max_tokens the reply
  may use min(--default-max-tokens, what is left of the context).
- Errors are OpenAI-shaped: {"error": {"message", "type", "param", "code"}}; 400 bad request, 404 unknown
  model or path, 503 busy; the server keeps serving.
- Responses carry `usage` and our per-request speculative stats under "specdec" (acceptance_length_mean
  includes the bonus token, as in vLLM): n_steps, drafted, accepted, tokens_per_s, ttft_s, reused_tokens.
Binds 127.0.0.1 by default. starlette and uvicorn are imported only when a server is built.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import queue
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from specdec.args import (
    add_drafter_args,
    add_sampling_args,
    add_verifier_args,
    at_least,
    load_models,
    sampling_of,
)
from specdec.chat import check_messages, check_text
from specdec.memory import max_record
from specdec.sampling import SamplingParams
from specdec.stream import Engine, StreamResult

__all__ = ["Metrics", "Worker", "add_serve_args", "build_app", "cmd_serve"]


class RequestError(ValueError):
    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def _error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    kind = {400: "invalid_request_error", 404: "not_found_error", 503: "server_busy"}.get(
        status, "server_error"
    )
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ---- request parsing -------------------------------------------------------------------------------------


@dataclass
class Params:
    prompt: Any  # chat messages (list of {role, content}) or text or token ids
    chat: bool
    max_tokens: int | None
    sampling: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool


def _number(body: dict, name: str, default: float, *, lo: float, hi: float, integer: bool = False) -> Any:
    v = body.get(name)
    if v is None:
        return default
    ok = isinstance(v, int) if integer else isinstance(v, int | float)
    if not ok or isinstance(v, bool):
        kind = "an integer" if integer else "a number"
        raise RequestError(f"'{name}' must be {kind}, got {json.dumps(v)}", param=name)
    if not lo <= v <= hi:
        raise RequestError(f"'{name}' must be in [{lo}, {hi}], got {v}", param=name)
    return v


def _content(m: dict, i: int) -> str:
    c = m.get("content")
    if isinstance(c, str):
        return c
    if isinstance(c, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in c):
        return "".join(str(p.get("text", "")) for p in c)
    raise RequestError(
        f"messages[{i}].content must be a string or a list of text parts, got {json.dumps(c)[:80]}",
        param=f"messages[{i}].content",
    )


def _checked(text: str, where: str, param: str) -> str:
    try:
        return check_text(text, where)
    except ValueError as e:
        raise RequestError(str(e), param=param) from None


def parse_request(body: Any, *, chat: bool, model: str, defaults: SamplingParams) -> Params:
    """Validate an OpenAI request body; RequestError (4xx) with the offending field otherwise."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    name = body.get("model")
    if name is not None and name != model:
        raise RequestError(
            f"model {name!r} does not exist; this server serves {model!r} (GET /v1/models)",
            status=404,
            param="model",
            code="model_not_found",
        )
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise RequestError("'messages' must be a non-empty list of {role, content}", param="messages")
        prompt: Any = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise RequestError(f"messages[{i}] must be an object with a string 'role'", param="messages")
            prompt.append({"role": m["role"], "content": _content(m, i)})
        try:
            prompt = check_messages(prompt)
        except ValueError as e:
            raise RequestError(str(e), param="messages") from None
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        is_ids = isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        )
        if not (isinstance(prompt, str) or is_ids) or not prompt:
            raise RequestError(
                "'prompt' must be a non-empty string or list of token ids (one prompt per request)",
                param="prompt",
            )
        if isinstance(prompt, str):
            _checked(prompt, "'prompt'", "prompt")
    n = _number(body, "n", 1, lo=1, hi=1, integer=True)
    assert n == 1
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    if mt is not None and (not isinstance(mt, int) or isinstance(mt, bool) or mt < 1):
        raise RequestError(f"'max_tokens' must be an integer >= 1, got {json.dumps(mt)}", param="max_tokens")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise RequestError(
            f"'stop' must be a string or a list of strings, got {json.dumps(stop)}", param="stop"
        )
    for s in stop:
        _checked(s, "'stop'", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(f"'stream' must be true or false, got {json.dumps(stream)}", param="stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise RequestError("'stream_options' must be an object", param="stream_options")
    try:
        sampling = SamplingParams(
            temperature=_number(body, "temperature", defaults.temperature, lo=0, hi=2),
            top_p=_number(body, "top_p", defaults.top_p, lo=0, hi=1),
            top_k=max(0, _number(body, "top_k", defaults.top_k, lo=-1, hi=2**31, integer=True)),  # -1: off
            min_p=_number(body, "min_p", defaults.min_p, lo=0, hi=1),
            seed=_number(body, "seed", defaults.seed, lo=0, hi=2**63 - 1, integer=True),
            rule=defaults.rule,
            proposal=defaults.proposal,
        )
    except ValueError as e:
        if isinstance(e, RequestError):
            raise
        raise RequestError(str(e)) from e
    return Params(
        prompt=prompt,
        chat=chat,
        max_tokens=mt,
        sampling=sampling,
        stop=[s for s in stop if s],
        stream=stream,
        include_usage=bool(opts.get("include_usage")),
    )


# ---- metrics ---------------------------------------------------------------------------------------------


class Metrics:
    """Server-wide counters (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started = time.time()
        names = (
            "requests_total requests_completed requests_cancelled requests_rejected_busy requests_invalid "
            "requests_failed prompt_tokens_total reused_prompt_tokens_total completion_tokens_total "
            "decode_steps_total drafted_tokens_total accepted_tokens_total"
        )
        self.c = dict.fromkeys(names.split(), 0)
        self.decode_s_total = 0.0
        self.decode_tokens_total = 0  # tokens after the first one of each request
        self.acceptance_length_sum = 0
        self.last: dict[str, Any] = {}
        self.peak: dict[str, dict | None] = {}

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.c[name] += n

    def record(self, r: StreamResult, stats: dict[str, Any]) -> None:
        decode = [s for s in r.steps if s.phase == "decode"]
        with self._lock:
            self.c["requests_cancelled" if r.finish_reason == "cancelled" else "requests_completed"] += 1
            self.c["prompt_tokens_total"] += r.prompt_tokens
            self.c["reused_prompt_tokens_total"] += r.reused_tokens
            self.c["completion_tokens_total"] += len(r.output_tokens)
            self.c["decode_steps_total"] += len(decode)
            self.c["drafted_tokens_total"] += stats["drafted"]
            self.c["accepted_tokens_total"] += stats["accepted"]
            self.acceptance_length_sum += sum(s.acceptance_length for s in decode)
            self.decode_s_total += sum(s.step_s for s in decode)
            self.decode_tokens_total += sum(len(s.tokens) for s in decode)
            self.last = {**stats, "completion_tokens": len(r.output_tokens)}
            for rt in {rt for s in r.steps for rt in s.peak_memory}:
                recs = [self.peak.get(rt), *(s.peak_memory.get(rt) for s in r.steps)]
                self.peak[rt] = max_record(recs)

    def snapshot(self, queue_depth: int, busy: bool) -> dict[str, Any]:
        with self._lock:
            steps = self.c["decode_steps_total"]
            return {
                **self.c,
                "queue_depth": queue_depth,
                "busy": busy,
                "uptime_s": time.time() - self.started,
                "acceptance_length_mean": self.acceptance_length_sum / steps if steps else None,
                "tokens_per_s": self.decode_tokens_total / self.decode_s_total
                if self.decode_s_total
                else None,
                "peak_memory": dict(self.peak),
                "peak_memory_bytes": {rt: (rec or {}).get("bytes") for rt, rec in self.peak.items()},
                "last_request": dict(self.last),
            }


def prometheus(snap: dict[str, Any], counters: Sequence[str]) -> str:
    """Prometheus text exposition: counters get the `_total` suffix, numbers are gauges."""
    lines = []
    for k, v in snap.items():
        if isinstance(v, bool):
            v = int(v)
        if v is None or not isinstance(v, int | float):
            continue
        name = f"specdec_{k}" + ("_total" if k in counters and not k.endswith("_total") else "")
        lines += [f"# TYPE {name} {'counter' if k in counters else 'gauge'}", f"{name} {v}"]
    lines.append("# TYPE specdec_peak_memory_bytes gauge")
    for rt, b in snap["peak_memory_bytes"].items():
        if b is not None:
            lines.append(f'specdec_peak_memory_bytes{{runtime="{rt}"}} {b}')
    return "\n".join(lines) + "\n"


# ---- the worker ------------------------------------------------------------------------------------------


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
        engine: Engine,
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
                        _error_body(f"internal error: {type(e).__name__}: {e}", 500) | {"status": 500},
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
            job.emit("error", _error_body(str(e), status, getattr(e, "param", None)) | {"status": status})
            return
        job.emit("start", len(ids))
        try:
            for ev in stream:
                job.emit("event", ev)
        except Exception as e:  # a runtime failure: report it, keep serving
            self.metrics.add("requests_failed")
            job.emit("error", _error_body(f"{type(e).__name__}: {e}", 500) | {"status": 500})
            return
        r = stream.result
        assert r is not None
        stats = request_stats(r)
        self.metrics.record(r, stats)
        job.emit("done", (r, stats))


def request_stats(r: StreamResult) -> dict[str, Any]:
    s = r.summary()
    return {
        "acceptance_length_mean": s["acceptance_length_mean"],
        "n_steps": s["n_steps"],
        "drafted": s["drafted"],
        "accepted": s["accepted"],
        "tokens_per_s": s["tokens_per_s"],
        "ttft_s": r.ttft_s,
        "decode_s": s["decode_s"],
        "reused_tokens": r.reused_tokens,
        "finish_reason": r.finish_reason,
    }


def _usage(r: StreamResult) -> dict[str, int]:
    n = len(r.output_tokens)
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": n, "total_tokens": r.prompt_tokens + n}


def _finish_reason(r: StreamResult) -> str:
    return "length" if r.finish_reason in ("length", "context") else r.finish_reason


# ---- the app ---------------------------------------------------------------------------------------------


def build_app(
    engine: Engine,
    *,
    model_name: str | None = None,
    max_queue: int = 16,
    default_max_tokens: int = 512,
    sampling: SamplingParams | None = None,
    on_death: Callable[[BaseException], None] | None = None,
) -> Any:
    """The Starlette app; `app.state.worker` is the Worker (its thread starts here; `on_death` as there)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    model = model_name or engine.verifier.model_name
    defaults = sampling or SamplingParams()
    worker = Worker(engine, max_queue=max_queue, default_max_tokens=default_max_tokens, on_death=on_death)

    def error(message: str, status: int, param: str | None = None, code: str | None = None) -> JSONResponse:
        headers = {"Retry-After": "1"} if status == 503 else None
        return JSONResponse(_error_body(message, status, param, code), status_code=status, headers=headers)

    async def watch_disconnect(request: Request, cancel: threading.Event) -> None:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                cancel.set()
                return

    async def completions(request: Request, chat: bool) -> Any:
        worker.metrics.add("requests_total")
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            worker.metrics.add("requests_invalid")
            return error(f"the request body is not valid JSON: {e}", 400)
        except RecursionError:  # json's decoder recurses per nesting level
            worker.metrics.add("requests_invalid")
            return error("the request body nests too deeply to parse", 400)
        try:
            params = parse_request(body, chat=chat, model=model, defaults=defaults)
        except RequestError as e:
            worker.metrics.add("requests_invalid")
            return error(str(e), e.status, e.param, e.code)
        job = Job(params=params, loop=asyncio.get_running_loop())
        if not worker.alive:
            return error("the engine worker died (see /health); restart the server", 503)
        if not worker.submit(job):
            worker.metrics.add("requests_rejected_busy")
            return error(
                f"server busy: {worker.max_queue} requests are already waiting for the engine "
                f"(--max-queue {worker.max_queue}); retry later",
                503,
            )
        watcher = asyncio.create_task(watch_disconnect(request, job.cancel))
        try:
            kind, payload = await job.events.get()
            if kind == "error":
                return JSONResponse({"error": payload["error"]}, status_code=payload["status"])
            if kind == "cancelled":
                return error("cancelled: the client disconnected", 499)
            if params.stream:
                watcher.cancel()  # StreamingResponse listens for the disconnect itself from here on
                return StreamingResponse(
                    sse(job, chat), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
                )
            text = []
            while True:
                kind, payload = await job.events.get()
                if kind == "event":
                    text.append(payload.delta)
                elif kind == "error":
                    return JSONResponse({"error": payload["error"]}, status_code=payload["status"])
                elif kind == "done":
                    break
            r, stats = payload
            return JSONResponse(response_body(job, chat, "".join(text), r, stats))
        finally:
            watcher.cancel()
            if not params.stream:
                job.cancel.set()  # no-op when finished; stops the run if this handler was cancelled

    def chunk(job_id: str, chat: bool, created: int, delta: str | None, finish: str | None) -> dict:
        if chat:
            d = {} if delta is None else {"content": delta}
            choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        return {"id": job_id, "object": obj, "created": created, "model": model, "choices": [choice]}

    async def sse(job: Job, chat: bool):
        job_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())

        def data(obj: dict) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        try:
            if chat:
                first = chunk(job_id, chat, created, "", None)
                first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                yield data(first)
            while True:
                kind, payload = await job.events.get()
                if kind == "event":
                    if payload.delta:
                        yield data(chunk(job_id, chat, created, payload.delta, None))
                elif kind == "error":
                    yield data({"error": payload["error"]})
                    break
                elif kind == "done":
                    r, stats = payload
                    last = chunk(job_id, chat, created, None, _finish_reason(r))
                    last["specdec"] = stats
                    yield data(last)
                    if job.params.include_usage:
                        yield data(
                            {**chunk(job_id, chat, created, None, None), "choices": [], "usage": _usage(r)}
                        )
                    break
            yield "data: [DONE]\n\n"
        finally:
            job.cancel.set()  # the client left (or we are done: then a no-op)

    def response_body(job: Job, chat: bool, text: str, r: StreamResult, stats: dict) -> dict:
        finish = _finish_reason(r)
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
            obj, prefix = "chat.completion", "chatcmpl-"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            obj, prefix = "text_completion", "cmpl-"
        return {
            "id": prefix + uuid.uuid4().hex,
            "object": obj,
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "usage": _usage(r),
            "specdec": stats,
        }

    async def chat_completions(request: Request) -> Any:
        return await completions(request, chat=True)

    async def text_completions(request: Request) -> Any:
        return await completions(request, chat=False)

    async def models(request: Request) -> JSONResponse:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": model,
                        "object": "model",
                        "created": int(worker.metrics.started),
                        "owned_by": "specdec",
                    }
                ],
            }
        )

    async def health(request: Request) -> JSONResponse:
        body = {"status": "ok", "model": model, "queue_depth": worker.jobs.qsize(), "busy": worker.busy}
        if not worker.alive:  # never "ok" with no one to serve the requests
            why = f"{type(worker.error).__name__}: {worker.error}" if worker.error else "stopped"
            return JSONResponse({**body, "status": "error", "error": f"engine worker died ({why})"}, 503)
        return JSONResponse(body)

    async def metrics(request: Request) -> Any:
        snap = worker.metrics.snapshot(worker.jobs.qsize(), worker.busy)
        want_text = request.query_params.get("format") == "prometheus" or (
            "text/plain" in request.headers.get("accept", "")
            and "json" not in request.headers.get("accept", "")
        )
        if want_text:
            text = prometheus(snap, list(worker.metrics.c))
            return PlainTextResponse(text, media_type="text/plain; version=0.0.4")
        return JSONResponse(snap)

    async def not_found(request: Request, exc: Exception) -> JSONResponse:
        return error(f"no route {request.method} {request.url.path}; see /v1/models", 404)

    async def method_not_allowed(request: Request, exc: Exception) -> JSONResponse:
        return error(f"{request.method} is not allowed on {request.url.path}", 405)

    async def internal_error(request: Request, exc: Exception) -> JSONResponse:  # a bug of ours, not a 4xx
        return error(f"internal error: {type(exc).__name__}: {exc}", 500)

    @contextlib.asynccontextmanager
    async def lifespan(app: Any):
        yield
        await asyncio.to_thread(worker.stop)

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", text_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        exception_handlers={404: not_found, 405: method_not_allowed, Exception: internal_error},
        lifespan=lifespan,
    )
    app.state.worker = worker
    return app


# ---- command line ----------------------------------------------------------------------------------------


def add_serve_args(p: argparse.ArgumentParser) -> None:
    add_verifier_args(p)
    add_drafter_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=at_least(0, 65535), default=8000)
    p.add_argument("--served-model-name", help="the model id clients send (default: the verifier's name)")
    p.add_argument(
        "--max-queue", type=at_least(0), default=16, help="requests that may wait (0: none); past that: 503"
    )
    p.add_argument("--max-context", type=at_least(2), help="positions per request (default: the model's)")
    p.add_argument(
        "--default-max-tokens", type=at_least(1), default=512, help="when a request gives no max_tokens"
    )
    p.add_argument("--no-reuse", action="store_true", help="prefill every prompt whole (no prefix reuse)")
    add_sampling_args(p)  # defaults for requests that leave them out; --rule / --proposal apply to all


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host`:`port` (0: any free port), for uvicorn to serve on; a bad host or a port
    in use is a one-line ValueError here, before any model loads (uvicorn would say so only after)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart may rebind at once
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def cmd_serve(args: argparse.Namespace) -> int:
    """Load, serve until SIGINT / SIGTERM; exit code 1 if the worker thread ever died."""
    sock = listen_socket(args.host, args.port)  # before any work
    try:
        return _serve_on(sock, args)
    finally:
        sock.close()


def _serve_on(sock: socket.socket, args: argparse.Namespace) -> int:
    import uvicorn

    sampling = sampling_of(args)
    verifier, drafter, block = load_models(args)
    engine = Engine(
        verifier, drafter, block_size=block, max_context=args.max_context, reuse=not args.no_reuse
    )
    server: Any = None
    died: list[BaseException] = []

    def on_death(e: BaseException) -> None:
        died.append(e)
        if server is not None:
            server.should_exit = True

    app = build_app(
        engine, model_name=args.served_model_name, max_queue=args.max_queue,
        default_max_tokens=args.default_max_tokens, sampling=sampling, on_death=on_death,
    )  # fmt: skip
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    name = args.served_model_name or verifier.model_name
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    print(f"specdec serve: {name} on http://{url_host}:{port}/v1", flush=True)
    server.run(sockets=[sock])
    if died:
        print(f"error: the engine worker died: {type(died[0]).__name__}: {died[0]}", file=sys.stderr)
        return 1
    return 0
