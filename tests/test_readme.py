"""Every command line the README shows parses with the command line it names: a renamed or dropped flag
fails here, not in a new user's terminal. (The two set-up commands run in CI itself.)"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from specdec.cli import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"


def _commands() -> list[list[str]]:
    """The `specdec ...` lines of the README's bash blocks, continuations joined, comments dropped."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            argv: list[str] = []
            for word in [*shlex.split(line, comments=True), "&&"]:  # commands chained with &&
                if word != "&&":
                    argv.append(word)
                    continue
                if argv and argv[0].endswith("specdec"):
                    out.append(argv[1:])
                argv = []
    return out


def test_the_readme_shows_commands():
    commands = _commands()
    assert len(commands) >= 8 and {c[0] for c in commands} >= {"demo", "generate", "eval", "serve", "fetch"}


@pytest.mark.parametrize("argv", _commands(), ids=lambda a: " ".join(a)[:60])
def test_readme_command_parses(argv, capsys):
    try:
        build_parser().parse_args(argv)
    except SystemExit as e:  # argparse's error exit (2): the message says which flag
        pytest.fail(f"`specdec {' '.join(argv)}` does not parse: {capsys.readouterr().err}")
        raise AssertionError from e
