"""The threads that run the engines of `specdec serve`: requests queue as `Job`s and are served in arrival
order, one at a time per engine; each job's events go back to its request's event loop. With several
engines (`--max-batch N`: N sequences of one batch) N requests run at once, each a member of the batch
while it runs, so their verifies share forwards. The oldest waiting request goes to the free engine whose
cache holds the longest start of its prompt (a conversation's next turn to the engine that served the
last, where it is free), so its prefill covers only the new tokens."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from specdec.engine import common_prefix_len
from specdec.processors import LogitsParams
from specdec.reasoning import ThinkingBudget
from specdec.serve.metrics import Metrics, request_stats
from specdec.serve.protocol import Params, RequestError, error_body
from specdec.stream import StreamingEngine

__all__ = ["Job", "Worker"]


@dataclass(eq=False)  # a job is itself (held in a set while it runs)
class Job:
    params: Params
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    ids: list[int] | None = None  # its prompt's token ids, once an engine choice needed them

    def emit(self, kind: str, payload: Any = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is gone (server shutting down)
            self.cancel.set()


def _plain_ids(tokenizer: Any, text: str) -> tuple[int, ...]:
    """`text`'s token ids as a model writes it in a reply (no BOS)."""
    try:
        return tuple(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:  # the stub's bytes: BOS first
        ids = list(tokenizer.encode(text))
        return tuple(ids[1:] if ids and ids[0] == getattr(tokenizer, "bos_token_id", None) else ids)


class TokenSpeller:
    """A token id's bytes (logprobs' `bytes`): llguidance knows every tokenizer's (byte-level, SentencePiece
    byte fallback), built on first use; without it, the token decoded alone."""

    def __init__(self, verifier: Any) -> None:
        self.verifier, self._spell = verifier, None

    def __call__(self, token: int) -> bytes:
        if self._spell is None:
            v, tok = self.verifier, self.verifier.tokenizer
            self._spell = lambda t: str(t).encode()
            if tok is not None:
                self._spell = lambda t: tok.decode([t]).encode()
                try:
                    from specdec.grammar import grammar_tokenizer

                    ll = grammar_tokenizer(tok, v.vocab_size, v.eos_token_ids)
                    self._spell = lambda t: ll.decode_bytes([t])
                except ValueError:
                    pass
        return self._spell(token)


class Worker:
    """One thread per engine; at most `max_queue` requests wait for a free one (0: none wait). Engines on
    sequences of one batch run their requests' verifies together (`engine.decode`).
    Every exception of a request becomes that request's error; should a thread itself ever end for another
    reason, `error` says why, /health answers 503 and `on_death` runs (the CLI server exits 1)."""

    def __init__(
        self,
        engines: StreamingEngine | Sequence[StreamingEngine],
        *,
        max_queue: int = 16,
        default_max_tokens: int = 512,
        on_death: Callable[[BaseException], None] | None = None,
        tool_parser: str | None = None,
    ) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        if default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {default_max_tokens}")
        self.engines = [engines] if isinstance(engines, StreamingEngine) else list(engines)
        self.engine, self.default_max_tokens = self.engines[0], default_max_tokens
        self.waiting: deque[Job] = deque()  # in arrival order, bounded by `submit`
        self.max_queue = max_queue
        self.metrics = Metrics()
        self.spell = TokenSpeller(self.engine.verifier)
        if tool_parser is not None:
            for e in self.engines:
                e.set_reply_format(tool_parser=tool_parser)
        self.format = self.engine.reply_format
        self.running: set[Job] = set()
        self.error: BaseException | None = None
        self._on_death = on_death
        self._lock = threading.Condition()  # guards `waiting`, `running`, `_idle`; signals a change of them
        self._idle: list[StreamingEngine] = []  # engines whose threads wait for a job
        self._stopping = False
        self._threads = [
            threading.Thread(target=self._loop, args=(e,), name=f"specdec-worker-{i}", daemon=True)
            for i, e in enumerate(self.engines)
        ]
        for t in self._threads:
            t.start()

    @property
    def busy(self) -> bool:
        return bool(self.running)

    @property
    def alive(self) -> bool:
        return all(t.is_alive() for t in self._threads) and self.error is None

    def submit(self, job: Job) -> bool:
        """Queue `job`; False when the queue is full (or the worker is gone)."""
        with self._lock:
            taken = len(self.running) + len(self.waiting)  # running or about to, for one of the engines
            if self._stopping or not self.alive or taken >= len(self.engines) + self.max_queue:
                return False
            self.waiting.append(job)
            self._lock.notify_all()
        return True

    def stop(self) -> None:
        """Cancel what runs and waits, then end the threads (never blocks for long)."""
        with self._lock:
            self._stopping = True
            while self.waiting:
                job = self.waiting.popleft()
                job.cancel.set()
                job.emit("cancelled")
            for job in self.running:
                job.cancel.set()
            self._lock.notify_all()
        for t in self._threads:
            t.join(timeout=30)

    def _loop(self, engine: StreamingEngine) -> None:
        try:
            while (job := self._take(engine)) is not None:
                if job.cancel.is_set():  # the client left while queued
                    self.metrics.add("requests_cancelled")
                    job.emit("cancelled")
                    with self._lock:
                        self.running.discard(job)
                    continue
                try:  # on a sequence of a batch, a member of it while it decodes (`engine.decode`)
                    self._serve(job, engine)
                except Exception as e:  # a bug of ours: that request's 500, the next one is served
                    self.metrics.add("requests_failed")
                    job.emit(
                        "error",
                        error_body(f"internal error: {type(e).__name__}: {e}", 500) | {"status": 500},
                    )
                finally:
                    with self._lock:
                        self.running.discard(job)
        except BaseException as e:
            self.error = e
            if self._on_death is not None:
                self._on_death(e)
            raise

    def _take(self, engine: StreamingEngine) -> Job | None:
        """The next job for `engine`'s thread (None: the worker stops): the oldest waiting one, where no
        other free engine's cache holds a longer start of its prompt."""
        with self._lock:
            self._idle.append(engine)
            self._lock.notify_all()  # a free engine may be the better one for the oldest job
            try:
                while not self._stopping:
                    if self.waiting and self._best(self.waiting[0]) is engine:
                        job = self.waiting.popleft()
                        self.running.add(job)
                        self._lock.notify_all()  # the next job may be another free engine's now
                        return job
                    self._lock.wait()
                return None
            finally:
                self._idle.remove(engine)

    def _best(self, job: Job) -> StreamingEngine:
        """With the lock held: the free engine whose cache holds the longest start of `job`'s prompt (the
        first free one where none holds any)."""
        if job.ids is None:
            p = job.params
            try:  # what `_serve` encodes again (and reports, where it fails)
                job.ids = self._idle[0].encode(p.prompt, tools=p.tools, template_kwargs=p.template_kwargs)
            except Exception:  # any failure: no preference (`_serve` says what is wrong)
                job.ids = []
        order = sorted(self._idle, key=self.engines.index)
        return max(order, key=lambda e: common_prefix_len(e.cached_tokens, job.ids))

    def _with_tool_grammar(self, p: Params) -> Params:
        """The request with the model's call syntax known, and under `tool_choice` "required" or a named
        function the grammar of a reply that is only valid calls."""
        try:
            self.format.call_syntax()
        except ValueError as e:
            raise RequestError(str(e), param="tools") from None
        try:
            grammar = self.format.tool_grammar(
                p.tools or [], p.tool_choice, p.parallel_tool_calls, opened=p.reasoning_opened
            )
        except ValueError as e:
            raise RequestError(str(e), param="tool_choice") from None
        if grammar is None:  # "auto" / "none": the model's own choice
            return p
        return replace(p, logits=replace(p.logits or LogitsParams(), grammar=grammar), grammar_field="tools")

    def _with_budget(self, p: Params, eng: StreamingEngine) -> Params:
        """The request with its thinking budget a processor (refused for a model that shows no reasoning)."""
        reasoning = self.format.reasoning
        if reasoning is None:
            raise RequestError(
                "this model's chat template shows no reasoning we know (<think>, Gemma 4's or gpt-oss's "
                "channels): 'thinking_budget' would do nothing",
                param="thinking_budget",
            )
        start, end = (_plain_ids(eng.verifier.tokenizer, t) for t in (reasoning.start, reasoning.end))
        budget = ThinkingBudget(p.thinking_budget or 0, end, start, p.reasoning_opened)
        return replace(p, logits=replace(p.logits or LogitsParams(), thinking=budget))

    def _serve(self, job: Job, eng: StreamingEngine) -> None:
        p = job.params
        try:
            try:
                ids = eng.encode(p.prompt, tools=p.tools, template_kwargs=p.template_kwargs)
            except ValueError as e:  # the messages, or tools the template cannot render
                field = "tools" if p.tools and "tool" in str(e) else "messages" if p.chat else "prompt"
                raise RequestError(str(e), param=field) from None
            if p.chat:  # does the prompt leave the reply inside the reasoning?
                p = job.params = replace(p, reasoning_opened=self.format.opened(ids))
            if p.tools is not None:
                p = job.params = self._with_tool_grammar(p)
            if p.thinking_budget is not None:
                p = job.params = self._with_budget(p, eng)
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
            if p.logits is not None:
                v = eng.verifier
                try:
                    p.logits.check_bias(v.vocab_size)
                except ValueError as e:
                    raise RequestError(str(e), param="logit_bias") from None
                try:
                    p.logits.check(v.vocab_size, v.tokenizer, v.eos_token_ids)
                except ValueError as e:
                    raise RequestError(str(e), param=p.grammar_field) from None
            stream = eng.stream(
                ids,
                max_tokens=max_tokens,
                sampling=p.sampling,
                stop=p.stop,
                cancel=job.cancel,
                logits=p.logits,
                logprobs=p.logprobs,
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
