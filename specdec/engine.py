"""The decode loop: exact greedy speculative decoding, one generator of step records.

Each step feeds `[last, *draft]` to the verifier in one call, accepts drafts while they equal the
verifier's own token at that position, commits the accepted drafts plus the verifier's next token
(the bonus), rolls the verifier cache back past the rejected part, and hands the drafter the features
of exactly the committed positions. With no drafter (or block_size 1) the same loop is plain
autoregressive decoding: the baseline that speedups are measured against.

Timers are honest without explicit device syncs: every phase ends in a host-side value that depends on
all of its device work (`list[int]` from propose/verify; the bridge materialises the feature slice).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from specdec.grammar import Constraint
from specdec.kernels import MAX_VERIFY_TOKENS
from specdec.lease import Run, hold
from specdec.memory import unmeasured
from specdec.processors import LogitsParams, Processor
from specdec.protocols import (
    BatchedCalls,
    Drafter,
    MemoryProbe,
    NativeFeatures,
    SampledProposals,
    SampledWalk,
    TreeProposals,
    TreeVerify,
    Verifier,
    check_compatible,
)
from specdec.records import JsonlWriter, PromptResult, StepRecord, TokenLogprob
from specdec.sampling import Sampler, SamplingParams
from specdec.threads import ThreadChoice, choice_for
from specdec.tree import Tree, TreeBudget

_NO_DRAFTER = unmeasured("no drafter in this run")
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs


@dataclass(frozen=True, kw_only=True)
class DecodeConfig:
    """How one run decodes; `decode_config` puts it together for a loaded drafter."""

    max_new_tokens: int = 256
    block_size: int = 16  # 1 = autoregressive baseline
    stop_token_ids: frozenset[int] | None = None  # None: the verifier's EOS ids
    max_context: int | None = None  # None: the verifier's limit
    sampling: SamplingParams | None = None  # None or temperature 0: greedy
    tree: TreeBudget | None = None  # verify a tree of drafts per step (`specdec.tree`); None: a chain
    logits: LogitsParams | None = None  # bias, penalties, grammar: applied inside verification (`processors`)
    logprobs: int | None = None  # record each committed token's log-probability and this many top ones

    def drafting(self, drafter: Drafter | None) -> Drafter | None:
        """The drafter a run with this config drafts with: None for the autoregressive baseline (no
        drafter, or blocks of 1) - the one place that decides it."""
        return drafter if self.block_size > 1 else None


def decode_config(
    drafter: Drafter | None,
    *,
    block_size: int | None = None,
    tree: TreeBudget | None = None,
    max_new_tokens: int = 256,
    sampling: SamplingParams | None = None,
    stop_token_ids: frozenset[int] | None = None,
    max_context: int | None = None,
    logits: LogitsParams | None = None,
    logprobs: int | None = None,
) -> DecodeConfig:
    """The `DecodeConfig` of a run with `drafter` (None: the autoregressive baseline, blocks of 1 and no
    tree), drafting blocks of `block_size` (None: the drafter's own) and verifying trees within `tree`."""
    block = 1 if drafter is None else block_size or drafter.block_size
    return DecodeConfig(
        max_new_tokens=max_new_tokens,
        block_size=block,
        stop_token_ids=stop_token_ids,
        max_context=max_context,
        sampling=sampling,
        tree=tree if block > 1 else None,
        logits=logits,
        logprobs=logprobs,
    )


def _stops(verifier: Verifier, cfg: DecodeConfig) -> frozenset[int]:
    return cfg.stop_token_ids if cfg.stop_token_ids is not None else verifier.eos_token_ids


def _processor(verifier: Verifier, cfg: DecodeConfig, prompt: Sequence[int]) -> Processor | None:
    """The run's logits processors (None: nothing changes a logit), its grammar compiled."""
    p = cfg.logits
    if p is None or not p.active:
        return None
    grammar = None
    if p.grammar is not None:
        grammar = Constraint(p.grammar, verifier.tokenizer, verifier.vocab_size, _stops(verifier, cfg))
    return Processor(p, prompt, constraint=grammar)


def _constrain(
    grammar: Constraint, draft: list[int], q: torch.Tensor | None, k: int
) -> tuple[list[int], torch.Tensor | None, torch.Tensor | None]:
    """A chain draft under a grammar: the tokens it forces next in front (free drafts; where the drafter
    guessed otherwise its later guesses went the wrong way and go too), cut before the first token it
    forbids (a row that could only reject). q [k, V] follows (a forced token is proposed with certainty:
    one-hot), and the q [V] of a sampled draft that was cut comes back: its rejection is still taken."""
    forced = grammar.forced()[:k]
    if forced:
        if draft[: len(forced)] != forced:
            draft, q = forced, None if q is None else q[: len(forced)]
        if q is not None:
            q = q.clone()
            q[: len(forced)] = torch.nn.functional.one_hot(torch.tensor(forced), q.shape[-1]).to(q)
    n = grammar.allowed_prefix(draft)
    cut = q[n] if q is not None and n < len(draft) else None
    return draft[:n], None if q is None else q[:n], cut


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of `a` and `b`: the drafts accepted against the verifier's tokens at
    the same positions, or the cached positions a new prompt can reuse."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def context_limit(verifier: Verifier, max_context: int | None) -> int:
    """Positions a run may fill: `max_context` (None: the verifier's own limit), at most the verifier's."""
    if max_context is not None and max_context < 2:
        raise ValueError(f"max_context must be >= 2 (or None for the model's), got {max_context}")
    return verifier.max_context if max_context is None else min(verifier.max_context, max_context)


def check_request(
    verifier: Verifier, prompt: Sequence[int], drafter: Drafter | None, cfg: DecodeConfig
) -> None:
    """Every error a user can cause, raised before any work is done."""
    if len(prompt) == 0:
        raise ValueError("empty prompt: give at least one token")
    if cfg.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {cfg.max_new_tokens}")
    if not 1 <= cfg.block_size <= MAX_VERIFY_TOKENS:
        raise ValueError(
            f"block_size must be 1..{MAX_VERIFY_TOKENS} (tokens per verify), got {cfg.block_size}"
        )
    if cfg.tree is not None and not 2 <= cfg.tree.nodes <= MAX_VERIFY_TOKENS:
        raise ValueError(
            f"a tree holds 2..{MAX_VERIFY_TOKENS} nodes (tokens per verify), got {cfg.tree.nodes}"
        )
    if cfg.logits is not None:
        cfg.logits.check(verifier.vocab_size, verifier.tokenizer, _stops(verifier, cfg))
    lp = cfg.logprobs
    if lp is not None and (
        isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= MAX_TOP_LOGPROBS
    ):
        raise ValueError(f"logprobs (the top tokens to report) must be 0..{MAX_TOP_LOGPROBS}, got {lp!r:.20}")
    bad = [t for t in prompt if not 0 <= t < verifier.vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} outside the vocabulary 0..{verifier.vocab_size - 1}")
    limit = context_limit(verifier, cfg.max_context)
    if len(prompt) >= limit:
        raise ValueError(
            f"prompt of {len(prompt)} tokens leaves no room in the context of {limit} positions "
            f"of {verifier.model_name!r}; shorten it"
        )
    drafter = cfg.drafting(drafter)
    if drafter is not None:
        check_compatible(verifier, drafter)
        verifier.check_rollback()  # a model we cannot roll back exactly is refused before any work
        if cfg.block_size > drafter.block_size:
            raise ValueError(
                f"block_size {cfg.block_size} exceeds the drafter's block size {drafter.block_size}"
            )
        if cfg.tree is not None:
            check_tree(verifier, drafter, cfg.sampling)


def check_tree(verifier: Verifier, drafter: Drafter, sampling: SamplingParams | None) -> None:
    """ValueError, before any work, where a tree cannot be drafted or verified exactly."""
    if not isinstance(drafter, TreeProposals):
        raise ValueError(
            f"drafter {drafter.name!r} cannot propose trees: --tree needs a DFlash or EAGLE-3 drafter (or "
            "one +lookup)"
        )
    if not isinstance(verifier, TreeVerify):
        raise ValueError(f"the {verifier.runtime} verifier does not verify trees; use a chain")
    verifier.check_tree()
    if sampling is not None and not sampling.greedy and sampling.rule != "match":
        raise ValueError("a tree is verified with the match rule at T > 0; --rule rejection needs a chain")
    if sampling is not None and not sampling.greedy and sampling.proposal != "argmax":
        raise ValueError("a tree holds the drafter's best candidates; --proposal sample needs a chain")


def _features(verifier: Verifier, drafter: Drafter, n: int) -> Any:
    if not drafter.target_layer_ids:  # a drafter that needs no features (prompt lookup, tests)
        return torch.empty(n, 0, device=drafter.device, dtype=drafter.dtype)
    if drafter.runtime == verifier.runtime and isinstance(verifier, NativeFeatures):  # no conversion
        return verifier.native_features(n)
    return verifier.features(n, device=drafter.device, dtype=drafter.dtype)


def _picker(
    sampler: Sampler | None, proc: Processor | None, paths: Any, pick: Any, lp: Logprobs | None
) -> Any:
    """The verifier's `sample` callback: logits [T, V] -> its token at each row, the logits processed with
    each row's path first (`proc`) and kept for their log-probabilities (`lp`), then `pick` (the sampler's
    rule) or argmax; None (the verifier picks by argmax on its own side) where there is nothing to do."""
    if proc is None and lp is None:
        return pick if sampler is not None else None

    def sample(logits: torch.Tensor) -> list[int]:
        x = proc(logits, paths()) if proc is not None else logits  # [T, V]
        if lp is not None:
            lp.capture(x)
        return pick(x) if sampler is not None else x.argmax(-1).tolist()

    return sample


class Logprobs:
    """Each committed token's log-probability under the processed logits of the row that decided it, and
    the `top` most likely tokens there (rows kept from the last verify until the step commits)."""

    def __init__(self, top: int) -> None:
        self.top = top
        self._rows: torch.Tensor | None = None  # [T, V] fp32 log-softmax of the last call's logits

    def capture(self, x: torch.Tensor) -> None:
        self._rows = torch.log_softmax(x.float(), dim=-1)

    def take(self, rows: Sequence[int], tokens: Sequence[int]) -> list[TokenLogprob]:
        """The records of `tokens`, decided at `rows` of the last verify."""
        assert self._rows is not None and len(rows) == len(tokens)
        x = self._rows[torch.tensor(list(rows), dtype=torch.long, device=self._rows.device)]  # [c, V]
        own = x.gather(1, torch.tensor(tokens, device=x.device)[:, None])[:, 0].tolist()
        top: list[list[tuple[int, float]]] = [[] for _ in tokens]
        if self.top:
            vals, ids = x.topk(self.top, dim=-1)
            top = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
        self._rows = None
        return [TokenLogprob(t, p, k) for t, p, k in zip(tokens, own, top)]


def _verify_tree(
    verifier: Verifier,
    tree: Tree,
    sampler: Sampler | None,
    proc: Processor | None,
    lp: Logprobs | None,
    pos: int,
) -> tuple[list[int], list[int], list[int]]:
    """Verify `tree` and keep its accepted path in the cache: (the path's drafts, the verifier's token after
    each of its nodes, the path's node indices): a chain step that accepted every draft it holds."""
    depths = tree.depths
    paths = lambda: [[tree.tokens[n] for n in tree.path(i)[1:]] for i in range(len(tree))]  # noqa: E731
    check = _picker(sampler, proc, paths, lambda logits: sampler.verify_tree(logits, depths, pos), lp)
    after = verifier.verify_tree(tree, sample=check)  # [N]: the verifier's token after each node
    path = tree.accept(after)
    verifier.keep_path(path)
    return [tree.tokens[i] for i in path[1:]], [after[i] for i in path], path


def _propose(
    drafter: Drafter, sampler: Sampler | None, token: int, k: int, pos: int
) -> tuple[list[int], torch.Tensor | None]:
    """The drafter's k tokens after `token` (the first at absolute position `pos`) and, when drafts are
    sampled (T > 0, `--proposal sample`), q [k, V]: the distribution each was drawn from."""
    if sampler is None or sampler.sp.proposal != "sample":
        return drafter.propose(token, k), None
    if isinstance(drafter, SampledWalk) and drafter.walks:
        return drafter.propose_walk(
            token, k, temperature=sampler.sp.temperature, u=sampler.draft_uniforms(pos, k)
        )
    if isinstance(drafter, SampledProposals):
        return sampler.propose(drafter.propose_logits(token, k), pos)
    return drafter.propose(token, k), None


def decode(
    verifier: Verifier,
    prompt: Sequence[int],
    *,
    drafter: Drafter | None = None,
    cfg: DecodeConfig,
    keep: int = 0,
    cancel: threading.Event | None = None,
    owner: object | None = None,
) -> Iterator[StepRecord]:
    """Yield the prefill record, then one record per decode step, the last with `finish_reason`.

    `keep` > 0: the verifier cache and the drafter context already hold `prompt[:keep]` (multi-turn
    reuse); only the rest is prefilled. At every yield both hold prompt + output[:-1]. A set `cancel`
    stops the loop before the next step (the caller records the cancellation).

    The run holds the verifier and the drafter from its first step to its end (`specdec.lease`): another
    run on either waits for it. On a sequence of a batch it is a member of the batch as long
    (`BatchedCalls.member`): its calls share forwards with the other runs', and while its consumer has
    a record (at each yield) they do not wait for it (`BatchedCalls.parked`). `owner`: who holds them (the
    streaming engine, which checks before it reuses a cache that nobody else ran on them since); None: this
    call alone, and `keep` is trusted."""
    check_request(verifier, prompt, drafter, cfg)
    drafter = cfg.drafting(drafter)
    batched = isinstance(verifier, BatchedCalls)
    member = verifier.member() if batched else contextlib.nullcontext()
    with hold(owner if owner is not None else Run(), verifier, drafter) as mine, member:
        if keep and owner is not None and not mine:
            raise RuntimeError(
                "another run used this model since: its cache no longer holds the prompt's start"
            )
        for record in _decode(verifier, prompt, drafter=drafter, cfg=cfg, keep=keep, cancel=cancel):
            with verifier.parked() if batched else contextlib.nullcontext():  # the consumer's turn
                yield record


def _finish(
    committed: list[int], n_out: int, stops: frozenset[int], max_new: int
) -> tuple[list[int], str | None]:
    """`committed` cut after a stop token or at `max_new` output tokens (`n_out` before it), and why."""
    for i, t in enumerate(committed):
        if t in stops:
            return committed[: i + 1], "stop"
        if n_out + i + 1 >= max_new:
            return committed[: i + 1], "length"
    return committed, None


def _prefill(
    verifier: Verifier,
    drafter: Drafter | None,
    prompt: Sequence[int],
    keep: int,
    sampler: Sampler | None,
    proc: Processor | None,
    lp: Logprobs | None,
    probes: tuple[MemoryProbe, MemoryProbe | None],
    finish: Any,
    rule: str,
) -> StepRecord:
    """The prompt's rest in one call, its last logits giving the first token; the drafter takes the
    prompt's features."""
    clock, (vprobe, dprobe) = time.perf_counter, probes
    t0 = clock()
    vprobe.reset()
    first = _picker(sampler, proc, lambda: [()], lambda logits: [sampler.first(logits, len(prompt))], lp)
    token = verifier.prefill(prompt[keep:], sample=first)
    t1 = clock()
    vmem = vprobe.read()
    draft_s = bridge_s = 0.0
    dmem = _NO_DRAFTER
    if drafter:
        feats = _features(verifier, drafter, len(prompt) - keep)  # [P-keep, K*H]
        t2 = clock()
        dprobe.reset()
        drafter.extend(feats, prompt[keep:])
        dmem = dprobe.read()
        draft_s, bridge_s = clock() - t2, t2 - t1
    out, reason = finish([token], 0)
    step_s = clock() - t0
    return StepRecord(
        index=0,
        phase="prefill",
        drafted=0,
        accepted=0,
        acceptance_length=1,
        tokens=out,
        draft_s=draft_s,
        verify_s=t1 - t0,
        bridge_s=bridge_s,
        other_s=step_s - draft_s - (t1 - t0) - bridge_s,
        step_s=step_s,
        peak_memory={"verifier": vmem, "drafter": dmem},
        finish_reason=reason,
        rule=rule,
        batch_size=verifier.batch_size if isinstance(verifier, BatchedCalls) else None,
        logprobs=lp.take([-1], out) if lp is not None else None,
    )


def _draft(
    drafter: Drafter,
    sampler: Sampler | None,
    tree_budget: TreeBudget | None,
    token: int,
    k: int,
    pos: int,
    room: int,
) -> tuple[list[int], torch.Tensor | None, Tree | None]:
    """This step's drafts after `token` (the first at absolute position `pos`): a chain of at most k, with q
    [k, V] where sampled, or with `tree_budget` a tree of at most k levels (no more nodes than `room`)."""
    if tree_budget is not None:  # its nodes sit in the cache until the path is kept: within the room left
        tree = drafter.propose_tree(token, k, replace(tree_budget, nodes=min(tree_budget.nodes, room)))
        return tree.tokens[1:], None, tree
    draft, q = _propose(drafter, sampler, token, k, pos)
    assert len(draft) <= k, f"drafter {drafter.name!r} proposed {len(draft)} > {k} tokens"
    return draft, q, None


def _setup(
    verifier: Verifier, cfg: DecodeConfig, prompt: Sequence[int]
) -> tuple[frozenset[int], int, Sampler | None, Processor | None, Logprobs | None, str]:
    """What a run decodes under: its stop tokens (a grammar's end tokens added: a run under a grammar
    ends with it), the context limit, the sampler (None: greedy), the logits processor, the logprobs
    collector and the acceptance rule's name."""
    stops = _stops(verifier, cfg)
    limit = context_limit(verifier, cfg.max_context)
    sp = cfg.sampling if cfg.sampling is not None and not cfg.sampling.greedy else None
    proc = _processor(verifier, cfg, prompt)
    if proc is not None and proc.constraint is not None:
        stops = stops | proc.constraint.end_tokens
    lp = Logprobs(cfg.logprobs) if cfg.logprobs is not None else None
    return stops, limit, Sampler(sp, limit) if sp else None, proc, lp, sp.rule if sp else "greedy"


def _verify_chain(
    verifier: Verifier,
    token: int,
    draft: list[int],
    q: Any,
    cut: Any,
    sampler: Sampler | None,
    proc: Processor | None,
    lp: Logprobs | None,
    pos: int,
    *,
    ahead: bool,
) -> list[int]:
    """[k+1]: the verifier's token after each of `[token, *draft]`, each row picked under its own history.
    `ahead` (no drafter): the next step's input is this step's output, which an asynchronous runtime can
    start on before the host sees it."""
    rows = lambda: [draft[:i] for i in range(len(draft) + 1)]  # noqa: E731 (row i's history)
    check = _picker(sampler, proc, rows, lambda x: sampler.verify(x, draft, q, pos, cut=cut), lp)
    return verifier.verify([token, *draft], sample=check, ahead=ahead)


def _phase_times(t0: float, t1: float, t2: float, t3: float, t4: float, t5: float) -> dict[str, float]:
    """A step's time by phase: drafting (proposal t0-t1, extend t4-t5), verify (t1-t2), the bridge's
    features (t3-t4), and the rest (acceptance, rollback)."""
    draft_s, verify_s, bridge_s = (t1 - t0) + (t5 - t4), t2 - t1, t4 - t3
    other_s = (t5 - t0) - draft_s - verify_s - bridge_s
    return {
        "draft_s": draft_s,
        "verify_s": verify_s,
        "bridge_s": bridge_s,
        "other_s": other_s,
        "step_s": t5 - t0,
    }


def _start(
    verifier: Verifier, drafter: Drafter | None, keep: int
) -> tuple[MemoryProbe, MemoryProbe | None, ThreadChoice]:
    """The verifier set to hand the drafter's layers, both emptied unless the first `keep` positions are
    reused; their memory probes; the model's intra-op thread choice, set on this thread."""
    threads = choice_for(verifier, probe=keep == 0)  # made on first use: it may reset the cache
    threads.apply(prompt=True)
    verifier.set_target_layers(drafter.target_layer_ids if drafter else ())
    if keep == 0:
        verifier.reset()
        if drafter:
            drafter.reset()
    return verifier.memory_probe(), drafter.memory_probe() if drafter else None, threads


# the loop is the engine; read top to bottom it shows every phase of a step and where its time goes
def _decode(
    verifier: Verifier,
    prompt: Sequence[int],
    *,
    drafter: Drafter | None,
    cfg: DecodeConfig,
    keep: int,
    cancel: threading.Event | None,
) -> Iterator[StepRecord]:
    stops, limit, sampler, proc, lp, rule = _setup(verifier, cfg, prompt)
    grammar = proc.constraint if proc is not None else None
    clock = time.perf_counter
    vprobe, dprobe, threads = _start(verifier, drafter, keep)
    finish = partial(_finish, stops=stops, max_new=cfg.max_new_tokens)
    record = _prefill(verifier, drafter, prompt, keep, sampler, proc, lp, (vprobe, dprobe), finish, rule)
    if proc is not None:
        proc.commit(record.tokens)
    yield record
    reason, token, index, n_out = record.finish_reason, record.tokens[-1], 0, len(record.tokens)
    while reason is None and not (cancel is not None and cancel.is_set()):
        index += 1
        room = limit - verifier.position  # >= 1: a step that filled the context finished the run
        # drafts past what max_new_tokens or the context can still take would be wasted work
        k = min(cfg.block_size - 1, cfg.max_new_tokens - n_out - 1, room - 1) if drafter else 0
        pos = verifier.position + 1  # absolute position of the first token this step decides
        draft, q, tree, dmem = [], None, None, _NO_DRAFTER  # q [k, V]: what sampled drafts were drawn from
        cut = None  # q [V] of a sampled draft the grammar cut
        n_threads, t0 = threads.apply(), clock()
        if k > 0:
            dprobe.reset()
            draft, q, tree = _draft(drafter, sampler, cfg.tree, token, k, pos, room)
            dmem = dprobe.read()
            if grammar is not None and tree is None:
                draft, q, cut = _constrain(grammar, draft, q, k)
        drafted = len(draft)
        t1 = clock()
        vprobe.reset()
        if tree is not None:  # after it, the cache holds the accepted path as a chain would
            draft, target, path = _verify_tree(verifier, tree, sampler, proc, lp, pos)
        else:
            target = _verify_chain(
                verifier, token, draft, q, cut, sampler, proc, lp, pos, ahead=drafter is None
            )
        vmem = vprobe.read()
        t2 = clock()
        a = common_prefix_len(draft, target)
        committed, reason = finish([*draft[:a], target[a]], n_out)
        c = len(committed)  # positions kept: token + draft[: c - 1] (c < a + 1 when cut at a stop)
        verifier.rollback(len(draft) + 1 - c)
        if reason is None and verifier.position >= limit:
            reason = "context"
        t3 = t4 = clock()
        if drafter:
            feats = _features(verifier, drafter, c)  # [c, K*H]
            t4 = clock()
            drafter.extend(feats, [token, *draft[: c - 1]])
        t5 = clock()
        threads.record(n_threads, t5 - t0, drafted + 1)
        yield StepRecord(
            index=index,
            phase="decode",
            drafted=drafted,
            accepted=a,
            acceptance_length=a + 1,
            tokens=committed,
            **_phase_times(t0, t1, t2, t3, t4, t5),
            peak_memory={"verifier": vmem, "drafter": dmem},
            finish_reason=reason,
            rule=rule,
            residual_resamples=sampler.resampled if rule == "rejection" else None,
            tree_nodes=len(tree) if tree else None,
            tree_ranks=[tree.ranks[i] for i in path[1:]] if tree else None,
            batch_size=verifier.batch_size if isinstance(verifier, BatchedCalls) else None,
            logprobs=lp.take(path[:c] if tree else range(c), committed) if lp is not None else None,
            threads=n_threads,
        )
        n_out += len(committed)
        token = committed[-1]
        if proc is not None:
            proc.commit(committed)


def generate(
    verifier: Verifier,
    prompt: Sequence[int],
    *,
    drafter: Drafter | None = None,
    cfg: DecodeConfig | None = None,
    prompt_id: str = "0",
    jsonl: JsonlWriter | None = None,
    cancel: threading.Event | None = None,
) -> PromptResult:
    """Run `decode` to the end (or until `cancel` is set) and collect a PromptResult (steps also appended
    to `jsonl`)."""
    cfg = cfg or DecodeConfig()
    steps: list[StepRecord] = []
    for step in decode(verifier, prompt, drafter=drafter, cfg=cfg, cancel=cancel):
        steps.append(step)
        if jsonl is not None:
            jsonl.write({"prompt_id": prompt_id, **step.to_json()})
    tokens = [t for s in steps for t in s.tokens]
    tok = verifier.tokenizer
    return PromptResult(
        id=prompt_id,
        prompt_tokens=len(prompt),
        steps=steps,
        output_tokens=tokens,
        text=tok.decode(tokens) if tok is not None else None,
        finish_reason=steps[-1].finish_reason
        or ("cancelled" if cancel is not None and cancel.is_set() else "stop"),
    )
