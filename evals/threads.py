"""Which thread decodes, and how many intra-op threads it uses, against how busy the machine is (issue 67,
step 0: "threads chosen, not inherited").

A `StreamingEngine` over the HF verifier (SmolLM2-135M, `--dtype auto`) with a drafter decodes the first
HumanEval prompts for `--tokens` new tokens, on the calling thread and on a worker thread, with the model's
intra-op thread count (`specdec.threads`, set by the engine on the decoding thread at every step) fixed at
1, fixed at 2, or adapted as it decodes ("auto", made afresh per condition), while 0, 1 or 2 other
processes keep a core busy (a spinning Python loop each). Every condition runs once per round, the rounds
interleaved, so drift hits all of them alike; tokens/s per condition: the median over rounds and the
range, and how often "auto" switched.

    python -m specdec.evals.threads --rounds 3 --json runs/threads.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

SPIN = "while True: pass"


def _busy(n: int) -> list[subprocess.Popen]:
    procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(n)]
    time.sleep(0.5)  # they are running before the timed decode starts
    return procs


def _decode(
    engine: Any, prompts: list[list[int]], tokens: int, threads: str, worker: bool
) -> tuple[float, int]:
    """Tokens/s of decoding every prompt, on this thread or a worker, with `threads` intra-op threads
    ("auto": the model's `ThreadChoice`, made afresh); and how often the choice switched."""
    from specdec.threads import choice_for, reset_choice

    out: dict[str, float] = {}
    # the count is set on the decoding thread at every step (OpenMP's team is per thread); "auto": the
    # adapting choice, as SPECDEC_THREADS=auto asks for it
    os.environ["SPECDEC_THREADS"] = "auto" if threads == "auto" else ""
    reset_choice(engine.verifier, fixed=None if threads == "auto" else int(threads))

    def work() -> None:
        choice_for(engine.verifier)  # made (and measured: it resets the cache) before the clock starts
        engine.reset()
        t0, n = time.perf_counter(), 0
        for ids in prompts:
            n += len(engine.complete(ids, max_tokens=tokens, stop_token_ids=frozenset()).output_tokens)
        out["tok_s"] = n / (time.perf_counter() - t0)

    if worker:
        t = threading.Thread(target=work)
        t.start()
        t.join()
    else:
        work()
    return out["tok_s"], choice_for(engine.verifier).switches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--drafter", default="prompt-lookup")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--busy", default="0,1,2", help="how many cores other processes keep busy, per condition")
    ap.add_argument("--counts", default="1,2,auto", help="intra-op threads per condition (auto: adapted)")
    ap.add_argument("--json")
    args = ap.parse_args()
    # killed (SIGTERM): leave through the `finally` that stops the busy processes, never orphaning them
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    import torch

    from specdec.api import RunSpec, load
    from specdec.chat import encode_prompt
    from specdec.evals.datasets import load_humaneval
    from specdec.stream import StreamingEngine

    m = load(RunSpec(verifier="hf", model=args.model, drafter=args.drafter, dtype=args.dtype))
    engine = StreamingEngine(m.verifier, m.drafter)
    prompts = [encode_prompt(m.verifier, r.messages) for r in load_humaneval(limit=args.prompts)]
    default_threads = torch.get_num_threads()
    _decode(engine, prompts[:1], 8, str(default_threads), False)  # warm-up
    counts = args.counts.split(",")
    conditions = [(b, w, t) for b in map(int, args.busy.split(",")) for w in (False, True) for t in counts]
    switches: dict[str, list[int]] = {}
    runs: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for busy, worker, threads in conditions:
            procs = _busy(busy)
            try:
                tok_s, n_switch = _decode(engine, prompts, args.tokens, threads, worker)
            finally:
                for p in procs:
                    p.kill()
                    p.wait()
            key = f"busy={busy} {'worker' if worker else 'calling'} threads={threads}"
            runs.setdefault(key, []).append(tok_s)
            switches.setdefault(key, []).append(n_switch)
            print(f"round {r + 1}: {key}: {tok_s:.1f} tok/s ({n_switch} switches)", flush=True)
    table = {
        k: {
            "median": round(statistics.median(v), 2),
            "min": round(min(v), 2),
            "max": round(max(v), 2),
            "runs": v,
            "switches": switches[k],
        }
        for k, v in runs.items()
    }
    for k, row in table.items():
        print(f"{k:34s} {row['median']:6.1f} tok/s ({row['min']:.1f}-{row['max']:.1f})")
    if args.json:
        info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
        names = [ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")]
        meta = {
            "date": time.strftime("%Y-%m-%d"),
            "command": " ".join(["python -m specdec.evals.threads", *sys.argv[1:]]),
            "model": args.model,
            "drafter": args.drafter,
            "dtype": m.dtype,
            "dtype_reason": m.dtype_reason,
            "prompts": args.prompts,
            "tokens": args.tokens,
            "rounds": args.rounds,
            "cpu": names[0] if names else platform.processor(),
            "avx512_bf16": "avx512_bf16" in info,
            "cores": os.cpu_count(),
            "default_threads": default_threads,
            "torch": torch.__version__,
            "omp_env": {k: v for k, v in os.environ.items() if k.startswith("OMP_")},
        }
        Path(args.json).write_text(json.dumps({**meta, "conditions": table}, indent=1) + "\n")


if __name__ == "__main__":
    main()
