"""Server-wide counters of `specdec serve`, as JSON or Prometheus text, and one request's stats."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from specdec.memory import max_record
from specdec.stream import StreamResult

__all__ = ["Metrics", "prometheus", "request_stats"]


class Metrics:
    """Server-wide counters (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started = time.time()
        names = (
            "requests_total requests_completed requests_cancelled requests_rejected_busy requests_invalid "
            "requests_failed prompt_tokens_total reused_prompt_tokens_total prompt_cache_hits_total "
            "completion_tokens_total "
            "decode_steps_total drafted_tokens_total accepted_tokens_total"
        )
        self.c = dict.fromkeys(names.split(), 0)
        self.decode_s_total = 0.0
        self.decode_tokens_total = 0  # tokens after the first one of each request
        self.acceptance_length_sum = 0
        #: decode steps by how many requests' calls their verify's forward ran (1: alone)
        self.batch_sizes: Counter[int] = Counter()
        self.last: dict[str, Any] = {}
        self.peak: dict[str, dict | None] = {}

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.c[name] += n

    def record(self, r: StreamResult, stats: dict[str, Any]) -> None:
        decode = [s for s in r.steps if s.phase == "decode"]
        with self._lock:
            self.c["requests_cancelled" if r.finish_reason == "cancelled" else "requests_completed"] += 1
            self.c["prompt_tokens_total"] += r.prompt_tokens
            self.c["reused_prompt_tokens_total"] += r.reused_tokens
            self.c["prompt_cache_hits_total"] += r.reused_tokens > 0
            self.c["completion_tokens_total"] += len(r.output_tokens)
            self.c["decode_steps_total"] += len(decode)
            self.c["drafted_tokens_total"] += stats["drafted"]
            self.c["accepted_tokens_total"] += stats["accepted"]
            self.acceptance_length_sum += sum(s.acceptance_length for s in decode)
            self.batch_sizes.update(s.batch_size or 1 for s in decode)
            self.decode_s_total += sum(s.step_s for s in decode)
            self.decode_tokens_total += sum(len(s.tokens) for s in decode)
            self.last = {**stats, "completion_tokens": len(r.output_tokens)}
            for rt in {rt for s in r.steps for rt in s.peak_memory}:
                recs = [self.peak.get(rt), *(s.peak_memory.get(rt) for s in r.steps)]
                self.peak[rt] = max_record(recs)

    def snapshot(self, queue_depth: int, running: int) -> dict[str, Any]:
        """The counters, with the requests decoding now (`running`) and waiting for an engine."""
        with self._lock:
            steps = self.c["decode_steps_total"]
            return {
                **self.c,
                "running": running,
                "queue_depth": queue_depth,
                "busy": running > 0,
                "uptime_s": time.time() - self.started,
                "acceptance_length_mean": self.acceptance_length_sum / steps if steps else None,
                "tokens_per_s": self.decode_tokens_total / self.decode_s_total
                if self.decode_s_total
                else None,
                "peak_memory": dict(self.peak),
                "peak_memory_bytes": {rt: (rec or {}).get("bytes") for rt, rec in self.peak.items()},
                "decode_steps_by_batch_size": {str(k): n for k, n in sorted(self.batch_sizes.items())},
                "last_request": dict(self.last),
            }


def prometheus(snap: dict[str, Any], counters: Sequence[str]) -> str:
    """Prometheus text exposition: counters get the `_total` suffix, numbers are gauges."""
    lines = []
    for k, v in snap.items():
        if isinstance(v, bool):
            v = int(v)
        if v is None or not isinstance(v, int | float):
            continue
        name = f"specdec_{k}" + ("_total" if k in counters and not k.endswith("_total") else "")
        lines += [f"# TYPE {name} {'counter' if k in counters else 'gauge'}", f"{name} {v}"]
    lines.append("# TYPE specdec_decode_steps_by_batch_size_total counter")
    for size, n in snap["decode_steps_by_batch_size"].items():
        lines.append(f'specdec_decode_steps_by_batch_size_total{{batch_size="{size}"}} {n}')
    lines.append("# TYPE specdec_peak_memory_bytes gauge")
    for rt, b in snap["peak_memory_bytes"].items():
        if b is not None:
            lines.append(f'specdec_peak_memory_bytes{{runtime="{rt}"}} {b}')
    return "\n".join(lines) + "\n"


def request_stats(r: StreamResult) -> dict[str, Any]:
    s = r.summary()
    return {
        "acceptance_length_mean": s["acceptance_length_mean"],
        "n_steps": s["n_steps"],
        "drafted": s["drafted"],
        "accepted": s["accepted"],
        "tokens_per_s": s["tokens_per_s"],
        "ttft_s": r.ttft_s,
        "decode_s": s["decode_s"],
        "reused_tokens": r.reused_tokens,
        "finish_reason": r.finish_reason,
    }
