"""CI: the wheel installed without any extra (`pip install specdec`), as a user who skipped them has it. Run
by that venv's python from a folder outside the checkout (`.ci/run`): the stub decodes, and each command
that needs an extra says which, in one line, exit code 2, before any work (`specdec serve` before it binds
its port)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

EXE = str(Path(sys.executable).parent / "specdec")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=300)


def refused(args: list[str], extra: str) -> None:
    r = run(*args)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, (args, r.returncode, r.stderr[-2000:])
    assert f"pip install 'specdec[{extra}]'" in lines[0], (args, lines[0])
    print(f"{' '.join(args[:3])}: {lines[0]}")


def main() -> None:
    ok = run("generate", "--verifier", "stub", "--prompt", "Hello", "--max-new-tokens", "4")
    assert ok.returncode == 0, ok.stderr
    with socket.socket() as s:  # a free port: serve must refuse before it binds one
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    refused(["serve", "--verifier", "stub", "--port", port], "serve")
    refused(["generate", "--verifier", "hf", "--model", "smollm2-135m", "--prompt", "hi"], "hf")
    refused(["generate", "--verifier", "mlx", "--model", "smollm2-135m", "--prompt", "hi"], "mlx")
    refused(["generate", "--verifier", "stub", "--drafter", "bundled:smollm2-135m", "--prompt", "hi"], "hf")
    refused(["eval", "--verifier", "stub", "--drafter", "prompt-lookup", "--out", "ev"], "eval")
    refused(["generate", "--verifier", "stub", "--prompt", "hi", "--json-object"], "grammar")
    print("the bare wheel: the stub decodes, every missing extra is one line")


if __name__ == "__main__":
    main()
