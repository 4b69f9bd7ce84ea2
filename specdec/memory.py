"""Peak-memory probes, one per runtime and device, read around each drafter and verifier call.

Contract: `probe.reset()` before the call, `probe.read()` after it; `read` returns a `MemoryRecord`
`{"bytes": int | None, "source": str, "kind": str}` (plus optional extra fields) where

- `source` names the API the number came from (`"torch.cuda.max_memory_allocated"`, `"linux:VmHWM"`, ...)
  or is `"unmeasured"`;
- `kind` says what the number means:
  `"peak"`                     peak of the runtime's allocator since `reset` (torch CUDA, MLX);
  `"process_peak"`             peak resident set of the whole process since `reset` (Linux CPU);
  `"process_peak_since_start"` peak resident set of the process since it started, as it could not be reset
                               (macOS CPU, or Linux without a writable /proc/self/clear_refs);
  `"current_after"`            memory held right after the call, not a peak (torch MPS has no peak counter:
                               torch's own allocations; the process-wide Metal driver total beside it);
  `"unmeasured"`               no honest reading: `bytes` is None and a `"reason"` field says why.

`bytes` is never a placeholder 0: an API that answers 0 (as `torch.cuda.max_memory_allocated` does without
CUDA) gives an unmeasured record instead. Failures of the underlying API on read (torch MPS) are tolerated and
reported as unmeasured; they never raise. `reset`/`read` run around every decode step, so they stay cheap: no
subprocesses, one open/read of /proc/self/status, and the clear_refs decision is made once per probe.

Device-specific functions are looked up at call time (`torch.cuda.max_memory_allocated`, `mx.get_peak_memory`,
...) so tests can substitute them. Importing this module never imports mlx.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import ModuleType

import torch

from specdec.protocols import MemoryProbe, MemoryRecord

__all__ = [
    "CudaProbe",
    "LinuxProcessProbe",
    "MacProcessProbe",
    "MlxProbe",
    "MpsProbe",
    "UnmeasuredProbe",
    "max_record",
    "mlx_probe",
    "probe_for_device",
    "probe_for_module",
    "unmeasured",
]


def unmeasured(reason: str) -> MemoryRecord:
    """A record for a platform or call that offers no honest reading (`bytes` None, never 0)."""
    return {"bytes": None, "source": "unmeasured", "kind": "unmeasured", "reason": reason}


def _platform() -> str:
    """`sys.platform`, behind a function so tests can pretend to be another OS."""
    return sys.platform


@dataclass
class UnmeasuredProbe:
    """Reads nothing; every read says why."""

    reason: str

    def reset(self) -> None:
        pass

    def read(self) -> MemoryRecord:
        return unmeasured(self.reason)


@dataclass
class CudaProbe:
    """torch caching-allocator peak on one CUDA device (tensors only: not the CUDA context or cuBLAS)."""

    index: int

    def reset(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.index)

    def read(self) -> MemoryRecord:
        n = int(torch.cuda.max_memory_allocated(self.index))
        if n <= 0:  # what it answers when CUDA was never initialised on this device
            return unmeasured(f"torch.cuda.max_memory_allocated({self.index}) returned {n}")
        return {"bytes": n, "source": "torch.cuda.max_memory_allocated", "kind": "peak"}


@dataclass
class MpsProbe:
    """torch MPS has no peak counter: torch's own MPS allocations right after the call ("current_after",
    `torch.mps.current_allocated_memory`). The Metal driver's total is process-wide (MLX allocates from the
    same device, so it holds the verifier's weights and cache too): reported beside it, labelled so."""

    def reset(self) -> None:
        pass  # nothing to reset

    def read(self) -> MemoryRecord:
        try:
            current = int(torch.mps.current_allocated_memory())
            driver = int(torch.mps.driver_allocated_memory())
        except Exception as e:  # e.g. "Cannot execute getDriverAllocatedMemory() without MPS backend."
            return unmeasured(f"torch.mps memory query failed: {type(e).__name__}: {e}")
        if current <= 0:
            return unmeasured(f"torch.mps.current_allocated_memory() returned {current}")
        return {
            "bytes": current,
            "source": "torch.mps.current_allocated_memory",
            "kind": "current_after",
            "process_driver_bytes": driver if driver > 0 else None,  # whole process, MLX included
        }


@dataclass
class MlxProbe:
    """MLX allocator peak since reset (Metal, CUDA or CPU build)."""

    mx: ModuleType = field(repr=False)
    _active_at_reset: int = field(default=0, repr=False)

    def reset(self) -> None:
        self.mx.reset_peak_memory()
        # reset_peak_memory sets the peak to 0, not to what is held now; keep that so a call that allocates
        # nothing still reads the memory it held
        self._active_at_reset = int(self.mx.get_active_memory())

    def read(self) -> MemoryRecord:
        n = max(int(self.mx.get_peak_memory()), int(self.mx.get_active_memory()), self._active_at_reset)
        if n <= 0:
            return unmeasured("mlx reports no memory held or allocated since reset")
        return {"bytes": n, "source": "mlx.get_peak_memory", "kind": "peak"}


@dataclass
class LinuxProcessProbe:
    """Process resident-set peak (VmHWM), reset by writing "5" to /proc/self/clear_refs."""

    status_path: str = "/proc/self/status"
    clear_refs_path: str = "/proc/self/clear_refs"
    _can_reset: bool | None = field(default=None, repr=False)  # decided on the first reset
    _was_reset: bool = field(default=False, repr=False)

    def reset(self) -> None:
        if self._can_reset is False:
            return
        try:
            fd = os.open(self.clear_refs_path, os.O_WRONLY)
            try:
                os.write(fd, b"5")
            finally:
                os.close(fd)
        except OSError:
            self._can_reset = False
            self._was_reset = False
            return
        self._can_reset = True
        self._was_reset = True

    def read(self) -> MemoryRecord:
        try:
            with open(self.status_path, "rb") as f:
                status = f.read()
        except OSError as e:
            return unmeasured(f"cannot read {self.status_path}: {e}")
        i = status.find(b"VmHWM:")
        if i < 0:
            return unmeasured(f"no VmHWM line in {self.status_path}")
        end = status.find(b"\n", i)
        fields = status[i + 6 : end if end >= 0 else len(status)].split()  # [b"123456", b"kB"]
        try:
            n = int(fields[0]) * (1024 if fields[1:2] == [b"kB"] else 1)
        except (IndexError, ValueError):
            return unmeasured(f"unparsable VmHWM line in {self.status_path}: {fields!r}")
        if n <= 0:
            return unmeasured(f"VmHWM in {self.status_path} is {n}")
        kind = "process_peak" if self._was_reset else "process_peak_since_start"
        return {"bytes": n, "source": "linux:VmHWM", "kind": kind}


@dataclass
class MacProcessProbe:
    """Process resident-set peak since start (ru_maxrss, in bytes on macOS); it cannot be reset."""

    def reset(self) -> None:
        pass  # not resettable

    def read(self) -> MemoryRecord:
        import resource  # Unix-only; cached in sys.modules after the first read

        n = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        if n <= 0:
            return unmeasured(f"getrusage ru_maxrss returned {n}")
        return {"bytes": n, "source": "getrusage:ru_maxrss", "kind": "process_peak_since_start"}


def probe_for_device(device: torch.device | str) -> MemoryProbe:
    """The probe for torch work on `device` (cuda[:i], mps, cpu); unmeasured for anything else."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return UnmeasuredProbe(f"device {dev} requested but torch.cuda.is_available() is False")
        return CudaProbe(dev.index if dev.index is not None else torch.cuda.current_device())
    if dev.type == "mps":
        return MpsProbe()
    if dev.type == "cpu":
        plat = _platform()
        if plat.startswith("linux"):
            return LinuxProcessProbe()
        if plat == "darwin":
            return MacProcessProbe()
        return UnmeasuredProbe(f"no process-peak reader for CPU on platform {plat!r}")
    return UnmeasuredProbe(f"no memory probe for device type {dev.type!r}")


def probe_for_module(module: torch.nn.Module) -> MemoryProbe:
    """The probe for the device holding `module`'s first parameter."""
    p = next(module.parameters(), None)
    if p is None:
        raise ValueError(
            f"cannot choose a memory probe for {type(module).__name__}: it has no parameters to take a "
            "device from; use probe_for_device(device) instead"
        )
    return probe_for_device(p.device)


def mlx_probe() -> MemoryProbe:
    """The probe for MLX work (imports mlx here, not at module import)."""
    try:
        import mlx.core as mx
    except ImportError as e:
        raise ImportError(f"mlx_probe needs mlx ({e}); install specdec[mlx] (mlx[cpu] on Linux)") from e
    return MlxProbe(mx)


def max_record(records: Iterable[MemoryRecord | None]) -> MemoryRecord | None:
    """The record with the largest `bytes`, for run summaries.

    None entries are skipped; if no record is given at all, None. If records exist but none has bytes, an
    unmeasured record whose reason joins their distinct reasons.
    """
    best: MemoryRecord | None = None
    reasons: list[str] = []
    seen = False
    for rec in records:
        if rec is None:
            continue
        seen = True
        n = rec.get("bytes")
        if n is None:
            reason = str(rec.get("reason") or f"no bytes from {rec.get('source', '?')}")
            if reason not in reasons:
                reasons.append(reason)
            continue
        if best is None or n > best["bytes"]:
            best = rec
    if best is not None:
        return dict(best)
    if not seen:
        return None
    return unmeasured("; ".join(reasons))
