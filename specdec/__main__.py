"""`python -m specdec`: the `specdec` command."""

from specdec.console import main

raise SystemExit(main())
