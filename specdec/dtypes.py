"""Which dtype and device a run uses: names to torch dtypes, the "auto" choice before a model loads, and
whether this torch can use a device / dtype pair at all. Imports torch only."""

from __future__ import annotations

import torch

__all__ = ["check_device_dtype", "resolve_dtype", "torch_dtype"]

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def resolve_dtype(name: str, runtime: str, device: str = "cpu") -> tuple[str, str]:
    """("float32" | "bfloat16" | ..., why) for a dtype name, before the model loads; "auto" picks bf16 for a
    torch verifier on a CPU with AMX or avx512_bf16 (native bf16 matmuls: faster end to end, see
    docs/dtype.md), fp32 everywhere else. Whether bf16 is also exact is a property of the loaded model:
    `load_verifier_auto` checks it and falls back to fp32."""
    if name != "auto":
        torch_dtype(name)
        return name, "asked for"
    if runtime not in ("hf", "stub") or torch.device(device).type != "cpu":
        return (
            "float32",
            f"{runtime} on {device}: the exact dtype everywhere (no batch-invariant bf16 verify here)",
        )
    units = [
        n
        for n, has in (
            ("AMX", torch.cpu._is_amx_tile_supported()),
            ("avx512_bf16", torch.cpu._is_avx512_bf16_supported()),
        )
        if has
    ]
    if not units:
        return (
            "float32",
            "this CPU has neither AMX nor avx512_bf16: bf16 matmuls are emulated, slower than fp32",
        )
    return "bfloat16", (
        f"this CPU has {' and '.join(units)} (native bf16 matmuls; measured on an avx512_bf16 EPYC, bf16 "
        "decodes 1.05-1.42x faster than fp32: docs/dtype.md)"
    )


def check_device_dtype(device: str | torch.device, dtype: torch.dtype | None = None) -> None:
    """ValueError for a device this torch cannot use (a CUDA device without CUDA, MPS off a Mac, a name
    torch does not know) or a device / dtype pair the platform cannot run (bf16 on MPS needs macOS 14)."""
    import platform

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r}: {e}") from None
    usable = {
        "cpu": lambda: True,
        "cuda": lambda: torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count(),
        "mps": lambda: torch.backends.mps.is_available(),
    }
    if dev.type not in usable:
        raise ValueError(f"device {device!r}: specdec runs on cpu, cuda or mps")
    if not usable[dev.type]():
        build = f"torch {torch.__version__}" + (
            "" if torch.version.cuda or dev.type != "cuda" else ", no CUDA build"
        )
        raise ValueError(f"device {device!r} is not available here ({build}); use --device cpu")
    if dev.type == "mps" and dtype == torch.bfloat16:
        version = platform.mac_ver()[0]
        if version and int(version.split(".")[0]) < 14:
            raise ValueError(
                f"bfloat16 on MPS needs macOS 14 or later (this is macOS {version}); use --dtype float16 or "
                "float32 for the drafter"
            )
