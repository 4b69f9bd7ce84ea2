"""Where a decode step's time goes: the verify of 1, 8 and 16 rows and a drafter's proposal, each timed end
to end and profiled by torch's profiler, split into the ops' own time and what is left (Python, module
calls, cache bookkeeping, dispatch between ops).

    python -m specdec.evals.step_profile [--model smollm2-135m] [--dtype bfloat16]
        [--drafter bundled:smollm2-135m] [--context 128] [--reps 20] [--top 12] [--out FIGURES.json]

For each call: the median wall time of `--reps` calls, then one profiled pass of `--reps` calls: the summed
self time of every op (aten and the oneDNN linears), the count of ops per call, and the top ops by self
time. `other` is wall minus the ops' self time: time no op accounts for.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from specdec.evals.report import emit_figures, figures_header


def _profile(call: Callable[[], object], undo: Callable[[], object], reps: int, top: int) -> dict:
    """Median wall ms of `call` (then `undo`, untimed) over `reps`, and its ops' self time by profiler."""
    from torch.profiler import ProfilerActivity, profile

    walls = []
    for _ in range(reps):
        t = time.perf_counter()
        call()
        walls.append(time.perf_counter() - t)
        undo()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            call()
            undo()
    events = [e for e in prof.key_averages() if not e.key.startswith("ProfilerStep")]
    ops = sum(e.self_cpu_time_total for e in events) / reps / 1e3  # ms per call
    wall = statistics.median(walls) * 1e3
    table = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
    return {
        "wall_ms": round(wall, 3),
        "ops_self_ms": round(ops, 3),
        "other_ms": round(max(wall - ops, 0.0), 3),
        "ops_per_call": round(sum(e.count for e in events) / reps, 1),
        "top": [
            {
                "op": e.key,
                "self_ms": round(e.self_cpu_time_total / reps / 1e3, 3),
                "calls": round(e.count / reps, 1),
            }
            for e in table
        ],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m specdec.evals.step_profile", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--drafter", default="bundled:smollm2-135m")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--out")
    args = p.parse_args(argv)
    from specdec.api import load_drafter, load_verifier

    v = load_verifier("hf", args.model, dtype=args.dtype)
    d = load_drafter(args.drafter, verifier=v, dtype=args.dtype)
    ids = [int(t) for t in torch.randint(10, v.vocab_size - 10, (args.context + 16,)).tolist()]
    v.set_target_layers(d.target_layer_ids)
    v.reset()
    v.prefill(ids[: args.context])
    d.reset()  # the drafter's context: the prefix's features, read right after the prefill
    feats = v.features(args.context, device=d.device, dtype=d.dtype) if d.target_layer_ids else None
    d.extend(feats, ids[: args.context])
    calls = {}
    for n in (1, 8, 16):
        block = ids[args.context : args.context + n]
        calls[f"verify_{n}"] = _profile(
            lambda b=block: v.verify(b), lambda n=n: v.rollback(n), args.reps, args.top
        )
    calls["draft"] = _profile(
        lambda: d.propose(ids[args.context], d.block_size - 1), lambda: None, args.reps, args.top
    )
    result = {
        **figures_header("specdec.evals.step_profile"),
        "model": args.model,
        "dtype": str(v.dtype),
        "drafter": args.drafter,
        "context": args.context,
        "threads": torch.get_num_threads(),
        "calls": calls,
    }
    emit_figures(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
