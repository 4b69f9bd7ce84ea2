"""Per-step records, run results, summary maths, and how they reach disk.

Conventions (vLLM's): a step drafts `drafted` tokens, the verifier accepts the first `accepted` of
them and adds one token of its own (the bonus), so `acceptance_length = accepted + 1` and the mean
acceptance length tau includes the bonus. Throughput `tokens_per_s` counts tokens generated after the
first one over the decode time (prefill and the first token are `ttft_s`). Unmeasured figures are
`null` with a reason, never 0.

Steps are appended to a `.jsonl` as they happen; the final JSON is written to a temporary file in the
same directory and renamed over the target, so a crash never leaves a truncated or half-replaced result.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, TextIO

from specdec.memory import max_record
from specdec.protocols import MemoryRecord

SCHEMA_VERSION = "1.0"
SCHEMA_PATH = Path(__file__).parent / "schema" / "result.schema.json"


@dataclass(frozen=True)
class TokenLogprob:
    """A committed token's log-probability under the verifier's processed logits (bias, penalties and
    grammar applied; before temperature and truncation), and the `top` most likely tokens there."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(steps: Sequence[StepRecord]) -> list[TokenLogprob] | None:
    """A run's output tokens' log-probability records, where it asked for them (`DecodeConfig.logprobs`)."""
    if any(s.logprobs is None for s in steps):
        return None
    return [e for s in steps for e in s.logprobs or ()]


@dataclass(kw_only=True)
class StepRecord:
    """One decode step (or the prefill, `phase="prefill"`, which commits the first token)."""

    index: int
    phase: str  # "prefill" | "decode"
    drafted: int
    accepted: int
    acceptance_length: int  # accepted + 1: the bonus token counts
    tokens: list[int]  # committed this step, after cutting at stop tokens / max_new_tokens
    draft_s: float
    verify_s: float
    bridge_s: float
    other_s: float
    step_s: float
    peak_memory: dict[str, MemoryRecord]  # {"verifier": ..., "drafter": ...}
    finish_reason: str | None = None  # set on the last step: "stop" | "length" | "context"
    rule: str = "greedy"  # verification rule: "greedy" | "match" | "rejection"
    residual_resamples: int | None = None  # rejection rule: tokens resampled from norm(max(0, p - q))
    tree_nodes: int | None = None  # a tree step (`--tree`): nodes verified, the root included; None: a chain
    # a tree step: per accepted draft, its candidate rank at its depth (0: the drafter's top-1, -1: lookup's)
    tree_ranks: list[int] | None = None
    # a batched request (`specdec.batch`): the sequences' calls this step's verify forward ran; None: alone
    batch_size: int | None = None
    # per committed token, where asked for (`DecodeConfig.logprobs`)
    logprobs: list[TokenLogprob] | None = None
    # a decode step: the intra-op threads its torch ops ran with (`specdec.threads`); None: the prefill
    threads: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(kw_only=True)
class PromptResult:
    id: str
    prompt_tokens: int
    steps: list[StepRecord]
    output_tokens: list[int]
    text: str | None
    finish_reason: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def decode_steps(self) -> list[StepRecord]:
        return [s for s in self.steps if s.phase == "decode"]

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "summary": summarize([self]),
            "steps": [s.to_json() for s in self.steps],
            **self.extra,
        }


def summarize(results: list[PromptResult], *, block_size: int | None = None) -> dict[str, Any]:
    """Aggregate figures over prompts. Histogram index = number of drafts accepted in a step."""
    steps = [s for r in results for s in r.decode_steps]
    prefill = [s for r in results for s in r.steps if s.phase == "prefill"]
    max_drafted = max([s.drafted for s in steps], default=0)
    width = max(max_drafted, (block_size or 1) - 1) + 1
    hist = [0] * width
    for s in steps:
        hist[s.accepted] += 1
    # rate at draft position i (1-based): of the steps that drafted >= i tokens, how many accepted >= i
    per_pos = []
    for i in range(1, width):
        n = sum(1 for s in steps if s.drafted >= i)
        per_pos.append(sum(1 for s in steps if s.drafted >= i and s.accepted >= i) / n if n else None)
    decode_s = sum(s.step_s for s in steps)
    n_after_first = sum(len(s.tokens) for s in steps)
    phases = {k: sum(getattr(s, f"{k}_s") for s in steps) for k in ("draft", "verify", "bridge", "other")}
    trees = [s.tree_nodes for s in steps if s.tree_nodes is not None]
    return {
        "n_prompts": len(results),
        "n_steps": len(steps),
        "n_output_tokens": sum(len(r.output_tokens) for r in results),
        "acceptance_length_mean": (sum(s.acceptance_length for s in steps) / len(steps)) if steps else None,
        "acceptance_histogram": hist,
        "per_position_acceptance": per_pos,
        # tree steps: mean nodes verified (the root included) and the share of steps won off the top-1 path
        "tree_nodes_mean": statistics.mean(trees) if trees else None,
        "tree_off_top1": _off_top1(steps) if trees else None,
        "tokens_per_s": (n_after_first / decode_s) if decode_s > 0 and n_after_first else None,
        "ttft_s": (sum(s.step_s for s in prefill) / len(prefill)) if prefill else None,
        "decode_s": decode_s,
        "time_share": {k: (v / decode_s if decode_s > 0 else None) for k, v in phases.items()},
        "peak_memory_bytes_max": {
            rt: max_record(s.peak_memory.get(rt) for s in [*prefill, *steps])
            for rt in sorted({rt for s in [*prefill, *steps] for rt in s.peak_memory})
        },
    }


def _off_top1(steps: Sequence[StepRecord]) -> float:
    """Of the tree steps that accepted a draft, the share whose accepted path left the top-1 candidates."""
    won = [s for s in steps if s.tree_ranks]
    return sum(any(r != 0 for r in s.tree_ranks) for s in won) / len(won) if won else 0.0


def _cpu_name() -> str | None:
    """The CPU's model name (Linux's /proc/cpuinfo; elsewhere what `platform` knows)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def environment(device: str | None = None) -> dict[str, Any]:
    """Where the run happened: platform, CPU, python and library versions, device."""
    versions = {}
    for pkg in ("specdec", "torch", "numpy", "mlx", "mlx-lm", "transformers"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {
        "platform": platform.platform(),
        "system": platform.system(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "versions": versions,
        "device": device,
    }


def _check_target(p: Path) -> None:
    """Refuse to replace anything at `p` that is not a plain file of ours to overwrite."""
    if p.is_symlink() or (p.exists() and not p.is_file()):
        kind = "a symbolic link" if p.is_symlink() else "a directory" if p.is_dir() else "not a regular file"
        raise ValueError(f"output path {str(p)!r} is {kind}; give the name of a new or regular file")


def check_output_path(path: str | os.PathLike[str]) -> Path:
    """Fail before any work if the result (and its `.steps.jsonl`) could not be written at `path`: its
    folder must exist or be creatable (the writer makes it) in a writable place; whatever is there already
    must be a regular file (not a folder, link, device or FIFO, which an atomic rename would replace)."""
    if not str(path).strip():
        raise ValueError("the output path is empty; give a file name such as result.json")
    p = Path(path)
    if p.is_dir() and not p.is_symlink():
        raise ValueError(f"output path {str(p)!r} is a directory; give a file name such as result.json")
    for target in (p, steps_path(p)):
        _check_target(target)
    _check_writable_dir(p.parent)
    return p


def _check_writable_dir(d: Path) -> None:
    """`d` is, or can be made as, a writable directory."""
    existing = next(q for q in [d, *d.absolute().parents] if q.exists())
    if not existing.is_dir():
        raise ValueError(f"cannot write into {str(d)!r}: {str(existing)!r} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write into {str(d)!r}: {str(existing)!r} is not writable")


def check_output_dir(
    path: str | os.PathLike[str], names: Sequence[str] = ("result.json", "steps.jsonl")
) -> Path:
    """Fail before any work if an output folder could not hold `names`: `path` must be a folder or not
    exist yet (it is made later, when there is something to write) in a writable place."""
    if not str(path).strip():
        raise ValueError("the output folder is empty; give a directory such as runs/eval")
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"--out {str(p)!r} exists and is not a directory; give a directory")
    for name in names:
        _check_target(p / name)
    _check_writable_dir(p)
    return p


def steps_path(out: str | os.PathLike[str]) -> Path:
    """Where the steps of a result at `out` go: `<out without .json>.steps.jsonl`."""
    return Path(out).with_suffix(".steps.jsonl")


def format_bytes(rec: dict | None) -> str:
    """A memory record as "123 MiB (kind)", or "n/a" when unmeasured."""
    if not rec or rec.get("bytes") is None:
        return "n/a"
    return f"{rec['bytes'] / 2**20:.0f} MiB ({rec['kind']})"


def atomic_write_bytes(
    path: str | os.PathLike[str], data: bytes, *, before_rename: Callable[[], None] | None = None
) -> None:
    """Write `data` to a temp file beside `path`, fsync, then rename over it: all or nothing. The file gets
    the usual permissions (umask), not mkstemp's 0600. `before_rename` runs once the data is safely on
    disk, right before the rename (e.g. `JsonlWriter.commit` for the steps of this result: a full disk
    then fails before either file is replaced, never between the two)."""
    p = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        if before_rename is not None:
            before_rename()
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(
    path: str | os.PathLike[str], obj: Any, *, before_rename: Callable[[], None] | None = None
) -> None:
    """`obj` as indented JSON, written with `atomic_write_bytes`."""
    atomic_write_bytes(path, (json.dumps(obj, indent=1) + "\n").encode(), before_rename=before_rename)


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def staging_dir(parent: str | os.PathLike[str], name: str) -> Path:
    """A new folder in `parent` to build `name` in before it is renamed into place: a fresh unpredictable
    name made by this call (never a path someone could have put a link at), the usual permissions."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=parent))
    os.chmod(tmp, 0o777 & ~_umask())
    return tmp


class JsonlWriter:
    """Appends one JSON object per line and flushes each. Lines go to a staging file beside `path`
    (`.<name>.<random>.tmp`, created new: a link planted there is never followed) and only `commit()`
    renames it to `path`, so a run that fails, is refused or is interrupted never replaces (or truncates)
    the steps of an earlier run; `discard()` (or leaving a `with` block by an exception) removes the
    staging file, so nothing is left behind either."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        _check_target(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        self.tmp = Path(tmp)
        self._f: TextIO = os.fdopen(fd, "w")

    def write(self, obj: dict[str, Any]) -> None:
        self._f.write(json.dumps(obj) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()

    def commit(self) -> None:
        """Close and move the steps into place: the `before_rename` of the result they belong to."""
        self.close()
        os.chmod(self.tmp, 0o666 & ~_umask())
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        """Close and remove the staging file (a no-op for what `commit` already moved into place)."""
        self.close()
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if kind is not None:
            self.discard()
        self.close()


def run_json(
    *,
    config: dict[str, Any],
    results: list[PromptResult],
    device: str | None,
    baseline: list[PromptResult] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The whole run's result JSON (see schema/result.schema.json)."""
    summary = summarize(results, block_size=config.get("block_size"))
    if baseline is not None:
        base = summarize(baseline, block_size=1)
        summary["baseline_tokens_per_s"] = base["tokens_per_s"]
        ok = summary["tokens_per_s"] and base["tokens_per_s"]
        summary["speedup"] = summary["tokens_per_s"] / base["tokens_per_s"] if ok else None
    out = {
        "schema_version": SCHEMA_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": config,
        "environment": environment(device),
        "prompts": [r.to_json() for r in results],
        "summary": summary,
    }
    if baseline is not None:
        out["baseline"] = [r.to_json() for r in baseline]
    if extra:
        out.update(extra)
    return out


def run_config(verifier: Any, drafter: Any, cfg: Any, **extra: Any) -> dict[str, Any]:
    """The result JSON's `config` section for a run of `verifier` and `drafter` (None: the autoregressive
    baseline) with `cfg` (a `DecodeConfig`), plus `extra` keys."""
    from specdec.protocols import Describes

    drafter = cfg.drafting(drafter)
    return {
        "verifier": {
            "runtime": verifier.runtime,
            "model": verifier.model_name,
            "dtype": verifier.dtype,
            # a verify of several tokens equals one-token steps bit for bit (see specdec.kernels)
            "batch_invariant": verifier.batch_invariant,
        },
        "drafter": None
        if drafter is None
        else {
            "name": drafter.name,
            "runtime": drafter.runtime,
            "block_size": drafter.block_size,
            "target_layer_ids": list(drafter.target_layer_ids),
            # where it was loaded from, how its drafts are cut, which corpus, proposals by source: what
            # the drafter says of itself (`specdec.protocols.Describes`), None where it has none of these
            **dict.fromkeys(("path", "min_confidence", "costs", "corpus", "proposals")),
            **(drafter.describe() if isinstance(drafter, Describes) else {}),
        },
        "block_size": cfg.block_size if drafter is not None else 1,
        "temperature": cfg.sampling.temperature if cfg.sampling else 0.0,
        "seed": cfg.sampling.seed if cfg.sampling else 0,
        "sampling": asdict(cfg.sampling) if cfg.sampling else None,
        "max_new_tokens": cfg.max_new_tokens,
        "decode": {
            k: (sorted(v) if isinstance(v, frozenset) else v)
            for k, v in asdict(cfg).items()
            if k != "sampling"
        },
        **extra,
    }


def validate(obj: dict[str, Any]) -> None:
    """Validate a result against the shipped JSON Schema (needs `jsonschema`, a dev extra)."""
    import jsonschema

    jsonschema.validate(obj, json.loads(SCHEMA_PATH.read_text()))
