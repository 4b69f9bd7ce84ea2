"""What a hostile probe of the batched server, the new drafter kinds, add-mtp and the wheel found (issue 62),
each case the test that would have caught it: a huge request body, malformed drafter configs (every field
of a tiny checkpoint of each kind set to null, a string, a negative number), a wheel without an extra,
add-mtp on the wrong folders, interrupted runs' staging files, an empty prompt, a cost table of another
model, and the server's error bodies."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import shutil
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

import tinymodels  # noqa: E402
from test_hardening import _stub_drafter_folder, interrupt_after_steps  # noqa: E402
from test_server import _serve  # noqa: E402

from specdec.cli import main  # noqa: E402
from specdec.stream import StreamingEngine  # noqa: E402
from specdec.verifiers.stub import StubVerifier  # noqa: E402


def _rss_mib() -> int:
    return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) // 1024


def _one_line(rc: int, err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("error:") or "Traceback" in ln]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error:"), err
    return lines[0]


def _cli(capsys, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    return rc, capsys.readouterr().err


# ---- the server ----------------------------------------------------------------------------------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc (Linux) for the memory check")
def test_a_huge_body_is_refused_as_it_arrives_not_tokenized_and_not_kept():
    """A 10 MB chat prompt used to cost an engine thread ~17 s of tokenizing and ~50 MB of server memory
    per request, never returned. Now it is a 413 by its Content-Length (or, sent chunked, once it passes
    the limit), before any tokenizing; three of them leave the memory where it was."""
    engine = StreamingEngine(StubVerifier())
    encoded: list[int] = []
    real = engine.encode
    engine.encode = lambda prompt, **kw: (encoded.append(1), real(prompt, **kw))[1]  # type: ignore[method-assign]
    text = "ab " * ((10 << 20) // 3)
    body = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 4}).encode()
    for s in _serve(engine, model_name="stub"):
        before = _rss_mib()
        for _ in range(3):
            t0 = time.perf_counter()
            r = httpx.post(s.url + "/v1/chat/completions", content=body, timeout=60,
                           headers={"content-type": "application/json"})  # fmt: skip
            assert r.status_code == 413 and time.perf_counter() - t0 < 5, r.text
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and "--max-request-bytes" in err["message"]
        chunks = (body[i : i + (1 << 16)] for i in range(0, len(body), 1 << 16))  # no Content-Length
        r = httpx.post(s.url + "/v1/chat/completions", content=chunks, timeout=60)
        assert r.status_code == 413 and "runs over this server's" in r.json()["error"]["message"]
        assert _rss_mib() - before < 60  # was ~190 MB for three
        assert not encoded
        ok = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        assert httpx.post(s.url + "/v1/chat/completions", json=ok, timeout=60).status_code == 200
        # the limit is the server's to set: a small one refuses a prompt the default takes
    for s in _serve(StreamingEngine(StubVerifier()), model_name="stub", max_request_bytes=2048):
        long = {"messages": [{"role": "user", "content": "x" * 3000}], "max_tokens": 3}
        assert httpx.post(s.url + "/v1/chat/completions", json=long, timeout=60).status_code == 413


def test_the_default_body_limit_follows_the_context():
    from specdec.serve.app import BYTES_PER_POSITION, request_bytes_for

    assert request_bytes_for(2048) == 1 << 20  # at least 1 MiB
    assert request_bytes_for(262144) == BYTES_PER_POSITION * 262144 + (64 << 10)


def test_error_bodies_are_typed_and_name_their_field():
    """A 405 was typed `server_error`; `top_p: 0` and `min_p: 1` came back with `param: null`."""
    for s in _serve(StreamingEngine(StubVerifier()), model_name="stub"):
        r = httpx.get(s.url + "/v1/chat/completions")
        assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
        for field, value in (("top_p", 0), ("min_p", 1), ("top_p", 1.5), ("temperature", -1)):
            body = {"messages": [{"role": "user", "content": "hi"}], field: value}
            r = httpx.post(s.url + "/v1/chat/completions", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
        body = {"messages": [{"role": "user", "content": "hi"}], "top_p": 1, "min_p": 0}  # the bounds kept
        assert httpx.post(s.url + "/v1/chat/completions", json=body).status_code == 200


# ---- a wheel without an extra ---------------------------------------------------------------------------


def _without(monkeypatch, *modules: str) -> None:
    """As in an environment where `modules` are not installed: not found, and not importable."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n in modules else real(n, *a))
    for m in modules:
        monkeypatch.setitem(sys.modules, m, None)  # `import m` raises ModuleNotFoundError


def test_serve_without_the_serve_extra_is_one_line_before_the_port_is_bound(monkeypatch, capsys):
    import specdec.serve.cli as serve_cli

    bound: list[int] = []
    monkeypatch.setattr(serve_cli, "listen_socket", lambda *a: bound.append(1))
    _without(monkeypatch, "uvicorn")
    line = _one_line(*_cli(capsys, "serve", "--verifier", "stub", "--port", "0"))
    assert "pip install 'specdec[serve]'" in line and "uvicorn" in line and not bound


def test_a_runtime_without_its_extra_is_one_line_before_anything_loads(monkeypatch, capsys):
    _without(monkeypatch, "mlx_lm")
    line = _one_line(*_cli(capsys, "generate", "--verifier", "mlx", "--model", "x", "--prompt", "hi"))
    assert "the mlx runtime needs the mlx extra (mlx_lm not installed)" in line
    assert "pip install 'specdec[mlx]'" in line


def test_a_module_of_an_extra_missing_later_is_still_one_line(capsys):
    from specdec.args import run_command

    def needs_matplotlib(args):
        import matplotlib_not_here  # noqa: F401  (stands for an extra's module found missing mid-command)

    def report(args):
        raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")

    assert run_command(report, None) == 2
    assert "it comes with the eval extra; pip install 'specdec[eval]'" in capsys.readouterr().err
    with pytest.raises(ModuleNotFoundError):  # a module no extra provides is a bug of ours: raised
        run_command(needs_matplotlib, None)


# ---- drafter checkpoints: every field of each kind's config, malformed ----------------------------------


def _leaves(d: dict, path: tuple = ()) -> list[tuple]:
    """Every key path of a config: scalars, lists and the objects themselves."""
    out = []
    for k, v in d.items():
        out.append((*path, k))
        if isinstance(v, dict):
            out += _leaves(v, (*path, k))
    return out


def _set(d: dict, path: tuple, value: object) -> dict:
    d = json.loads(json.dumps(d))
    inner = d
    for k in path[:-1]:
        inner = inner[k]
    inner[path[-1]] = value
    return d


@pytest.fixture(scope="module")
def kinds(tmp_path_factory) -> dict[str, tuple[Path, list[str]]]:
    """A tiny checkpoint of each kind with the verifier flags it drafts for."""
    import eagle3ckpt

    root = tmp_path_factory.mktemp("kinds")
    llama = tinymodels.tiny_tokenizer(tinymodels.tiny_llama(root / "llama"), bos=1, eos=2)
    g4 = tinymodels.tiny_tokenizer(tinymodels.tiny_gemma4(root / "g4", sliding_window=8), bos=2, eos=1)
    return {
        "dflash": (_stub_drafter_folder(root / "dflash"), ["--verifier", "stub"]),
        "eagle3": (
            eagle3ckpt.tiny_eagle3(root / "e3", target_hidden=64, vocab=320, aux=[1, 2, 3]),
            ["--verifier", "hf", "--model", str(llama)],
        ),
        "gemma4 assistant": (
            tinymodels.tiny_gemma4_assistant(root / "asst", sliding_window=8),
            ["--verifier", "hf", "--model", str(g4), "--dtype", "float32"],
        ),
    }


@pytest.mark.parametrize("kind", ["dflash", "eagle3", "gemma4 assistant"])
def test_every_config_field_malformed_is_one_line_or_runs(kinds, kind, tmp_path):
    """The probe's `num_attention_heads: null` (a Gemma-4 assistant: inspect-drafter said it fits, generate
    printed a 28-frame traceback), EAGLE-3's `rope_theta: "x"` (no file, no field) and `speculators_config:
    "oops"` (accepted): each field of each kind's tiny config set to null, "x" and -1, through
    `generate` as a user runs it: exit code 0, or 2 with one line."""
    folder, verifier = kinds[kind]
    raw = json.loads((folder / "config.json").read_text())
    failures = []
    for path in _leaves(raw):
        for value in (None, "x", -1):
            case = tmp_path / "case"
            shutil.rmtree(case, ignore_errors=True)
            shutil.copytree(folder, case)
            (case / "config.json").write_text(json.dumps(_set(raw, path, value)))
            err = io.StringIO()
            try:
                with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                    rc = main(["generate", *verifier, "--drafter", str(case), "--prompt", "hello",
                               "--max-new-tokens", "3"])  # fmt: skip
            except BaseException as e:  # a traceback for the user
                failures.append(f"{'.'.join(path)}={value!r}: {type(e).__name__}: {str(e)[:100]}")
                continue
            lines = [ln for ln in err.getvalue().splitlines() if ln.startswith("error:")]
            if rc not in (0, 2) or (rc == 2 and len(lines) != 1):
                failures.append(f"{'.'.join(path)}={value!r}: exit {rc}: {err.getvalue()[-200:]}")
    assert not failures, failures


EAGLE3_CASES = {
    "rope_theta": (("transformer_layer_config", "rope_theta"), "x",
                   "(config.json): rope_theta must be a positive number"),
    "speculators_config": (("speculators_config",), "oops",
                           "speculators_config must be an object, got 'oops'"),
    "speculative_tokens": (("speculators_config", "proposal_methods"), [{"speculative_tokens": 0}],
                           "speculative_tokens must be a positive integer, got 0"),
}  # fmt: skip


@pytest.mark.parametrize("name", EAGLE3_CASES)
def test_the_probes_eagle3_configs_name_the_file_and_field(kinds, name, tmp_path, capsys):
    folder, _ = kinds["eagle3"]
    raw = json.loads((folder / "config.json").read_text())
    path, value, says = EAGLE3_CASES[name]
    case = shutil.copytree(folder, tmp_path / name)
    (case / "config.json").write_text(json.dumps(_set(raw, path, value)))
    line = _one_line(*_cli(capsys, "inspect-drafter", str(case)))
    assert says in line and str(case) in line, line


def test_the_probes_gemma4_assistant_without_heads_is_refused_by_inspect_and_generate(
    kinds, tmp_path, capsys
):
    folder, verifier = kinds["gemma4 assistant"]
    raw = json.loads((folder / "config.json").read_text())
    case = shutil.copytree(folder, tmp_path / "asst")
    (case / "config.json").write_text(json.dumps(_set(raw, ("text_config", "num_attention_heads"), None)))
    says = "text_config.num_attention_heads must be a positive integer, got None"
    model = verifier[verifier.index("--model") + 1]
    assert says in _one_line(*_cli(capsys, "inspect-drafter", str(case), "--model", model))
    assert says in _one_line(*_cli(capsys, "generate", *verifier, "--drafter", str(case), "--prompt", "x"))


# ---- add-mtp and the MTP layers' shapes -----------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory) -> Path:
    return tinymodels.add_mtp(tinymodels.tiny_qwen3_5(tmp_path_factory.mktemp("q35") / "q35"))


def test_add_mtp_refuses_one_folder_twice_and_a_missing_original(qwen35, tmp_path, capsys):
    """`specdec add-mtp X X` wrote X/mtp.safetensors into the original; a missing original was told it
    had no MTP layers in `--drafter mtp`'s words."""
    x = shutil.copytree(qwen35, tmp_path / "x")
    before = sorted(p.name for p in x.iterdir())
    line = _one_line(*_cli(capsys, "add-mtp", str(x), str(x)))
    assert "is both the original and the conversion" in line
    assert sorted(p.name for p in x.iterdir()) == before
    line = _one_line(*_cli(capsys, "add-mtp", str(tmp_path / "nope"), str(x)))
    assert "add-mtp: the original checkpoint" in line and "nope' does not exist" in line
    line = _one_line(*_cli(capsys, "add-mtp", str(qwen35), str(tmp_path / "gone")))
    assert "add-mtp: the conversion" in line and "does not exist" in line


def test_an_interrupted_add_mtp_leaves_no_staging_file_that_a_rerun_keeps(
    qwen35, tmp_path, monkeypatch, capsys
):
    """Killed between its staging file and the rename, add-mtp left `conv/tmpXXXX/` that no rerun removed:
    its staging file is now `.mtp.safetensors.<random>.tmp`, removed when it fails and by the next run."""
    import safetensors.torch

    from specdec.drafting.mtp.torch import MTP_FILE

    conv = tmp_path / "conv"
    conv.mkdir()
    raw = json.loads((qwen35 / "config.json").read_text())
    (conv / "config.json").write_text(json.dumps(raw))
    real = safetensors.torch.save_file

    def killed(tensors, path, metadata=None):
        real(tensors, path, metadata=metadata)
        raise KeyboardInterrupt  # between the staging file and the link into place

    monkeypatch.setattr(safetensors.torch, "save_file", killed)
    assert main(["add-mtp", str(qwen35), str(conv)]) == 1
    assert sorted(p.name for p in conv.iterdir()) == ["config.json"]
    (conv / f".{MTP_FILE}.abc123.tmp").write_bytes(b"what a SIGKILL leaves")  # no Python to clean up
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    assert main(["add-mtp", str(qwen35), str(conv)]) == 0
    assert sorted(p.name for p in conv.iterdir()) == ["config.json", MTP_FILE]


def test_a_wrong_shaped_mtp_tensor_is_named_before_the_verifier_loads(qwen35, tmp_path, monkeypatch, capsys):
    """A wrong-shaped `mtp.fc.weight` was refused only after the verifier loaded, in transformers' words
    ("look at the above report!", no report shown)."""
    from safetensors.torch import load_file, save_file

    from specdec.verifiers.hf import HFVerifier

    bad = shutil.copytree(qwen35, tmp_path / "bad")
    for f in bad.glob("*.safetensors"):
        state = load_file(f)
        if "mtp.fc.weight" in state:
            state["mtp.fc.weight"] = state["mtp.fc.weight"][:, :-2].contiguous()
            save_file(state, f)
    shape = list(load_file(next(qwen35.glob("*.safetensors")))["mtp.fc.weight"].shape)

    def no_load(*a, **kw):
        raise AssertionError("the verifier loaded before the MTP layers were checked")

    monkeypatch.setattr(HFVerifier, "__init__", no_load)
    line = _one_line(*_cli(capsys, "generate", "--verifier", "hf", "--model", str(bad), "--drafter", "mtp",
                           "--prompt", "x"))  # fmt: skip
    assert f"mtp.fc.weight is [{shape[0]}, {shape[1] - 2}]" in line and f"needs {shape}" in line


# ---- runs: staging files, empty prompts, cost tables ------------------------------------------------------


def test_an_interrupted_or_refused_run_leaves_no_staging_file(tmp_path, monkeypatch, capsys):
    """SIGINT during `generate --out d/r.json` left `d/.r.steps.jsonl.<random>.tmp`, one more per
    interrupt; an eval refused mid-way (its second turn) did the same."""
    out = tmp_path / "d" / "r.json"
    with monkeypatch.context() as m:
        interrupt_after_steps(m, 3)
        for _ in range(2):
            assert main(["generate", "--prompt", "hello", "--max-new-tokens", "20", "--out", str(out)]) == 1
    assert not list((tmp_path / "d").iterdir())
    assert main(["generate", "--prompt", "hello", "--max-new-tokens", "4", "--out", str(out)]) == 0
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["r.json", "r.steps.jsonl"]

    from specdec.drafting.lookup.prompt import PromptLookupDrafter
    from specdec.engine import DecodeConfig
    from specdec.evals import run as run_mod
    from specdec.evals.datasets import PromptRecord

    def refused(*a, **kw):
        raise ValueError("refused mid-way")

    monkeypatch.setattr(run_mod, "_eval_prompt", refused)
    record = PromptRecord(id="0", dataset="t", messages=[{"role": "user", "content": "hi"}], turns=["hi"])
    with pytest.raises(ValueError, match="refused mid-way"):
        run_mod.run_eval(StubVerifier(), [record], drafter=PromptLookupDrafter(block_size=4),
                         cfg=DecodeConfig(max_new_tokens=4, block_size=4), out_dir=tmp_path / "e",
                         peers=False, warmup=False, progress=False, report=False)  # fmt: skip
    assert not list((tmp_path / "e").iterdir())


def test_an_empty_prompt_is_refused_as_the_server_refuses_it(capsys):
    line = _one_line(*_cli(capsys, "generate", "--verifier", "stub", "--prompt", ""))
    assert "--prompt is empty" in line


def test_a_cost_table_of_another_model_is_refused(tmp_path, capsys):
    """A `--costs` file measured on the stub was taken silently for SmolLM2 (the table names its model,
    runtime and dtype)."""
    table = tmp_path / "costs.json"
    assert main(["bench-verify", "--verifier", "stub", "--dtype", "float32", "--contexts", "32",
                 "--sizes", "1,2,4", "--reps", "1", "--out", str(table)]) == 0  # fmt: skip
    capsys.readouterr()
    drafter = str(_stub_drafter_folder(tmp_path / "d"))

    def run(costs: Path) -> list[str]:
        return ["generate", "--verifier", "stub", "--dtype", "float32", "--drafter", drafter, "--block-size",
                "auto", "--costs", str(costs), "--prompt", "x", "--max-new-tokens", "2"]  # fmt: skip

    assert main(run(table)) == 0, capsys.readouterr().err  # its own model's table is taken
    data = json.loads(table.read_text())
    for key, theirs, ours in (("runtime", "hf", "stub"), ("dtype", "bfloat16", "float32")):
        other = tmp_path / f"{key}.json"
        other.write_text(json.dumps(data | {"verifier": data["verifier"] | {key: theirs}}))
        line = _one_line(*_cli(capsys, *run(other)))
        assert f"was measured with {key} {theirs!r}, this run's is {ours!r}" in line
    with pytest.raises(ValueError, match="was measured with model 'stub-h64', this run's is 'smollm2-135m'"):
        from specdec.costs import VerifyCosts

        VerifyCosts.check_measured_on(data | {"verifier": data["verifier"] | {"model": "stub-h64"}},
                                      source="t", runtime="stub", model="smollm2-135m")  # fmt: skip
