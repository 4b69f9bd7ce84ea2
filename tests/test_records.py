"""Result JSON: schema, summary maths on hand-made steps, JSONL streaming and atomic writes."""

from __future__ import annotations

import json
import os

import pytest

from specdec.api import load_drafter, load_verifier, run
from specdec.engine import DecodeConfig
from specdec.records import (
    JsonlWriter,
    PromptResult,
    StepRecord,
    atomic_write_json,
    check_output_path,
    run_json,
    summarize,
    validate,
)

MEM = {
    "verifier": {"bytes": 100, "source": "x", "kind": "peak"},
    "drafter": {"bytes": None, "source": "unmeasured", "kind": "unmeasured", "reason": "r"},
}


def step(
    i: int, drafted: int, accepted: int, n_tok: int, step_s: float = 0.5, phase: str = "decode"
) -> StepRecord:
    return StepRecord(
        index=i,
        phase=phase,
        drafted=drafted,
        accepted=accepted,
        acceptance_length=accepted + 1,
        tokens=list(range(n_tok)),
        draft_s=0.1,
        verify_s=0.2,
        bridge_s=0.05,
        other_s=step_s - 0.35,
        step_s=step_s,
        peak_memory=MEM,
    )


def hand_made() -> PromptResult:
    steps = [
        step(0, 0, 0, 1, step_s=0.25, phase="prefill"),
        step(1, 3, 3, 4),
        step(2, 3, 0, 1),
        step(3, 3, 1, 2),
        step(4, 2, 2, 3),
    ]
    return PromptResult(
        id="p", prompt_tokens=5, steps=steps, output_tokens=list(range(11)), text="t", finish_reason="length"
    )


def test_summary_maths():
    s = summarize([hand_made()], block_size=4)
    assert s["acceptance_length_mean"] == pytest.approx((4 + 1 + 2 + 3) / 4)
    assert s["acceptance_histogram"] == [1, 1, 1, 1]  # accepted 0, 1, 2, 3 once each
    # position 1: drafted>=1 in 4 steps, accepted>=1 in 3; position 3: drafted>=3 in 3 steps, accepted>=3 in 1
    assert s["per_position_acceptance"] == pytest.approx([3 / 4, 2 / 4, 1 / 3])
    assert s["tokens_per_s"] == pytest.approx(10 / 2.0)  # tokens after the first / decode time
    assert s["ttft_s"] == pytest.approx(0.25)
    assert s["time_share"]["verify"] == pytest.approx(0.4)
    assert s["peak_memory_bytes_max"]["verifier"]["bytes"] == 100
    assert s["peak_memory_bytes_max"]["drafter"]["bytes"] is None


def test_summary_empty_and_baseline():
    only_prefill = PromptResult(
        id="p",
        prompt_tokens=3,
        steps=[step(0, 0, 0, 1, phase="prefill")],
        output_tokens=[0],
        text=None,
        finish_reason="stop",
    )
    s = summarize([only_prefill])
    assert s["acceptance_length_mean"] is None and s["tokens_per_s"] is None  # unmeasurable, not 0
    cfg = {
        "verifier": {"runtime": "stub", "model": "m", "dtype": "float32"},
        "drafter": None,
        "block_size": 4,
        "temperature": 0.0,
        "seed": 0,
        "max_new_tokens": 10,
    }
    base = PromptResult(
        id="p",
        prompt_tokens=5,
        steps=[step(0, 0, 0, 1, phase="prefill")] + [step(i, 0, 0, 1) for i in range(1, 11)],
        output_tokens=list(range(11)),
        text="t",
        finish_reason="length",
    )
    out = run_json(config=cfg, results=[hand_made()], baseline=[base], device="cpu")
    assert out["summary"]["baseline_tokens_per_s"] == pytest.approx(10 / 5.0)
    assert out["summary"]["speedup"] == pytest.approx(5.0 / 2.0)
    validate(out)


def test_run_writes_valid_json_and_jsonl(tmp_path):
    v = load_verifier("stub")
    out = tmp_path / "r.json"
    res = run(
        v,
        ["Hello there", [256, 1, 2, 3]],
        drafter=load_drafter("prompt-lookup", verifier=v),
        cfg=DecodeConfig(max_new_tokens=24, block_size=8),
        out=out,
        progress=False,
    )
    on_disk = json.loads(out.read_text())
    validate(on_disk)
    assert on_disk["summary"] == res["summary"]
    assert on_disk["config"]["verifier"]["runtime"] == "stub" and on_disk["config"]["block_size"] == 8
    lines = [json.loads(x) for x in out.with_suffix(".steps.jsonl").read_text().splitlines()]
    assert len(lines) == sum(len(p["steps"]) for p in on_disk["prompts"])
    assert {x["prompt_id"] for x in lines} == {"0", "1"}
    assert oct(out.stat().st_mode & 0o777) != "0o600"


def test_schema_rejects_fake_zero_memory():
    s = summarize([hand_made()])
    cfg = {
        "verifier": {"runtime": "stub", "model": "m", "dtype": "f"},
        "drafter": None,
        "block_size": 1,
        "temperature": 0.0,
        "seed": 0,
        "max_new_tokens": 1,
    }
    out = run_json(config=cfg, results=[hand_made()], device=None)
    out["prompts"][0]["steps"][1]["peak_memory"]["verifier"] = {"bytes": 0, "source": "x", "kind": "peak"}
    with pytest.raises(Exception, match="0"):
        validate(out)
    assert s["n_steps"] == 4


def test_atomic_write_keeps_old_result_on_failure(tmp_path):
    p = tmp_path / "r.json"
    atomic_write_json(p, {"a": 1})

    class Boom:
        pass

    with pytest.raises(TypeError):
        atomic_write_json(p, {"a": Boom()})  # fails half way through serialising
    assert json.loads(p.read_text()) == {"a": 1}
    assert os.listdir(tmp_path) == ["r.json"]  # no temp file left behind


def test_jsonl_flushes_each_line_and_replaces_only_on_commit(tmp_path):
    p = tmp_path / "s.jsonl"
    p.write_text("earlier run\n")
    w = JsonlWriter(p)
    w.write({"i": 1})
    tmp = w.tmp
    assert tmp.parent == tmp_path and tmp.name.startswith(".s.jsonl.") and tmp.suffix == ".tmp"
    assert json.loads(tmp.read_text()) == {"i": 1}  # readable before close: a crash keeps it
    assert p.read_text() == "earlier run\n"  # not truncated by a run that may still fail
    w.close()
    assert p.read_text() == "earlier run\n"
    w = JsonlWriter(p)
    assert w.tmp != tmp  # a fresh name each time
    w.write({"i": 2})
    w.commit()
    assert json.loads(p.read_text()) == {"i": 2} and not w.tmp.exists()


def test_output_path_checks(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="is not a directory"):
        check_output_path(tmp_path / "f" / "r.json")
    assert check_output_path(tmp_path / "missing" / "r.json")  # made when the run writes
    with pytest.raises(ValueError, match="directory"):
        check_output_path(tmp_path)
