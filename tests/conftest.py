"""Shared test set-up, and the rule CI holds skips to.

A skip hides a test; under `SPECDEC_STRICT_SKIPS=1` (what `.ci/run` sets) the run fails on any skip
whose reason is not missing hardware (CUDA, MPS, a Mac / Apple silicon, Linux's /proc) or an optional
package CI does not install (`NOT_IN_CI`, named in the reason). Every other reason is a test that should
have run: a model it could fetch, a measurement it should assert, a package CI does install.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

#: optional packages CI does not install: a test that needs one may skip naming it
NOT_IN_CI = ("llama_cpp",)
#: what a skip's reason must name to be allowed under SPECDEC_STRICT_SKIPS
ALLOWED_SKIP = re.compile(
    r"needs CUDA|needs MPS|needs a Mac|needs Apple silicon|needs /proc \(Linux\)|"
    + "|".join(rf"\b{re.escape(m)}\b" for m in NOT_IN_CI)
)
_skips: list[tuple[str, str]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skips.append((report.nodeid, reason.removeprefix("Skipped: ")))


def pytest_collectreport(report: pytest.CollectReport) -> None:
    pytest_runtest_logreport(report)  # a module skipped whole (importorskip at its top)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("SPECDEC_STRICT_SKIPS") != "1":
        return
    bad = [(n, r) for n, r in _skips if not ALLOWED_SKIP.search(r)]
    if bad:
        print(f"\nSPECDEC_STRICT_SKIPS: {len(bad)} skip(s) for a reason CI does not allow:")
        for nodeid, reason in bad:
            print(f"  {nodeid}: {reason}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def _one_thread_for_tiny_models(request: pytest.FixtureRequest):
    """Tiny models spend their time in thread hand-offs, not arithmetic: one intra-op thread is several
    times faster (and immune to a busy machine). Real-model tests (`slow`) keep the default, except under
    pytest-xdist (`-n 2`), where the other worker holds the other core and a second thread would only wait."""
    if request.node.get_closest_marker("slow") and not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
