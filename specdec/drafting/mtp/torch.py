"""`--drafter mtp`: the verifier's own multi-token-prediction layers as its drafter (Qwen3.5 / Qwen3.6 /
Qwen3-Next checkpoints ship them: `mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`,
`mtp.layers.0.*`, `mtp.norm`).

Row r of the MTP layer pairs the embedding of the token at position r + 1 with the verifier's hidden state
at position r after its final norm (what transformers 5.25 hands its MTP layers: `hidden_states[-1]`,
the normed output on Qwen3.5, and what vLLM's Qwen3-Next MTP reads): `fc(concat(norm_e(emb), norm_h(h)))`
through one decoder layer of the model's own full-attention kind (MoE where the model is), `mtp.norm`, and
the model's LM head give the token at r + 2; a chain feeds each row's normed output back with the token
just drafted, so k drafts reuse the one layer k times (as vLLM does). The rows and their rollback are
`chain.ChainDrafter`'s; the layer is transformers' own `MtpModel`, loaded from the checkpoint's
safetensors (transformers' loader drops `mtp.*` from the model itself), with its own attention cache.

This module runs it beside the HF verifier (PyTorch); `mtp.mlx` beside the MLX verifier (mlx_lm's loaders
drop the `mtp.*` weights: it reads them from the checkpoint and builds the layer from mlx_lm's own class).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdec.drafting.chain import ChainDrafter
from specdec.drafting.policy import DraftPolicy
from specdec.kernels import use_cpu_linears
from specdec.protocols import MemoryProbe

__all__ = [
    "MTP_BLOCK_SIZE", "MTP_FILE", "SPLIT_TYPES", "MtpDrafter", "SplitMtp", "add_mtp", "check_mtp_folder",
    "check_split_fits", "load_mtp_model", "mtp_layer_count", "read_split", "tensor_names",
]  # fmt: skip

#: the file `add_mtp` writes beside a conversion: the `mtp.*` tensors, their layer count in its metadata
MTP_FILE = "mtp.safetensors"

#: drafts per step + 1 unless --block-size says: one layer chained on its own outputs drifts, so short
MTP_BLOCK_SIZE = 4
_COUNTS = ("mtp_num_hidden_layers", "num_mtp_layers", "num_nextn_predict_layers")


def mtp_layer_count(raw: dict[str, Any], folder: Path | None = None) -> int:
    """The MTP layers a model config names (its text config's or its own), else those an `add_mtp` file in
    `folder` says it holds; 0: none."""
    for c in (raw.get("text_config") or {}, raw):
        for k in _COUNTS:
            if isinstance(c.get(k), int) and c[k] > 0:
                return c[k]
    if folder is not None and (folder / MTP_FILE).is_file():
        from safetensors import safe_open

        with safe_open(str(folder / MTP_FILE), framework="pt") as f:
            return int((f.metadata() or {}).get("mtp_num_hidden_layers", 0))
    return 0


def tensor_names(f: Path) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(f), framework="pt") as h:
            return list(h.keys())
    except Exception as e:  # safetensors' errors of a truncated or foreign file
        raise ValueError(f"cannot read {str(f)!r} (truncated or not safetensors): {e}") from None


def _weight_files(folder: Path) -> dict[str, Path]:
    """Each tensor of a model folder's weights (its index's, or every file's) -> its file, `add_mtp`'s
    file aside."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {k: folder / f for k, f in json.loads(index.read_text()).get("weight_map", {}).items()}
    files = sorted(f for f in folder.glob("*.safetensors") if f.name != MTP_FILE)
    return {k: f for f in files for k in tensor_names(f)}


def _shapes(where: dict[str, Path], names: list[str]) -> dict[str, tuple[int, ...] | None]:
    """The shapes of `names` read from their files' headers (no tensor loads); None for a tensor stored
    quantized or packed (not a float dtype: its shape is not the layer's)."""
    from safetensors import safe_open

    out: dict[str, tuple[int, ...] | None] = {}
    for f in {where[k] for k in names}:
        with safe_open(str(f), framework="pt") as h:
            for k in (k for k in names if where[k] == f):
                piece = h.get_slice(k)
                floating = piece.get_dtype() in ("F16", "BF16", "F32", "F64")
                out[k] = tuple(piece.get_shape()) if floating else None
    return out


def check_mtp_folder(folder: str | Path, *, who: str = "--drafter mtp") -> int:
    """Before any weights load: the model folder's config names MTP layers and its weights hold them, as
    many as it names, of the model's shapes (`fc` [H, 2H], the norms [H], layer 0 as the model's own
    full-attention layer); the count, or a one-line ValueError from `who` saying what is wrong."""
    from specdec.models import read_config

    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{who}: {str(folder)!r} does not exist (or is not a folder)")
    raw = read_config(folder) or {}
    n = mtp_layer_count(raw, folder)
    if not n:
        raise ValueError(
            f"{who}: {folder.name!r} has no MTP layers (its config names none: "
            f"{' / '.join(_COUNTS)}); use another drafter"
        )
    beside = (folder / MTP_FILE).is_file()  # `add_mtp`'s copy beside a conversion (checked when copied)
    where = _weight_files(folder)
    if beside:
        where |= dict.fromkeys(tensor_names(folder / MTP_FILE), folder / MTP_FILE)
    full_name = {k.removeprefix("model.language_model.").removeprefix("model."): k for k in where}
    names = list(full_name)
    layers = {k.split(".")[2] for k in names if k.startswith("mtp.layers.")}
    if not any(k.startswith("mtp.") for k in names):
        raise ValueError(
            f"{who}: {folder.name!r} names {n} MTP layer(s) but its weights hold no mtp.* tensors (a "
            "conversion that dropped them); copy them from the original: specdec add-mtp <original> <folder>"
        )
    if len(layers) != n or not {"mtp.fc.weight", "mtp.norm.weight"} <= set(names):
        raise ValueError(
            f"{who}: {folder.name!r} names {n} MTP layer(s), its weights hold {len(layers)} "
            "(mtp.layers.*) and the fc / norm they need only in part"
        )
    text = raw.get("text_config") or raw
    H = text.get("hidden_size")
    norms = ("mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight")
    shapes = {"mtp.fc.weight": (H, 2 * H)} | dict.fromkeys(norms, (H,)) if isinstance(H, int) else {}
    full = [i for i, t in enumerate(text.get("layer_types") or []) if t == "full_attention"]
    pairs: dict[str, str] = {}  # an MTP layer's tensor -> the model's full-attention layer's, same shape
    if full and not beside:  # an MTP layer is a full-attention layer of the model's own kind: its weights
        want = {k.split(".", 2)[2] for k in names if k.startswith(f"layers.{full[-1]}.")}
        have = {k.split(".", 3)[3] for k in names if k.startswith("mtp.layers.0.")}
        if want - have:
            raise ValueError(
                f"{who}: {folder.name!r}'s mtp.layers.0 lacks {sorted(want - have)[:3]} of a "
                "full-attention layer of the model"
            )
        pairs = {f"mtp.layers.0.{k}": f"layers.{full[-1]}.{k}" for k in sorted(want)}
    asked = [k for k in dict.fromkeys([*shapes, *pairs, *pairs.values()]) if k in full_name]
    read = _shapes(where, [full_name[k] for k in asked])
    got = {k: read[full_name[k]] for k in asked}
    for k, shape in (shapes | {a: got.get(b) for a, b in pairs.items()}).items():
        if got.get(k) is not None and shape is not None and got[k] != shape:
            raise ValueError(
                f"{who}: {folder.name!r}'s {k} is {list(got[k])}, the model (hidden size {H}) needs "
                f"{list(shape)}: not this model's MTP layers"
            )
    return n


def load_mtp_model(main: Any, n: int, *, cpu_linears: bool = True) -> Any:
    """transformers' `MtpModel` of the HF model `main` whose checkpoint holds n MTP layers: its config told
    what `MtpModel` reads (real configs say `mtp_num_hidden_layers`), loaded quietly (its load report lists
    the model's own weights as unexpected), eval, no grad; with `cpu_linears`, its linears on a CPU switched
    to `specdec.kernels`' (one-row products cost about half; off: exactly as transformers runs it)."""
    from transformers.modeling_layers import MtpModel
    from transformers.utils import logging as hf_logging

    text = main.config.get_text_config()
    text.num_mtp_layers = n
    if getattr(text, "layer_types", None) is not None:
        text.mtp_layer_types = ["full_attention"] * n
    if getattr(text, "mlp_layer_types", None) is not None:
        text.mtp_mlp_layer_types = [text.mlp_layer_types[-1]] * n
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        mtp = MtpModel.from_pretrained(main, device_map={"": main.device}).eval().requires_grad_(False)
    finally:
        hf_logging.set_verbosity(level)
    if cpu_linears:
        use_cpu_linears(mtp)
    return mtp


#: the split model types read: mlx-vlm writes Qwen3.5 / 3.6 and Qwen3-Next MTP layers as this one
SPLIT_TYPES = ("qwen3_5_mtp",)
_NEEDED = ("fc.weight", "norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")


@dataclass(frozen=True)
class SplitMtp:
    """A split MTP folder as read before any weights load: the shape of the model it was split from, its
    layer count, and mlx's quantization config (None: not quantized)."""

    folder: Path
    hidden_size: int
    num_layers: int
    vocab_size: int
    layers: int
    quantization: dict[str, Any] | None
    weights_file: str


def _names(folder: Path) -> tuple[list[str], str]:
    files = sorted(p for p in folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder.name!r}: a split MTP folder without weights (no *.safetensors)")
    return [k for f in files for k in tensor_names(f)], ", ".join(f.name for f in files)


def read_split(folder: Path, raw: dict[str, Any]) -> SplitMtp:
    """The header of the split MTP folder `folder` (config `raw`), checked: a model type specdec reads, the
    model's shape, the tensors the layer needs, a quantization config where the weights are quantized."""
    where = f"split MTP folder {folder.name!r}"
    mt = raw.get("model_type")
    if mt not in SPLIT_TYPES:
        raise ValueError(
            f"{where} holds MTP layers of model_type {mt!r}; specdec reads {list(SPLIT_TYPES)} "
            "(Qwen3.5 / 3.6 / Qwen3-Next)"
        )
    text = raw.get("text_config")
    shape = (
        [text.get(k) for k in ("hidden_size", "num_hidden_layers", "vocab_size")]
        if isinstance(text, dict)
        else []
    )
    if len(shape) != 3 or not all(isinstance(v, int) and v > 0 for v in shape):
        raise ValueError(
            f"{where}: config.json lacks the model's text_config (hidden_size, num_hidden_layers, vocab_size)"
        )
    names, files = _names(folder)
    missing = [k for k in _NEEDED if k not in names] + (
        [] if any(k.startswith("layers.0.") for k in names) else ["layers.0.*"]
    )
    if missing:
        raise ValueError(f"{where}: its weights lack {missing}")
    q = raw.get("quantization")
    quantized = any(k.endswith(".scales") for k in names)
    if quantized and not (
        isinstance(q, dict) and isinstance(q.get("group_size"), int) and isinstance(q.get("bits"), int)
    ):
        raise ValueError(f"{where}: quantized weights but no quantization (group_size, bits) in config.json")
    hidden, layers, vocab = shape
    return SplitMtp(folder, hidden, layers, vocab, mtp_layer_count(raw) or 1, q if quantized else None, files)


def check_split_fits(header: SplitMtp, target: Any, name: str) -> None:
    """A one-line ValueError where the model `target` (a verifier, or its shape before it loads) is not the
    one the layers were split from (hidden size, layers, vocabulary)."""
    want = (header.hidden_size, header.num_layers, header.vocab_size)
    have = (target.hidden_size, target.num_layers, target.vocab_size)
    if want != have:
        raise ValueError(
            f"drafter {name!r}: MTP layers split from a model of hidden size {want[0]}, {want[1]} layers, "
            f"vocabulary {want[2]}; {target.model_name} has {have[0]}, {have[1]}, {have[2]}"
        )


def add_mtp(source: str | Path, target: str | Path) -> Path:
    """Copy the MTP layers of the original checkpoint `source` beside a conversion of it, `target` (an MLX
    conversion, whose converter dropped them): a new file `target/mtp.safetensors` with the `mtp.*` tensors
    as the original has them and their layer count in its metadata; nothing in `target` is changed or
    replaced (an existing file of that name is refused). The file is written under a staging name and
    linked into place; a staging file an interrupted run left is removed first. One line of ValueError
    where `source` has none, is `target`, or `target` is not a model of the same shape."""
    import os
    import tempfile

    from safetensors.torch import save_file

    from specdec.models import read_config

    source, target = Path(source), Path(target)
    if not source.is_dir():
        raise ValueError(f"add-mtp: the original checkpoint {str(source)!r} does not exist (or is no folder)")
    if not target.is_dir():
        raise ValueError(f"add-mtp: the conversion {str(target)!r} does not exist (or is not a folder)")
    if source.resolve() == target.resolve():
        raise ValueError(
            f"add-mtp: {str(source)!r} is both the original and the conversion; give the original "
            "checkpoint first and the conversion that dropped its MTP layers second"
        )
    n = check_mtp_folder(source, who="add-mtp")
    if not (target / "config.json").is_file():
        raise ValueError(f"{str(target)!r} is not a model folder (no config.json)")
    if (target / MTP_FILE).exists():
        raise ValueError(
            f"{str(target / MTP_FILE)!r} exists already; remove it first to copy the layers again"
        )
    a, b = (read_config(p) or {} for p in (source, target))
    a, b = (c.get("text_config") or c for c in (a, b))
    for k in ("hidden_size", "num_hidden_layers", "vocab_size"):
        if a.get(k) != b.get(k):
            raise ValueError(
                f"{target.name!r} is not a conversion of {source.name!r}: {k} {b.get(k)} != {a.get(k)}"
            )
    tensors = {}
    for f in sorted(source.glob("*.safetensors")):
        from safetensors import safe_open

        with safe_open(str(f), framework="pt") as h:
            tensors |= {k: h.get_tensor(k) for k in h.keys() if k.startswith("mtp.")}  # noqa: SIM118
    for stale in target.glob(f".{MTP_FILE}.*.tmp"):  # what an interrupted add-mtp left (only ours)
        stale.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{MTP_FILE}.", suffix=".tmp", dir=target)  # beside: one disk
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"mtp_num_hidden_layers": str(n)})
        os.chmod(tmp, 0o644)
        os.link(tmp, target / MTP_FILE)  # fails rather than replace a file that appeared meanwhile
    except FileExistsError:
        raise ValueError(f"{str(target / MTP_FILE)!r} appeared while copying; left as it is") from None
    finally:
        Path(tmp).unlink(missing_ok=True)
    return target / MTP_FILE


class _Cache:
    """transformers' `MtpCache` behind the settable `length` `ChainDrafter` moves."""

    def __init__(self, config: Any) -> None:
        from transformers.cache_utils import MtpCache

        self.hf = MtpCache(config=config)

    @property
    def length(self) -> int:
        return self.hf.get_seq_length()

    @length.setter
    def length(self, n: int) -> None:
        if n < self.length:
            self.hf.crop(n - self.length)  # transformers 5.25: the (negative) count to remove


class _Net:
    """The MTP layer 0 of transformers' `MtpModel` as a chain network (`chain.ChainDrafter`)."""

    def __init__(self, mtp: Any, final_norm: Any) -> None:
        self.mtp, self.final_norm = mtp, final_norm

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The last decoder layer's outputs [n, H] -> the verifier's final-normed hidden states [n, H]."""
        return self.final_norm(features)

    def rows(self, cache: _Cache, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        start, T = cache.length, emb.shape[0]
        pos = torch.arange(start + 1, start + 1 + T, device=emb.device)[None]  # row r: position r + 1
        out = self.mtp.forward_layer(0, hidden[None], pos, cache.hf, inputs_embeds=emb[None])
        return out[0]

    def readout(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mtp._project_to_logits(out), out  # the layer's post norm is in `out` already


class MtpDrafter(ChainDrafter):
    """The verifier's MTP layers as a `ChainDrafter` (module docstring). Built by `for_verifier`."""

    @classmethod
    def for_verifier(
        cls, verifier: Any, *, policy: DraftPolicy | None = None, block_size: int | None = None
    ) -> MtpDrafter:
        """The MTP drafter of an HF verifier whose checkpoint folder holds MTP layers (checked first)."""
        if verifier.runtime != "hf":
            raise ValueError(
                f"--drafter mtp runs on the HF and MLX verifiers, not the {verifier.runtime} one"
            )
        main = verifier.model
        n = check_mtp_folder(Path(main.config.name_or_path))
        mtp = load_mtp_model(main, n)
        device, dtype = main.device, main.dtype
        H, N = verifier.hidden_size, verifier.num_layers
        d = cls(
            _Net(mtp, verifier.final_norm_fn(device=main.device, dtype=main.dtype)),  # `FinalNorm`
            _Cache(mtp.config),
            name="mtp",
            policy=policy,
            block_size=block_size or MTP_BLOCK_SIZE,
            hidden_size=H,
            vocab_size=verifier.vocab_size,
            draft_vocab_size=verifier.vocab_size,
            feature_dim=H,
            target_layer_ids=(N - 1,),
            device=device,
            dtype=dtype,
        )
        d.mtp_layers, d.verifier = n, verifier
        return d

    def bind(self, verifier: Any) -> None:
        if getattr(verifier, "model", None) is not self.verifier.model:  # a sequence of its batch shares it
            raise ValueError("an MTP drafter drafts for the model whose layers it is (built with it)")
        self.verifier = verifier
        self.embed_fn = verifier.embed_fn(device=self.device, dtype=self.dtype)
        self.reset()

    def describe(self) -> dict[str, Any]:
        """For the result JSON: the MTP layers, that one is chained, the cut."""
        return {
            "architecture": "mtp",
            "mtp_layers": self.mtp_layers,
            "chained_layer": 0,
            **self.policy.describe(),
        }

    def memory_probe(self) -> MemoryProbe:
        from specdec.memory import probe_for_module

        return probe_for_module(self.model.mtp)
