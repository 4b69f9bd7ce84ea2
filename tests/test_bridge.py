"""mx.array <-> torch conversion, and embed_fn / lm_head_fn rebuilt in torch from MLX weights."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core")
nn = pytest.importorskip("mlx.nn")
pytest.importorskip("mlx_lm")

from specdec.bridges.mlx import (  # noqa: E402
    _via_buffer,
    embed_scale,
    final_softcap,
    make_embed_fn,
    make_lm_head_fn,
    text_model,
    to_mlx,
    to_torch,
)

pytestmark = pytest.mark.mlx

DTYPES = [(mx.float32, torch.float32), (mx.bfloat16, torch.bfloat16), (mx.float16, torch.float16)]


def test_import_specdec_does_not_import_mlx():
    code = "import sys, specdec, specdec.engine, specdec.verifiers.stub; assert 'mlx' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- to_torch / to_mlx ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("mdt", "tdt"), DTYPES)
def test_round_trip(mdt, tdt):
    x = (mx.arange(24, dtype=mx.float32).reshape(2, 3, 4) / 7).astype(mdt)  # lazy: to_torch evaluates it
    t = to_torch(x, device="cpu")
    assert t.dtype == tdt and t.shape == (2, 3, 4)
    back = to_mlx(t)
    assert back.dtype == mdt and mx.array_equal(back, x).item()
    expect = (torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) / 7).to(tdt)
    assert torch.equal(t, expect)


@pytest.mark.parametrize(("mdt", "tdt"), DTYPES)
@pytest.mark.parametrize("route", ["dlpack", "buffer"])
def test_zero_copy(mdt, tdt, route):
    """Same memory: a write through torch is seen by MLX (no copy was made)."""
    x = mx.zeros((4, 8), dtype=mdt)
    mx.eval(x)
    t = to_torch(x, device="cpu") if route == "dlpack" else _via_buffer(x)
    assert t.dtype == tdt
    t[1, 2] = 5.0
    assert x[1, 2].item() == 5.0


def test_dtype_change_copies():
    x = mx.zeros((4, 8), dtype=mx.bfloat16)
    t = to_torch(x, device="cpu", dtype=torch.float32)
    t[0, 0] = 1.0
    assert t.dtype == torch.float32 and x[0, 0].item() == 0.0


@pytest.mark.parametrize(
    "take",
    [
        lambda a: a[:, 1:3],  # column slice: strided rows
        lambda a: a[1:],  # row slice: offset into the buffer
        lambda a: a.T,  # transposed
        lambda a: a[::2, ::-1],  # step and reversal: negative strides (torch aborts on them via DLPack)
        lambda a: (a * 2)[:, 2],  # a lazy op, then a strided column
    ],
)
def test_non_contiguous_slices(take):
    base = mx.arange(48, dtype=mx.float32).reshape(6, 8)
    expect = torch.from_numpy(take(np.arange(48, dtype=np.float32).reshape(6, 8)).copy())
    t = to_torch(take(base), device="cpu")
    assert torch.equal(t, expect) and t.is_contiguous()


def test_row_slice_shares_memory():
    base = mx.zeros((6, 8), dtype=mx.float32)
    mx.eval(base)
    t = to_torch(base[2:4], device="cpu")  # [2, 8]: rows of a row-major array, a view
    t[0, 0] = 3.0
    assert base[2, 0].item() == 3.0


def test_to_mlx_copies_and_keeps_ids():
    ids = torch.tensor([[1, 2, 3]], dtype=torch.int64)
    a = to_mlx(ids)
    ids[0, 0] = 9
    assert a.dtype == mx.int64 and a.tolist() == [[1, 2, 3]]
    strided = torch.arange(12.0).reshape(3, 4)[:, 1::2]
    assert to_mlx(strided).tolist() == strided.tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_to_cuda():
    x = mx.arange(10, dtype=mx.float32)
    t = to_torch(x, device="cuda", dtype=torch.bfloat16)
    assert t.device.type == "cuda" and t.dtype == torch.bfloat16
    assert torch.equal(t.cpu().float(), torch.arange(10, dtype=torch.float32))


# ---- embed_fn / lm_head_fn ------------------------------------------------------------------------------


class _Inputs:
    """Records the input of layer 0 (the scaled embedding) and the output of the last layer (raw)."""

    def __init__(self, model):
        self.model, self.seen = model, {}

    def __enter__(self):
        layers = self.model.layers
        self.saved = (layers[0], layers[-1])
        first, last = self.saved

        def rec_first(x, *a, **k):
            self.seen["embedded"] = x
            return first(x, *a, **k)

        def rec_last(*a, **k):
            out = last(*a, **k)
            self.seen["last"] = out[0] if isinstance(out, tuple) else out
            return out

        layers[0], layers[-1] = _Wrap(first, rec_first), _Wrap(last, rec_last)
        return self.seen

    def __exit__(self, *exc):
        self.model.layers[0], self.model.layers[-1] = self.saved


class _Wrap:
    def __init__(self, layer, fn):
        self.layer, self.fn = layer, fn

    def __getattr__(self, name):
        return getattr(self.layer, name)

    def __call__(self, *a, **k):
        return self.fn(*a, **k)


def _llama(path: Path, tie: bool):
    import tinymodels
    from mlx_lm.utils import load_model

    return load_model(tinymodels.tiny_llama(path, tie=tie))[0]


def _gemma3(path: Path):
    import tinymodels
    from mlx_lm.utils import load_model

    return load_model(tinymodels.tiny_gemma3(path))[0]


def _gemma2():
    from mlx_lm.models import gemma2

    mx.random.seed(0)
    args = gemma2.ModelArgs(model_type="gemma2", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                            num_attention_heads=4, head_dim=16, rms_norm_eps=1e-6, vocab_size=320,
                            num_key_value_heads=2, final_logit_softcapping=2.0)  # fmt: skip
    model = gemma2.Model(args)
    # larger embeddings so logits reach the soft cap's non-linear range
    model.model.embed_tokens.weight = model.model.embed_tokens.weight * 20
    return model


def _quantized(path: Path):
    from mlx_lm.utils import quantize_model

    model = _llama(path, tie=False)
    return quantize_model(model, {}, group_size=32, bits=4)[0]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("bridge_models")
    return {
        "llama-untied": _llama(root / "lu", tie=False),
        "llama-tied": _llama(root / "lt", tie=True),
        "gemma3": _gemma3(root / "g3"),
        "gemma2-softcap": _gemma2(),
        "llama-q4": _quantized(root / "lq"),
    }


@pytest.mark.parametrize("name", ["llama-untied", "llama-tied", "gemma3", "gemma2-softcap", "llama-q4"])
def test_embed_and_head_reproduce_the_model(models, name):
    model = models[name]
    ids = [(5 * i) % 300 + 7 for i in range(12)]
    with _Inputs(model) as seen:
        logits = model(mx.array(ids)[None])[0]  # [T, V]
    normed = text_model(model).model.norm(seen["last"])[0]  # [T, H]: the final norm is not in lm_head_fn
    kw = dict(device="cpu", dtype=torch.float32)
    emb = make_embed_fn(model, **kw)(torch.tensor(ids))  # [T, H]
    head = make_lm_head_fn(model, **kw)(to_torch(normed, **kw))  # [T, V]
    # the embedding is a gather times the model's own scale: bit-exact in fp32
    assert torch.equal(emb, to_torch(seen["embedded"][0], **kw))
    torch.testing.assert_close(head, to_torch(logits, **kw), atol=2e-5, rtol=1e-5)
    # bf16 callables stay near the fp32 model (loose: bf16 has 8 mantissa bits, the soft cap amplifies)
    kw16 = dict(device="cpu", dtype=torch.bfloat16)
    head16 = make_lm_head_fn(model, **kw16)(to_torch(normed, **kw16))
    torch.testing.assert_close(head16.float(), head, atol=0.15 * float(head.abs().max()), rtol=0.05)


def test_scale_and_cap_conventions(models):
    assert embed_scale(models["gemma3"]) == 8.0  # sqrt(64), exact in bf16
    assert embed_scale(models["llama-tied"]) is None and final_softcap(models["llama-tied"]) is None
    # mlx_lm gemma3_text ignores final_logit_softcapping (tinymodels sets 30.0); we match the MLX model
    assert final_softcap(models["gemma3"]) is None
    assert final_softcap(models["gemma2-softcap"]) == 2.0


def test_gemma3_embed_scale_rounds_like_mlx_lm():
    """hidden 640 (Gemma-3-270M): mlx_lm multiplies by sqrt(640) rounded to bf16, 25.25, not 25.298."""
    from mlx_lm.models import gemma3_text

    args = gemma3_text.ModelArgs(
        model_type="gemma3_text", hidden_size=640, num_hidden_layers=1, intermediate_size=8,
        num_attention_heads=1, head_dim=8, vocab_size=8, sliding_window_pattern=1,
    )  # fmt: skip
    assert embed_scale(gemma3_text.Model(args)) == 25.25


def test_unsupported_architecture_refused():
    from mlx_lm.models import mamba

    args = mamba.ModelArgs(
        model_type="mamba", vocab_size=64, hidden_size=16, intermediate_size=32, state_size=4,
        num_hidden_layers=1, conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=2,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"'mamba' has no `model\.embed_tokens`"):
        make_embed_fn(mamba.Model(args), device="cpu", dtype=torch.float32)
