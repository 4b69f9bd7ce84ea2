"""Streaming generation for apps: text deltas as tokens are committed, cancellation, multi-turn cache reuse.

engine = StreamingEngine(verifier, drafter)
for event in engine.stream([{"role": "user", "content": "Hi"}], max_tokens=64, stop=["\\n\\n"]):
    print(event.delta, end="", flush=True)      # event.step: the StepRecord; event.result on the last one
session = ChatSession(engine); session.send("Hi").text(); session.send("And then?").text()

Contract:
- A `StreamingEngine` owns a verifier, an optional drafter and their caches, and runs one stream at a time.
  Engines may share a loaded model (two conversations of a chat app): their runs take turns, each holding
  the model from its first step to its end (another thread's run waits; two streams iterated in turn on
  one thread are refused), and an engine reuses a cache only where no other run touched it since its own.
  `engine.stream(...)` returns a `Stream`: an iterator (or, with `async for`, an async iterator whose work
  runs on a thread) of `StreamEvent`s, one per engine step, the prefill first.
- Text: after each step the whole output so far is decoded and only the stable new suffix is emitted;
  trailing U+FFFD (a multi-byte character split across tokens) and any suffix that could be the start of a
  stop string are held back until they resolve. Stop tokens (EOS) are never decoded. `"".join(deltas)`
  equals `result.text`, the decode of the output tokens cut before the earliest stop string, for any
  tokenizer whose decode only changes at its end as tokens are appended (byte-level BPE, SentencePiece,
  the stub's bytes).
- Stop strings: the text ends before the earliest occurrence; the output tokens end with the token that
  completed it (finish_reason "stop"); the stop string itself is never emitted.
- Cancellation: `stream.cancel()` (from any thread), a `cancel=threading.Event`, or closing the iterator.
  Checked before every step, so work stops within one step; finish_reason "cancelled".
- Reuse: after every run (finished, stopped, cancelled) the verifier cache holds exactly
  `prompt + output[:-1]` (the last committed token was never fed; the next prefill feeds it) and the
  drafter's context the same positions. The next run rolls both back to the longest common prefix of that
  and its own prompt and prefills only the rest, so a chat app that resends the whole conversation pays
  for the new tokens only. The tokens equal a fresh `specdec.engine.decode` of the same prompt (the
  sampler's randomness is indexed by absolute position, so this holds at T > 0 as well).
- Memory: the context is capped at `max_context` (default: the verifier's). A prompt that does not fit
  raises ValueError naming the sizes (a `ChatSession` says to start a new session or drop turns);
  generation that reaches the cap ends with finish_reason "context".
- Prompts are encoded by `specdec.chat.encode_prompt` (chat messages through the tokenizer's chat
  template; the stub's bytes get `specdec.chat.FALLBACK_CHAT_FORMAT`).
"""

from __future__ import annotations

import asyncio
import threading
import time
import warnings
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from specdec.chat import encode_prompt
from specdec.detokenize import Detokenizer, text_decoder
from specdec.engine import (
    DecodeConfig,
    check_request,
    common_prefix_len,
    context_limit,
    decode,
    decode_config,
)
from specdec.lease import hold
from specdec.processors import LogitsParams
from specdec.protocols import Drafter, RollbackError, Verifier
from specdec.records import PromptResult, StepRecord, summarize
from specdec.reply import ReplyFormat, ReplySplit
from specdec.sampling import SamplingParams
from specdec.tools import check_tools
from specdec.tree import TreeBudget

__all__ = [
    "ChatSession",
    "Detokenizer",
    "Engine",
    "Prompt",
    "Stream",
    "StreamEvent",
    "StreamResult",
    "StreamingEngine",
    "text_decoder",
]

Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]


# ---- events and results ----------------------------------------------------------------------------------


@dataclass(kw_only=True)
class StreamResult:
    text: str
    output_tokens: list[int]
    finish_reason: str  # "stop" | "length" | "context" | "cancelled"
    prompt_tokens: int
    reused_tokens: int  # prompt positions served from the cache of the previous run
    steps: list[StepRecord]
    stop_string: str | None = None
    ttft_s: float | None = None  # wall clock from the start of the run (rollback included) to the first token
    wall_s: float = 0.0
    #: a chat prompt's reply as an OpenAI assistant message: "content", and where the model wrote them
    #: "reasoning_content" (a thinking model's) and "tool_calls"; None for a text or token prompt
    message: dict[str, Any] | None = None

    def prompt_result(self, prompt_id: str = "0") -> PromptResult:
        return PromptResult(
            id=prompt_id,
            prompt_tokens=self.prompt_tokens,
            steps=self.steps,
            output_tokens=self.output_tokens,
            text=self.text,
            finish_reason=self.finish_reason,
        )

    def summary(self) -> dict[str, Any]:
        """`specdec.records.summarize` of this run, plus drafted / accepted totals."""
        s = summarize([self.prompt_result()])
        decode = [st for st in self.steps if st.phase == "decode"]
        s["drafted"] = sum(st.drafted for st in decode)
        s["accepted"] = sum(st.accepted for st in decode)
        s["reused_tokens"] = self.reused_tokens
        s["ttft_wall_s"] = self.ttft_s
        return s


@dataclass(kw_only=True)
class StreamEvent:
    delta: str  # text that became final with this step ("" while held back)
    tokens: list[int]  # tokens committed in this step
    step: StepRecord | None  # None on the closing event of a cancelled run
    result: StreamResult | None = None  # on the last event only
    # a chat prompt's delta split: reasoning apart, and content without tool calls (held until they parse)
    reasoning: str = ""
    content: str = ""


# ---- the engine ------------------------------------------------------------------------------------------


class StreamingEngine:
    """A verifier (+ drafter) that streams text and keeps its caches between runs for prefix reuse."""

    def __init__(
        self,
        verifier: Verifier,
        drafter: Drafter | None = None,
        *,
        block_size: int | None = None,
        max_context: int | None = None,
        reuse: bool = True,
        tree: TreeBudget | None = None,
    ) -> None:
        """`block_size` None: the drafter's own; `tree`: verify a tree of drafts per step within this budget
        (`specdec.tree`; None: chains)."""
        self.verifier, self.reuse = verifier, reuse
        if drafter is not None:  # one bound elsewhere (to the model a batch's sequence shares) reads this one
            drafter.bind(verifier)
        self.max_context = context_limit(verifier, max_context)
        # every run's DecodeConfig is this one with the run's own limits (`specdec.engine.decode_config`)
        self._base = decode_config(drafter, block_size=block_size, tree=tree, max_context=self.max_context)
        self.block_size, self.tree = self._base.block_size, self._base.tree
        self.drafter = self._base.drafting(drafter)  # None: the AR baseline
        tok = verifier.tokenizer
        self._decode = text_decoder(tok) if tok is not None else None
        self._reply_format: ReplyFormat | None = None  # read on first use
        self._lock = threading.Lock()
        self._vtokens: list[int] | None = None  # what the verifier cache holds; None: unknown
        self._dtokens: list[int] | None = None  # what the drafter's context holds; None: unknown

    @classmethod
    def from_loaded(
        cls, loaded: Any, *, max_context: int | None = None, reuse: bool = True
    ) -> StreamingEngine:
        """The engine of what `specdec.api.load` built (`api.Loaded`): its verifier, drafter, blocks, tree."""
        return cls(
            loaded.verifier,
            loaded.drafter,
            block_size=loaded.block_size,
            max_context=max_context,
            reuse=reuse,
            tree=loaded.tree,
        )

    @property
    def cached_tokens(self) -> list[int]:
        """The token ids the verifier cache holds now (a copy)."""
        return list(self._vtokens or [])

    def reset(self) -> None:
        """Forget the caches (the next run prefills its whole prompt)."""
        with self._lock:
            self._vtokens = self._dtokens = None

    def encode(self, prompt: Prompt, **kw: Any) -> list[int]:
        """Text, chat messages or token ids -> prompt ids (`specdec.chat.encode_prompt`, its keywords)."""
        return encode_prompt(self.verifier, prompt, **kw)

    def stream(
        self,
        prompt: Prompt,
        *,
        max_tokens: int = 256,
        sampling: SamplingParams | None = None,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: frozenset[int] | None = None,
        cancel: threading.Event | None = None,
        logits: LogitsParams | None = None,
        logprobs: int | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: Any = None,
        parallel_tool_calls: bool = True,
        response_format: Mapping[str, Any] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> Stream:
        """Start a run (work happens as the Stream is iterated); `logits`: bias, penalties, grammar (applied
        inside verification); `logprobs` k: `StepRecord.logprobs`, top k. Errors a user causes raise here.
        Chat prompts only: `tools` (OpenAI's) through the chat template, `tool_choice` "auto" / "none" /
        "required" / {"type": "function", "function": {"name"}} (the last two forced valid by a grammar),
        `parallel_tool_calls`; `response_format` as OpenAI's (json_object, json_schema); `template_kwargs`
        to the template (e.g. enable_thinking). The reply's split is on each event (`reasoning`, `content`)
        and in `result.message`."""
        chat = not isinstance(prompt, str) and bool(prompt) and isinstance(prompt[0], Mapping)
        tools = check_tools(tools) if tools is not None else None
        ids = self.encode(prompt, tools=tools, template_kwargs=template_kwargs)
        opened = chat and self._decode is not None and self.reply_format.opened(ids)
        logits = self.reply_format.constrain(
            logits,
            tools=tools,
            tool_choice=tool_choice,
            parallel=parallel_tool_calls,
            response_format=response_format,
            opened=opened,
        )
        stops = tuple([stop] if isinstance(stop, str) else (stop or ()))
        if not all(isinstance(s, str) for s in stops):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        limits = {"max_new_tokens": max_tokens, "stop_token_ids": stop_token_ids}
        cfg = replace(self._base, **limits, sampling=sampling, logits=logits, logprobs=logprobs)
        check_request(self.verifier, ids, self.drafter, cfg)
        if stops and self._decode is None:
            raise ValueError(f"stop strings need a tokenizer; verifier {self.verifier.model_name!r} has none")
        split = None
        if chat and self._decode is not None:
            split = self.reply_format.split(tools=tools is not None, opened=opened)
        return Stream(self, ids, cfg, stops, cancel or threading.Event(), split)

    @property
    def reply_format(self) -> ReplyFormat:
        """How the verifier writes reasoning and tool calls (`specdec.reply`), read from its chat template;
        `set_reply_format` to name a call syntax."""
        if self._reply_format is None:
            self._reply_format = ReplyFormat.of(self.verifier)
        return self._reply_format

    def set_reply_format(self, *, tool_parser: str | None = None) -> None:
        """Read the reply format again (after a chat template change); `tool_parser` names the call syntax."""
        self._reply_format = ReplyFormat.of(self.verifier, tool_parser=tool_parser)

    def complete(self, prompt: Prompt, **kw: Any) -> StreamResult:
        """Run to the end; the StreamResult."""
        s = self.stream(prompt, **kw)
        for _ in s:
            pass
        assert s.result is not None
        return s.result

    # ---- the run: text over the step loop ---------------------------------------------------------------

    def _run(
        self, ids: list[int], cfg: DecodeConfig, stops: tuple[str, ...], st: Stream
    ) -> Iterator[StreamEvent]:
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(
                "engine busy: another stream is running on it; iterate it to the end or close() it first "
                "(one StreamingEngine serves one stream at a time)"
            )
        try:  # the models, held for the whole run (a stop string's cut included) against other engines
            with hold(self, self.verifier, self.drafter) as mine:
                if not mine:  # another engine ran on them since our last run: what they cache is not ours
                    self._vtokens = self._dtokens = None
                yield from self._events(ids, cfg, stops, st)
        finally:
            self._lock.release()

    def _events(
        self, ids: list[int], cfg: DecodeConfig, stops: tuple[str, ...], st: Stream
    ) -> Iterator[StreamEvent]:
        stop_ids = cfg.stop_token_ids if cfg.stop_token_ids is not None else self.verifier.eos_token_ids
        detok = Detokenizer(self._decode, stop=stops, skip_ids=stop_ids) if self._decode else None
        steps: list[StepRecord] = []
        out: list[int] = []
        reason, ttft = None, None
        t0 = time.perf_counter()
        box: dict[str, int] = {}
        inner = self._steps(ids, cfg, st._cancel, box)
        result: StreamResult | None = None

        def finalize(finish: str, stop_string: str | None = None) -> StreamResult:
            text = detok.text if detok else ""
            return StreamResult(
                text=text,
                output_tokens=list(out),
                finish_reason=finish,
                prompt_tokens=len(ids),
                reused_tokens=box.get("reused", 0),
                steps=steps,
                stop_string=stop_string,
                ttft_s=ttft,
                wall_s=time.perf_counter() - t0,
            )

        try:
            for step in inner:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                out += step.tokens
                delta = detok.push(step.tokens) if detok else ""
                reason = step.finish_reason
                if detok and detok.stop_string is not None:
                    inner.close()  # the cache holds ids + out[:-1]: cut it back to the kept tokens
                    n_cut = len(out) - detok.n_keep
                    self._rollback(n_cut)
                    del out[detok.n_keep :]
                    step = replace(step, tokens=step.tokens[: len(step.tokens) - n_cut], finish_reason="stop")
                    reason = "stop"
                steps.append(step)
                if reason is not None:
                    delta += detok.flush() if detok else ""
                    result = finalize(reason, detok.stop_string if detok else None)
                st.result = result
                yield StreamEvent(delta=delta, tokens=list(step.tokens), step=step, result=result)
                if result is not None:
                    return
            # the step loop ended without a finish reason: cancelled between steps
            delta = detok.flush() if detok else ""
            st.result = result = finalize("cancelled")
            yield StreamEvent(delta=delta, tokens=[], step=None, result=result)
        except GeneratorExit:  # closed by the consumer at a yield: the caches are consistent
            if st.result is None:
                if detok:
                    detok.flush()
                st.result = finalize("cancelled")
            raise
        finally:
            inner.close()

    # ---- the step loop: specdec.engine.decode, started from the kept cache ------------------------------

    def _rollback(self, n: int) -> None:
        """Drop the last n positions of both caches (which hold the same positions between runs). Where the
        verifier cannot do that exactly both caches are forgotten: the next run prefills from scratch."""
        if n == 0:
            return
        assert self._vtokens is not None
        try:
            self.verifier.rollback(n)
        except RollbackError:
            self._vtokens = self._dtokens = None
            return
        del self._vtokens[len(self._vtokens) - n :]
        if self.drafter is not None:
            assert self._dtokens is not None and len(self._dtokens) == len(self._vtokens) + n
            self.drafter.rollback(n)
            del self._dtokens[len(self._dtokens) - n :]

    def _restore(self, prompt: list[int]) -> int:
        """Roll both caches back to the longest prefix they share with `prompt` (at most all but its last
        token, which prefill must feed), or reset them. Returns the positions kept."""
        v, d = self.verifier, self.drafter
        keep = 0
        if self.reuse and self._vtokens is not None and v.position == len(self._vtokens):
            keep = min(common_prefix_len(self._vtokens, prompt), len(prompt) - 1)
            if d is not None:
                ok = self._dtokens is not None and d.context_len == len(self._dtokens)
                keep = min(keep, common_prefix_len(self._dtokens, prompt) if ok else 0)
        if keep > 0:
            try:
                v.rollback(len(self._vtokens) - keep)
            except RollbackError:  # e.g. a full sliding window cannot reach that far back: prefill it all
                keep = 0
        if keep == 0:
            v.reset()
            self._vtokens = []
            if d is not None:
                d.reset()
                self._dtokens = []
        else:
            del self._vtokens[keep:]
            if d is not None:
                d.rollback(len(self._dtokens) - keep)
                del self._dtokens[keep:]
        assert v.position == keep, (v.position, keep)
        return keep

    def _steps(
        self, prompt: list[int], cfg: DecodeConfig, cancel: threading.Event, box: dict[str, int]
    ) -> Iterator[StepRecord]:
        """`engine.decode` from the kept cache; records what both caches hold (prompt + out[:-1])."""
        if cancel.is_set():
            return
        drafter = self.drafter if cfg.block_size > 1 else None
        try:
            keep = box["reused"] = self._restore(prompt)
            if drafter is None:
                self._dtokens = None  # the drafter does not follow this run: its context is unknown after
            vt, dt = self._vtokens, self._dtokens
            run_cfg = replace(cfg, max_context=self.max_context)
            last = None
            for step in decode(
                self.verifier, prompt, drafter=drafter, cfg=run_cfg, keep=keep, cancel=cancel, owner=self
            ):
                # both caches just took the prompt's rest, or the last token + committed[:-1]
                new = prompt[keep:] if last is None else [last, *step.tokens[:-1]]
                vt += new
                if dt is not None:
                    dt += new
                last = step.tokens[-1]
                yield step
        except GeneratorExit:
            raise  # closed at a yield: the caches are consistent
        except BaseException:
            self._vtokens = self._dtokens = None  # failed mid-call: the next run starts from scratch
            raise


class Engine(StreamingEngine):
    """The old name of `StreamingEngine` (`specdec.engine` is the decode loop), kept for one release."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        warnings.warn(
            "specdec.stream.Engine is now specdec.stream.StreamingEngine; the old name goes next release",
            DeprecationWarning,
            stacklevel=2,
        )
        super().__init__(*args, **kwargs)


# ---- the stream object -----------------------------------------------------------------------------------


class Stream:
    """Iterate (or `async for`) to run; `cancel()` from any thread; `result` once finished or closed."""

    def __init__(
        self,
        engine: StreamingEngine,
        ids: list[int],
        cfg: DecodeConfig,
        stops: tuple[str, ...],
        cancel: threading.Event,
        split: ReplySplit | None = None,
    ) -> None:
        self.prompt_ids = ids
        self._split = split
        self.result: StreamResult | None = None
        self._cancel = cancel
        self._gen = engine._run(ids, cfg, stops, self)
        self._on_done: list[Callable[[StreamResult], None]] = []
        self._done = False

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> StreamEvent:
        ev = next(self._gen)
        if self._split is None:
            ev.content = ev.delta
        else:
            ev.reasoning, ev.content = self._split.push(ev.delta, ev.tokens)
        if ev.result is not None:
            more_reasoning, more_content = self._finished()  # what the split held back to the end
            ev.reasoning, ev.content = ev.reasoning + more_reasoning, ev.content + more_content
        return ev

    def cancel(self) -> None:
        """Stop within one step (thread-safe); the run ends with finish_reason "cancelled"."""
        self._cancel.set()

    def close(self) -> None:
        """Stop now; the caches stay consistent and `result` holds what was generated."""
        self._gen.close()
        self._finished()

    def text(self) -> str:
        """Run to the end and return the whole text."""
        for _ in self:
            pass
        assert self.result is not None
        return self.result.text

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _finished(self) -> tuple[str, str]:
        """Runs once, at the end: the reply's message, the callbacks; (reasoning, content) held to the end."""
        tail = ("", "")
        if not self._done and self.result is not None:
            self._done = True
            if self._split is not None:
                tail = self._split.finish()[:2]
                self.result.message = self._split.message()
            for f in self._on_done:
                f(self.result)
        return tail

    def __aiter__(self) -> AsyncIterator[StreamEvent]:
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[StreamEvent]:
        """The same events; the work runs on a thread so the event loop stays free. Leaving the loop early
        (break, task cancellation) cancels the run and waits for the current step to end."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[Any] = asyncio.Queue()
        done = object()

        def put(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:  # the event loop is gone
                self.cancel()

        def produce() -> None:
            try:
                for ev in self:
                    put(ev)
            except BaseException as e:
                put(_Failure(e))
            finally:
                put(done)

        worker = threading.Thread(target=produce, name="specdec-stream", daemon=True)
        worker.start()
        try:
            while (item := await q.get()) is not done:
                if isinstance(item, _Failure):
                    raise item.error
                yield item
        finally:
            self.cancel()
            await asyncio.shield(asyncio.to_thread(worker.join))


@dataclass
class _Failure:
    error: BaseException


# ---- conversations ---------------------------------------------------------------------------------------


@dataclass
class ChatSession:
    """A conversation on one StreamingEngine: each `send` appends the user message, streams the reply, and
    appends it (also a cancelled, partial one) to `messages`; the cache keeps the conversation so the next
    turn only prefills its new tokens. Another prompt on the same engine between turns is correct but
    evicts the conversation from the cache. With `tools`, a reply that calls them is appended with its
    `tool_calls`; `tool_result` appends each call's result and `send(None)` lets the model go on."""

    engine: StreamingEngine
    messages: list[dict[str, Any]] = field(default_factory=list)
    system: str | None = None
    tools: list[dict[str, Any]] | None = None  # OpenAI's tools, offered on every turn

    def __post_init__(self) -> None:
        if self.system is not None and not self.messages:
            self.messages.append({"role": "system", "content": self.system})

    def send(self, content: str | None, **kw: Any) -> Stream:
        """Stream the reply to `content` (None: to the conversation as it is, e.g. after tool results);
        kwargs as `StreamingEngine.stream` (max_tokens, sampling, logits, logprobs, stop, cancel,
        tool_choice, template_kwargs...)."""
        msgs = [*self.messages, *([{"role": "user", "content": content}] if content is not None else [])]
        try:
            s = self.engine.stream(msgs, **{"tools": self.tools, **kw})
        except ValueError as e:
            if "leaves no room" in str(e):
                raise ValueError(
                    f"the conversation no longer fits the context: {e}. Start a new ChatSession, or drop "
                    "earlier turns from session.messages"
                ) from e
            raise
        s._on_done.append(lambda r: self._append(msgs, r))
        return s

    def _append(self, msgs: list[dict[str, Any]], r: StreamResult) -> None:
        calls = (r.message or {}).get("tool_calls")
        # the reply's text whole (the cache holds it so) unless it called tools: then the calls, as templates
        # render them back
        reply = {"role": "assistant", "content": r.text} if not calls else {**r.message}
        self.messages = [*msgs, reply]

    def tool_result(self, call_id: str, content: str) -> None:
        """Append a tool call's result (`call_id`: its "id" in the reply's `tool_calls`)."""
        self.messages = [*self.messages, {"role": "tool", "tool_call_id": call_id, "content": content}]

    def prompt_ids(self, next_user: str | None = None) -> list[int]:
        """The ids the next turn's prompt would have (for checks and measurements)."""
        msgs = self.messages + ([{"role": "user", "content": next_user}] if next_user is not None else [])
        return self.engine.encode(msgs, tools=self.tools)
