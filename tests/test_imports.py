"""`import specdec` (and the CLI module) must not import mlx, transformers or the server stack."""

from __future__ import annotations

import subprocess
import sys


def test_import_specdec_is_light():
    code = (
        "import sys, specdec, specdec.api, specdec.cli, specdec.engine, specdec.stream, specdec.serve\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & "
        "{'mlx', 'mlx_lm', 'transformers', 'starlette', 'uvicorn', 'matplotlib'})\n"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
