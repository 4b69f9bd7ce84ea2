"""The Apple Silicon path, made safe on Linux: MLX decoding from any thread, a strict-device mode that catches
what MPS refuses, honest guards, and the Metal DLPack bridge decided by substituted device kinds.

Before: an MLX verifier loaded with a dtype cast on one thread and decoded on another raised
"There is no Stream(cpu, 0) in current thread" (MLX >= 0.32 keeps default streams per thread; the cast was
still lazy). The sampler combined float64 CPU uniforms with the logits on the drafter's device, and the
drafter fed strided cache views to SDPA.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from strict import StrictDevice, StrictDeviceError
from tinymodels import tiny_llama

from specdec.drafting.dflash.config import DFlashConfig
from specdec.drafting.dflash.torch import DFlashDrafter, DFlashDraftModel
from specdec.sampling import Sampler, SamplingParams, sample_from, warp
from specdec.stream import ChatSession, StreamingEngine
from specdec.verifiers.stub import StubVerifier

MSGS = [{"role": "user", "content": "hello"}]


# ---- MLX from any thread ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlx_models(tmp_path_factory) -> dict[str, Path]:
    pytest.importorskip("mlx_lm")
    import shutil

    from mlx_lm.utils import load_model, quantize_model, save_config, save_model
    from tinymodels import tiny_tokenizer

    root = tmp_path_factory.mktemp("mlx")
    fp = tiny_tokenizer(
        tiny_llama(root / "llama"), chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    q4 = root / "q4"
    model, config = load_model(fp)
    model, config = quantize_model(model, config, group_size=32, bits=4)
    save_model(q4, model)
    save_config(config, q4 / "config.json")
    for f in fp.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation")):
            shutil.copy(f, q4)
    return {"llama": fp, "q4": q4}


def _in_thread(f):
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = f()
        except BaseException as e:  # report it to the test thread
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=120)
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.mark.mlx
@pytest.mark.parametrize(
    ("model", "dtype"), [("llama", None), ("llama", "bfloat16"), ("q4", None), ("q4", "bfloat16")]
)
def test_mlx_loaded_here_decodes_on_another_thread(mlx_models, model, dtype):
    from specdec.verifiers.mlx import MLXVerifier

    here = MLXVerifier(mlx_models[model], dtype=dtype)  # loaded (and cast) on this thread
    want = StreamingEngine(MLXVerifier(mlx_models[model], dtype=dtype)).complete(MSGS, max_tokens=12).text
    assert (
        _in_thread(lambda: StreamingEngine(here).complete(MSGS, max_tokens=12).text) == want
    )  # streaming API
    session = ChatSession(StreamingEngine(here))
    assert _in_thread(lambda: session.send("hello", max_tokens=12).text()) == want  # ChatSession


@pytest.mark.mlx
def test_mlx_server_decodes_on_its_worker_thread(mlx_models):
    pytest.importorskip("uvicorn")
    import httpx
    from test_server import _serve

    from specdec.verifiers.mlx import MLXVerifier

    v = MLXVerifier(mlx_models["llama"], dtype="bfloat16")
    want = (
        StreamingEngine(MLXVerifier(mlx_models["llama"], dtype="bfloat16")).complete(MSGS, max_tokens=8).text
    )
    for s in _serve(StreamingEngine(v), model_name="m"):
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 8}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want


@pytest.mark.mlx
def test_quantized_scales_are_not_recast_unless_asked(mlx_models):
    import mlx.core as mx

    from specdec.verifiers.mlx import MLXVerifier

    stored = MLXVerifier(mlx_models["q4"]).model.model.layers[0].self_attn.q_proj.scales.dtype
    kept = MLXVerifier(mlx_models["q4"], dtype="bfloat16").model.model.layers[0].self_attn.q_proj
    recast = MLXVerifier(mlx_models["q4"], dtype="bfloat16", recast_quantized=True).model.model.layers[0]
    assert kept.scales.dtype == stored and recast.self_attn.q_proj.scales.dtype == mx.bfloat16


# ---- the strict-device mode ---------------------------------------------------------------------------


def test_the_strict_mode_catches_what_mps_refuses():
    with StrictDevice(), pytest.raises(StrictDeviceError, match="float64"):
        torch.rand(3, dtype=torch.float64)
    with StrictDevice(), pytest.raises(StrictDeviceError, match="mixes devices"):
        torch.ones(2, device="meta") + torch.ones(2)
    q = torch.ones(1, 2, 4, 8, device="meta").transpose(2, 3)
    with StrictDevice(), pytest.raises(StrictDeviceError, match="non-contiguous"):
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    with StrictDevice():
        assert (
            torch.ones(2, device="meta") * torch.tensor(2.0)
        ).device.type == "meta"  # a CPU scalar is fine


def _meta_drafter(head_dim: int = 64) -> DFlashDrafter:
    """A DFlash drafter on the meta device, bound to the stub's embedding / head moved there: any CPU tensor
    made inside its ops is a mixed-device op under StrictDevice."""
    cfg = DFlashConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        intermediate_size=32, vocab_size=259, num_target_layers=4, mask_token_id=258, block_size=8,
        target_layer_ids=(1, 2), draft_vocab=tuple(range(100)),
    )  # fmt: skip
    d = DFlashDrafter(DFlashDraftModel(cfg).to("meta"))
    d.bind(StubVerifier())
    return d


def test_drafter_extend_and_blocks_stay_on_their_device():
    d = _meta_drafter()
    with StrictDevice():
        d.extend(torch.randn(20, 128).to("meta"), list(range(20)))  # features as the bridge hands them
        d.extend(torch.randn(3, 128).to("meta"), [1, 2, 3])
        assert d.block_logits(5, 7).shape == (7, 100)
        assert d.vocab_logits(5, 7).shape == (7, 259)
        d.rollback(2)
        d.block_logits(9, 3)


@pytest.mark.parametrize("rule", ["match", "rejection"])
def test_sampler_math_stays_on_the_logits_device(rule):
    s = Sampler(SamplingParams(temperature=0.8, top_p=0.9, seed=3, rule=rule), 64)
    logits = torch.randn(5, 259).to("meta")
    with StrictDevice():
        p = warp(logits, s.sp)
        sample_from(p, s.u(0, 10, 5, p))  # float32 uniforms moved to the logits' device
        assert s.u(1, 10, 4, p).device.type == "meta" and s.u(1, 10, 4, p).dtype == torch.float32


@pytest.mark.mlx
def test_bridge_features_move_to_the_drafter_device():
    pytest.importorskip("mlx")
    import mlx.core as mx

    from specdec.bridges.mlx import to_torch

    x = mx.arange(24, dtype=mx.float32).reshape(4, 6)
    with StrictDevice():
        t = to_torch(x[1:3], device="meta", dtype=torch.float32)
    assert t.device.type == "meta" and t.shape == (2, 6)


# ---- guards and the Metal bridge decision ---------------------------------------------------------------


def test_bf16_on_mps_needs_macos_14(monkeypatch):
    import platform

    from specdec.api import check_device_dtype

    monkeypatch.setattr(platform, "mac_ver", lambda: ("13.6.1", ("", "", ""), "arm64"))
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)  # a Mac's GPU, which we lack
    with pytest.raises(ValueError, match="macOS 14"):
        check_device_dtype("mps", torch.bfloat16)
    check_device_dtype("mps", torch.float16)
    monkeypatch.setattr(platform, "mac_ver", lambda: ("14.2", ("", "", ""), "arm64"))
    check_device_dtype("mps", torch.bfloat16)


@pytest.mark.mlx
@pytest.mark.parametrize(("kind", "target", "dlpack_ok", "path"), [
    (8, "mps", True, "dlpack"),  # Metal export, torch imports it onto MPS: no host round trip
    (8, "mps", False, "buffer"),  # an older torch: the buffer protocol
    (8, "cpu", True, "buffer"),  # a CPU drafter on a Mac reads unified memory through the buffer
    (1, "cpu", False, "dlpack"),  # the CPU build
])  # fmt: skip
def test_metal_dlpack_is_used_only_where_it_works(monkeypatch, kind, target, dlpack_ok, path):
    pytest.importorskip("mlx")
    import mlx.core as mx

    import specdec.bridges.mlx as bridge

    used = []
    real_dlpack, real_buffer = torch.from_dlpack, bridge._via_buffer
    monkeypatch.setattr(bridge, "_dlpack_kind", lambda x: kind)
    monkeypatch.setattr(bridge, "metal_dlpack_ok", lambda: dlpack_ok)
    monkeypatch.setattr(torch, "from_dlpack", lambda x: used.append("dlpack") or real_dlpack(x))
    monkeypatch.setattr(bridge, "_via_buffer", lambda x: used.append("buffer") or real_buffer(x))
    x = mx.arange(6, dtype=mx.float32)
    mx.eval(x)
    assert torch.equal(bridge._import(x, target), torch.arange(6, dtype=torch.float32)) and used == [path]


def test_metal_dlpack_is_off_without_mps():
    pytest.importorskip("mlx")
    from specdec.bridges.mlx import metal_dlpack_ok

    if not torch.backends.mps.is_available():
        assert metal_dlpack_ok() is False


# ---- hub drafters --------------------------------------------------------------------------------------


def _hub_cache(root: Path, repo: str, folder: Path) -> Path:
    """A Hugging Face hub cache holding `folder`'s files as the latest snapshot of `repo` (the layout
    huggingface_hub writes: refs/main -> a revision, snapshots/<revision>/<files>)."""
    import shutil

    rev = "0123456789abcdef0123456789abcdef01234567"
    snap = root / f"models--{repo.replace('/', '--')}" / "snapshots" / rev
    snap.mkdir(parents=True)
    for f in folder.iterdir():
        shutil.copy(f, snap / f.name)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text(rev)
    return root


def test_hub_drafter_loads_from_the_cache_offline(tmp_path):
    import os
    import subprocess
    import sys

    pytest.importorskip("huggingface_hub")
    from test_hardening import _stub_drafter_folder

    cache = _hub_cache(tmp_path / "hub", "z-lab/tiny-dflash", _stub_drafter_folder(tmp_path / "d"))
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    code = (
        "from specdec.api import load_drafter, load_verifier; "
        "d = load_drafter('z-lab/tiny-dflash', verifier=load_verifier('stub')); print(d.block_size, d.path)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[0] == "4" and "models--z-lab--tiny-dflash" in out.stdout
    missing = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "generate", "--drafter", "z-lab/not-cached", "--prompt", "hi"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert missing.returncode == 2 and "not found in the local Hugging Face cache" in missing.stderr


def test_bench_verify_writes_a_cost_table(tmp_path, capsys):
    import json

    from specdec.cli import main

    out = tmp_path / "costs.json"
    argv = ["bench-verify", "--verifier", "stub", "--contexts", "16,64", "--sizes", "1,4", "--reps", "2"]
    assert main([*argv, "--out", str(out)]) == 0
    table = json.loads(out.read_text())
    assert set(table["seconds"]) == {"16", "64"} and set(table["seconds"]["16"]) == {"1", "4"}
    assert table["relative"]["64"]["1"] == 1.0 and table["seconds"]["64"]["4"] > 0
    assert "context 64" in capsys.readouterr().out
