"""`--drafter mtp` beside an MLX verifier: the model's MTP layer run in MLX (see `specdec.drafting.mtp` for
what it computes). mlx_lm's loaders drop the `mtp.*` weights, so they are read from the checkpoint's
safetensors here (an original, unconverted checkpoint: conversions drop them) and the layer is built from
the MLX model's own decoder-layer class at a full-attention index, its weights passed through the model's
own `sanitize` (expert stacking, Qwen3.5's zero-centred norms) as the model's layers were. The layer's
K/V cache is mlx_lm's `KVCache` (rolled back by `trim`); the verifier's final norm, embedding and LM head
are its own modules. A proposal stays lazy until its one sync.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import torch

from specdec.bridges.mlx import embed_scale, text_model
from specdec.drafting.chain_mlx import MLXChainProposals
from specdec.drafting.dflash_mlx import _head_fn
from specdec.drafting.mtp import MTP_BLOCK_SIZE, check_mtp_folder
from specdec.drafting.policy import DraftPolicy

__all__ = ["MLXMtpDrafter"]


def _mtp_weights(folder: Path) -> tuple[dict[str, mx.array], str]:
    """The checkpoint's `mtp.*` tensors (whatever shard holds them) and the prefix of its model's layers
    ("model." or a multimodal checkpoint's "model.language_model.")."""
    out: dict[str, mx.array] = {}
    root = "model."
    for f in sorted(folder.glob("*.safetensors")):
        arrays = mx.load(str(f))
        out |= {k: v for k, v in arrays.items() if k.startswith("mtp.")}
        root = "model.language_model." if any(k.startswith("model.language_model.") for k in arrays) else root
    return out, root


def _layer(model: nn.Module, weights: dict[str, mx.array], root: str) -> nn.Module:
    """The MTP decoder layer: the model's own layer class at a full-attention index, its weights (renamed
    to that layer's, under the checkpoint's `root` prefix) through the model's own `sanitize`. An original
    checkpoint's norms are zero-centred and sanitize shifts them where it sees the unconverted conv1d
    layout, so a conv1d of that layout goes along to tell it (the `mtp.*` weights only exist unconverted)."""
    tm = text_model(model)
    fa = next(i for i, la in enumerate(tm.model.layers) if not getattr(la, "is_linear", True))
    layer = type(tm.model.layers[fa])(tm.args, fa)
    prefix = f"{root}layers.{fa}."
    raw = {
        prefix + k.removeprefix("mtp.layers.0."): v
        for k, v in weights.items()
        if k.startswith("mtp.layers.0.")
    }
    raw[f"{root}layers.0.linear_attn.conv1d.weight"] = mx.zeros((1, 1, 4))  # read by sanitize, then dropped
    clean = model.sanitize(raw)
    mark = f"layers.{fa}."
    layer.load_weights([(k.split(mark, 1)[1], v) for k, v in clean.items() if mark in k], strict=True)
    return layer


class _Net(nn.Module):
    def __init__(self, model: nn.Module, weights: dict[str, mx.array], root: str) -> None:
        super().__init__()
        tm = text_model(model)
        H, eps = tm.args.hidden_size, tm.args.rms_norm_eps
        self.layer = _layer(model, weights, root)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.fc.weight = weights["mtp.fc.weight"]
        self.enorm, self.hnorm, self.post = (nn.RMSNorm(H, eps=eps) for _ in range(3))
        for norm, name in (
            (self.enorm, "pre_fc_norm_embedding"),
            (self.hnorm, "pre_fc_norm_hidden"),
            (self.post, "norm"),
        ):
            norm.weight = weights[f"mtp.{name}.weight"] + 1.0  # zero-centred, as the model's own norms
        self.final_norm = tm.model.norm  # the verifier's own (mlx_lm shifted it when it loaded)
        self.head = _head_fn(model, None)  # the verifier's LM head (a function: not a parameter here)

    def fuse(self, features: mx.array) -> mx.array:
        """The last decoder layer's outputs [n, H] -> the verifier's final-normed hidden states [n, H]."""
        return self.final_norm(features)

    def rows(self, cache: _KV, emb: mx.array, hidden: mx.array) -> mx.array:
        """New rows after the cache's: embeddings, hidden states [T, H] -> outputs [T, H] (post-normed)."""
        x = self.fc(mx.concatenate([self.enorm(emb), self.hnorm(hidden.astype(emb.dtype))], -1))[None]
        mask = "causal" if emb.shape[0] > 1 else None
        return self.post(self.layer(x, mask=mask, cache=cache.kv))[0]

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
    """The MTP layer as a chain drafter beside an `MLXVerifier` (`runtime = "mlx"`)."""

    def __init__(
        self, verifier: Any, *, policy: DraftPolicy | None = None, block_size: int | None = None
    ) -> None:
        if getattr(verifier, "path", None) is None:
            raise ValueError("--drafter mtp needs the MLX verifier's checkpoint folder (its mtp.* weights)")
        folder = Path(verifier.path)
        self.mtp_layers = check_mtp_folder(folder)
        model = verifier.model
        self.model = _Net(model, *_mtp_weights(folder))
        mx.eval(self.model.parameters())
        self.verifier, self.name, self.policy = verifier, "mtp", policy or DraftPolicy()
        self.block_size = block_size or MTP_BLOCK_SIZE
        H, N = verifier.hidden_size, verifier.num_layers
        self.target_layer_ids, self.feature_dim = (N - 1,), H
        self.vocab_size = self.draft_vocab_size = verifier.vocab_size
        self.device, self.dtype = torch.device("cpu"), torch.float32
        table, scale = text_model(model).model.embed_tokens, embed_scale(model)
        self._embed = table if scale is None else (lambda i: table(i) * scale)
        self._cache = _KV()
        self._fused = mx.zeros((256, H), dtype=self.model.final_norm.weight.dtype)
        mx.eval(self._fused)
        self.reset()

    def describe(self) -> dict[str, Any]:
        return {"architecture": "mtp", "mtp_layers": self.mtp_layers, "chained_layer": 0, "runtime": "mlx",
                **self.policy.describe()}  # fmt: skip

    def bind(self, verifier: Any) -> None:
        if verifier is not self.verifier:
            raise ValueError("an MTP drafter drafts for the verifier whose layers it is (built with it)")
        self.reset()
