"""Verify costs and draft lengths: how many drafted tokens a step should send to the verifier.

A verify of b tokens costs c(b) one-token verifies. On a GPU c stays near 1 for small b; on a small CPU it
climbs in steps that the matmul kernels decide. Measured on the 2-core AMD EPYC CI machine (SmolLM2-135M
fp32, context 400, `VerifyCosts.measure`, packed oneDNN linears): 2 tokens 1.03, 3 1.03, 4 1.13, 6 1.20,
8 1.28, 12 1.37, 16 1.70 (four loads in one process spread by up to ±0.1 at 4-12 tokens).
A draft whose j-th token is accepted with probability p_j, given that the ones before it were, commits
1 + p_1 + p_1 p_2 + ... + p_1...p_k tokens in expectation when cut after k tokens. `VerifyCosts.best_length`
keeps the k with the most expected tokens per unit of verify cost, so the cut follows the machine's
cost curve: a fourth token that costs nothing is drafted, a fifth that doubles the verify is not.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdec.protocols import Drafter, TreeVerify, Verifier

__all__ = [
    "MAX_ROW_COST",
    "MIN_BATCH_GAIN",
    "VerifyCosts",
    "choose_block",
    "choose_max_batch",
    "knee",
    "measure_costs",
    "measure_tree_costs",
]


@dataclass(frozen=True)
class VerifyCosts:
    """`relative[b - 1]`: a verify of b tokens over a verify of one, for b = 1..len(relative); beyond it the
    last step's slope goes on. `source`: where the figures came from (a file, or "measured")."""

    relative: tuple[float, ...]
    source: str

    def __post_init__(self) -> None:
        if len(self.relative) < 2 or not all(c > 0 for c in self.relative):
            raise ValueError(
                f"a verify cost table needs positive costs of 1 and 2 tokens, got {self.relative}"
            )

    @classmethod
    def from_seconds(cls, seconds: Mapping[int, float], *, source: str) -> VerifyCosts:
        """From measured seconds by verify size (sizes 1 and 2 at least; others interpolated)."""
        sizes = sorted(seconds)
        if sizes[:2] != [1, 2]:
            raise ValueError(f"the cost table must measure verifies of 1 and 2 tokens; it has sizes {sizes}")
        bad = {b: c for b, c in seconds.items() if not (math.isfinite(c) and c > 0)}
        if bad:
            raise ValueError(f"verify costs must be positive finite numbers; {source} has {bad}")
        one = seconds[1]
        rel = np.interp(np.arange(1, sizes[-1] + 1), sizes, [seconds[s] / one for s in sizes])
        return cls(tuple(float(c) for c in rel), source)

    @classmethod
    def from_table(cls, table: Mapping[str, Any], *, source: str) -> VerifyCosts:
        """From a `specdec bench-verify --out` table: its relative costs, averaged over its contexts."""
        rel = table.get("relative") if isinstance(table, Mapping) else None
        if not rel or not isinstance(rel, Mapping):
            raise ValueError(
                "the cost table has no 'relative' costs; write it with `specdec bench-verify --out`"
            )
        try:
            sizes = sorted({int(b) for row in rel.values() for b in row})
            mean = {b: statistics.mean(float(r[str(b)]) for r in rel.values() if str(b) in r) for b in sizes}
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise ValueError(f"malformed cost table ({type(e).__name__}: {e})") from None
        return cls.from_seconds(mean, source=source)

    @staticmethod
    def check_measured_on(
        table: Mapping[str, Any], *, source: str, runtime: str, model: str | None, dtype: str | None = None
    ) -> None:
        """A one-line ValueError where the table (`specdec bench-verify --out`) names the model it was
        measured on and that is not this run's: its `runtime`, `model` (a name, folder or repo id; None:
        not compared) and, once known, `dtype`. A table that names none is taken as it is."""
        on = table.get("verifier") if isinstance(table, Mapping) else None
        if not isinstance(on, Mapping):
            return
        name = Path(str(model)).name if model is not None else None
        have = {"runtime": runtime, "model": name, "dtype": dtype}
        for key, value in have.items():
            theirs = on.get(key)
            if value is None or theirs is None:
                continue
            if theirs != value:
                raise ValueError(
                    f"--costs {source!r} was measured with {key} {theirs!r}, this run's is {value!r}: "
                    f"measure this one with `specdec bench-verify ... --out` (or leave --costs out)"
                )

    @classmethod
    def measure(cls, verifier: Verifier, *, context: int = 400, reps: int = 5) -> VerifyCosts:
        """Time this verifier's verifies of 1..16 tokens here and now (a few seconds on a small CPU)."""
        sizes = (1, 2, 3, 4, 5, 6, 8, 12, 16)
        context = max(1, min(context, verifier.max_context - max(sizes) - 1))
        return cls.from_seconds(
            measure_costs(verifier, context=context, sizes=sizes, reps=reps)[0], source="measured"
        )

    def cost(self, b: int) -> float:
        """A verify of `b` >= 1 tokens, in one-token verifies."""
        r = self.relative
        if b <= len(r):
            return r[b - 1]
        return r[-1] + (b - len(r)) * max(0.0, r[-1] - r[-2])

    def rate(self, probs: Sequence[float]) -> tuple[int, float]:
        """(k, expected committed tokens per cost) for the best cut k of a draft whose token j is accepted
        with probability `probs[j]` given the ones before it (k = 0: verify the last token alone)."""
        best_k, best, run, expected = 0, 1.0 / self.cost(1), 1.0, 1.0
        for k, p in enumerate(probs, 1):
            run *= p
            expected += run
            if expected / self.cost(k + 1) > best:
                best_k, best = k, expected / self.cost(k + 1)
        return best_k, best

    def best_length(self, probs: Sequence[float]) -> int:
        return self.rate(probs)[0]

    def summary(self) -> str:
        """One line for logs: "verify costs (measured): 2 tokens 0.94x, 4 tokens 1.05x, ..."."""
        sizes = [b for b in (2, 4, 8, 16) if b <= max(2, len(self.relative))]
        return f"verify costs ({self.source}): " + ", ".join(f"{b} tokens {self.cost(b):.2f}x" for b in sizes)

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "relative": [round(c, 4) for c in self.relative]}


#: a row costing more than this fraction of a one-token step is not drafted by `--block-size auto`: it
#: would need a draft accepted more than half the time, which late DFlash positions rarely are
MAX_ROW_COST = 0.5


def choose_block(costs: VerifyCosts, *, max_block: int) -> tuple[int, str]:
    """(block size, why) for `--block-size auto` from verify costs (e.g. a `bench_verify` table:
    `VerifyCosts.from_table`). Row k of a verify costs r(k) - r(k-1) one-token steps, and a draft pays
    only when its chance of acceptance exceeds the cost of its row; so the block grows while rows cost at
    most MAX_ROW_COST (at least 2). Which drafts of a block are verified is `--min-confidence`'s choice."""
    r = costs.relative
    row = {k: max(0.0, r[k - 1] - r[k - 2]) for k in range(2, len(r) + 1)}
    block = 2
    while block < max_block and row.get(block + 1, float("inf")) <= MAX_ROW_COST:
        block += 1
    why = f"rows 2..{block} cost at most {MAX_ROW_COST} of a one-token step"
    return block, why


def measure_costs(
    verifier: Verifier,
    drafter: Drafter | None = None,
    *,
    context: int = 400,
    sizes: Sequence[int] = (1, 2, 3, 4, 6, 8, 12, 16),
    reps: int = 10,
) -> tuple[dict[int, float], float | None]:
    """Median seconds of a verify of each size at `context` cached positions (sizes interleaved within each
    repetition, so drift hits all alike), and of one proposal of `drafter` (None without one). The
    verifier's cache (and the drafter's context) are reset."""
    ids = [int(t) for t in torch.randint(10, verifier.vocab_size - 10, (context + max(sizes),)).tolist()]
    verifier.set_target_layers(drafter.target_layer_ids if drafter else ())
    verifier.reset()
    verifier.prefill(ids[:context])
    if drafter:
        drafter.reset()
        feats = (  # [context, K*H]; none for a drafter that reads no features (prompt lookup)
            verifier.features(context, device=drafter.device, dtype=drafter.dtype)
            if drafter.target_layer_ids
            else None
        )
        drafter.extend(feats, ids[:context])
    times: dict[int, list[float]] = {b: [] for b in sizes}
    draft: list[float] = []
    for _ in range(reps):
        for b in sizes:  # each verify ends in a host list: timed end to end
            t = time.perf_counter()
            verifier.verify(ids[context : context + b])
            times[b].append(time.perf_counter() - t)
            verifier.rollback(b)
        if drafter:
            t = time.perf_counter()
            drafter.propose(ids[context], drafter.block_size - 1)
            draft.append(time.perf_counter() - t)
    verifier.reset()
    if drafter:
        drafter.reset()
    return {b: statistics.median(x) for b, x in times.items()}, statistics.median(draft) if draft else None


def measure_tree_costs(
    verifier: Verifier, *, context: int = 400, sizes: Sequence[int] = (2, 4, 8, 16, 32), reps: int = 7
) -> tuple[dict[int, float], dict[int, float]]:
    """Median seconds of a chain verify of N tokens and of a tree verify of N nodes (`TreeVerify`), N in
    `sizes`, at `context` cached positions, interleaved. The trees are what `best_first` makes of peaked
    random block distributions (a few branches per depth, as a trained drafter's), at most 15 deep."""
    from specdec.tree import TreeBudget, best_first

    if not isinstance(verifier, TreeVerify):
        raise ValueError(f"the {verifier.runtime} verifier does not verify trees")
    g = torch.Generator().manual_seed(0)
    ids = [int(t) for t in torch.randint(10, verifier.vocab_size - 10, (context + max(sizes),), generator=g)]
    logits = torch.randn(15, verifier.vocab_size, generator=g) * 4  # [D, V]
    trees = {n: best_first(ids[context], logits, TreeBudget(n)) for n in sizes}
    verifier.set_target_layers(())
    verifier.reset()
    verifier.prefill(ids[:context])
    chain: dict[int, list[float]] = {n: [] for n in sizes}
    tree: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(reps):
        for n in sizes:
            t = time.perf_counter()
            verifier.verify(ids[context : context + n])
            chain[n].append(time.perf_counter() - t)
            verifier.rollback(n)
            t = time.perf_counter()
            verifier.verify_tree(trees[n])
            tree[n].append(time.perf_counter() - t)
            verifier.keep_path([0])
            verifier.rollback(1)
    verifier.reset()
    return {n: statistics.median(x) for n, x in chain.items()}, {
        n: statistics.median(x) for n, x in tree.items()
    }


#: `--max-batch auto` doubles the requests served at once while the doubling raises the measured rate of
#: committed steps by at least this much (past the knee, more at once only adds to each one's latency)
MIN_BATCH_GAIN = 1.1
#: what `cut_step_tokens` decodes to see how many tokens a step with drafts cut by cost verifies
WARMUP_PROMPT = "Explain how a bicycle works, step by step."
WARMUP_TOKENS = 32


def warmup_ids(verifier: Verifier) -> list[int]:
    """`WARMUP_PROMPT` as a chat turn where the model has a template, as text where it has only a tokenizer,
    as spread token ids where it has none."""
    from specdec.chat import encode_prompt
    from specdec.measure import probe_ids

    if verifier.tokenizer is None:
        return probe_ids(verifier.vocab_size, 16)
    try:
        return encode_prompt(verifier, [{"role": "user", "content": WARMUP_PROMPT}])
    except ValueError:  # no chat template
        return encode_prompt(verifier, WARMUP_PROMPT)


def cut_step_tokens(verifier: Verifier, drafter: Drafter, block_size: int) -> int:
    """The tokens a step verifies on this model with this drafter where its drafts are cut by the verify
    costs (`--min-confidence auto`): the mean of drafts + 1 over the decode steps of `WARMUP_TOKENS`
    greedy tokens of `WARMUP_PROMPT` (as a chat turn where the model has a template), rounded up, at
    most `block_size`. What `--max-batch auto` measures steps of, instead of the whole block."""
    from specdec.engine import DecodeConfig, generate

    cfg = DecodeConfig(max_new_tokens=WARMUP_TOKENS, block_size=block_size)
    steps = generate(verifier, warmup_ids(verifier), drafter=drafter, cfg=cfg).decode_steps
    if not steps:
        return block_size
    return min(block_size, math.ceil(statistics.mean(s.drafted + 1 for s in steps)))


def choose_max_batch(
    batch: Any, *, block: int, draft_s: float = 0.0, most: int = 16, context: int = 128, reps: int = 3
) -> tuple[int, str]:
    """(N, why) for `--max-batch auto`: N = 1, 2, 4, ... up to `most` sequences of `batch` (a
    `specdec.batch.batch_of`), each `context` tokens in, verify `block` tokens at once (and roll them back),
    timed here and now; a step of N requests costs N drafts (`draft_s` each: they take turns on the host)
    and that verify. N doubles while the doubling raises N / step by `MIN_BATCH_GAIN`."""
    from specdec.rendezvous import together

    context = max(1, min(context, batch.base.max_context - block - 1))
    g = torch.Generator().manual_seed(0)
    ids = [int(t) for t in torch.randint(10, batch.base.vocab_size - 10, (context + block,), generator=g)]
    seqs: list[Any] = []

    def step(i: int) -> None:
        seqs[i].verify(ids[context:])
        seqs[i].rollback(block)

    rates: dict[int, float] = {}
    n = 1
    while n <= most:
        while len(seqs) < n:
            seqs.append(batch.sequence())
            seqs[-1].prefill(ids[:context])  # not a member yet: alone
        times = []
        for _ in range(reps + 1):  # the first warms up (caches grown, weights packed)
            t = time.perf_counter()
            errors = [e for e in together(batch, seqs[:n], step) if isinstance(e, Exception)]
            times.append(time.perf_counter() - t)
            if errors:
                raise errors[0]
        rates[n] = n / (n * draft_s + statistics.median(times[1:]))
        if knee(rates) < n:
            break
        n *= 2
    best = knee(rates)
    gains = ", ".join(f"{k}: {rates[k] / rates[1]:.2f}x" for k in sorted(rates))
    why = f"steps of {block} tokens at once, the rate over one (measured): {gains}"
    return best, why


def knee(rates: Mapping[int, float]) -> int:
    """The most requests at once, of 1, 2, 4, ... (`rates`: measured steps per second by that number), that
    each doubling up to it raised the rate by `MIN_BATCH_GAIN`."""
    n = 1
    while 2 * n in rates and rates[2 * n] >= MIN_BATCH_GAIN * rates[n]:
        n *= 2
    return n
