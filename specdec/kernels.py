"""oneDNN linears for decoding on x86 CPUs: a verify of a few tokens at close to the cost of one.

PyTorch's default CPU `F.linear` (MKL sgemm) runs a one-row product near memory speed, but a product of
2-16 rows, which is what a speculative verify and a drafter block are, at about half that speed: it
repacks the weight on every call. oneDNN's matmul (`torch.ops.mkldnn._linear_pointwise`, the op
Inductor emits for CPU linears) streams the weight once. Measured on the 2-core x86 CI machine,
SmolLM2-135M fp32 at a 400-token context, the HF verifier with these linears and its copy-free GQA
attention against the model as loaded, interleaved in one process: one verify of 1 token 59 -> 54 ms,
of 8 tokens 110 -> 85 ms; the drafter's [7, 8192] read-out alone 3.5 -> 1.7 ms. Results agree with
`F.linear` to float rounding.

Used for inference only (`torch.no_grad` / `inference_mode`, float32 on an x86-64 CPU: the only place
it was measured); anything else, or a build without the op, takes `F.linear`.
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F

__all__ = ["OneDNNLinear", "linear_fn", "onednn_usable", "use_onednn"]

LinearFn = Callable[..., torch.Tensor]


@cache
def _op_works() -> bool:
    """The op exists in this build and agrees with F.linear (checked once per process)."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not torch.backends.mkldnn.is_available():
        return False
    try:
        op = torch.ops.mkldnn._linear_pointwise
        g = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(s, generator=g) for s in ((3, 64), (40, 64), (40,)))
        with torch.inference_mode():
            return bool(torch.allclose(op(x, w, b, "none", [], ""), F.linear(x, w, b), atol=1e-4))
    except (AttributeError, RuntimeError):
        return False


def onednn_usable(device: torch.device | str, dtype: torch.dtype) -> bool:
    """oneDNN linears apply: float32 on an x86-64 CPU, in a build that has a working op."""
    return torch.device(device).type == "cpu" and dtype == torch.float32 and _op_works()


def _onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return F.linear(x, w, b)  # the op has no backward: training keeps the default kernel
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def linear_fn(device: torch.device | str, dtype: torch.dtype) -> LinearFn:
    """`F.linear` or its oneDNN twin, whichever is faster for small batches on `device` / `dtype`."""
    return _onednn_linear if onednn_usable(device, dtype) else F.linear


class OneDNNLinear(torch.nn.Linear):
    """`nn.Linear` whose inference forward is oneDNN's matmul (same parameters, same state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _onednn_linear(x, self.weight, self.bias)


def use_onednn(module: torch.nn.Module) -> int:
    """Switch every plain `nn.Linear` in `module` (float32, CPU) to `OneDNNLinear` in place; how many.

    The parameters stay the same objects, so tied weights stay tied and training still works (the
    default kernel runs whenever gradients are needed)."""
    n = 0
    for m in module.modules():
        if type(m) is torch.nn.Linear and onednn_usable(m.weight.device, m.weight.dtype):
            m.__class__ = OneDNNLinear
            n += 1
    return n
