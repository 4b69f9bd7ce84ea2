"""oneDNN linears (`specdec.kernels`) and the verifier's masked GQA attention against the defaults."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec.kernels import PACKED_ROWS, CPULinear, linear_fn, onednn_usable, packed_weight, use_cpu_linears

needs_onednn = pytest.mark.skipif(not onednn_usable("cpu", torch.float32), reason="no oneDNN linear")


def test_usable_only_for_float32_and_bfloat16_on_cpu():
    assert not onednn_usable("cpu", torch.float16)
    assert not onednn_usable("meta", torch.float32)
    assert linear_fn("meta", torch.bfloat16) is F.linear
    assert linear_fn("cpu", torch.float16) is not F.linear  # one-row products paired


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_rows_do_not_depend_on_the_call(dtype):
    """A lone half precision row takes a GEMV kernel that rounds unlike the same row in a larger call
    (measured on an avx512_bf16 EPYC at K = 1536: up to 0.0078 apart); `linear_fn` computes it as two."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(576, 1536, generator=g).to(dtype), torch.randn(16, 1536, generator=g).to(dtype)
    fast = linear_fn("cpu", dtype)
    with torch.inference_mode():
        full = fast(x, w)
        assert torch.equal(torch.cat([fast(x[i : i + 1], w) for i in range(16)]), full)
        assert torch.equal(torch.cat([fast(x[i : i + 1][None], w)[0] for i in range(16)]), full)  # [1, 1, K]
        torch.testing.assert_close(full.float(), F.linear(x.float(), w.float()), atol=0.5, rtol=2e-2)


@needs_onednn
@pytest.mark.parametrize(
    "shape", [(1, 64), (2, 64), (7, 64), (1, 5, 64), (2, 3, 64), (9, 64), (3, 4, 64), (PACKED_ROWS + 6, 64)]
)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_fn_matches_f_linear(shape, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g)
    w = torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    fast = linear_fn("cpu", torch.float32)
    assert fast is not F.linear
    part = torch.randn(1, 9, 64, generator=g)[:, 2:8]  # a non-contiguous slice of 6 rows
    with torch.inference_mode():
        got, strided = fast(x, w, b), fast(part, w, b)
    assert got.shape == (*shape[:-1], 96)
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(strided, F.linear(part, w, b), atol=1e-4, rtol=1e-5)


@needs_onednn
def test_packed_weight_follows_changes_to_the_weight():
    g = torch.Generator().manual_seed(0)
    lin = CPULinear(64, 32)
    x = torch.randn(3, 64, generator=g)
    assert PACKED_ROWS >= 3  # the packed path
    with torch.inference_mode():
        first = packed_weight(lin.weight)
        assert packed_weight(lin.weight) is first  # packed once, then reused
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        lin.weight.mul_(2)  # in place: the version moves
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
    lin.weight.data = torch.randn(32, 64, generator=g)  # new data under the same Parameter (Module.to)
    with torch.inference_mode():
        assert packed_weight(lin.weight) is not first
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)


@needs_onednn
def test_use_cpu_linears_keeps_parameters_and_training():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16, bias=False))
    net[2].weight = torch.nn.Parameter(net[0].weight.t().clone())  # [16, 32]
    ref = [p.detach().clone() for p in net.parameters()]
    keys = list(net.state_dict())
    x = torch.randn(4, 16)
    with torch.no_grad():
        before = net(x)
    assert use_cpu_linears(net) == 2
    assert all(type(m) is CPULinear for m in (net[0], net[2]))
    assert list(net.state_dict()) == keys
    assert all(torch.equal(a, b) for a, b in zip(ref, net.parameters()))
    with torch.no_grad():
        torch.testing.assert_close(net(x), before, atol=1e-5, rtol=1e-5)
    loss = net(x).square().sum()  # the default kernel runs when gradients are needed
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in net.parameters())
    assert use_cpu_linears(net) == 0  # already switched


def test_masked_gqa_attention_is_bit_identical():
    pytest.importorskip("transformers")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from specdec.verifiers.hf_parts import sdpa_gqa

    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    g = torch.Generator().manual_seed(0)
    T, S = 8, 40
    q = torch.randn(1, 6, T, 16, generator=g)
    k, v = (torch.randn(1, 2, S, 16, generator=g) for _ in range(2))
    mask = torch.ones(T, S, dtype=torch.bool).tril(S - T)[None, None]  # [1, 1, T, S] causal over the cache
    mask[..., :5] = False  # a sliding window, say
    got, _ = sdpa_gqa(module, q, k, v, mask, scaling=0.25)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    assert got.shape == want.shape == (1, T, 6, 16)
    assert torch.equal(got, want)
