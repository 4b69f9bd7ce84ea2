"""`--drafter mtp` beside an MLX verifier: the model's MTP layer run in MLX (see `specdec.drafting.mtp` for
what it computes). mlx_lm's loaders drop the `mtp.*` weights, so they are read from the checkpoint's
safetensors here (an original, unconverted checkpoint: conversions drop them) and the layer is built from
the MLX model's own decoder-layer class at a full-attention index, its weights passed through the model's
own `sanitize` (expert stacking, Qwen3.5's zero-centred norms) as the model's layers were. The layer's
K/V cache is mlx_lm's `KVCache` (rolled back by `trim`); the verifier's final norm, embedding and LM head
are its own modules. A proposal stays lazy until its one sync.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


class MLXMtpDrafter(MLXChainProposals):
    """The MTP layer as a chain drafter beside an `MLXVerifier` (`runtime = "mlx"`)."""

    def __init__(
        self, verifier: Any, *, policy: DraftPolicy | None = None, block_size: int | None = None
    ) -> None:
        from mlx_lm.models.cache import KVCache

        if getattr(verifier, "path", None) is None:
            raise ValueError("--drafter mtp needs the MLX verifier's checkpoint folder (its mtp.* weights)")
        folder = Path(verifier.path)
        self.mtp_layers = check_mtp_folder(folder)
        model = verifier.model
        self.net = _Net(model, *_mtp_weights(folder))
        mx.eval(self.net.parameters())
        self._kv = KVCache
        self.verifier, self.name, self.policy = verifier, "mtp", policy or DraftPolicy()
        self.block_size = block_size or MTP_BLOCK_SIZE
        H, N = verifier.hidden_size, verifier.num_layers
        self.target_layer_ids, self.feature_dim = (N - 1,), H
        self.vocab_size = self.draft_vocab_size = verifier.vocab_size
        self.hidden_size = H
        self.device, self.dtype = torch.device("cpu"), torch.float32
        table, scale = text_model(model).model.embed_tokens, embed_scale(model)
        self._embed: Callable[[mx.array], mx.array] = table if scale is None else (lambda i: table(i) * scale)
        self._head = _head_fn(model, None)
        self.reset()

    def describe(self) -> dict[str, Any]:
        return {"architecture": "mtp", "mtp_layers": self.mtp_layers, "chained_layer": 0, "runtime": "mlx",
                **self.policy.describe()}  # fmt: skip

    def bind(self, verifier: Any) -> None:
        if verifier is not self.verifier:
            raise ValueError("an MTP drafter drafts for the verifier whose layers it is (built with it)")
        self.reset()

    @property
    def length(self) -> int:  # the rows the layer's cache holds (`ChainRows` moves it)
        return self._cache.offset

    @length.setter
    def length(self, n: int) -> None:
        if n < self._cache.offset:
            self._cache.trim(self._cache.offset - n)

    def reset(self) -> None:
        self._cache = self._kv()
        self._tokens, self._pending, self._n_fused, self._tail = [], [], 0, None
        self._fused = mx.zeros((0, self.hidden_size))

    def extend(self, features: mx.array, tokens: Sequence[int]) -> None:
        if features.ndim != 2 or tuple(features.shape) != (len(tokens), self.feature_dim):
            raise ValueError(
                f"features must be [{len(tokens)}, {self.feature_dim}], got {list(features.shape)}"
            )
        if tokens:
            self._commit(tokens, self)
            mx.eval(features)
            self._pending.append(features)

    def rollback(self, n: int) -> None:
        if self._check_rollback(n):
            self._fuse()
            self._uncommit(n, self)
            self._fused = self._fused[: self._n_fused]
            mx.eval(self._fused)

    def _fuse(self) -> None:
        if self._pending:
            new = self.net.final_norm(mx.concatenate(self._pending))  # the verifier's normed hidden states
            self._fused = mx.concatenate([self._fused[: self._n_fused].astype(new.dtype), new])
            self._pending, self._n_fused = [], self._fused.shape[0]

    def _rows(self, emb: mx.array, hidden: mx.array) -> mx.array:
        net, T = self.net, emb.shape[0]
        x = net.fc(mx.concatenate([net.enorm(emb), net.hnorm(hidden.astype(emb.dtype))], -1))[None]
        mask = "causal" if T > 1 else None
        return net.post(net.layer(x, mask=mask, cache=self._cache))[0]  # [T, H]

    def _chain(self, last_token: int, n: int, pick: Callable[[mx.array, int], mx.array]) -> mx.array:
        if n <= 0 or not self._tokens:
            return mx.zeros((0,), dtype=mx.int32)
        self._fuse()
        L = len(self._tokens)
        R = min(self.length, L - 1)
        self.length = R
        ids = mx.array([*self._tokens[R + 1 :], last_token], dtype=mx.int32)
        out = self._rows(self._embed(ids), self._fused[R:L])[-1:]
        self._tail, cols = last_token, []
        for i in range(n):
            cols.append(pick(self._head(out).astype(mx.float32), i))  # [1]
            if i + 1 < n:
                out = self._rows(self._embed(cols[-1]), out)
        self.length = L
        return mx.concatenate(cols)

    def _sync(self, *arrays: mx.array) -> None:
        mx.eval(*arrays, self._cache.state, self._fused)  # the one sync of a proposal
