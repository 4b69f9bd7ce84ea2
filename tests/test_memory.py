"""Memory probes: real readings where this machine has them (Linux CPU, MLX-cpu), monkeypatched otherwise."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest
import torch

from specdec import memory
from specdec.memory import (
    CudaProbe,
    LinuxProcessProbe,
    MacProcessProbe,
    MlxProbe,
    MpsProbe,
    UnmeasuredProbe,
    max_record,
    mlx_probe,
    probe_for_device,
    probe_for_module,
    unmeasured,
)

MB = 1 << 20
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc (Linux)")


def _assert_unmeasured(rec, *words):
    assert rec["bytes"] is None
    assert rec["source"] == "unmeasured"
    assert rec["kind"] == "unmeasured"
    assert isinstance(rec["reason"], str) and rec["reason"]
    for w in words:
        assert w in rec["reason"]


# ---- Linux CPU: VmHWM, real -------------------------------------------------------------------------------


# Run in a fresh interpreter: in a full test run the process's resident set carries earlier tests' models,
# threads and file-backed pages, and twice (gc held off the second time) a 200 MB allocation left VmHWM at
# exactly the value read at the reset. A new process measures only what the test itself allocates.
_PEAK_SCRIPT = """
import json, torch
from specdec.memory import LinuxProcessProbe
MB = 1 << 20
probe = LinuxProcessProbe()
probe.reset()
if not probe._can_reset:
    print(json.dumps(None)); raise SystemExit
base = probe.read()
probe.reset()
x = torch.ones(200 * MB // 4, dtype=torch.float32)  # 200 MB, every page touched
big = probe.read()
del x
probe.reset()  # the high-water mark must drop back to the current RSS
y = torch.ones(10 * MB // 4, dtype=torch.float32)
small = probe.read()
print(json.dumps([base, big, small]))
"""


@linux_only
def test_linux_cpu_real_peak_grows_and_resets(monkeypatch):
    monkeypatch.setattr(memory, "_platform", lambda: "linux")
    assert isinstance(probe_for_device("cpu"), LinuxProcessProbe)
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT], capture_output=True, text=True, check=True)
    readings = json.loads(out.stdout)
    if readings is None:
        pytest.skip("needs /proc (Linux) with a writable /proc/self/clear_refs, not so here")
    base, big, small = readings
    assert base["source"] == "linux:VmHWM"
    assert base["kind"] == big["kind"] == small["kind"] == "process_peak"
    assert big["bytes"] >= base["bytes"] + 150 * MB
    assert small["bytes"] < big["bytes"] - 100 * MB


def test_linux_clear_refs_written_once_per_reset_and_status_parsed(tmp_path):
    status = tmp_path / "status"
    status.write_bytes(b"Name:\tpython\nVmPeak:\t  999 kB\nVmHWM:\t    2048 kB\nVmRSS:\t 1024 kB\n")
    clear = tmp_path / "clear_refs"
    clear.write_bytes(b"")
    probe = LinuxProcessProbe(status_path=str(status), clear_refs_path=str(clear))
    assert probe.read()["kind"] == "process_peak_since_start"  # never reset yet
    probe.reset()
    assert clear.read_bytes() == b"5"
    assert probe.read() == {"bytes": 2048 * 1024, "source": "linux:VmHWM", "kind": "process_peak"}


def test_linux_clear_refs_unwritable_says_not_reset_and_is_not_retried(tmp_path, monkeypatch):
    status = tmp_path / "status"
    status.write_bytes(b"VmHWM:\t    4096 kB\n")
    probe = LinuxProcessProbe(status_path=str(status), clear_refs_path=str(tmp_path / "no" / "clear_refs"))
    probe.reset()
    assert probe._can_reset is False
    rec = probe.read()
    assert rec == {"bytes": 4096 * 1024, "source": "linux:VmHWM", "kind": "process_peak_since_start"}

    calls = []
    monkeypatch.setattr(memory.os, "open", lambda *a, **k: calls.append(a) or pytest.fail("retried"))
    probe.reset()
    assert calls == []


def test_linux_status_problems_are_unmeasured(tmp_path):
    _assert_unmeasured(LinuxProcessProbe(status_path=str(tmp_path / "missing")).read(), "cannot read")
    status = tmp_path / "status"
    status.write_bytes(b"Name:\tpython\n")
    _assert_unmeasured(LinuxProcessProbe(status_path=str(status)).read(), "VmHWM")
    status.write_bytes(b"VmHWM:\t0 kB\n")
    _assert_unmeasured(LinuxProcessProbe(status_path=str(status)).read(), "VmHWM")


# ---- macOS CPU and other platforms ------------------------------------------------------------------------


def test_macos_cpu_uses_ru_maxrss_in_bytes(monkeypatch):
    resource = pytest.importorskip("resource")
    monkeypatch.setattr(memory, "_platform", lambda: "darwin")
    monkeypatch.setattr(resource, "getrusage", lambda who: types.SimpleNamespace(ru_maxrss=123_456_789))
    probe = probe_for_device(torch.device("cpu"))
    assert isinstance(probe, MacProcessProbe)
    probe.reset()
    assert probe.read() == {
        "bytes": 123_456_789,
        "source": "getrusage:ru_maxrss",
        "kind": "process_peak_since_start",
    }


def test_cpu_on_other_platform_is_unmeasured(monkeypatch):
    monkeypatch.setattr(memory, "_platform", lambda: "win32")
    probe = probe_for_device("cpu")
    probe.reset()
    _assert_unmeasured(probe.read(), "win32")


def test_unknown_device_type_is_unmeasured():
    probe = probe_for_device("meta")
    assert isinstance(probe, UnmeasuredProbe)
    probe.reset()
    _assert_unmeasured(probe.read(), "meta")


# ---- torch CUDA, monkeypatched ----------------------------------------------------------------------------


def _fake_cuda(monkeypatch, peak):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d=None: calls.append(("reset", d)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: calls.append(("max", d)) or peak)
    return calls


def test_cuda_resets_and_reads_the_right_device(monkeypatch):
    calls = _fake_cuda(monkeypatch, 7 * MB)
    probe = probe_for_device("cuda:1")
    assert probe == CudaProbe(1)
    probe.reset()
    rec = probe.read()
    assert calls == [("reset", 1), ("max", 1)]
    assert rec == {"bytes": 7 * MB, "source": "torch.cuda.max_memory_allocated", "kind": "peak"}


def test_cuda_without_index_uses_current_device(monkeypatch):
    calls = _fake_cuda(monkeypatch, 5 * MB)
    probe = probe_for_device(torch.device("cuda"))
    probe.reset()
    probe.read()
    assert calls == [("reset", 3), ("max", 3)]


def test_cuda_zero_is_never_reported(monkeypatch):
    _fake_cuda(monkeypatch, 0)
    probe = probe_for_device("cuda:0")
    probe.reset()
    _assert_unmeasured(probe.read(), "returned 0")


def test_cuda_unavailable_is_unmeasured(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    probe = probe_for_device("cuda:0")
    probe.reset()  # must not touch CUDA
    _assert_unmeasured(probe.read(), "is_available")


# ---- torch MPS, monkeypatched -----------------------------------------------------------------------------


def test_mps_reads_current_values_labelled_honestly(monkeypatch):
    monkeypatch.setattr(torch.mps, "driver_allocated_memory", lambda: 300 * MB)
    monkeypatch.setattr(torch.mps, "current_allocated_memory", lambda: 200 * MB)
    probe = probe_for_device("mps")
    assert isinstance(probe, MpsProbe)
    probe.reset()
    rec = probe.read()
    # the drafter's own torch allocations, not the driver's process-wide total (MLX's verifier included)
    assert rec == {
        "bytes": 200 * MB,
        "source": "torch.mps.current_allocated_memory",
        "kind": "current_after",
        "process_driver_bytes": 300 * MB,
    }
    assert "peak" not in rec["kind"]


def test_mps_failure_is_unmeasured_not_raised(monkeypatch):
    def boom():
        raise RuntimeError("Cannot execute getDriverAllocatedMemory() without MPS backend.")

    monkeypatch.setattr(torch.mps, "current_allocated_memory", lambda: 1)
    monkeypatch.setattr(torch.mps, "driver_allocated_memory", boom)
    probe = probe_for_device("mps")
    probe.reset()
    _assert_unmeasured(probe.read(), "RuntimeError", "without MPS backend")


# ---- MLX, real on the CPU build ---------------------------------------------------------------------------


def test_mlx_real_peak_covers_allocation():
    mx = pytest.importorskip("mlx.core")
    probe = mlx_probe()
    assert isinstance(probe, MlxProbe)
    probe.reset()
    a = mx.ones((16 * MB // 4,), dtype=mx.float32)  # 16 MB
    mx.eval(a)
    rec = probe.read()
    assert rec["source"] == "mlx.get_peak_memory" and rec["kind"] == "peak"
    assert rec["bytes"] >= 16 * MB

    probe.reset()  # a call that allocates nothing still holds `a`: the reading is not 0
    rec = probe.read()
    assert rec["bytes"] >= 16 * MB
    del a


def test_mlx_nothing_held_is_unmeasured():
    fake = types.SimpleNamespace(
        reset_peak_memory=lambda: None, get_peak_memory=lambda: 0, get_active_memory=lambda: 0
    )
    probe = MlxProbe(fake)
    probe.reset()
    _assert_unmeasured(probe.read(), "mlx")


def test_importing_memory_does_not_import_mlx():
    code = (
        "import sys, specdec.memory; sys.exit(any(m == 'mlx' or m.startswith('mlx.') for m in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# ---- probe_for_module -------------------------------------------------------------------------------------


def test_probe_for_module_uses_first_parameter_device(monkeypatch):
    _fake_cuda(monkeypatch, 1)
    monkeypatch.setattr(memory, "_platform", lambda: "linux")
    assert isinstance(probe_for_module(torch.nn.Linear(2, 2)), LinuxProcessProbe)
    meta = torch.nn.Linear(2, 2, device="meta")
    _assert_unmeasured(probe_for_module(meta).read(), "meta")


def test_probe_for_module_without_parameters_raises():
    with pytest.raises(ValueError, match="no parameters"):
        probe_for_module(torch.nn.ReLU())


# ---- max_record -------------------------------------------------------------------------------------------


def test_max_record_picks_largest_bytes_and_ignores_unmeasured():
    recs = [
        None,
        {"bytes": 5, "source": "linux:VmHWM", "kind": "process_peak"},
        unmeasured("skipped"),
        {"bytes": 9, "source": "linux:VmHWM", "kind": "process_peak"},
        {"bytes": 7, "source": "linux:VmHWM", "kind": "process_peak"},
    ]
    best = max_record(iter(recs))
    assert best == recs[3]
    best["bytes"] = 0
    assert recs[3]["bytes"] == 9  # a copy, not an alias


def test_max_record_without_bytes_keeps_reasons():
    rec = max_record([unmeasured("no CUDA"), None, unmeasured("no CUDA"), unmeasured("mps failed")])
    _assert_unmeasured(rec, "no CUDA", "mps failed")
    assert rec["reason"].count("no CUDA") == 1


def test_max_record_of_nothing_is_none():
    assert max_record([]) is None
    assert max_record([None, None]) is None
