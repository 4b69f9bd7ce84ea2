"""fp32 against bf16 (or any two dtypes) on this machine, interleaved in one process: which is faster end to
end, autoregressive and speculative, for the HF verifier and a drafter.

    python -m specdec.evals.dtype_ab --model smollm2-135m --drafter bundled:smollm2-135m+lookup \
        --dataset humaneval --limit 10 --max-new-tokens 128 --out dtype_ab.json

Both verifiers (and their drafters, in the same dtype, cut by verify costs measured at load) stay loaded;
for every prompt the four runs (AR and speculative in each dtype) go in an order rotated from prompt to
prompt, so machine drift hits all four alike. Reports tokens/s (tokens after the first over decode time,
summed over prompts), tau, and whether each speculative output equals the AR output of its dtype.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from specdec.args import Parser, add_max_new_tokens, at_least, run_main


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m specdec.evals.dtype_ab", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--drafter", default="bundled:smollm2-135m+lookup")
    p.add_argument("--corpus", help="with a '+lookup' drafter: n-grams of this corpus (see specdec --help)")
    p.add_argument("--dtypes", nargs=2, default=["float32", "bfloat16"], metavar="DTYPE")
    p.add_argument("--dataset", choices=["humaneval", "mtbench"], default="humaneval")
    p.add_argument("--limit", type=at_least(1), default=10)
    add_max_new_tokens(p, default=128)
    p.add_argument("--out", help="write the figures here (JSON)")
    p.set_defaults(func=_run)
    return p


def _run(args: argparse.Namespace) -> int:
    import torch

    from specdec.api import load_drafter, load_verifier, torch_dtype
    from specdec.chat import encode_prompt
    from specdec.costs import VerifyCosts
    from specdec.engine import decode_config, generate
    from specdec.evals.datasets import load_dataset
    from specdec.records import atomic_write_json, check_output_path, environment, summarize

    out = check_output_path(args.out) if args.out is not None else None
    for d in args.dtypes:
        torch_dtype(d)  # a bad name fails before any load
    records = load_dataset(args.dataset, args.limit)
    arms = {}
    for d in args.dtypes:
        v = load_verifier("hf", args.model, dtype=d)
        costs = VerifyCosts.measure(v)
        drafter = load_drafter(args.drafter, verifier=v, dtype=d, costs=costs, corpus=args.corpus)
        arms[d] = (v, drafter, [encode_prompt(v, r.messages) for r in records])
        for warm in (None, drafter):  # first calls pack weights and fill caches: not timed
            generate(v, arms[d][2][0], drafter=warm, cfg=decode_config(warm, block_size=4, max_new_tokens=8))
        print(f"{d}: batch-invariant {v.batch_invariant}; {costs.summary()}", file=sys.stderr)
    runs = [(d, mode) for d in args.dtypes for mode in ("ar", "spec")]
    results: dict[tuple[str, str], list] = {run: [] for run in runs}
    for i in range(len(records)):
        for d, mode in runs[i % 4 :] + runs[: i % 4]:  # rotated per prompt
            v, drafter, prompts = arms[d]
            d_run = drafter if mode == "spec" else None  # None: the autoregressive baseline
            cfg = decode_config(d_run, max_new_tokens=args.max_new_tokens)
            results[d, mode].append(generate(v, prompts[i], drafter=d_run, cfg=cfg))
        print(f"prompt {i + 1}/{len(records)}", file=sys.stderr)
    table = {}
    for d in args.dtypes:
        ar, spec = summarize(results[d, "ar"]), summarize(results[d, "spec"])
        same = sum(a.output_tokens == s.output_tokens for a, s in zip(results[d, "ar"], results[d, "spec"]))
        table[d] = {
            "ar_tokens_per_s": ar["tokens_per_s"], "spec_tokens_per_s": spec["tokens_per_s"],
            "tau": spec["acceptance_length_mean"], "spec_equals_ar": f"{same}/{len(records)}",
        }  # fmt: skip
        print(
            f"{d:>9}: AR {ar['tokens_per_s']:.1f} tok/s, spec {spec['tokens_per_s']:.1f} tok/s "
            f"(tau {spec['acceptance_length_mean']:.2f}), spec == AR {same}/{len(records)}"
        )
    a, b = args.dtypes
    for mode in ("ar", "spec"):
        ratio = table[b][f"{mode}_tokens_per_s"] / table[a][f"{mode}_tokens_per_s"]
        print(f"{mode}: {b} / {a} = {ratio:.2f}x")
    if out:
        cfg = {
            k: getattr(args, k)
            for k in ("model", "drafter", "corpus", "dtypes", "dataset", "limit", "max_new_tokens")
        }
        cpu = {
            "capability": torch.backends.cpu.get_cpu_capability(),
            "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
            "amx": torch.cpu._is_amx_tile_supported(),
        }
        atomic_write_json(out, {"config": cfg, "environment": environment(), "cpu": cpu, "dtypes": table})
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
