"""Which optional extra of the package provides a module, and the one line that says what to install.

A wheel installed without an extra (`pip install specdec` without `[serve]`) lacks what a command needs;
the command says so in one line, naming the extra, before it does any work (`require`), and a module
missing later still becomes that line, not a traceback (`missing_extra`, used by `args.run_command`).
"""

from __future__ import annotations

import importlib.util

__all__ = ["EXTRAS", "missing_extra", "require"]

#: top-level module -> the extra of pyproject.toml that installs it
EXTRAS: dict[str, str] = {
    "transformers": "hf", "safetensors": "hf", "gguf": "hf", "accelerate": "hf", "jinja2": "hf",
    "mlx": "mlx", "mlx_lm": "mlx",
    "matplotlib": "eval",
    "starlette": "serve", "uvicorn": "serve",
    "llguidance": "grammar",
    "jsonschema": "dev",
}  # fmt: skip


def _install(extra: str) -> str:
    return f"pip install 'specdec[{extra}]'"


def missing_extra(e: BaseException) -> str | None:
    """The one line for an import of a module an extra provides (None: `e` is something else)."""
    if not isinstance(e, ModuleNotFoundError) or not e.name:
        return None
    top = e.name.split(".")[0]
    extra = EXTRAS.get(top)
    if extra is None:
        return None
    return f"no module named {top!r}: it comes with the {extra} extra; {_install(extra)}"


def require(what: str, extra: str) -> None:
    """A one-line ValueError unless every module of `extra` imports here; `what` needs them (a command, a
    verifier). Only looks for the modules: nothing is imported."""
    missing = [m for m, x in EXTRAS.items() if x == extra and importlib.util.find_spec(m) is None]
    if missing:
        names = ", ".join(missing)
        raise ValueError(f"{what} needs the {extra} extra ({names} not installed): {_install(extra)}")
