"""What logit bias and penalties cost a step: `specdec.processors.Processor` on a verify's rows, beside the
verify itself, on a real model.

    python -m specdec.evals.processor_cost [--model smollm2-135m] [--rows 1 16] [--history 256 2048]
        [--reps 20] [--out FIGURES.json]

For each history length (prompt tokens already in the cache, random ids) and each row count it times, as
medians of `--reps` calls after a warm-up: the verify of that many rows (rolled back after each), and the
processor on the verify's logits with a bias and all three penalties, over the whole history and over
mlx_lm's 20-token windows.
"""

from __future__ import annotations

import argparse
import random
import sys

import torch

from specdec.evals.report import emit_figures, figures_header, median_ms
from specdec.processors import LogitsParams, Processor


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m specdec.evals.processor_cost", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--history", type=int, nargs="+", default=[256, 2048])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out")
    args = p.parse_args(argv)
    from specdec.api import load_verifier

    v = load_verifier("hf", args.model, dtype=args.dtype)
    rng = random.Random(0)
    whole = LogitsParams(logit_bias={11: 2.0, 12: -100}, repetition_penalty=1.3, presence_penalty=0.5,
                         frequency_penalty=0.3)  # fmt: skip
    windowed = LogitsParams(**{**whole.__dict__, "penalty_context": 20})
    rows_out = []
    for hist in args.history:
        ids = [rng.randrange(v.vocab_size) for _ in range(hist)]
        for n in args.rows:
            v.reset()
            v.prefill(ids[:-1])
            tokens = [ids[-1], *(rng.randrange(v.vocab_size) for _ in range(n - 1))]

            def verify(tokens=tokens, n=n) -> list[int]:
                out = v.verify(tokens)
                v.rollback(n)
                return out

            verify_ms = median_ms(verify, args.reps)
            logits = v.forward(tokens)  # [n, V]
            v.rollback(n)
            paths = [tokens[1 : i + 1] for i in range(n)]
            row = {"history": hist, "rows": n, "verify_ms": verify_ms}
            for name, params in (("whole", whole), ("windowed", windowed)):
                proc = Processor(params, ids[: hist // 2])
                proc.commit(ids[hist // 2 :])
                ms = median_ms(lambda proc=proc, x=logits, ps=paths: proc(x, ps).sum().item(), args.reps)
                row[f"processors_{name}_ms"] = ms
                row[f"processors_{name}_share"] = round(ms / verify_ms, 4)
            rows_out.append(row)
            print(row, file=sys.stderr)
    result = {**figures_header("specdec.evals.processor_cost"), "model": args.model, "dtype": args.dtype,
              "threads": torch.get_num_threads(), "rows": rows_out}  # fmt: skip
    emit_figures(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
