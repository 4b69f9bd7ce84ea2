"""Offline training prompts: the same in fresh processes (no addresses, no hash order), the sets disjoint.

Fresh processes only: a few stdlib defaults print live state (`logging.shutdown`'s handler list), so a
process that has made loggers writes a different signature there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

WRITE = (
    "import sys; from specdec.trainsets import write_more_prompts, write_prompts, write_third_prompts; "
    "write_prompts(sys.argv[1] + '/a.jsonl', n_code=40, n_chat=30); "
    "write_more_prompts(sys.argv[1] + '/b.jsonl', after_code=40, after_chat=30, n_method=50, n_chat=40); "
    "write_third_prompts(sys.argv[1] + '/c.jsonl', first_chat=30, second_chat=40, n_code=50, n_chat=30)"
)


def test_prompt_sets_are_reproducible_and_disjoint(tmp_path: Path) -> None:
    for run, seed in (("1", "0"), ("2", "12345")):  # another process, another string-hash seed
        (tmp_path / run).mkdir()
        env = {"PYTHONHASHSEED": seed, "PATH": ""}
        subprocess.run([sys.executable, "-c", WRITE, str(tmp_path / run)], check=True, env=env)
    for name in ("a.jsonl", "b.jsonl", "c.jsonl"):
        assert (tmp_path / "1" / name).read_bytes() == (tmp_path / "2" / name).read_bytes(), name
    a = [json.loads(line) for line in (tmp_path / "1/a.jsonl").read_text().splitlines()]
    b = [json.loads(line) for line in (tmp_path / "1/b.jsonl").read_text().splitlines()]
    c = [json.loads(line) for line in (tmp_path / "1/c.jsonl").read_text().splitlines()]
    assert len(a) == 70 and {r["source"] for r in b} == {"code", "method", "chat"}
    assert " at 0x" not in (tmp_path / "1/a.jsonl").read_text()
    assert len(c) == 80 and {r["source"] for r in c} == {"code", "chat"}
    ids = [r["id"] for r in a + b + c]
    assert len(set(ids)) == len(ids)
    texts = [r["messages"][0]["content"] for r in a + b + c]
    assert len(set(texts)) == len(texts)  # each set repeats nothing of the ones before
