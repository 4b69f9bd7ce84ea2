"""CI: the wheel as a user installs it. Run by the wheel venv's python from a folder outside the checkout
(`.ci/run`, the checkout's path as the one argument): the package must come from site-packages, every module
must import, the console script must answer, a stub generate must decode, and the bundled drafters and
corpora must be found and read through the installed package, the same files as the checkout's."""

from __future__ import annotations

import importlib
import json
import pkgutil
import subprocess
import sys
import tempfile
from pathlib import Path


def files(folder: Path) -> set[str]:
    return {
        str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts
    }


def check_modules(home: Path) -> None:
    import specdec

    assert "site-packages" in home.parts, f"specdec imported from {home}, not from the installed wheel"
    modules = [m.name for m in pkgutil.walk_packages(specdec.__path__, "specdec.")]
    for name in modules:
        if not name.endswith("__main__"):  # runs the command on import
            importlib.import_module(name)
    for sub in ("drafting", "serve", "train", "verifiers", "bridges", "evals"):
        assert f"specdec.{sub}" in modules, f"specdec.{sub} is not in the wheel"
    print(f"imported {len(modules)} modules from {home}")


def check_console_script() -> None:
    exe = str(Path(sys.executable).parent / "specdec")
    run = lambda *a: subprocess.run([exe, *a], capture_output=True, text=True)  # noqa: E731
    help_ = run("--help")
    assert help_.returncode == 0 and "generate" in help_.stdout, help_.stderr
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        gen = run(
            "generate", "--verifier", "stub", "--prompt", "Hello", "--max-new-tokens", "8", "--out", str(out)
        )
        assert gen.returncode == 0, gen.stderr
        assert len(json.loads(out.read_text())["prompts"][0]["output_tokens"]) == 8
    bad = run("generate", "--verifier", "stub", "--drafter", "no/such-folder", "--prompt", "x")
    assert bad.returncode == 2 and bad.stderr.startswith("error:"), bad.stderr
    print("specdec --help, a stub generate and a refusal: ok")


def check_bundled(home: Path, checkout: Path) -> None:
    from specdec.bundled import BUNDLED, bundled_corpus, bundled_drafter
    from specdec.corpus import Corpus
    from specdec.drafting.dflash.config import check_checkpoint

    for name in BUNDLED:
        folder = bundled_drafter(name)
        assert home in folder.resolve().parents, folder
        check_checkpoint(folder)  # config and every weight's name and shape, from the installed files
        corpus = bundled_corpus(name)
        if corpus is not None:
            assert Corpus(corpus).all_sequences(), f"{name}: the bundled corpus has no sequences"
    source, installed = files(checkout / "specdec" / "bundled"), files(home / "bundled")
    assert source <= installed, f"bundled files missing from the wheel: {sorted(source - installed)[:10]}"
    print(f"bundled drafters and corpora found and read: {sorted(BUNDLED)}")


def main(checkout: Path) -> int:
    import specdec

    home = Path(specdec.__file__).resolve().parent
    check_modules(home)
    check_console_script()
    check_bundled(home, checkout)
    print("wheel smoke: ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1])))
