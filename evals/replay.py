"""Replay drafting policies offline: τ and speed of `--min-confidence P` (with or without `+lookup`)
for many P, and of prompt lookup alone, from one pass over the verifier's greedy answers, instead of one
full eval per policy. It also reports how often each one's first draft is the verifier's next token.

Why it is exact at T = 0: the committed text is the verifier's greedy output whatever is proposed, and
what the drafter proposes after a position depends only on that position (its context is the committed
prefix and the verifier's features of it; prompt lookup sees the same prefix). So one teacher-forced pass
records, at every position of each answer, the DFlash block with its top-1 probabilities and the lookup
proposal. A policy is then a walk over these records, as `specdec.engine.decode` takes its steps; each
step is charged the measured time of a verify of its length plus the drafter's time when it ran.
The τ a replay gives is the τ the engine measures (tested); the speedup is an estimate from the cost
table (it leaves out the loop's own overheads, a few percent).
With `--corpus DIR` it also replays n-grams of the verifier's own answers in a training corpus
(`drafting.lookup.ngrams.CorpusNgrams`, the engine's `--corpus`), tried where lookup has nothing, alone and
before DFlash blocks at the cut P that is best with `+lookup`. Last comes the engine's `--min-confidence
auto` with `+lookup` (and the corpus where given): every draft cut by the verify costs measured here.
With `--tree N ...` it also walks the trees the engine verifies with `--tree N` (`replay_tree`: the
drafter's top candidates at each block position, recorded in the same pass), alone and `+lookup`, each
step charged a tree verify of its size as measured here (`specdec.costs.measure_tree_costs`).

    python -m specdec.evals.replay --model smollm2-135m --drafter bundled:smollm2-135m \\
        --dataset humaneval --limit 20 --grid 0 0.2 0.4 0.6 0.8
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

from specdec.args import Parser, add_max_new_tokens, add_verifier_args, at_least, finite, run_main
from specdec.costs import VerifyCosts, measure_costs, measure_tree_costs
from specdec.drafting.dflash.torch import DFlashDrafter
from specdec.drafting.lookup.ngrams import CorpusNgrams, chances_of, check_corpus, load_corpus_ngrams
from specdec.drafting.lookup.prompt import LOOKUP_ACCEPT, Chances, lookup_accept
from specdec.drafting.mix import LookupFirstDrafter
from specdec.drafting.policy import Calibration, Draft, DraftPolicy
from specdec.engine import DecodeConfig, common_prefix_len
from specdec.kernels import MAX_VERIFY_TOKENS
from specdec.protocols import Verifier
from specdec.tree import TREE_AUTO_NODES, TREE_TOPK, Tree, TreeBudget, best_first_of

__all__ = [
    "Position",
    "ReplayResult",
    "Trace",
    "first_draft_agreement",
    "measure_costs",
    "record",
    "replay",
    "replay_tree",
]


@dataclass(frozen=True)
class Position:
    """What would be proposed right after one committed output token."""

    dflash: tuple[int, ...]  # the drafter's greedy block (block_size - 1 ids)
    confidence: tuple[float, ...]  # its top-1 probabilities
    lookup: tuple[int, ...]  # prompt lookup's proposal; () when the last n-gram never occurred before
    corpus: tuple[int, ...] = ()  # corpus n-grams' greedy chain (`--corpus`), () without
    corpus_share: tuple[float, ...] = ()  # the share of each of its tokens after its context
    lookup_ngram: int = 0  # the length of the n-gram prompt lookup matched; 0 where it has nothing
    # the drafter's TREE_TOPK best candidates at each block position and their log-probabilities (trees)
    candidates: tuple[tuple[int, ...], ...] = ()
    candidate_logp: tuple[tuple[float, ...], ...] = ()


@dataclass
class Trace:
    prompt_id: str
    output: list[int]  # the verifier's greedy answer
    positions: list[Position] = field(default_factory=list)  # one per output token but the last


@torch.inference_mode()
def record(
    verifier: Verifier,
    drafter: DFlashDrafter,
    prompt: Sequence[int],
    output: Sequence[int],
    *,
    prompt_id: str = "0",
    block_size: int = 16,
    corpus: CorpusNgrams | None = None,
) -> Trace:
    """One teacher-forced pass over prompt + output (`drafter` bound to `verifier`). `block_size` is the
    engine's (lookup proposes up to block_size - 1 tokens, as in `LookupFirstDrafter`, and so does
    `corpus` where given)."""
    prompt, output = list(prompt), list(output)
    P, N = len(prompt), len(output)
    proposer = drafter
    if drafter.embed_fn is None:
        raise RuntimeError(f"drafter {drafter.name!r} is not bound: call bind(verifier) first")
    verifier.set_target_layers(drafter.target_layer_ids)
    verifier.reset()
    verifier.prefill(prompt + output[:-1])
    feats = verifier.features(P + N - 1, device=drafter.device, dtype=drafter.dtype)  # [P+N-1, K*H]
    drafter.reset()
    drafter.extend(feats[:P], prompt)
    lookup = LookupFirstDrafter(drafter, block_size=block_size).lookup  # its lookup half, same n-grams
    lookup.extend(feats[:0], prompt)  # lookup ignores the features
    trace = Trace(prompt_id, output)
    seq = prompt + output
    for i in range(N - 1):
        logits = proposer.block_logits(output[i], drafter.block_size - 1)  # [bs-1, K]
        top, best = logits.float().softmax(dim=-1).max(dim=-1)  # [bs-1], [bs-1]
        ids = proposer.rows[best] if proposer.rows is not None else best
        cand = logits.float().log_softmax(-1).topk(min(TREE_TOPK, logits.shape[-1]), dim=-1)  # [bs-1, k]
        cand_ids = proposer.rows[cand.indices] if proposer.rows is not None else cand.indices
        lk, g = lookup.match(output[i], block_size - 1)
        end = P + i + 1  # the committed tokens up to output[i]; the chain reads their last max_order
        chain = corpus.chain(seq[max(0, end - corpus.max_order) : end], block_size - 1) if corpus else []
        trace.positions.append(
            Position(
                tuple(ids.tolist()), tuple(top.tolist()), tuple(lk), *map(tuple, zip(*chain)), lookup_ngram=g,
                candidates=tuple(map(tuple, cand_ids.tolist())),
                candidate_logp=tuple(map(tuple, cand.values.tolist())),
            )
        )  # fmt: skip
        drafter.extend(feats[P + i : P + i + 1], [output[i]])
        lookup.extend(feats[:0], [output[i]])
    return trace


def bench_verify(
    verifier: Verifier,
    *,
    contexts: Sequence[int] = (128, 512),
    sizes: Sequence[int] = (1, 2, 4, 8, 12, 16),
    reps: int = 7,
) -> dict[str, Any]:
    """The verify cost table of `verifier` on this machine: {"contexts": {ctx: {size: seconds}}, "relative":
    {ctx: {size: cost / one-token cost}}} (medians of interleaved repetitions)."""
    table = {ctx: measure_costs(verifier, None, context=ctx, sizes=sizes, reps=reps)[0] for ctx in contexts}
    return {
        "verifier": {"runtime": verifier.runtime, "model": verifier.model_name, "dtype": verifier.dtype},
        "reps": reps,
        "seconds": {str(c): {str(b): s for b, s in t.items()} for c, t in table.items()},
        "relative": {str(c): {str(b): s / t[sizes[0]] for b, s in t.items()} for c, t in table.items()},
    }


@dataclass(frozen=True)
class ReplayResult:
    min_confidence: float
    lookup: bool
    dflash: bool  # False: prompt lookup alone (a one-token step where it has nothing)
    tau: float  # mean acceptance length over decode steps, as the engine reports it
    steps: int
    tokens: int
    est_speedup: float | None  # AR time / replayed time, from the cost table; None without one
    corpus: float | None = None  # the cut of corpus n-gram drafts, tried after lookup; None: not used
    by_cost: bool = False  # `--min-confidence auto`: every draft cut by verify costs (`replay(cut_by=)`)
    tree: int | None = None  # `--tree N`: trees of up to N nodes (`replay_tree`); None: chains
    tree_auto: bool = False  # `--tree auto`: as many of those nodes as pay for their verify cost
    lookup_first: bool = False  # trees only where lookup has no draft (`replay_tree(lookup_first=True)`)
    tree_nodes_mean: float | None = None  # nodes a tree step verified, on average


def _step_draft(
    pos: Position,
    k: int,
    policy: DraftPolicy,
    calibration: Calibration,
    future: Sequence[int],
    *,
    lookup: bool,
    dflash: bool,
    corpus: bool,
    chances: Chances,
) -> tuple[list[int], bool]:
    """(draft, DFlash ran) at `pos` under `policy`, as `LookupFirstDrafter` chooses (`DraftPolicy.choose`),
    allowed k drafts; under verify costs `calibration` learns how the draft fares against the verifier's
    tokens that follow (`future`), as the drafter's does."""
    looked = pos.lookup[:k] if lookup else ()
    looked = Draft(list(looked), "lookup", lookup_accept(pos.lookup_ngram, len(looked), chances))
    mined = (
        Draft(list(pos.corpus[:k]), "corpus", list(pos.corpus_share[:k])) if corpus else Draft([], "corpus")
    )
    chosen = policy.choose(looked, mined, calibration)
    if chosen is not None:
        if policy.costs is not None:
            calibration.learn(
                chosen.source, policy.acceptance(chosen), common_prefix_len(chosen.tokens, future)
            )
        return chosen.tokens, False
    if not dflash:
        return [], False
    return policy.cut(Draft(list(pos.dflash[:k]), "dflash", list(pos.confidence[:k]))).tokens, True


def _interpolated(costs: Mapping[int, float] | None) -> Callable[[int], float]:
    """Seconds of a verify of b rows (or b tree nodes) from timed sizes, interpolated between them."""
    sizes = sorted(costs) if costs else []
    return lambda b: float(np.interp(b, sizes, [costs[s] for s in sizes]))


def replay(
    traces: Sequence[Trace],
    *,
    min_confidence: float,
    lookup: bool = True,
    dflash: bool = True,
    block_size: int = 16,
    max_new_tokens: int | None = None,
    costs: Mapping[int, float] | None = None,
    draft_s: float = 0.0,
    corpus: float | None = None,
    cut_by: VerifyCosts | None = None,
    lookup_chances: Chances = LOOKUP_ACCEPT,
) -> ReplayResult:
    """Walk each trace as the engine would with this policy (see the module docstring). `dflash=False`
    replays prompt lookup alone: the engine with `PromptLookupDrafter(block_size, min_ngram=2)`, the
    lookup half of `LookupFirstDrafter`, so it shows what the DFlash half adds to `+lookup`.
    `corpus=P` drafts by corpus n-grams (recorded with `record(..., corpus=)`) where lookup has nothing
    and the chain, cut at running share P, is not empty; then DFlash, if on (`LookupFirstDrafter` with a
    `corpus`). A corpus draft is charged no drafting time (a few binary searches). `cut_by` replays
    `--min-confidence auto` (`LookupFirstDrafter` and DFlash with these verify costs, corpus n-grams
    where recorded, lookup's drafts priced by `lookup_chances` as the drafter's are by its corpus';
    `min_confidence`, `lookup`, `dflash` and `corpus` unused)."""
    if not (lookup or dflash or corpus is not None):
        raise ValueError("a policy drafts with lookup, corpus n-grams, DFlash or a mix")
    cost = _interpolated(costs)

    by_cost = cut_by is not None  # the engine's --min-confidence auto: every source, cut by verify cost
    policy = (
        DraftPolicy(costs=cut_by) if by_cost
        else DraftPolicy(min_confidence=min_confidence, corpus_cut=corpus or 0.0)
    )  # fmt: skip
    sources = dict(lookup=lookup or by_cost, dflash=dflash or by_cost, corpus=corpus is not None or by_cost)
    steps = accepted_plus_one = tokens = 0
    spent = ar = 0.0
    for tr in traces:
        out, i = tr.output, 0
        calibration = Calibration()  # per request, as the engine's drafter resets it
        limit = max_new_tokens or len(out)
        while i < len(out) - 1:
            pos = tr.positions[i]
            k = min(block_size - 1, limit - (i + 1) - 1)  # what the engine lets a step draft
            draft, ran = _step_draft(
                pos, k, policy, calibration, out[i + 1 :], chances=lookup_chances, **sources
            )
            a = common_prefix_len(draft, out[i + 1 :])
            steps, accepted_plus_one = steps + 1, accepted_plus_one + a + 1
            if costs:
                spent += cost(len(draft) + 1) + (draft_s if ran and k > 0 else 0.0)
            i += a + 1
        tokens += len(out) - 1
        ar += (len(out) - 1) * cost(1) if costs else 0.0
    return ReplayResult(
        min_confidence, lookup, dflash, accepted_plus_one / max(steps, 1), steps, tokens,
        ar / spent if costs and spent else None, corpus, cut_by is not None,
    )  # fmt: skip


def replay_tree(
    traces: Sequence[Trace],
    *,
    nodes: int,
    lookup: bool = True,
    block_size: int = 16,
    max_new_tokens: int | None = None,
    costs: Mapping[int, float] | None = None,
    draft_s: float = 0.0,
    cut_by: VerifyCosts | None = None,
    lookup_first: bool = False,
) -> ReplayResult:
    """Walk each trace as the engine does with `--tree nodes` (the DFlash drafter's `best_first` tree;
    with `lookup`, `LookupFirstDrafter.propose_tree`: lookup's draft as a branch of its own, the DFlash
    tree in the rest of the budget, or lookup's draft alone where it takes the whole budget). A step is
    charged `costs[len(tree)]` (seconds of a tree verify of that many nodes, interpolated:
    `measure_tree_costs`) plus the drafter's time where it ran. `cut_by`: `--tree auto`, each DFlash tree
    cut by these verify costs. `lookup_first` (a study, not an engine policy): where lookup has a draft it
    is verified alone, as `+lookup` chains do, and trees only where it has none."""
    cost = _interpolated(costs)

    steps = accepted_plus_one = tokens = n_nodes = tree_steps = 0
    spent = ar = 0.0
    for tr in traces:
        out, i = tr.output, 0
        limit = max_new_tokens or len(out)
        while i < len(out) - 1:
            pos = tr.positions[i]
            k = min(block_size - 1, limit - (i + 1) - 1)
            tree, ran = Tree.chain(out[i], []), False
            if k > 0:
                branch = list(pos.lookup[:k]) if lookup else []
                depth = min(k, len(pos.candidates))
                # else lookup's draft alone, as a chain
                ran = not branch or (nodes - len(branch) > 1 and not lookup_first)
                if ran:
                    top = TreeBudget(nodes - len(branch), costs=cut_by)
                    tree = best_first_of(out[i], pos.candidate_logp[:depth], pos.candidates[:depth], top)
                tree = tree.with_branch(branch)
                n_nodes, tree_steps = n_nodes + len(tree), tree_steps + 1
            a = len(tree.accept_along(out[i + 1 :])) - 1
            steps, accepted_plus_one = steps + 1, accepted_plus_one + a + 1
            if costs:
                spent += cost(len(tree)) + (draft_s if ran else 0.0)
            i += a + 1
        tokens += len(out) - 1
        ar += (len(out) - 1) * cost(1) if costs else 0.0
    return ReplayResult(
        0.0, lookup, True, accepted_plus_one / max(steps, 1), steps, tokens,
        ar / spent if costs and spent else None, tree=nodes, tree_auto=cut_by is not None,
        lookup_first=lookup_first,
        tree_nodes_mean=n_nodes / tree_steps if tree_steps else None,
    )  # fmt: skip


def first_draft_agreement(traces: Sequence[Trace]) -> dict[str, float]:
    """How often the first draft is the verifier's next token, over every position of `traces`: DFlash's
    (it always drafts), and prompt lookup's where it proposes (`lookup_coverage` of the positions). A
    drafter far below lookup on text that repeats its prompt has not learnt to copy from its context.
    With corpus n-grams recorded: theirs where lookup has nothing and they propose (`corpus_coverage`)."""
    pairs = [(p, tr.output[i + 1]) for tr in traces for i, p in enumerate(tr.positions)]
    looked = [(p, nxt) for p, nxt in pairs if p.lookup]
    mined = [(p, nxt) for p, nxt in pairs if p.corpus and not p.lookup]

    def agree(sub: list[tuple[Position, int]], field: str) -> float:
        return float(np.mean([getattr(p, field)[0] == nxt for p, nxt in sub])) if sub else float("nan")

    n = len(pairs)
    out = {
        "positions": n, "dflash": agree(pairs, "dflash"), "lookup": agree(looked, "lookup"),
        "lookup_coverage": len(looked) / n if n else float("nan"),
    }  # fmt: skip
    if mined:
        out |= {"corpus": agree(mined, "corpus"), "corpus_coverage": len(mined) / n}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = Parser(prog="python -m specdec.evals.replay", description=__doc__.split("\n\n")[0])
    add_verifier_args(p, runtime="hf")  # --model: smollm2-135m unless the verifier is the stub
    p.add_argument(
        "--drafter", nargs="+", default=["bundled:smollm2-135m"],
        help="DFlash drafters (no '+lookup'); several are compared on the same greedy answers",
    )  # fmt: skip
    p.add_argument("--block-size", type=at_least(2, MAX_VERIFY_TOKENS), help="default: the drafter's")
    p.add_argument("--dataset", default="humaneval", choices=("humaneval", "mtbench"))
    p.add_argument("--limit", type=at_least(1), default=10)
    p.add_argument("--turns", type=int, default=1, choices=(1, 2))
    add_max_new_tokens(p, default=256)
    grid = [0.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 0.9]
    p.add_argument("--grid", type=finite(0, 1), nargs="+", default=grid, help="--min-confidence values")
    p.add_argument(
        "--corpus", metavar="DIR",
        help="also replay drafting by n-grams of this corpus of the verifier's own answers (a `specdec.train."
        "corpus` folder, e.g. specdec/bundled/smollm2-135m/corpus) where lookup has nothing (a study)",
    )  # fmt: skip
    p.add_argument("--corpus-cut", type=finite(0, 1), nargs="+", default=[0.2, 0.4], help="their cuts")
    p.add_argument(
        "--tree", type=at_least(2, MAX_VERIFY_TOKENS), nargs="*", default=[],
        help="also replay trees of up to these many nodes (`--tree N`), alone and +lookup, charged tree "
        "verify costs measured here",
    )  # fmt: skip
    p.add_argument("--out", help="write traces' figures and the cost table here (JSON)")
    p.set_defaults(func=_run)
    return run_main(p, argv)


def _run(args: argparse.Namespace) -> int:
    from specdec.api import RunSpec, check_drafter, load, load_drafter
    from specdec.chat import encode_prompt
    from specdec.engine import generate
    from specdec.evals.datasets import load_dataset, second_turn_messages
    from specdec.evals.run import _answer_text
    from specdec.records import atomic_write_json, check_output_path

    if args.out is not None:
        check_output_path(args.out)  # fail before the work, not after it

    if args.corpus:
        check_corpus(args.corpus)  # a bad folder fails before the model loads
    plans = [check_drafter(name) for name in args.drafter]  # config and weights header, before any load
    for name, plan in zip(args.drafter, plans):
        if plan.folder is None or plan.spec.lookup:
            raise ValueError(
                f"--drafter {name!r}: give a DFlash drafter (lookup is replayed with and without)"
            )
        block = plan.block_size
        if args.block_size is not None and args.block_size > block:
            raise ValueError(f"--block-size {args.block_size} exceeds drafter {name!r}'s block size {block}")
    model = args.model or (None if args.verifier == "stub" else "smollm2-135m")
    spec = RunSpec(verifier=args.verifier, model=model, dtype=args.dtype, device=args.device, drafter="none")
    m = load(spec)
    verifier = m.verifier
    corpus = load_corpus_ngrams(args.corpus, verifier) if args.corpus else None
    drafters = []
    for name, plan in zip(args.drafter, plans):  # all loaded and checked before the long part
        d = load_drafter(plan, verifier=verifier, dtype=m.dtype, device=args.device)
        if not isinstance(d, DFlashDrafter):
            raise ValueError(
                f"--drafter {name!r}: give a DFlash drafter (lookup is replayed with and without)"
            )
        drafters.append((name, d, args.block_size or d.block_size))
    traces: list[list[Trace]] = [[] for _ in drafters]  # per drafter
    cfg = DecodeConfig(max_new_tokens=args.max_new_tokens, block_size=1)
    for rec in load_dataset(args.dataset, limit=args.limit):
        messages = rec.messages
        for turn in range(1, args.turns + 1):
            ids = encode_prompt(verifier, messages)
            pid = rec.id if turn == 1 else f"{rec.id}:turn{turn}"
            res = generate(verifier, ids, cfg=cfg, prompt_id=pid)  # the greedy answer, once for all
            for (_, d, bs), tr in zip(drafters, traces):
                tr.append(
                    record(
                        verifier, d, ids, res.output_tokens, prompt_id=res.id, block_size=bs, corpus=corpus
                    )
                )
            print(
                f"recorded {res.id}: {len(ids)} prompt + {len(res.output_tokens)} output tokens", flush=True
            )
            if turn < args.turns and len(rec.turns) > 1:
                messages = second_turn_messages(rec, _answer_text(verifier, res))
    ctx = int(statistics.mean(len(t.output) for t in traces[0])) + 150
    costs, _ = measure_costs(verifier, None, context=ctx)  # one verify table: drafters differ in draft_s only
    print("verify ms by tokens:", {b: round(c * 1e3, 1) for b, c in costs.items()})
    tree_costs = None
    if args.tree:  # a tree of N nodes against a chain of N tokens, same context, interleaved
        sizes = sorted({1, 2, 4, 8, 16, TREE_AUTO_NODES, *args.tree})
        chain_s, tree_costs = measure_tree_costs(verifier, context=ctx, sizes=sizes)
        print("chain vs tree verify ms:", {n: (round(chain_s[n] * 1e3, 1), round(tree_costs[n] * 1e3, 1))
                                           for n in sizes})  # fmt: skip
    report = []
    print(f"{'drafter':40s} {'policy':16s} {'tau':>6s} {'est speedup':>12s}")
    for (name, d, bs), tr in zip(drafters, traces):
        draft_s = measure_costs(verifier, d, context=ctx, sizes=(1,))[1]
        run = partial(
            replay, tr, block_size=bs, max_new_tokens=args.max_new_tokens, costs=costs, draft_s=draft_s
        )
        rows = [run(min_confidence=pc, lookup=lk) for lk in (True, False) for pc in args.grid]
        rows.append(run(min_confidence=0.0, dflash=False))
        if corpus:  # lookup, then corpus n-grams, then nothing or DFlash at the best '+lookup' cut
            p = max((r for r in rows if r.lookup and r.dflash), key=lambda r: r.est_speedup).min_confidence
            rows += [
                run(min_confidence=p, dflash=df, corpus=cc) for cc in args.corpus_cut for df in (False, True)
            ]
        auto = VerifyCosts.from_seconds(costs, source="measured")
        rows.append(run(min_confidence=0.0, cut_by=auto, lookup_chances=chances_of(corpus)))
        rows += [
            replay_tree(tr, nodes=n, lookup=lk, block_size=bs, max_new_tokens=args.max_new_tokens,
                        costs=tree_costs, draft_s=draft_s)
            for n in args.tree for lk in (False, True)
        ]  # fmt: skip
        if tree_costs:  # --tree auto: up to TREE_AUTO_NODES, priced by the tree verifies timed above
            by_tree = VerifyCosts.from_seconds(tree_costs, source="measured tree verifies")
            rows += [
                replay_tree(tr, nodes=TREE_AUTO_NODES, lookup=lk, block_size=bs,
                            max_new_tokens=args.max_new_tokens, costs=tree_costs, draft_s=draft_s,
                            cut_by=by_tree)
                for lk in (False, True)
            ]  # fmt: skip
            rows += [
                replay_tree(tr, nodes=n, block_size=bs, max_new_tokens=args.max_new_tokens, costs=tree_costs,
                            draft_s=draft_s, lookup_first=True)
                for n in args.tree
            ]  # fmt: skip
        for r in rows:
            if r.tree is not None:
                size = "auto" if r.tree_auto else r.tree
                how = " lookup-first" if r.lookup_first else " +lookup" if r.lookup else ""
                policy = f"tree {size}{how} ({r.tree_nodes_mean:.1f} nodes)"
            elif r.by_cost:
                policy = "+lookup" + (" +corpus" if corpus else "") + " cut by cost (auto)"
            elif r.corpus is not None:
                policy = f"+lookup +corpus P={r.corpus:g}" + (
                    f" DFlash P={r.min_confidence:g}" if r.dflash else ""
                )
            elif r.dflash:
                policy = f"P={r.min_confidence:g}{' +lookup' if r.lookup else ''}"
            else:
                policy = "lookup alone"
            print(f"{name[-40:]:40s} {policy:16s} {r.tau:6.2f} {r.est_speedup:11.2f}x")
        agree = first_draft_agreement(tr)
        print(
            f"{name[-40:]:40s} first draft = next token: DFlash {agree['dflash']:.3f}; lookup "
            f"{agree['lookup']:.3f} where it proposes ({agree['lookup_coverage']:.0%} of positions)"
            + (f"; corpus {agree['corpus']:.3f} where it proposes and lookup does not "
               f"({agree['corpus_coverage']:.0%})" if "corpus" in agree else "")
        )  # fmt: skip
        report.append({
            "drafter": name, "draft_s": draft_s, "first_draft_agreement": agree,
            "results": [asdict(r) for r in rows],
        })  # fmt: skip
    if args.out is not None:
        atomic_write_json(args.out, {"costs_s": costs, "tree_costs_s": tree_costs, "drafters": report})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
