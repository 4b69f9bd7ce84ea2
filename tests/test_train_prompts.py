"""Offline training prompts: the same in fresh processes (no addresses, no hash order), and distinct.

Fresh processes only: a few stdlib defaults print live state (`logging.shutdown`'s handler list), so a
process that has made loggers writes a different signature there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

WRITE = (
    "import json, sys; from specdec.train import prompts as ts; "
    "rows = {'q': ts.stage_questions(200), 'chat': ts.chat_prompts_v2(300), "
    "'code': ts.code_prompts_v2(packages=('idna', 'packaging'))}; "
    "open(sys.argv[1], 'w').write(json.dumps(rows))"
)


def test_prompt_sources_are_reproducible_and_distinct(tmp_path: Path) -> None:
    for run, seed in (("1", "0"), ("2", "12345")):  # another process, another string-hash seed
        env = {"PYTHONHASHSEED": seed, "PATH": ""}
        subprocess.run([sys.executable, "-c", WRITE, str(tmp_path / run)], check=True, env=env)
    a, b = (tmp_path / "1").read_text(), (tmp_path / "2").read_text()
    assert a == b and " at 0x" not in a
    rows = json.loads(a)
    assert len(rows["q"]) == 200 and len(rows["chat"]) == 300 and len(rows["code"]) > 1000
    texts = [m[0]["content"] for _, m in rows["q"]] + rows["chat"] + [t for _, t in rows["code"]]
    assert len(set(texts)) == len(texts)
    assert {src for src, _ in rows["code"]} == {"stdlib", "idna", "packaging"}
