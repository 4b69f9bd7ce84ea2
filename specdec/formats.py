"""What a checkpoint folder is, from its config.json alone (before any weights load).

specdec reads DFlash and DFlash2 drafters in the public format, and causal LMs as draft models
(`model:<folder>`). The field's other drafter formats are recognised by the marks their configs carry and
named in the error, so a user learns what the folder holds (and that specdec does not read it yet) instead
of a diagnosis as a broken DFlash config; a drafter folder given as a model is refused the same way. It
sits below the verifiers and the drafters, since both read it.

The marks, from the public configs and loaders (vLLM, SGLang, speculators, mlx-vlm 0.7.10, transformers):
- DFlash / DFlash2: `architectures` DFlashDraftModel / DFlash2DraftModel, or a `dflash_config`
- the speculators container: `speculators_model_type` (eagle3, eagle, peagle, dflash, dspark, mtp, ...)
- EAGLE-3: an architecture naming Eagle3 (SGLang's LlamaForCausalLMEagle3), `model_type` eagle3, or a
  `draft_vocab_size` (yuhuili's configs); EAGLE-1/2: an architecture naming Eagle
- Medusa: `medusa_num_heads`; DSpark: `model_type` or an architecture naming dspark, a `markov_rank`
  (top level or in `dflash_config`), or `dflash_config.projector_type` dspark (checked before DFlash)
- Gemma-4 assistants: `model_type` gemma4_assistant / gemma4_unified_assistant
- MTP layers split into a folder of their own: a `model_type` ending in _mtp (mlx-vlm's qwen3_5_mtp)
- PARD: `pard_token` (or `ptd_token_id`), on an otherwise plain causal LM
- a model carrying MTP layers: `num_nextn_predict_layers`, `mtp_num_hidden_layers` or `num_mtp_layers` > 0
- a causal LM: an architecture ending in ForCausalLM or ForConditionalGeneration
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DRAFTER_KINDS", "Format", "identify", "refuse_as_drafter", "refuse_as_model"]

#: family -> how a message names it
NAMES = {
    "dflash": "a DFlash drafter", "dflash2": "a DFlash2 drafter", "eagle3": "an EAGLE-3 drafter",
    "eagle": "an EAGLE (1/2) drafter", "peagle": "a P-EAGLE drafter", "medusa": "a Medusa drafter",
    "dspark": "a DSpark drafter", "mtp": "MTP drafter layers", "mlp": "an MLP speculator",
    "gemma4-assistant": "a Gemma-4 assistant drafter", "pard": "a PARD parallel draft model",
    "model-with-mtp": "a model with MTP layers", "causal-lm": "a causal LM",
    "unknown": "an unrecognised checkpoint",
}  # fmt: skip
#: the families that are drafters only (never a verifier's model)
DRAFTER_KINDS = frozenset(NAMES) - {"pard", "model-with-mtp", "causal-lm", "unknown"}
#: speculators_model_type -> family ("independent": a plain draft model)
_SPECULATORS = {"eagle3": "eagle3", "eagle": "eagle", "peagle": "peagle", "dflash": "dflash",
                "dspark": "dspark", "mtp": "mtp", "mlp": "mlp", "independent": "causal-lm"}  # fmt: skip
_MTP_COUNTS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers")


@dataclass(frozen=True)
class Format:
    """What a config says a folder holds: its family (a key of `NAMES`), the dialect of its config (whose
    layout), and the config's model_type / architectures for messages."""

    family: str
    dialect: str
    model_type: str = ""
    architectures: tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        """Deprecated name of `family`."""
        import warnings

        warnings.warn("Format.kind is deprecated: use Format.family", DeprecationWarning, 2)
        return self.family

    def readable(self, formats: Collection[tuple[str, str]]) -> bool:
        """specdec reads it as a `--drafter` checkpoint folder, where it reads the (format kind, dialect)
        pairs `formats` (`registry.READABLE`)."""
        return (self.family, self.dialect) in formats

    def describe(self) -> str:
        """e.g. "an EAGLE-3 drafter (speculators format)", "a causal LM (model_type 'llama')"."""
        what = NAMES[self.family]
        if self.dialect:
            return f"{what} ({self.dialect} format)"
        if self.family in DRAFTER_KINDS:
            return what
        seen = [f"model_type {self.model_type!r}"] if self.model_type else []
        seen += [f"architectures {list(self.architectures)}"] if self.architectures else []
        return f"{what} ({', '.join(seen)})" if seen else what


def _text(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    sub = raw.get("text_config")
    return sub if isinstance(sub, Mapping) else {}


def identify(raw: Mapping[str, Any], files: Collection[str] = ()) -> Format:
    """The `Format` of a config dict (`files`: the names in its folder, which tell some dialects apart)."""
    listed = raw.get("architectures")
    archs = tuple(a for a in listed if isinstance(a, str)) if isinstance(listed, list) else ()
    mt = str(raw.get("model_type") or "")
    low = [a.lower() for a in archs]
    fmt = lambda family, dialect: Format(family, dialect, mt, archs)  # noqa: E731
    spec = raw.get("speculators_model_type")
    if isinstance(spec, str) or isinstance(raw.get("speculators_config"), Mapping):
        return fmt(_SPECULATORS.get(str(spec), "unknown"), "speculators")
    dfc = raw.get("dflash_config") if isinstance(raw.get("dflash_config"), Mapping) else {}
    dspark_marks = ("markov_rank" in raw, "markov_rank" in dfc, dfc.get("projector_type") == "dspark")
    if "dspark" in mt or any("dspark" in a for a in low) or any(dspark_marks):
        return fmt("dspark", "public")
    if "DFlash2DraftModel" in archs:
        return fmt("dflash2", "public")
    if "DFlashDraftModel" in archs or "dflash_config" in raw:
        return fmt("dflash", "public")
    if mt == "eagle3" or any("eagle3" in a for a in low) or "draft_vocab_size" in raw:
        yuhuili = "pytorch_model.bin" in files or "LlamaForCausalLMEagle3" not in archs
        return fmt("eagle3", "mlx-vlm" if mt == "eagle3" else "yuhuili" if yuhuili else "SGLang")
    if any("eagle" in a for a in low):
        return fmt("eagle", "")
    if "medusa_num_heads" in raw or mt == "medusa":
        return fmt("medusa", "")
    if mt in ("gemma4_assistant", "gemma4_unified_assistant"):
        return fmt("gemma4-assistant", "unified" if "unified" in mt else "")
    if mt.endswith("_mtp"):
        return fmt("mtp", "split")
    if "pard_token" in raw or "ptd_token_id" in raw:
        return fmt("pard", "")
    if any(isinstance(c.get(k), int) and c[k] > 0 for c in (raw, _text(raw)) for k in _MTP_COUNTS):
        return fmt("model-with-mtp", "")
    if any(a.endswith(("ForCausalLM", "ForConditionalGeneration")) for a in archs):
        return fmt("causal-lm", "")
    return fmt("unknown", "")


def refuse_as_drafter(
    folder: str | Path, raw: Mapping[str, Any], *, name: str, readable: Collection[tuple[str, str]]
) -> Format:
    """The format of the drafter checkpoint folder `folder` (config `raw`), or a one-line ValueError naming
    what it holds where it is not one of the (format kind, dialect) pairs `readable`."""
    files = {p.name for p in Path(folder).iterdir()} if Path(folder).is_dir() else set()
    fmt = identify(raw, files)
    if fmt.readable(readable):
        return fmt
    where = f"drafter {name!r}" + (f" ({str(folder)!r})" if name != str(folder) else "")
    where += f" holds {fmt.describe()}"
    as_model = f"to draft with it token by token, pass --drafter model:{folder}"
    if fmt.family == "model-with-mtp":
        raise ValueError(
            f"{where}, not a drafter checkpoint: to draft with its MTP layers, load it as --model and pass "
            f"--drafter mtp (HF verifier); {as_model}"
        )
    if fmt.family == "pard":
        raise ValueError(f"{where}; to draft with it (a block per forward), pass --drafter model:{folder}")
    if fmt.family == "causal-lm":
        raise ValueError(f"{where}, not a drafter checkpoint; {as_model}")
    if fmt.family == "unknown":
        raise ValueError(
            f"{where}; specdec reads DFlash / DFlash2 checkpoints (config.json with dflash_config), EAGLE-3 "
            "checkpoints (speculators, yuhuili's or SGLang's) and draft models (model:<folder>)"
        )
    raise ValueError(f"{where}, which specdec does not read yet")


def refuse_as_model(
    folder: str | Path, raw: Mapping[str, Any], *, readable: Collection[tuple[str, str]] | None = None
) -> None:
    """A one-line ValueError where the model folder `folder` (config `raw`) holds a drafter, not a model;
    with `readable` (the format kinds specdec reads as drafters, `registry.READABLE`) it says which to do."""
    fmt = identify(raw)
    if fmt.family in DRAFTER_KINDS:
        use = (
            ""
            if readable is None
            else " (pass it as --drafter)"
            if fmt.readable(readable)
            else (" (specdec does not read it yet)")
        )
        raise ValueError(f"{str(folder)!r} holds {fmt.describe()}, not a model: it drafts for one{use}")
