"""What a hostile probe of the engine, the command line and the API found (issue 49: 511 cases, 15 bugs).
Each test here reproduced its bug before the fix."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_ctrl_c_while_torch_imports_is_one_line_and_exit_1():
    """The console script imports torch (seconds) inside its own interrupt handling; an import hook stands
    in for the key press, at the same moment each time."""
    code = textwrap.dedent("""
        import sys
        class Interrupt:
            def find_spec(self, name, path=None, target=None):
                if name == "torch":
                    raise KeyboardInterrupt
        sys.meta_path.insert(0, Interrupt())
        from specdec.console import main
        sys.exit(main(["generate", "--verifier", "stub", "--prompt", "hi"]))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stderr) == (1, "error: interrupted\n")
