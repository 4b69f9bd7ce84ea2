"""What serving several requests at once buys: `specdec serve` with `--max-batch 8` (eight engines on one
batch, their verifies run together) against today's serial server (one engine, requests in turn), in
one run on this machine, 1 / 2 / 4 / 8 concurrent clients; SmolLM2-135M in bf16 on the HF verifier with
the bundled drafter + prompt lookup by default (`--verifier mlx`: the MLX verifier, its drafter in MLX).

    python -m specdec.evals.batch_cost --rounds 3 --out docs/history/batch-cost-rounds-2026-12-07.json
    python -m specdec.evals.batch_cost --verifier mlx --out docs/history/batch-cost-mlx-2026-12-06.json

Both servers run in this process at once, each on a free local port, over the same loaded model. After an
untimed warm-up of each, per round (`--rounds`) and per N in `--clients`: N clients post a chat completion
each at once (greedy, `--max-new-tokens`, prompts from `PROMPTS`) to one server, then to the other, the
order alternating between rounds, so both see the same machine state; the wall time until the last answer,
the aggregate completion tokens/s, each client's latency (mean, worst), and whether every answer was the
same from both servers (it must be: the batch is exact or refused). Per N the speedup of every round, its
median and its spread (min, max): a claim is only as good as the smallest round.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

from specdec.args import Parser, at_least, run_main

PROMPTS = [
    "Explain how a refrigerator keeps food cold.",
    "Write a short poem about the sea at night.",
    "List five tips for learning a new language.",
    "What is the difference between weather and climate?",
    "Describe the water cycle in simple words.",
    "Give me a recipe for a quick vegetable soup.",
    "Why do leaves change colour in autumn?",
    "Summarise the plot of a detective story in three sentences.",
]


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m specdec.evals.batch_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--verifier", choices=["hf", "mlx"], default="hf")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--drafter", default="bundled:smollm2-135m+lookup")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--clients", type=at_least(1), nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--max-batch", type=at_least(2, 16), default=8)
    p.add_argument("--max-new-tokens", type=at_least(1), default=64)
    p.add_argument("--block-size", type=at_least(2, 16), help="tokens per verify (default: the drafter's)")
    p.add_argument(
        "--min-confidence", choices=["0", "auto"], default="0",
        help="auto: both servers' drafts cut by the verify costs measured here (as `specdec serve "
        "--min-confidence auto`); 0: whole blocks",
    )  # fmt: skip
    p.add_argument("--rounds", type=at_least(1), default=3, help="interleaved rounds of serial and batched")
    p.add_argument("--out", help="write the figures here (JSON)")
    p.set_defaults(func=_run)
    return p


class _Server:
    """An app served by uvicorn on a free local port, on a thread of this process."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/chat/completions"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


def _clients(url: str, n: int, max_tokens: int) -> dict[str, Any]:
    """N clients at once, one chat completion each: wall time, tokens, latencies, the answers."""
    import httpx

    out: dict[int, tuple[float, str, int, dict[str, Any]]] = {}

    def ask(i: int) -> None:
        body = {"model": "m", "max_tokens": max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]}  # fmt: skip
        t0 = time.perf_counter()
        r = httpx.post(url, json=body, timeout=600).json()
        out[i] = (
            time.perf_counter() - t0,
            r["choices"][0]["message"]["content"],
            r["usage"]["completion_tokens"],
            r["specdec"],
        )

    t0 = time.perf_counter()
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat, tokens = [out[i][0] for i in range(n)], sum(out[i][2] for i in range(n))
    stats = [out[i][3] for i in range(n)]
    steps = sum(st["n_steps"] for st in stats)  # decode steps: each verifies its drafts + 1 token
    return {"wall_s": round(wall, 3), "tokens": tokens, "tokens_per_s": round(tokens / wall, 1),
            "latency_mean_s": round(statistics.mean(lat), 3), "latency_max_s": round(max(lat), 3),
            "verified_per_step": round((sum(st["drafted"] for st in stats) + steps) / steps, 2),
            "accepted_per_step": round(sum(st["accepted"] for st in stats) / steps, 2),
            "answers": [out[i][1] for i in range(n)]}  # fmt: skip


def _apps(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """The serial app, the batched app and the batch, over one loaded model."""
    from specdec.api import load_drafter, load_verifier
    from specdec.batch import batch_of
    from specdec.costs import VerifyCosts
    from specdec.serve import build_app
    from specdec.stream import StreamingEngine

    v = load_verifier(args.verifier, args.model, dtype=args.dtype)
    batch = batch_of(v)
    runtime = "mlx" if args.verifier == "mlx" else "torch"
    costs = VerifyCosts.measure(v) if args.min_confidence == "auto" else None

    def engine(verifier: Any) -> StreamingEngine:
        d = load_drafter(args.drafter, verifier=v, dtype=args.dtype, runtime=runtime, costs=costs)
        return StreamingEngine(verifier, d, block_size=args.block_size)

    serial = build_app(engine(v), model_name="m", max_queue=16)
    engines = [engine(batch.sequence()) for _ in range(args.max_batch)]
    return serial, build_app(engines, model_name="m", max_queue=16), batch


def _run(args: argparse.Namespace) -> int:
    from specdec.evals.report import emit_figures, figures_header

    serial_app, batched_app, batch = _apps(args)
    result: dict[str, Any] = {**figures_header("specdec.evals.batch_cost"), "verifier": args.verifier,
                              "model": args.model, "drafter": args.drafter, "dtype": args.dtype,
                              "max_batch": args.max_batch, "block_size": args.block_size,
                              "min_confidence": args.min_confidence, "rounds": args.rounds,
                              "clients": {}}  # fmt: skip
    servers = {"serial": _Server(serial_app), "batched": _Server(batched_app)}
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in args.clients}
    try:
        for server in servers.values():
            _clients(server.url, 2, 4)  # warm-up: weights packed, caches grown
        for r in range(args.rounds):
            order = ("serial", "batched") if r % 2 == 0 else ("batched", "serial")
            for n in args.clients:
                got = {name: _clients(servers[name].url, n, args.max_new_tokens) for name in order}
                s, b = got["serial"], got["batched"]
                same = s.pop("answers") == b.pop("answers")
                speedup = round(s["wall_s"] / b["wall_s"], 2)
                runs[n].append({"same_answers": same, "first": order[0], "serial": s, "batched": b,
                                "speedup": speedup})  # fmt: skip
    finally:
        for server in servers.values():
            server.stop()
    for n, rounds in runs.items():
        ups = [x["speedup"] for x in rounds]
        tps = {k: statistics.median(x[k]["tokens_per_s"] for x in rounds) for k in ("serial", "batched")}
        result["clients"][n] = {
            "same_answers": all(x["same_answers"] for x in rounds), "speedup_median": statistics.median(ups),
            "speedup_min": min(ups), "speedup_max": max(ups), "tokens_per_s_median": tps, "rounds": rounds,
        }  # fmt: skip
    result["forwards_by_calls"] = dict(sorted(batch.forwards.items()))
    emit_figures(result, args.out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
