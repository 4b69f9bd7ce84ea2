"""`--drafter mtp` beside an MLX verifier: the model's MTP layer run in MLX (see `mtp.torch` for
what it computes). mlx_lm's loaders drop the `mtp.*` weights, so they are read from the checkpoint's
safetensors here (an original, unconverted checkpoint, or a conversion `specdec add-mtp` gave them back)
and put in the layout of mlx-vlm's split MTP folders (`qwen3_5_mtp`: `fc`, the three norms shifted as the
model's zero-centred norms are, `layers.0.*` through the model's own `sanitize`: expert stacking). A split
folder (`--drafter <folder>`, `specdec.drafting.mtp.entry`) is read as it is, quantized or not; weights read
from a checkpoint are quantized as the model's own layer of the same kind is where the model is quantized
(`_quantize_like`: a 4-bit conversion gets a 4-bit MTP layer, as `mlx_vlm.convert --mtp -q` writes one).
Either way the layer is the MLX model's own decoder-layer class at a full-attention index. Its K/V cache
is mlx_lm's `KVCache` (rolled back by `trim`); the verifier's final norm, embedding and LM head are its own
modules. A proposal stays lazy until its one sync.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import torch

from specdec.bridges.mlx import embed_scale, materialize, text_model
from specdec.drafting.chain_mlx import MLXChainProposals
from specdec.drafting.layers_mlx import head_fn
from specdec.drafting.mtp.torch import MTP_BLOCK_SIZE, check_mtp_folder, check_split_fits
from specdec.drafting.policy import DraftPolicy

__all__ = ["MLXMtpDrafter", "checkpoint_weights", "split_weights"]

_NORMS = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")


def _full_attention_index(model: nn.Module) -> int:
    """The first full-attention layer of a hybrid model (Qwen3.5 / 3.6 / Qwen3-Next): the MTP layer's kind."""
    layers = text_model(model).model.layers
    found = next((i for i, la in enumerate(layers) if not getattr(la, "is_linear", True)), None)
    if found is None:
        raise ValueError(
            f"MTP layers draft for Qwen3.5 / 3.6 / Qwen3-Next models; {type(layers[0]).__module__} has no "
            "full-attention layer of that kind"
        )
    return found


def _mtp_tensors(folder: Path) -> tuple[dict[str, mx.array], str]:
    """The checkpoint's `mtp.*` tensors (whatever shard holds them) and the prefix of its model's layers
    ("model." or a multimodal checkpoint's "model.language_model.")."""
    out: dict[str, mx.array] = {}
    root = "model."
    for f in sorted(folder.glob("*.safetensors")):
        arrays = mx.load(str(f))
        out |= {k: v for k, v in arrays.items() if k.startswith("mtp.")}
        root = "model.language_model." if any(k.startswith("model.language_model.") for k in arrays) else root
    return out, root


def _layer_weights(model: nn.Module, tensors: dict[str, mx.array], root: str) -> dict[str, mx.array]:
    """`mtp.layers.0.*` as the model's layer at a full-attention index has its weights: renamed to that
    layer's (under the checkpoint's `root` prefix) and through the model's own `sanitize`. An original
    checkpoint's norms are zero-centred and sanitize shifts them where it sees the unconverted conv1d
    layout, so a conv1d of that layout goes along to tell it (the `mtp.*` weights only exist unconverted)."""
    fa = _full_attention_index(model)
    prefix = f"{root}layers.{fa}."
    raw = {
        prefix + k.removeprefix("mtp.layers.0."): v
        for k, v in tensors.items()
        if k.startswith("mtp.layers.0.")
    }
    raw[f"{root}layers.0.linear_attn.conv1d.weight"] = mx.zeros((1, 1, 4))  # read by sanitize, then dropped
    mark = f"layers.{fa}."
    return {k.split(mark, 1)[1]: v for k, v in model.sanitize(raw).items() if mark in k}


def checkpoint_weights(model: nn.Module, folder: Path) -> dict[str, mx.array]:
    """The MTP weights of the verifier's checkpoint `folder` (HF layout) in the split layout."""
    tensors, root = _mtp_tensors(folder)
    out = {"fc.weight": tensors["mtp.fc.weight"]}
    out |= {f"{n}.weight": tensors[f"mtp.{n}.weight"] + 1.0 for n in _NORMS}  # zero-centred, as the model's
    return out | {f"layers.0.{k}": v for k, v in _layer_weights(model, tensors, root).items()}


def split_weights(folder: Path) -> dict[str, mx.array]:
    """A split MTP folder's tensors, as they lie (mlx-vlm wrote them in the layout `_Mtp` names)."""
    out: dict[str, mx.array] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= mx.load(str(f))
    return out


class _Mtp(nn.Module):
    """The MTP layer's own modules, named as the split layout names its tensors."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        tm = text_model(model)
        H, eps = tm.args.hidden_size, tm.args.rms_norm_eps
        fa = _full_attention_index(model)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, self.norm = (
            nn.RMSNorm(H, eps=eps) for _ in _NORMS
        )
        self.layers = [type(tm.model.layers[fa])(tm.args, fa)]

    @classmethod
    def load(
        cls, model: nn.Module, weights: Mapping[str, mx.array], quantization: Mapping[str, Any] | None
    ) -> _Mtp:
        """Built for `model` and given `weights` (strict: every tensor, no more), quantized first where
        `quantization` (mlx's config: group_size, bits, mode, per-module overrides) and the weights say."""
        m = cls(model)
        if quantization:

            def which(path: str, _: nn.Module) -> bool | dict[str, Any]:
                own = quantization.get(path)
                return own if isinstance(own, dict) else f"{path}.scales" in weights

            nn.quantize(
                m,
                group_size=quantization["group_size"],
                bits=quantization["bits"],
                mode=quantization.get("mode", "affine"),
                class_predicate=which,
            )
        try:
            m.load_weights(list(weights.items()), strict=True)
        except ValueError as e:  # another model's layer: mlx names the tensors that do not fit
            raise ValueError(f"the MTP weights do not fit this model's full-attention layer: {e}") from None
        return m


def _quantize_like(mtp: _Mtp, model: nn.Module) -> dict[str, Any] | None:
    """Quantize the float MTP layer `mtp` as `model`'s own layer at its full-attention index is: each module
    whose counterpart there is quantized, with that one's group size, bits and mode (a mixed recipe stays
    mixed); `fc` (no counterpart) as that layer's attention output projection. What most quantized
    modules got ({group_size, bits, mode}), None where nothing was (a model that is not quantized)."""
    theirs = dict(text_model(model).model.layers[_full_attention_index(model)].named_modules())
    done: list[tuple[tuple[str, Any], ...]] = []

    def like(path: str, module: nn.Module) -> bool | dict[str, Any]:
        them = theirs.get("self_attn.o_proj" if path == "fc" else path.removeprefix("layers.0."))
        if getattr(them, "bits", None) is None:
            return False
        done.append((("group_size", them.group_size), ("bits", them.bits), ("mode", them.mode)))
        return dict(done[-1])

    nn.quantize(mtp, class_predicate=like)
    return dict(max(set(done), key=done.count)) if done else None


class _Net(nn.Module):
    def __init__(self, model: nn.Module, mtp: _Mtp) -> None:
        super().__init__()
        self.mtp = mtp
        # the verifier's own final norm (mlx_lm shifted it when it loaded)
        self.final_norm = text_model(model).model.norm
        self.head = head_fn(model, None)  # the verifier's LM head (a function: not a parameter here)

    def fuse(self, features: mx.array) -> mx.array:
        """The last decoder layer's outputs [n, H] -> the verifier's final-normed hidden states [n, H]."""
        return self.final_norm(features)

    def rows(self, cache: _KV, emb: mx.array, hidden: mx.array) -> mx.array:
        """New rows after the cache's: embeddings, hidden states [T, H] -> outputs [T, H] (post-normed)."""
        m = self.mtp
        x = m.fc(
            mx.concatenate([m.pre_fc_norm_embedding(emb), m.pre_fc_norm_hidden(hidden.astype(emb.dtype))], -1)
        )
        mask = "causal" if emb.shape[0] > 1 else None
        return m.norm(m.layers[0](x[None], mask=mask, cache=cache.kv))[0]

    def readout(self, out: mx.array) -> tuple[mx.array, mx.array]:
        return self.head(out), out  # the layer's post norm is in `out` already


class _KV:
    """mlx_lm's `KVCache` of the MTP layer behind the settable `length` the chain drafters move."""

    def __init__(self) -> None:
        from mlx_lm.models.cache import KVCache

        self.kv = KVCache()

    @property
    def length(self) -> int:
        return self.kv.offset

    @length.setter
    def length(self, n: int) -> None:
        if n < self.kv.offset:
            self.kv.trim(self.kv.offset - n)

    def arrays(self) -> list[mx.array]:
        return [] if self.kv.keys is None else [self.kv.keys, self.kv.values]


class MLXMtpDrafter(MLXChainProposals):
    """The MTP layer as a chain drafter beside an `MLXVerifier` (`runtime = "mlx"`): the verifier's own
    (`--drafter mtp`, from its checkpoint folder) or, with `split` (`mtp.SplitMtp`), a split folder's.
    Built for the verifier it is bound to (again for another)."""

    def __init__(
        self,
        verifier: Any = None,
        *,
        policy: DraftPolicy | None = None,
        block_size: int | None = None,
        split: Any = None,
    ) -> None:
        self.split, self.verifier, self.quantized = split, None, None
        self.name, self.policy = "mtp", policy or DraftPolicy()
        self.block_size = block_size or MTP_BLOCK_SIZE
        self.mtp_layers = split.layers if split is not None else 0
        self.device, self.dtype = torch.device("cpu"), torch.float32
        if verifier is not None:
            self.bind(verifier)

    def _build(self, verifier: Any) -> None:
        model = verifier.model
        if self.split is not None:
            check_split_fits(self.split, verifier, self.name)
            try:
                mtp = _Mtp.load(model, split_weights(self.split.folder), self.split.quantization)
            except ValueError as e:
                raise ValueError(f"drafter {self.name!r}: {e}") from None
        else:
            if getattr(verifier, "path", None) is None:
                raise ValueError(
                    "--drafter mtp needs the MLX verifier's checkpoint folder (its mtp.* weights)"
                )
            folder = Path(verifier.path)
            self.mtp_layers = check_mtp_folder(folder)
            mtp = _Mtp.load(model, checkpoint_weights(model, folder), None)
            self.quantized = _quantize_like(mtp, model)
        self.model = _Net(model, mtp)
        H, N = verifier.hidden_size, verifier.num_layers
        self.target_layer_ids, self.feature_dim = (N - 1,), H
        self.vocab_size = self.draft_vocab_size = verifier.vocab_size
        table, scale = text_model(model).model.embed_tokens, embed_scale(model)
        self._embed = table if scale is None else (lambda i: table(i) * scale)
        self._cache = _KV()
        self._fused = mx.zeros((256, H), dtype=self.model.final_norm.weight.dtype)
        materialize(self.model, self._fused)  # the layer's RoPE too: any thread may decode

    def describe(self) -> dict[str, Any]:
        where = (
            {"quantization": self.quantized}
            if self.split is None
            else {"split_folder": str(self.split.folder), "quantization": self.split.quantization}
        )
        return {
            "architecture": "mtp",
            "mtp_layers": self.mtp_layers,
            "chained_layer": 0,
            "runtime": "mlx",
            **where,
            **self.policy.describe(),
        }

    def bind(self, verifier: Any) -> None:
        if self.verifier is None or verifier.model is not self.verifier.model:  # built for the model once
            self._build(verifier)
        self.verifier = verifier  # a sequence of a batch over that model, say
        self.reset()
