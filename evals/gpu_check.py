"""The table of `bash evals/gpu_check.sh`: CUDA tests, per-step peak memory, the training-step benchmark.

python -m specdec.evals.gpu_check OUT_DIR    # reads tests.xml, generate.json(.steps.jsonl), bench_train.json

Writes OUT_DIR/gpu_check.json and gpu_check.md; a part whose file is missing is recorded as missing (null),
never guessed.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from specdec.records import atomic_write_json, environment, format_bytes, steps_path


def _tests(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    suite = ET.parse(path).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    cases = suite.findall("testcase") if suite is not None else []
    failed = [
        f"{c.get('classname')}::{c.get('name')}"
        for c in cases
        if c.find("failure") is not None or c.find("error") is not None
    ]
    skipped = [f"{c.get('classname')}::{c.get('name')}" for c in cases if c.find("skipped") is not None]
    cuda = [c for c in cases if "test_cuda" in (c.get("classname") or "")]
    ran = [c.get("name") for c in cuda if c.find("skipped") is None]
    return {
        "total": len(cases), "failed": failed, "skipped": skipped, "cuda_tests_run": ran,
        "cuda_tests_skipped": [c.get("name") for c in cuda if c.find("skipped") is not None],
    }  # fmt: skip


def _memory(result: Path) -> dict[str, Any] | None:
    """The verifier's peak-memory records of a `specdec generate --out` run: the prefill's, and the
    smallest and largest of the decode steps' (each reset before its verify: the smallest below the
    prefill's shows the reset)."""
    path = steps_path(result)
    if not path.is_file():
        return None
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    ver = [s["peak_memory"]["verifier"] for s in steps]
    decode = sorted(
        (m for s, m in zip(steps, ver) if s["phase"] == "decode" and m["bytes"]), key=lambda m: m["bytes"]
    )
    return {
        "steps": len(steps),
        "sources": sorted({m["source"] for m in ver}),
        "prefill": ver[0] if ver else None,
        "decode_min": decode[0] if decode else None,
        "decode_max": decode[-1] if decode else None,
    }


def collect(out: Path) -> dict[str, Any]:
    bench = out / "bench_train.json"
    return {
        "tests": _tests(out / "tests.xml"),
        "peak_memory": _memory(out / "generate.json"),
        "bench_train": json.loads(bench.read_text()) if bench.is_file() else None,
        "environment": environment("cuda"),
    }


def markdown(r: dict[str, Any]) -> str:
    lines = ["# GPU check (`bash evals/gpu_check.sh`)", ""]
    t = r["tests"]
    tests = "missing"
    if t is not None:
        tests = (
            f"{t['total']} run, {len(t['failed'])} failed, {len(t['skipped'])} skipped; CUDA tests run: "
            f"{', '.join(t['cuda_tests_run']) or 'none'}; skipped (no CUDA): "
            f"{', '.join(t['cuda_tests_skipped']) or 'none'}"
            + (f"; failed: {t['failed']}" if t["failed"] else "")
        )
    lines += [
        "## CUDA tests",
        "",
        tests,
        "",
        "## Per-step peak memory (HF verifier, prompt lookup, 64 tokens)",
        "",
    ]
    m = r["peak_memory"]
    if m is None:
        lines.append("missing")
    else:
        lines += [
            "| steps | source | prefill peak | decode peak min | decode peak max |",
            "|---|---|---|---|---|",
            f"| {m['steps']} | {', '.join(m['sources'])} | {format_bytes(m['prefill'])} | "
            f"{format_bytes(m['decode_min'])} | {format_bytes(m['decode_max'])} |",
        ]
    lines += ["", "## Training-step benchmark", ""]
    b = r["bench_train"]
    if b is None:
        lines.append("missing")
    else:
        from specdec.evals.bench_train import table

        lines += [
            f"preset {b['preset']}, {b['anchors']} anchors: `{json.dumps(b['shape'])}`",
            "",
            table(b["rows"]),
        ]
    env = r["environment"]
    lines += ["", f"torch {env['versions'].get('torch')}, python {env['python']}, {env['platform']}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m specdec.evals.gpu_check OUT_DIR", file=sys.stderr)
        return 2
    out = Path(args[0])
    result = collect(out)
    atomic_write_json(out / "gpu_check.json", result)
    text = markdown(result)
    (out / "gpu_check.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
