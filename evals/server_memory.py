"""Whether a batched server keeps memory per request: `--requests` chat completions through `specdec serve`'s
app (`--max-batch` engines on one batch), `--clients` at a time, the process's resident memory read after
every `--every` requests. A server that keeps something per request grows in a line; one that only warms
(caches reaching their longest prompt, allocator pools) levels off.

    python -m specdec.evals.server_memory --requests 2000 --out docs/history/server-memory-2026-12-07.json

The stub verifier in bf16 by default (CI's model: fast, batch-invariant on this project's CPUs), prompt
lookup per engine; prompts of different lengths and answers of `--max-new-tokens`, greedy and sampled.
Linux (reads /proc/self/status).
"""

from __future__ import annotations

import argparse
import gc
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specdec.args import Parser, at_least, run_main


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m specdec.evals.server_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--verifier", choices=["stub", "hf", "mlx"], default="stub")
    p.add_argument("--model", help="for hf / mlx")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--drafter", default="prompt-lookup")
    p.add_argument("--max-batch", type=at_least(1, 16), default=8)
    p.add_argument("--clients", type=at_least(1), default=16)
    p.add_argument("--requests", type=at_least(1), default=2000)
    p.add_argument("--every", type=at_least(1), default=100)
    p.add_argument("--max-new-tokens", type=at_least(1), default=16)
    p.add_argument("--out", help="write the figures here (JSON)")
    p.set_defaults(func=_run)
    return p


def rss_mib() -> float:
    """This process's resident memory (VmRSS), MiB."""
    kib = int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0])
    return round(kib / 1024, 1)


def _app(args: argparse.Namespace) -> Any:
    from specdec.api import load_drafter, load_verifier
    from specdec.batch import batch_of
    from specdec.serve import build_app
    from specdec.stream import StreamingEngine

    v = load_verifier(args.verifier, args.model, dtype=args.dtype)
    seqs = [v]
    if args.max_batch > 1:
        batch = batch_of(v)
        seqs = [batch.sequence() for _ in range(args.max_batch)]
    engines = [StreamingEngine(s, load_drafter(args.drafter, verifier=s, dtype=args.dtype)) for s in seqs]
    return build_app(engines, model_name="m", max_queue=4 * args.clients)


def _run(args: argparse.Namespace) -> int:
    import httpx

    from specdec.evals.batch_cost import _Server
    from specdec.evals.report import emit_figures, figures_header

    server = _Server(_app(args))
    sent, lock, errors = 0, threading.Lock(), []
    readings: list[dict[str, Any]] = [{"requests": 0, "rss_mib": rss_mib()}]

    def client(i: int) -> None:
        nonlocal sent
        with httpx.Client(timeout=600) as http:
            while True:
                with lock:
                    if sent >= args.requests:
                        return
                    sent += 1
                    k = sent
                text = f"request {k}: " + "ab " * (k % 40)  # prompts of different lengths
                body = {"model": "m", "max_tokens": args.max_new_tokens, "temperature": 0.8 if k % 3 else 0,
                        "seed": k, "messages": [{"role": "user", "content": text}]}  # fmt: skip
                r = http.post(server.url, json=body)
                if r.status_code != 200:
                    errors.append(r.text[:200])
                if k % args.every == 0:
                    gc.collect()
                    with lock:
                        readings.append({"requests": k, "rss_mib": rss_mib()})

    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        server.stop()
    readings.sort(key=lambda r: r["requests"])
    half = [r["rss_mib"] for r in readings if r["requests"] >= args.requests // 2]
    result = {
        **figures_header("specdec.evals.server_memory"), "verifier": args.verifier, "model": args.model,
        "dtype": args.dtype, "drafter": args.drafter, "max_batch": args.max_batch, "clients": args.clients,
        "requests": args.requests, "errors": len(errors), "readings": readings,
        "second_half_growth_mib": round(half[-1] - half[0], 1) if len(half) > 1 else None,
    }  # fmt: skip
    emit_figures(result, args.out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
