"""The `specdec` console script. It imports the command line (and with it torch, which takes seconds)
inside its own Ctrl-C handling, so an interrupt at any moment is `error: interrupted` and exit code 1."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    try:
        from specdec.cli import main as cli_main

        return cli_main(argv)  # a command's own interrupts are answered inside (`specdec.args.run_command`)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
