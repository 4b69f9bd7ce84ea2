"""A Gemma-4 assistant drafter in MLX, beside the MLX verifier (what a step computes:
`gemma4_assistant.config`). Its decoder layers are mlx_lm's own Gemma 4 layers (`gemma4_text.DecoderLayer`,
every one KV-shared: it takes `shared_kv` and the RoPE offset as the model's own KV-shared layers do),
built from the assistant's text config; the K/V they read are slices of the verifier's caches
(`SharedKV`: its sliding layers hold every position, so nothing is kept aside), the hidden state the
verifier's last-layer output through its own final norm, the embedding its own table and scale. A
proposal stays lazy until its one sync.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import torch

from specdec.bridges.mlx import embed_scale, materialize, text_model
from specdec.drafting.gemma4_assistant.config import AssistantConfig, LastRow, fit_verifier, kv_window
from specdec.drafting.layers_mlx import sample_rows
from specdec.drafting.policy import DraftPolicy
from specdec.kernels import MAX_VERIFY_TOKENS
from specdec.memory import mlx_probe
from specdec.protocols import MemoryProbe

__all__ = ["MLXAssistantDrafter"]


class _Body(nn.Module):
    """`model.*` of the checkpoint: the layers, the norm, the (tied) head's table."""

    def __init__(self, cfg: AssistantConfig) -> None:
        super().__init__()
        from mlx_lm.models.gemma4_text import DecoderLayer, ModelArgs

        from specdec.compat import config_fixes

        args = ModelArgs.from_dict({**cfg.text, **config_fixes(cfg.text)})
        self.layers = [DecoderLayer(args, i) for i in range(len(cfg.layer_types))]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=args.rms_norm_eps)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)


class _Centroids(nn.Module):
    def __init__(self, cfg: AssistantConfig) -> None:
        super().__init__()
        self.centroids = nn.Linear(cfg.hidden_size, cfg.num_centroids, bias=False)


class _Net(nn.Module):
    def __init__(self, cfg: AssistantConfig) -> None:
        super().__init__()
        self.model = _Body(cfg)
        self.pre_projection = nn.Linear(2 * cfg.backbone_hidden_size, cfg.hidden_size, bias=False)
        self.post_projection = nn.Linear(cfg.hidden_size, cfg.backbone_hidden_size, bias=False)
        if cfg.ordered:
            self.masked_embedding = _Centroids(cfg)


class MLXAssistantDrafter:
    """The `Drafter` protocol over a Gemma-4 assistant in MLX (`runtime = "mlx"`; module docstring)."""

    runtime = "mlx"
    walks = True

    def __init__(
        self,
        net: _Net,
        cfg: AssistantConfig,
        clusters: mx.array | None,
        *,
        name: str,
        policy: DraftPolicy | None,
        block_size: int | None,
    ) -> None:
        self.net, self.cfg, self.name, self._clusters = net, cfg, name, clusters
        self.policy = policy or DraftPolicy()
        self.block_size = min(block_size or cfg.block_size, MAX_VERIFY_TOKENS)
        self.vocab_size, self.feature_dim = cfg.vocab_size, cfg.backbone_hidden_size
        self.target_layer_ids: tuple[int, ...] = ()
        self.device, self.dtype = torch.device("cpu"), torch.float32  # what torch sees of it: nothing
        self.path: str | None = None
        self._ctx = LastRow(cfg.backbone_hidden_size)

    @classmethod
    def from_pretrained(
        cls,
        folder: str | Path,
        cfg: AssistantConfig,
        *,
        device: Any = "cpu",
        dtype: Any = torch.float32,
        policy: DraftPolicy | None = None,
        block_size: int | None = None,
    ) -> MLXAssistantDrafter:
        """Load a checkpoint `read_assistant` checked, in `dtype`'s MLX float type."""
        weights: dict[str, mx.array] = {}
        for f in sorted(Path(folder).glob("*.safetensors")):
            weights |= mx.load(str(f))
        weights.pop("lm_head.weight", None)  # tied to model.embed_tokens
        order = weights.pop("masked_embedding.token_ordering", None)
        net = _Net(cfg)
        float_type = getattr(mx, str(dtype).removeprefix("torch."))
        net.load_weights([(k, v.astype(float_type)) for k, v in weights.items()], strict=True)
        clusters = None if order is None else order.astype(mx.int32).reshape(cfg.num_centroids, -1)
        materialize(net, clusters)
        d = cls(net, cfg, clusters, name=Path(folder).name, policy=policy, block_size=block_size)
        d.path = str(folder)
        return d

    def bind(self, verifier: Any) -> None:
        """As the torch drafter's `bind`, for the MLX verifier."""
        self._sources = fit_verifier(self.cfg, verifier, name=self.name, runtime="mlx")
        self.target_layer_ids = (verifier.num_layers - 1,)
        self.verifier = verifier
        tm = text_model(verifier.model)
        table, scale = tm.model.embed_tokens, embed_scale(verifier.model)
        self._embed: Callable[[mx.array], mx.array] = table if scale is None else (lambda i: table(i) * scale)
        self._final_norm = tm.model.norm
        self.reset()

    @property
    def context_len(self) -> int:
        return self._ctx.n

    def reset(self) -> None:
        self._ctx.reset()

    def extend(self, features: mx.array, tokens: Any) -> None:
        self._ctx.extend(features, len(tokens))

    def rollback(self, n: int) -> None:
        self._ctx.rollback(n)

    # ---- drafting -----------------------------------------------------------------------------------------

    def _walk(self, last_token: int, n: int, pick: Callable[..., mx.array]) -> mx.array | None:
        """n drafts after `last_token`, lazy [n]: `pick(logits [1, S], ids [S] | None, i)` chooses draft i's
        index among the S candidates (`ids` their token ids; None: the whole vocabulary)."""
        P = self._ctx.n
        if n <= 0 or P == 0:
            return None
        net, src = self.net, self._sources
        kv = {t: self.verifier.shared_kv(layer, last=kv_window(self.cfg, t)) for t, layer in src.items()}
        h = self._final_norm(self._ctx.last())  # [1, Hb]
        tok, drafts = mx.array([last_token]), []
        for i in range(n):
            x = net.pre_projection(mx.concatenate([self._embed(tok).astype(h.dtype), h], -1))[
                None
            ]  # [1, 1, H]
            for layer, t in zip(net.model.layers, self.cfg.layer_types, strict=True):
                x, _, _ = layer(x, None, None, shared_kv=kv[t], offset=P)
            out = net.model.norm(x)[0]  # [1, H]
            logits, ids = self._head(out)
            j = pick(logits.astype(mx.float32), ids, i)  # [1]
            tok = j if ids is None else ids[j]
            drafts.append(tok)
            h = net.post_projection(out)
        return mx.concatenate(drafts)

    def _head(self, out: mx.array) -> tuple[mx.array, mx.array | None]:
        table = self.net.model.embed_tokens
        if self._clusters is None:
            return table.as_linear(out), None
        k = self.cfg.top_k
        c = self.net.masked_embedding.centroids(out)  # [1, C]
        top = mx.argpartition(-c, kth=k - 1, axis=-1)[0, :k]  # the k best centroids (any order)
        ids = self._clusters[top].reshape(-1)  # [k * V/C]
        return out @ table.weight[ids].T, ids

    def propose(self, last_token: int, n: int) -> list[int]:
        if not 0 <= n < self.block_size:
            raise ValueError(f"can propose 0..{self.block_size - 1} tokens per step, asked for {n}")
        cut, tops = self.policy.needs_confidence("dflash"), []

        def greedy(logits: mx.array, ids: mx.array | None, i: int) -> mx.array:
            if cut:
                tops.append(mx.max(mx.softmax(logits, axis=-1), axis=-1))
            return mx.argmax(logits, axis=-1)

        drafts = self._walk(last_token, n, greedy)
        if drafts is None:
            return []
        top = mx.concatenate(tops) if tops else None
        mx.eval(drafts, *(() if top is None else (top,)))  # the one sync
        return self.policy.block_cut(drafts.tolist(), None if top is None else top.tolist())

    def propose_walk(
        self, last_token: int, n: int, *, temperature: float, u: torch.Tensor
    ) -> tuple[list[int], torch.Tensor]:
        """n drafts sampled at `temperature` with uniforms u [n] -> (tokens, q [n, V]) (`SampledWalk`)."""
        us, qs = u.tolist(), []

        def sample(logits: mx.array, ids: mx.array | None, i: int) -> mx.array:
            q = mx.softmax(logits / temperature, axis=-1)  # [1, S]
            qs.append(q if ids is None else mx.zeros((1, self.vocab_size)).at[:, ids].add(q))
            return sample_rows(q, us[i])

        drafts = self._walk(last_token, n, sample)
        if drafts is None:
            return [], torch.zeros(0, self.vocab_size)
        q = mx.concatenate(qs)
        mx.eval(drafts, q)
        return drafts.tolist(), torch.tensor(np.array(q))

    def memory_probe(self) -> MemoryProbe:
        return mlx_probe()

    def describe(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "architecture": "gemma4-assistant",
            "runtime": "mlx",
            "head": "centroid-sparse" if self.cfg.ordered else "dense",
            "kv_layers": dict(getattr(self, "_sources", {})),
            **self.policy.describe(),
        }
