"""A real tiny causal transformer in plain torch, so the whole engine runs where neither mlx nor
transformers is installed (CI, unit tests).

Weights come from a fixed seed, so the model is the same on every machine. It has its own KV cache
(a preallocated buffer plus a write position, as in gpt-fast: rollback only moves the position back and
the rejected slots are overwritten later, so it is exact), captures decoder-layer outputs at chosen
layers, and gives `embed_fn` / `lm_head_fn` built from its own weights. Tokens are bytes (0..255) plus
BOS / EOS / PAD, so it can encode and decode any text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specdec.kernels import TreeAttention, batch_invariant, invariant_attention, linear_fn
from specdec.measure import probe_own_cache, trees_equal_chains, verify_equals_steps
from specdec.memory import probe_for_module
from specdec.models import STUB_SHAPE
from specdec.protocols import (
    EmbedFn,
    LMHeadFn,
    MemoryProbe,
    ProbeCall,
    SampleFn,
    check_call,
    check_layer_ids,
)
from specdec.tree import Tree

BOS, EOS, PAD = 256, 257, 258


@dataclass(frozen=True, kw_only=True)
class StubConfig:
    vocab_size: int = STUB_SHAPE[2]
    hidden_size: int = STUB_SHAPE[1]
    num_layers: int = STUB_SHAPE[0]
    num_heads: int = 4
    intermediate_size: int = 128
    max_context: int = 2048
    rope_theta: float = 10000.0
    eps: float = 1e-6
    seed: int = 0
    logit_scale: float = 4.0  # sharp distributions: greedy near-ties are vanishingly rare in fp32


class ByteTokenizer:
    """UTF-8 bytes as tokens; BOS=256, EOS=257, PAD=258."""

    bos_token_id, eos_token_id, pad_token_id = BOS, EOS, PAD

    def encode(self, text: str) -> list[int]:
        return [BOS, *text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def tokenizer_json(self) -> str:
        """These tokens as a Hugging Face `tokenizers` byte-level BPE without merges (what a grammar engine
        reads, `specdec.grammar`)."""
        vocab = {_BYTE_NAMES[b]: b for b in range(256)}
        specials = [(BOS, "<bos>"), (EOS, "<eos>"), (PAD, "<pad>")]
        vocab.update({t: i for i, t in specials})
        flags = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False}
        added = [{"id": i, "content": t, **flags, "special": True} for i, t in specials]
        level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
        model = {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "vocab": vocab,
            "merges": [],
        }
        none = dict.fromkeys(["truncation", "padding", "normalizer", "post_processor"])
        return json.dumps(
            {
                "version": "1.0",
                **none,
                "added_tokens": added,
                "pre_tokenizer": level,
                "decoder": level,
                "model": model,
            }
        )


def _byte_names() -> list[str]:
    """GPT-2's printable stand-in for each byte, as byte-level BPE vocabularies name them."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    names, extra = {}, 0
    for b in range(256):
        if b in keep:
            names[b] = chr(b)
        else:
            names[b] = chr(256 + extra)
            extra += 1
    return [names[b] for b in range(256)]


_BYTE_NAMES = _byte_names()


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """In fp32, as transformers' Llama norm: torch's vectorised bf16 rsqrt (a call of 32 or more rows) rounds
    unlike its scalar path, so a bf16 norm made a verify of 32+ tokens differ from one-token steps."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _rope_table(n: int, hd: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE's cos and sin for positions 0..n-1, each [n, hd]: made once, so a call gathers its
    rows (each position's values the same whatever call it is in) instead of recomputing them per layer."""
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = torch.arange(n, dtype=torch.float32)[:, None] * inv[None, :]  # [n, hd/2]
    return torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [nh, T, hd]; cos, sin: [T, hd] (the call's rows of `_rope_table`)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class StubModel(nn.Module):
    """Llama-shaped: pre-norm RMSNorm, MHA with RoPE, SiLU-gated MLP, untied head."""

    def __init__(self, cfg: StubConfig) -> None:
        super().__init__()
        self.cfg = cfg
        g = torch.Generator().manual_seed(cfg.seed)
        H, I, V, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers

        def w(*shape: int, std: float) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, generator=g) * std, requires_grad=False)

        self.embed = w(V, H, std=1.0)
        self.layers = nn.ModuleList()
        for _ in range(L):
            layer = nn.Module()
            layer.qkv = w(3 * H, H, std=H**-0.5)
            layer.o = w(H, H, std=H**-0.5 / L**0.5)
            layer.up = w(2 * I, H, std=H**-0.5)
            layer.down = w(H, I, std=I**-0.5 / L**0.5)
            layer.norm1 = nn.Parameter(torch.ones(H), requires_grad=False)
            layer.norm2 = nn.Parameter(torch.ones(H), requires_grad=False)
            self.layers.append(layer)
        self.norm = nn.Parameter(torch.ones(H), requires_grad=False)
        self.head = w(V, H, std=cfg.logit_scale * H**-0.5)


class StubVerifier:
    """Verifier protocol over `StubModel`, fp32 by default."""

    runtime = "stub"

    def __init__(
        self,
        cfg: StubConfig | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        invariant: bool | None = None,
    ) -> None:
        """`invariant` (None: on for bf16 / fp16): attention through `specdec.kernels.invariant_attention`,
        so a verify of several tokens gives each row bit for bit what one-token verifies give (as in
        `HFVerifier`; `batch_invariant` says whether the linears are invariant too)."""
        self.cfg = cfg = cfg or StubConfig()
        self.model = StubModel(cfg).to(dtype)
        half = dtype in (torch.bfloat16, torch.float16)
        self.invariant = half if invariant is None else invariant
        self._linear = linear_fn("cpu", dtype)  # [T, K] x [N, K]^T; one-row products paired in half precision
        self.model_name = f"stub-h{cfg.hidden_size}-l{cfg.num_layers}-seed{cfg.seed}"
        self.dtype = str(dtype).removeprefix("torch.")
        self.vocab_size, self.hidden_size = cfg.vocab_size, cfg.hidden_size
        self.num_layers, self.max_context = cfg.num_layers, cfg.max_context
        self.eos_token_ids = frozenset({EOS})
        self.tokenizer = ByteTokenizer()
        nh, hd = cfg.num_heads, cfg.hidden_size // cfg.num_heads
        # [L, 2, nh, max_context, hd]: K and V per layer, written at [pos, pos+T)
        self._kv = torch.zeros(cfg.num_layers, 2, nh, cfg.max_context, hd, dtype=dtype)
        self._cos, self._sin = _rope_table(cfg.max_context, hd, cfg.rope_theta, dtype)  # [max_context, hd]
        self._pos = 0
        self._layer_ids: tuple[int, ...] = ()
        self._captured: torch.Tensor | None = None  # [T, K*H] of the last call
        self._tree_size = 0  # nodes of the last verify_tree
        shapes = tuple(sorted({tuple(p.shape) for p in self.model.parameters() if p.dim() == 2}))  # [N, K]
        # measured on this model here (a verify vs one-token steps), not inferred from a toy shape
        self.batch_invariant = (
            self.invariant and batch_invariant(dtype, "cpu", shapes) and verify_equals_steps(self)
        )
        # tree verifies bit for bit equal to their paths as chains (see `HFVerifier.tree_exact`)
        self.tree_exact = trees_equal_chains(self) if self.batch_invariant else True

    @property
    def position(self) -> int:
        return self._pos

    def set_target_layers(self, layer_ids: Sequence[int]) -> None:
        self._layer_ids = check_layer_ids(layer_ids, self.num_layers, self.model_name)

    def check_rollback(self) -> None:
        return None  # one plain KV buffer: always exact

    def reset(self) -> None:
        self._pos, self._captured = 0, None

    def check_tree(self) -> None:
        if not self.tree_exact:
            raise ValueError(
                f"{self.model_name} cannot verify trees: its {self.dtype} tree verify does not give its "
                "paths' logits bit for bit here (measured); use a chain"
            )

    @torch.inference_mode()
    def forward(
        self, tokens: Sequence[int], *, last_only: bool = False, tree: TreeAttention | None = None
    ) -> torch.Tensor:
        """Append `tokens` to the cache; logits [T, V] (or [1, V] with last_only). With `tree`, `tokens`
        are a tree's nodes: positions by depth, each seeing the cache and its ancestors."""
        T, p0 = len(tokens), self._pos
        check_call(T, p0, self.cfg.max_context)
        if tree is None:  # causal over the cache: new query i sees cached positions <= p0 + i
            pos = torch.arange(p0, p0 + T)
            mask = pos[:, None] >= torch.arange(p0 + T)[None, :]  # [T, p0+T]
        else:
            pos, mask = tree.positions, tree.flat_mask(p0)
        x, captured = self.layers(tokens, pos, lambda li, q, k, v: self.attend(li, q, k, v, mask, tree))
        self._pos = p0 + T
        # [T, K*H], layers in the order asked for
        self._captured = torch.cat([captured[i] for i in self._layer_ids], -1) if self._layer_ids else None
        return self.head(x[-1:] if last_only else x)  # [T|1, V]

    def layers(
        self, tokens: Sequence[int], pos: torch.Tensor, attend: Any, layer_ids: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The decoder layers over `tokens` at positions `pos` [T]; `attend(li, q, k, v)` -> [nh, T, hd]
        (q, k after RoPE, each [nh, T, hd]) writes layer li's cache and attends. The last layer's output
        [T, H] and the outputs of `layer_ids` (default: the target layers) by layer."""
        cfg = self.cfg
        T, nh, hd = len(tokens), cfg.num_heads, cfg.hidden_size // cfg.num_heads
        x = F.embedding(torch.tensor(tokens, dtype=torch.long), self.model.embed)  # [T, H]
        wanted = set(self._layer_ids if layer_ids is None else layer_ids)
        captured: dict[int, torch.Tensor] = {}
        cos, sin = self._cos[pos], self._sin[pos]  # [T, hd]
        for li, layer in enumerate(self.model.layers):
            h = _rms_norm(x, layer.norm1, cfg.eps)
            q, k, v = self._linear(h, layer.qkv).view(T, 3, nh, hd).permute(1, 2, 0, 3)  # each [nh, T, hd]
            att = attend(li, _rope(q, cos, sin), _rope(k, cos, sin), v)  # [nh, T, hd]
            x = x + self._linear(att.transpose(0, 1).reshape(T, -1), layer.o)
            gate, up = self._linear(_rms_norm(x, layer.norm2, cfg.eps), layer.up).chunk(2, -1)
            x = x + self._linear(F.silu(gate) * up, layer.down)
            if li in wanted:
                captured[li] = x
        return x, captured

    def attend(
        self,
        li: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor,
        tree: TreeAttention | None = None,
    ) -> torch.Tensor:
        """Layer li's new keys and values [nh, T, hd] into this verifier's cache at its position, and the
        attention of queries q [nh, T, hd] over the cache (`mask` [T, p0+T]; a tree's own) -> [nh, T, hd]."""
        p0, T, hd = self._pos, q.shape[1], q.shape[-1]
        self._kv[li, 0, :, p0 : p0 + T] = k
        self._kv[li, 1, :, p0 : p0 + T] = v
        keys, vals = self._kv[li, 0, :, : p0 + T], self._kv[li, 1, :, : p0 + T]  # [nh, p0+T, hd]
        if tree is not None:  # each node as its path verified as a chain
            return tree.attend(q[None], keys[None], vals[None], scale=hd**-0.5)[0]
        if self.invariant:
            return invariant_attention(q[None], keys[None], vals[None], mask[None, None], scale=hd**-0.5)[0]
        return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm and LM head: x [T, H] -> logits [T, V]."""
        return self._linear(_rms_norm(x, self.model.norm, self.cfg.eps), self.model.head)

    def probe_logits(self, calls: Sequence[ProbeCall]) -> list[torch.Tensor | None]:
        """`specdec.measure`'s calls on this verifier's own cache from empty (at load; leaves it reset)."""
        return probe_own_cache(self, calls, "cpu")

    def prefill(self, tokens: Sequence[int], *, sample: SampleFn | None = None) -> int:
        logits = self.forward(tokens, last_only=True)  # [1, V]
        return sample(logits)[0] if sample else int(logits[-1].argmax())

    def verify(
        self, tokens: Sequence[int], *, sample: SampleFn | None = None, ahead: bool = False
    ) -> list[int]:
        logits = self.forward(tokens)  # [T, V]; `ahead` buys nothing on a synchronous runtime
        return sample(logits) if sample else logits.argmax(-1).tolist()

    def verify_tree(self, tree: Tree, *, sample: SampleFn | None = None) -> list[int]:
        logits = self.forward(tree.tokens, tree=TreeAttention(tree, self._pos, "cpu"))  # [N, V]
        self._tree_size = len(tree)
        return sample(logits) if sample else logits.argmax(-1).tolist()

    def keep_path(self, path: Sequence[int]) -> None:
        p0 = self._pos - self._tree_size
        rows = torch.tensor(path)
        self._kv[:, :, :, p0 : p0 + len(path)] = self._kv[:, :, :, p0 + rows]  # index: a copy, no overlap
        self._pos = p0 + len(path)
        if self._captured is not None:
            self._captured = self._captured[rows]  # [len(path), K*H]

    def rollback(self, n: int) -> None:
        if not 0 <= n <= self._pos:
            raise ValueError(f"cannot roll back {n} of {self._pos} cached positions")
        self._pos -= n

    def features(self, n: int, *, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        if self._captured is None:
            raise RuntimeError("no features captured: call set_target_layers() before prefill/verify")
        return self._captured[:n].to(device=device, dtype=dtype)  # [n, K*H]

    def embed_fn(self, *, device: torch.device, dtype: torch.dtype) -> EmbedFn:
        weight = self.model.embed.detach().to(device=device, dtype=dtype)  # [V, H]
        return lambda ids: F.embedding(ids, weight)

    def final_norm_fn(
        self, *, device: torch.device, dtype: torch.dtype
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        weight = self.model.norm.detach()
        return lambda x: _rms_norm(x.to(weight.dtype), weight, self.cfg.eps).to(device=device, dtype=dtype)

    def lm_head_fn(
        self, *, device: torch.device, dtype: torch.dtype, rows: torch.Tensor | None = None
    ) -> LMHeadFn:
        weight = self.model.head.detach().to(device=device, dtype=dtype)  # [V, H]
        if rows is not None:  # a draft vocabulary: logits [..., K] of these ids only
            weight = weight[rows.to(weight.device)]  # [K, H]
        return lambda h: h @ weight.T

    def memory_probe(self) -> MemoryProbe:
        return probe_for_module(self.model)
