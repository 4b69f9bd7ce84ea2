"""The corpus format: the verifier's own greedy responses to many prompts, as token ids, in chunks.

Token ids are all a drafter's training needs from the verifier ahead of time (features are computed from
them online, see `specdec.train.features`), and they are small: a corpus of 20k sequences is ~15 MB, so
it is committed and a fresh machine never regenerates it. Corpus n-gram drafting (`--corpus`) reads the
same folders. Layout of a corpus folder:

    corpus.json                the verifier it was built with (name, vocabulary, layers) and each stage's
                               settings: {"budget", "chunk_size", "n_prompts"}
    <stage>/prompts.jsonl.gz   the stage's prompts, fixed when the stage starts: {"key", "messages"} a line
    <stage>/chunk-NNNNN.npz    the results of prompts [N*chunk_size, (N+1)*chunk_size): keys, prompt ids
                               and response ids (int32, flat, with lengths)
    <stage>/partial.npz        while a build is unfinished: the answers of chunks not yet complete, with
                               their prompt indices

Readers see complete chunks only. Building one: `specdec.train.corpus`.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from specdec.protocols import Verifier
from specdec.records import atomic_write_bytes

__all__ = ["Corpus", "Messages", "Row", "TrainSequence", "read_rows", "write_rows"]

FORMAT = "specdec-corpus"
VERSION = 1
Messages = list[dict[str, str]]


@dataclass(frozen=True)
class TrainSequence:
    """One training sequence: prompt ids then the verifier's response ids."""

    key: str
    ids: np.ndarray  # [T] int32
    prompt_len: int


class Corpus:
    """A corpus folder (see the module docstring)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        meta = self.path / "corpus.json"
        if not meta.is_file():
            raise FileNotFoundError(f"{str(self.path)!r} is not a corpus (no corpus.json): build one first")
        try:
            self.meta: dict[str, Any] = json.loads(meta.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{str(meta)!r} is not a JSON corpus record ({e})") from None
        if not isinstance(self.meta, dict) or self.meta.get("format") != FORMAT:
            raise ValueError(f"{str(meta)!r} is not a {FORMAT} file")
        stages, record = self.meta.get("stages"), self.meta.get("verifier")
        if (
            not isinstance(stages, dict)
            or not isinstance(record, dict)
            or not all(
                isinstance(s, dict) and {"n_prompts", "chunk_size"} <= s.keys() for s in stages.values()
            )
        ):
            raise ValueError(
                f"{str(meta)!r} lacks its 'verifier' record or its stages' sizes: not a corpus record"
            )

    @classmethod
    def create(cls, path: str | os.PathLike[str], verifier: Verifier, *, max_len: int) -> Corpus:
        """Open the corpus at `path`, or start one for `verifier` (refusing a folder built by another)."""
        if not str(path).strip():
            raise ValueError("the corpus folder is empty; give a folder such as runs/corpus")
        path = Path(path)
        want = {
            "model": verifier.model_name,
            "vocab_size": verifier.vocab_size,
            "hidden_size": verifier.hidden_size,
            "num_layers": verifier.num_layers,
        }
        if (path / "corpus.json").is_file():
            c = cls(path)
            diff = {
                k: (c.meta["verifier"].get(k), v) for k, v in want.items() if c.meta["verifier"].get(k) != v
            }
            if diff or c.meta["max_len"] != max_len:
                raise ValueError(
                    f"corpus {str(path)!r} was built for another verifier or max_len: {diff} (stored, "
                    "given); use another folder"
                )
            return c
        path.mkdir(parents=True, exist_ok=True)
        meta = {"format": FORMAT, "version": VERSION, "verifier": want, "max_len": max_len, "stages": {}}
        atomic_write_bytes(path / "corpus.json", json.dumps(meta, indent=1).encode())
        return cls(path)

    # ---- stages ----------------------------------------------------------------------------------------

    def has_stage(self, stage: str) -> bool:
        return stage in self.meta["stages"]

    def start_stage(
        self, stage: str, make: Callable[[], list[tuple[str, Messages]]], *, budget: int, chunk_size: int
    ) -> None:
        """Fix a stage's prompts (`make()`, called only if the stage is new) and settings."""
        if self.has_stage(stage):
            have = self.meta["stages"][stage]
            if (have["budget"], have["chunk_size"]) != (budget, chunk_size):
                raise ValueError(
                    f"stage {stage!r} of {str(self.path)!r} has budget {have['budget']} and chunk size "
                    f"{have['chunk_size']}; asked for {budget} and {chunk_size}"
                )
            return
        prompts = make()
        keys = [k for k, _ in prompts]
        if len(set(keys)) != len(keys):
            raise ValueError(f"stage {stage!r}: prompt keys must be unique")
        (self.path / stage).mkdir(exist_ok=True)
        lines = "".join(json.dumps({"key": k, "messages": m}) + "\n" for k, m in prompts)
        atomic_write_bytes(self.path / stage / "prompts.jsonl.gz", gzip.compress(lines.encode(), mtime=0))
        self.meta["stages"][stage] = {"budget": budget, "chunk_size": chunk_size, "n_prompts": len(prompts)}
        atomic_write_bytes(self.path / "corpus.json", json.dumps(self.meta, indent=1).encode())

    def prompts(self, stage: str) -> list[tuple[str, Messages]]:
        text = gzip.decompress((self.path / stage / "prompts.jsonl.gz").read_bytes()).decode()
        return [(r["key"], r["messages"]) for r in map(json.loads, text.splitlines())]

    def n_chunks(self, stage: str) -> int:
        s = self.meta["stages"][stage]
        return -(-s["n_prompts"] // s["chunk_size"])

    def chunk_path(self, stage: str, n: int) -> Path:
        return self.path / stage / f"chunk-{n:05d}.npz"

    def check_chunks(self) -> None:
        """Open every chunk file there is (the zip's directory, not the data: milliseconds): a truncated or
        foreign file is a one-line error here, before a run reads it."""
        for stage in self.meta["stages"]:
            for n in range(self.n_chunks(stage)):
                p = self.chunk_path(stage, n)
                if p.is_file() and not _open_rows(p, lambda z: set(z.files) >= _ROW_ARRAYS):
                    _bad(p, f"it lacks the arrays {sorted(_ROW_ARRAYS)}")

    def missing_chunks(self, stage: str) -> list[int]:
        return [n for n in range(self.n_chunks(stage)) if not self.chunk_path(stage, n).is_file()]

    def partial_path(self, stage: str) -> Path:
        return self.path / stage / "partial.npz"

    # ---- reading ---------------------------------------------------------------------------------------

    def sequences(self, stage: str) -> Iterator[TrainSequence]:
        """The finished sequences of `stage`, chunk by chunk, up to the first chunk still missing (so the
        first N sequences stay the same while a build goes on)."""
        for n in range(self.n_chunks(stage)):
            p = self.chunk_path(stage, n)
            if not p.is_file():
                return
            for key, prompt, response in read_rows(p)[0]:
                ids = np.concatenate([prompt, response]).astype(np.int32)
                yield TrainSequence(key=key, ids=ids, prompt_len=len(prompt))

    def all_sequences(self) -> list[TrainSequence]:
        """The finished sequences of every stage, in stage order."""
        return [s for stage in self.meta["stages"] for s in self.sequences(stage)]

    def responses(self, stage: str) -> dict[str, np.ndarray]:
        """key -> response ids [n] of the finished prompts of `stage`."""
        return {s.key: s.ids[s.prompt_len :] for s in self.sequences(stage)}

    def stats(self) -> dict[str, Any]:
        """Per stage: prompts, finished sequences and their prompt / response token counts."""
        out = {}
        for stage in self.meta["stages"]:
            seqs = list(self.sequences(stage))
            out[stage] = {
                "n_prompts": self.meta["stages"][stage]["n_prompts"],
                "n_sequences": len(seqs),
                "prompt_tokens": sum(s.prompt_len for s in seqs),
                "response_tokens": sum(len(s.ids) - s.prompt_len for s in seqs),
            }
        return out


Row = tuple[str, list[int], list[int]]  # (key, prompt ids, response ids)


def write_rows(path: Path, rows: list[Row], index: list[int] | None = None) -> None:
    """A chunk file (or, with the rows' prompt indices, a partial file), written atomically."""
    buf = io.BytesIO()
    extra = {} if index is None else {"index": np.array(index, dtype=np.int64)}
    np.savez_compressed(
        buf,
        keys=np.array([k for k, _, _ in rows], dtype=str),
        prompt_len=np.array([len(p) for _, p, _ in rows], dtype=np.int32),
        response_len=np.array([len(r) for _, _, r in rows], dtype=np.int32),
        prompt=np.array([t for _, p, _ in rows for t in p], dtype=np.int32),
        response=np.array([t for _, _, r in rows for t in r], dtype=np.int32),
        **extra,
    )
    atomic_write_bytes(path, buf.getvalue())


_ROW_ARRAYS = {"keys", "prompt_len", "response_len", "prompt", "response"}


def _bad(path: Path, why: str) -> NoReturn:
    raise ValueError(f"corpus file {str(path)!r} cannot be read ({why}): truncated, or not a corpus chunk")


def _open_rows(path: Path, read: Callable[[Any], Any]) -> Any:
    """`read(z)` of the npz file at `path`, with any failure to read it as one line naming the file."""
    try:
        with np.load(path) as z:
            return read(z)
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        _bad(path, f"{type(e).__name__}: {e}")


def read_rows(path: Path) -> tuple[list[tuple[str, np.ndarray, np.ndarray]], list[int] | None]:
    """The rows of a chunk or partial file, and the partial file's prompt indices (None for a chunk)."""

    def read(z: Any) -> tuple:
        index = z["index"].tolist() if "index" in z else None
        return z["keys"].tolist(), z["prompt_len"], z["response_len"], z["prompt"], z["response"], index

    keys, plen, rlen, prompt, response, index = _open_rows(path, read)
    po, ro = np.concatenate([[0], np.cumsum(plen)]), np.concatenate([[0], np.cumsum(rlen)])
    rows = [(k, prompt[po[i] : po[i + 1]], response[ro[i] : ro[i + 1]]) for i, k in enumerate(keys)]
    return rows, index
