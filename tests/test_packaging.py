"""What a wheel holds: every package and every data file of the source tree (issue 49: the wheel once lacked
`specdec.drafting` and `specdec.serve`, so an installed specdec did not start while editable installs did).

The fast checks read pyproject.toml against the tree; the last one builds the wheel and reads it. CI also
installs that wheel in a fresh venv and runs it from outside the checkout (`.ci/wheel_smoke.py`)."""

from __future__ import annotations

import fnmatch
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]
SETUP = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
# scripts run from a checkout (not imported, not package data)
REPO_ONLY = ("evals/*.sh",)


def _package_dirs() -> dict[str, Path]:
    """Package name -> folder, as pyproject maps them."""
    mapping = SETUP["package-dir"]
    out = {}
    for name in SETUP["packages"]:
        root = max((k for k in mapping if name == k or name.startswith(k + ".")), key=len)
        out[name] = ROOT / mapping[root] / Path(*name[len(root) :].split(".")[1:])
    return out


def _source_files() -> list[Path]:
    return [
        p
        for top in ("specdec", "bridges", "verifiers", "evals")
        for p in sorted((ROOT / top).rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    ]


def _owner(path: Path, dirs: dict[str, Path]) -> str | None:
    """The listed package whose folder holds `path` directly."""
    return next((name for name, d in dirs.items() if path.parent == d), None)


def test_every_folder_with_an_init_is_a_listed_package():
    dirs = _package_dirs()
    found = {p.parent for p in _source_files() if p.name == "__init__.py"}
    missing = sorted(str(d.relative_to(ROOT)) for d in found - set(dirs.values()))
    assert not missing, f"packages not in pyproject.toml [tool.setuptools] packages: {missing}"
    gone = sorted(name for name, d in dirs.items() if not d.is_dir())
    assert not gone, f"listed packages without a folder: {gone}"


def test_every_module_and_data_file_ships():
    """Each source file lies in a listed package's own folder and, if it is not Python, matches that
    package's package-data patterns (patterns are relative to the package folder)."""
    dirs, data = _package_dirs(), SETUP.get("package-data", {})
    homeless, unshipped = [], []
    for f in _source_files():
        rel = str(f.relative_to(ROOT))
        if any(fnmatch.fnmatch(rel, pat) for pat in REPO_ONLY):
            continue
        # data files sit below their package's folder, in subfolders without an __init__.py
        pkg = next(
            (n for n, d in sorted(dirs.items(), key=lambda kv: -len(kv[1].parts)) if d in f.parents), None
        )
        if f.suffix == ".py":
            if _owner(f, dirs) is None:
                homeless.append(rel)
        elif pkg is None or not any(
            fnmatch.fnmatch(str(f.relative_to(dirs[pkg])), pat) for pat in data.get(pkg, [])
        ):
            unshipped.append(rel)
    assert not homeless, f"modules outside every listed package: {homeless}"
    assert not unshipped, f"data files no package-data pattern ships: {unshipped[:10]}"


def test_the_built_wheel_holds_every_module_and_data_file(tmp_path: Path):
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path),
         str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if proc.returncode != 0 and "No module named" in proc.stderr:
        pytest.skip(f"cannot build a wheel here: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("specdec-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    dirs = _package_dirs()
    want = set()
    for f in _source_files():
        if any(fnmatch.fnmatch(str(f.relative_to(ROOT)), pat) for pat in REPO_ONLY):
            continue
        pkg = next(n for n, d in sorted(dirs.items(), key=lambda kv: -len(kv[1].parts)) if d in f.parents)
        want.add("/".join([*pkg.split("."), *f.relative_to(dirs[pkg]).parts]))
    assert not sorted(want - names), f"missing from the wheel: {sorted(want - names)[:10]}"
