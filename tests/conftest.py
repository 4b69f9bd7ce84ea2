"""Shared test set-up."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread_for_tiny_models(request: pytest.FixtureRequest):
    """Tiny models spend their time in thread hand-offs, not arithmetic: one intra-op thread is several
    times faster (and immune to a busy machine). Real-model tests (`slow`) keep the default."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
