"""A strict-device test mode: what an accelerator (MPS above all) refuses or gets wrong, caught on a CPU.

`StrictDevice()` is a `TorchFunctionMode` that fails on
- an op whose tensor arguments sit on more than one device (0-dim CPU scalars aside, which torch allows),
- a float64 result (MPS has no float64),
- `scaled_dot_product_attention` with non-contiguous q / k / v on an accelerator (MPS SDPA has returned
  wrong values for strided inputs with head_dim >= 64: pytorch #181133, #163597).
Run the drafter on the `meta` device to stand in for a non-CPU one: its ops run (shapes only), and any CPU
tensor that slips into them is a mixed-device op.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten


class StrictDeviceError(AssertionError):
    pass


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


class StrictDevice(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ts = _tensors((args, kwargs))
        devices = {t.device for t in ts if not (t.dim() == 0 and t.device.type == "cpu")}
        if len(devices) > 1:
            raise StrictDeviceError(
                f"{getattr(func, '__name__', func)} mixes devices {sorted(map(str, devices))}"
            )
        if func is F.scaled_dot_product_attention:
            qkv = args[:3]
            if any(t.device.type != "cpu" and not t.is_contiguous() for t in qkv):
                raise StrictDeviceError(
                    "scaled_dot_product_attention got non-contiguous q/k/v on an accelerator"
                )
        out = func(*args, **kwargs)
        for t in _tensors(out):
            if t.dtype == torch.float64:
                raise StrictDeviceError(f"{getattr(func, '__name__', func)} made a float64 tensor")
        return out
