"""Eval reports from a result JSON of `specdec.evals.run`: Markdown, PNG plots and a console table.

`write_report(result, out_dir)` writes `report.md` plus `acceptance_histogram.png`,
`per_position_acceptance.png`, `speedup_per_prompt.png` and `speedup_by_group.png` (matplotlib's object
API with the Agg canvas: no display, no pyplot state). `print_summary_table(result)` prints one line per
dataset and per peer. With more than one group (Spec-Bench's six, or a prompt file's categories) the report
opens with Spec-Bench's layout: one row per method, a speedup column per group, the mean accepted tokens and
the overall speedup. Everything is read from the result dict alone, so `python -m specdec.evals.report
OUT_DIR` rebuilds a report from a saved `result.json`; `compare_results(paths)` puts several side by side.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from specdec.records import atomic_write_bytes, format_bytes

__all__ = [
    "compare_results",
    "format_summary_table",
    "group_table",
    "plot_all",
    "print_summary_table",
    "render_markdown",
    "write_report",
]

PLOTS = {
    "acceptance_histogram": "acceptance_histogram.png",
    "per_position_acceptance": "per_position_acceptance.png",
    "speedup_per_prompt": "speedup_per_prompt.png",
    "speedup_by_group": "speedup_by_group.png",
}


# ---- formatting ------------------------------------------------------------------------------------------


def _f(x: float | None, fmt: str = ".2f", suffix: str = "") -> str:
    return "n/a" if x is None else f"{x:{fmt}}{suffix}"


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1e3:.0f}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:.0f}%"


def _shares(ts: dict[str, float | None]) -> str:
    return " / ".join(_pct(ts.get(k)) for k in ("draft", "verify", "bridge", "other"))


def _runtimes(result: dict[str, Any]) -> tuple[str, str]:
    """Labels of the memory roles: verifier runtime, drafter device."""
    cfg = result["config"]
    return cfg["verifier"]["runtime"], str(result["environment"].get("device") or "torch")


def _rows(result: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    ev = result["eval"]
    rows = list(ev["datasets"].items())
    if len(rows) > 1:
        rows.append(("all", ev["overall"]))
    return rows


def _peer_rows(result: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    out = []
    for name, peer in result.get("peers", {}).items():
        if name == "skipped":
            continue
        for ds, fig in peer["datasets"].items():
            out.append((name, ds, fig))
        if len(peer["datasets"]) > 1:
            out.append((name, "all", peer["overall"]))
    return out


def format_summary_table(result: dict[str, Any]) -> str:
    """Plain-text table: one line per dataset (and 'all'), then one per peer and dataset."""
    w = max(10, *(len(ds) for ds in result["eval"]["datasets"]))
    head = (
        f"{'dataset':<{w}} {'n':>4} {'tau':>6} {'speedup':>8} {'AR tok/s':>9} {'spec tok/s':>10} {'match':>7}"
    )
    head += f" {'TTFT ms AR/spec':>16}  draft/verify/bridge/other"
    lines = [head]
    for ds, f in _rows(result):
        lines.append(
            f"{ds:<{w}} {f['n_prompts']:>4} {_f(f['acceptance_length_mean']):>6} "
            f"{_f(f['speedup'], '.2f', 'x'):>8} {_f(f['baseline_tokens_per_s'], '.1f'):>9} "
            f"{_f(f['tokens_per_s'], '.1f'):>10} {_pct(f['match_rate']):>7} "
            f"{_ms(f['baseline_ttft_s']) + '/' + _ms(f['ttft_s']):>16}  {_shares(f['time_share'])}"
        )
    peers = _peer_rows(result)
    if peers:
        lines.append("")
        cols = f"{'tau':>6} {'tok/s':>8} {'vs our AR':>10} {'match AR':>9}"
        lines.append(f"{'peer':<24} {'dataset':<{w}} {cols}")
        for name, ds, f in peers:
            lines.append(
                f"{name:<24} {ds:<{w}} {_f(f.get('acceptance_length_mean')):>6} "
                f"{_f(f['tokens_per_s'], '.1f'):>8} "
                f"{_f(f['speedup_vs_baseline'], '.2f', 'x'):>10} {_pct(f['match_rate_vs_baseline']):>9}"
            )
    return "\n".join(lines)


def print_summary_table(result: dict[str, Any], file: TextIO | None = None) -> None:
    print(format_summary_table(result), file=file or sys.stdout)


def _title(dataset: str) -> str:
    """A group's column title: Spec-Bench's for its groups, the dataset's name otherwise."""
    from specdec.evals.datasets import SPEC_BENCH, SPEC_BENCH_GROUPS

    base, _, group = dataset.partition(":")
    return SPEC_BENCH_GROUPS[group][0] if base == SPEC_BENCH.name and group in SPEC_BENCH_GROUPS else dataset


def _methods(result: dict[str, Any]) -> list[tuple[str, dict[str, Any], str]]:
    """(label, figures by dataset, speedup key) for our run and each peer."""
    ev, drafter = result["eval"], result["config"].get("drafter") or {}
    ours = f"specdec, {drafter.get('name')} (block {result['config']['block_size']})"
    rows = [(ours, {**ev["datasets"], "all": ev["overall"]}, "speedup")]
    for name, peer in result.get("peers", {}).items():
        if name != "skipped":
            rows.append((name, {**peer["datasets"], "all": peer["overall"]}, "speedup_vs_baseline"))
    return rows


def group_table(result: dict[str, Any]) -> list[str]:
    """Spec-Bench's layout: a row per method (ours, each peer), its speedup over our AR per group, the mean
    accepted tokens and the overall speedup; then τ, match rate and our AR's tokens/s per group."""
    groups = list(result["eval"]["datasets"])
    md = [
        "| method | " + " | ".join(_title(g) for g in groups) + " | #Mean Accepted Tokens | Overall |",
        "|---|" + "---:|" * (len(groups) + 2),
    ]
    for label, figs, speed in _methods(result):
        cells = [_f(figs[g].get(speed), ".2f", "×") for g in groups]
        md.append(f"| {label} | " + " | ".join(cells) + f" | {_f(figs['all'].get('acceptance_length_mean'))} "
                  f"| {_f(figs['all'].get(speed), '.2f', '×')} |")  # fmt: skip
    ev = result["eval"]
    figs = {**ev["datasets"], "all": ev["overall"]}
    md += [
        "",
        "| by group | " + " | ".join(_title(g) for g in groups) + " | all |",
        "|---|" + "---:|" * (len(groups) + 1),
        "| prompts | " + " | ".join(str(figs[g]["n_prompts"]) for g in [*groups, "all"]) + " |",
        "| τ (ours) | " + " | ".join(_f(figs[g]["acceptance_length_mean"]) for g in [*groups, "all"]) + " |",
        "| match (ours vs our AR) | "
        + " | ".join(_pct(figs[g]["match_rate"]) for g in [*groups, "all"])
        + " |",
        "| our AR tok/s | "
        + " | ".join(_f(figs[g]["baseline_tokens_per_s"], ".1f") for g in [*groups, "all"])
        + " |",
    ]
    return md


def render_markdown(result: dict[str, Any], plots: dict[str, str] | None = None) -> str:
    """The report as Markdown; `plots` maps plot keys to file names relative to the report."""
    cfg, ev, env = result["config"], result["eval"], result["environment"]
    vrt, drt = _runtimes(result)
    drafter = cfg.get("drafter") or {}
    md = [
        "# specdec eval report",
        "",
        f"- verifier: `{cfg['verifier']['model']}` [{vrt}], dtype {cfg['verifier']['dtype']}",
        f"- drafter: {drafter.get('name')} (block size {cfg['block_size']}), device {env.get('device')}",
        f"- datasets: {', '.join(ev['datasets'])}; turns {ev['turns']}; prompt format "
        f"{', '.join(ev['prompt_format'])}; max_new_tokens {cfg['max_new_tokens']}; temperature "
        f"{cfg['temperature']}",
        f"- machine: {env.get('cpu') or env.get('machine')}, {env.get('cpu_count')} CPUs, "
        f"{env.get('platform')}, python {env.get('python')}, "
        + ", ".join(f"{k} {v}" for k, v in env.get("versions", {}).items() if v),
        f"- warm-up (excluded): {'yes' if ev.get('warmup') else 'no'}; order: {ev.get('interleaving')}",
        "",
    ]
    if len(ev["datasets"]) > 1:
        md += [
            "## By group",
            "",
            "Speedup over our AR baseline (same process, same prompts, interleaved) per group, in "
            "Spec-Bench's layout; #Mean Accepted Tokens is τ over all groups (n/a for peers that do not "
            "draft in our loop).",
            "",
            *group_table(result),
            "",
        ]
    md += [
        "## Summary",
        "",
        "Speedup = spec tokens/s over AR-baseline tokens/s, both counting the tokens after the first over "
        "decode time (TTFT separate); e2e counts all tokens over prefill + decode. AR baseline = the same "
        "loop and verifier with block size 1. Match = spec output equals the baseline output token for "
        "token.",
        "",
        "| dataset | n | τ mean | speedup | e2e speedup | AR tok/s | spec tok/s | match "
        "| TTFT AR / spec (ms) "
        f"| draft / verify / bridge / other | peak verifier [{vrt}] | peak drafter [{drt}] |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for ds, f in _rows(result):
        mem = f["peak_memory_bytes_max"]
        md.append(
            f"| {ds} | {f['n_prompts']} | {_f(f['acceptance_length_mean'])} | {_f(f['speedup'], '.2f', '×')} "
            f"| {_f(f['e2e_speedup'], '.2f', '×')} | {_f(f['baseline_tokens_per_s'], '.1f')} "
            f"| {_f(f['tokens_per_s'], '.1f')} | {f['n_match']}/{f['n_prompts']} "
            f"| {_ms(f['baseline_ttft_s'])} / {_ms(f['ttft_s'])} | {_shares(f['time_share'])} "
            f"| {format_bytes(mem.get('verifier'))} | {format_bytes(mem.get('drafter'))} |"
        )
    peers = _peer_rows(result)
    if peers:
        md += [
            "",
            "## Peers (same process, same clock)",
            "",
            "tok/s counts tokens after the first emitted chunk over the time from it to the last chunk; "
            "e2e = all new tokens over the whole call. Ratios are against our AR baseline on the same "
            "prompts; an `hf-generate` / `mlx_lm-stream_generate` ratio below 1 means our AR loop is "
            "faster than the runtime's own. τ only for peers that are our loop with another drafter.",
            "",
            "| peer | dataset | n | τ | tok/s | e2e tok/s | vs our AR | e2e vs our AR | TTFT (ms) "
            "| match vs our AR | peak memory |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for name, ds, f in peers:
            md.append(
                f"| {name} | {ds} | {f['n_prompts']} | {_f(f.get('acceptance_length_mean'))} "
                f"| {_f(f['tokens_per_s'], '.1f')} "
                f"| {_f(f['e2e_tokens_per_s'], '.1f')} | {_f(f['speedup_vs_baseline'], '.2f', '×')} "
                f"| {_f(f['e2e_speedup_vs_baseline'], '.2f', '×')} | {_ms(f['ttft_s'])} "
                f"| {f['n_match_baseline']}/{f['n_prompts']} | {format_bytes(f['peak_memory_bytes_max'])} |"
            )
        md.append("")
        md += [f"- `{n}`: {p['description']}" for n, p in result["peers"].items() if n != "skipped"]
        md += [f"- `{n}`: {why}" for n, why in result["peers"].get("skipped", {}).items()]
    md += ["", "## Acceptance", ""]
    md.append("Histogram: fraction of decode steps by acceptance length τ = accepted drafts + 1 (the bonus).")
    md.append("")
    width = max(len(f["acceptance_histogram"]) for _, f in _rows(result))
    md.append("| dataset | " + " | ".join(f"τ={k + 1}" for k in range(width)) + " |")
    md.append("|---|" + "---:|" * width)
    for ds, f in _rows(result):
        h = f["acceptance_histogram"]
        n = sum(h) or 1
        md.append(
            f"| {ds} | " + " | ".join(f"{h[k] / n:.2f}" if k < len(h) else "" for k in range(width)) + " |"
        )
    md.append("")
    md.append(
        "Per-position acceptance: of the steps that drafted ≥ i tokens, the fraction that accepted ≥ i."
    )
    md.append("")
    md.append("| dataset | " + " | ".join(f"pos {i + 1}" for i in range(width - 1)) + " |")
    md.append("|---|" + "---:|" * (width - 1))
    for ds, f in _rows(result):
        pp = f["per_position_acceptance"]
        md.append(
            f"| {ds} | " + " | ".join(_f(pp[i]) if i < len(pp) else "" for i in range(width - 1)) + " |"
        )
    if plots:
        md += ["", "## Plots", ""]
        md += [f"![{key}]({name})" for key, name in plots.items()]
    md += [
        "",
        "## Per prompt",
        "",
        "| prompt | first | tokens AR / spec | τ | AR tok/s | spec tok/s | speedup | match |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for p, b in zip(result["prompts"], result["baseline"]):
        s = p["summary"]
        md.append(
            f"| {p['id']} | {p.get('order', '').replace('_first', '')} | {len(b['output_tokens'])} / "
            f"{len(p['output_tokens'])} | {_f(s['acceptance_length_mean'])} "
            f"| {_f(p.get('baseline_tokens_per_s'), '.1f')} | {_f(s['tokens_per_s'], '.1f')} "
            f"| {_f(p.get('speedup'), '.2f', '×')} | {'yes' if p.get('match') else '**no**'} |"
        )
    return "\n".join(md) + "\n"


# ---- plots -----------------------------------------------------------------------------------------------


def _figure(w: float = 7.0, h: float = 4.0) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(w, h), dpi=100, layout="constrained")


def plot_acceptance_histogram(result: dict[str, Any], path: Path) -> None:
    fig = _figure()
    ax = fig.subplots()
    rows = list(result["eval"]["datasets"].items())
    width = 0.8 / max(len(rows), 1)
    for j, (ds, f) in enumerate(rows):
        h = f["acceptance_histogram"]
        n = sum(h) or 1
        ax.bar([k + 1 + (j - (len(rows) - 1) / 2) * width for k in range(len(h))], [c / n for c in h], width,
               label=f"{ds} (τ {_f(f['acceptance_length_mean'])})")  # fmt: skip
    ax.set_xlabel("acceptance length τ (accepted drafts + bonus)")
    ax.set_ylabel("fraction of decode steps")
    ax.set_title("Acceptance histogram")
    ax.legend()
    fig.savefig(path)


def plot_per_position(result: dict[str, Any], path: Path) -> None:
    fig = _figure()
    ax = fig.subplots()
    for ds, f in result["eval"]["datasets"].items():
        pp = f["per_position_acceptance"]
        xs = [i + 1 for i, v in enumerate(pp) if v is not None]
        ax.plot(xs, [v for v in pp if v is not None], marker="o", label=ds)
    ax.set_xlabel("draft position i")
    ax.set_ylabel("P(accepted ≥ i | drafted ≥ i)")
    ax.set_ylim(0, 1.05)
    ax.set_title("Per-position acceptance")
    ax.legend()
    fig.savefig(path)


def plot_speedup_per_prompt(result: dict[str, Any], path: Path) -> None:
    prompts = result["prompts"]
    fig = _figure(max(7.0, 0.12 * len(prompts)), 4.0)
    ax = fig.subplots()
    datasets = list(result["eval"]["datasets"])
    colors = {ds: f"C{i}" for i, ds in enumerate(datasets)}
    for ds in datasets:
        xs = [i for i, p in enumerate(prompts) if p.get("dataset") == ds]
        ax.bar(xs, [prompts[i].get("speedup") or 0.0 for i in xs], color=colors[ds], label=ds)
    ax.axhline(1.0, color="k", lw=0.8)
    overall = result["eval"]["overall"]["speedup"]
    if overall:
        ax.axhline(overall, color="r", ls="--", lw=1, label=f"overall {overall:.2f}×")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("prompt (run order)")
    ax.set_ylabel("speedup over AR (tokens/s ratio)")
    ax.set_title("Per-prompt speedup")
    ax.legend()
    fig.savefig(path)


def plot_speedup_by_group(result: dict[str, Any], path: Path) -> None:
    """Grouped bars: each method's speedup over our AR per group and overall."""
    groups = [*result["eval"]["datasets"], "all"]
    methods = _methods(result)
    fig = _figure(max(7.0, 1.2 * len(groups) * max(1, len(methods)) / 2), 4.0)
    ax = fig.subplots()
    width = 0.8 / len(methods)
    for j, (label, figs, speed) in enumerate(methods):
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(groups))]
        ax.bar(xs, [figs[g].get(speed) or 0.0 for g in groups], width, label=label)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(groups)), [_title(g) if g != "all" else "Overall" for g in groups],
                  rotation=20, ha="right")  # fmt: skip
    ax.set_ylabel("speedup over our AR (tokens/s ratio)")
    ax.set_title("Speedup by group")
    ax.legend(fontsize="small")
    fig.savefig(path)


def plot_all(result: dict[str, Any], out_dir: str | Path) -> dict[str, str]:
    """Write the PNGs into `out_dir`; return {plot key: file name}."""
    out = Path(out_dir)
    plot_acceptance_histogram(result, out / PLOTS["acceptance_histogram"])
    plot_per_position(result, out / PLOTS["per_position_acceptance"])
    plot_speedup_per_prompt(result, out / PLOTS["speedup_per_prompt"])
    plot_speedup_by_group(result, out / PLOTS["speedup_by_group"])
    return dict(PLOTS)


# ---- several runs side by side ---------------------------------------------------------------------------


def _read_result(path: str | Path) -> dict[str, Any]:
    p = Path(path).expanduser()
    p = p / "result.json" if p.is_dir() else p
    if not p.is_file():
        raise FileNotFoundError(f"--compare {str(path)!r}: no result.json there")
    try:
        result = json.loads(p.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--compare {str(p)!r}: not JSON ({e})") from None
    if not isinstance(result, dict) or "eval" not in result:
        raise ValueError(f"--compare {str(p)!r}: not a `specdec eval` result (no 'eval' section)")
    return result


def _describe(result: dict[str, Any]) -> dict[str, str]:
    """What a run was: its verifier, drafting, limits and machine, one cell each."""
    cfg, env = result["config"], result["environment"]
    v, d = cfg["verifier"], cfg.get("drafter") or {}
    versions = env.get("versions", {})
    return {
        "verifier": f"{v.get('model')} [{v.get('runtime')}, {v.get('dtype')}]",
        "drafter": f"{d.get('name')} (block {cfg.get('block_size')}"
        + (f", tree {cfg['tree']}" if cfg.get("tree") else "")
        + ")",
        "tokens / temperature": f"{cfg.get('max_new_tokens')} / {cfg.get('temperature')}",
        "prompts": f"{result['eval']['overall']['n_prompts']} ({', '.join(result['eval']['datasets'])})",
        "machine": f"{env.get('cpu') or env.get('processor') or env.get('machine')}, {env.get('cpu_count')} "
        f"CPUs, {env.get('platform')}",
        "versions": ", ".join(f"{k} {versions[k]}" for k in ("specdec", "torch", "mlx") if versions.get(k)),
        "date": str(result.get("created", "n/a")),
    }


def compare_results(paths: list[str | Path]) -> str:
    """Markdown: the runs at `paths` (result.json files or their folders) side by side, what each ran on,
    then τ, speedup over its own AR and match rate per group, and each peer's overall speedup."""
    results = [_read_result(p) for p in paths]
    names = [chr(ord("A") + i) if i < 26 else f"R{i}" for i in range(len(results))]
    md = ["# specdec eval comparison", ""] + [f"- {n}: `{p}`" for n, p in zip(names, paths)] + [""]
    md += ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    described = [_describe(r) for r in results]
    md += [f"| {k} | " + " | ".join(d[k] for d in described) + " |" for k in described[0]]
    groups = list(dict.fromkeys(g for r in results for g in r["eval"]["datasets"]))
    cols = [f"{n} {c}" for n in names for c in ("τ", "speedup", "match")]
    md += ["", "| group | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for g in [*groups, "all"]:
        cells = []
        for r in results:
            f = r["eval"]["overall"] if g == "all" else r["eval"]["datasets"].get(g)
            if f is None:  # a group this run did not have
                cells += ["", "", ""]
                continue
            cells += [_f(f["acceptance_length_mean"]), _f(f["speedup"], ".2f", "×"), _pct(f["match_rate"])]
        md.append(f"| {_title(g) if g != 'all' else 'Overall'} | " + " | ".join(cells) + " |")
    peers = list(dict.fromkeys(n for r in results for n in r.get("peers", {}) if n != "skipped"))
    if peers:
        md += ["", "| peer (overall, vs its run's AR) | " + " | ".join(names) + " |"]
        md.append("|---|" + "---:|" * len(names))
        for p in peers:
            cells = [
                _f(r["peers"][p]["overall"]["speedup_vs_baseline"], ".2f", "×")
                if p in r.get("peers", {})
                else ""
                for r in results
            ]
            md.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(md) + "\n"


def write_report(result: dict[str, Any], out_dir: str | Path) -> Path:
    """`report.md` and the PNGs in `out_dir`; returns the report's path."""
    out = Path(out_dir)
    plots = plot_all(result, out)
    path = out / "report.md"
    atomic_write_bytes(path, render_markdown(result, plots).encode())
    return path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m specdec.evals.report OUT_DIR|result.json", file=sys.stderr)
        return 2
    src = Path(args[0])
    src = src / "result.json" if src.is_dir() else src
    result = json.loads(src.read_text())
    print_summary_table(result)
    print(f"report: {write_report(result, src.parent)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def median_ms(fn: Callable[[], Any], reps: int) -> float:
    """The median of `reps` timed calls of `fn` after one untimed warm-up, in ms (3 decimals); each call
    ends at a sync of its own (a token list, a tensor the caller evaluates)."""
    import statistics
    import time

    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 3)


def figures_header(module: str) -> dict[str, Any]:
    """The head of a benchmark's figures JSON: the date, the command that made them, where they ran."""
    import time

    from specdec.records import environment

    return {
        "date": time.strftime("%Y-%m-%d"), "command": f"python -m {module} " + " ".join(sys.argv[1:]),
        "environment": environment("cpu"),
    }  # fmt: skip


def emit_figures(result: dict[str, Any], out: str | None) -> None:
    """Print a benchmark's figures (without the environment) and, with `out`, write them all atomically."""
    from specdec.records import atomic_write_json

    print(json.dumps({k: v for k, v in result.items() if k != "environment"}, indent=1))
    if out:
        atomic_write_json(Path(out), result)
