"""Linears for decoding on x86 CPUs: a verify of a few tokens at close to the cost of one.

PyTorch's default CPU `F.linear` (MKL sgemm) runs a one-row product near memory speed, but a product of
2-16 rows, which is what a speculative verify and a drafter block are, at about half that speed: it
repacks the weight on every call. oneDNN's matmul (`torch.ops.mkldnn._linear_pointwise`, the op
Inductor emits for CPU linears) streams the weight once. Measured on the 2-core x86 CI machine,
SmolLM2-135M fp32 at a 400-token context, the HF verifier with these linears and its copy-free GQA
attention against the model as loaded, interleaved in one process: one verify of 1 token 59 -> 54 ms,
of 8 tokens 110 -> 85 ms; the drafter's [7, 8192] read-out alone 3.5 -> 1.7 ms. Results agree with
`F.linear` to float rounding.

Faster still, and flat up to 16 rows: the weight reordered once into oneDNN's blocked layout
(`packed_weight`, the layout Inductor's weight prepacking uses), so no call reorders it again. A pack is
made the first time a weight meets a product of at most `PACKED_ROWS` rows and then kept beside the
plain weight (memory: one more copy of the linears that decoding reads, +0.4 GB resident for
SmolLM2-135M; a training forward of many rows never makes one). Measured on the 2-core AMD EPYC CI
machine (AVX2), SmolLM2-135M fp32 at a 400-token context, against the linears of before
(`torch.mm(weight, x.T)` for 1-8 rows, unpacked oneDNN above), 15 verifies in a row per kernel,
alternated: 1 token 70 -> 64 ms, 3 tokens 88 -> 68, 6 tokens 111 -> 89; in decoding (4 MT-Bench prompts
x 256 tokens) autoregressive steps 65 -> 60 ms. Measured here too: the rows of a packed product come out
bit for bit the same whatever the number of rows in the call; fp32 attention still does not, so fp32
decoding stays exact by test.

bf16 takes the same packed path where the op works for it (x86 CPUs; on one with avx512_bf16, a
[1536, 576] product of one row: fp32 packed 71 us, bf16 `F.linear` 97 us, bf16 packed 42 us). In half
precision a one-row product is computed as two: measured on an avx512_bf16 EPYC, the GEMV kernel a lone
row takes rounds differently from the same row inside any larger call once K is large (K = 1536: up to
0.0078 apart, bf16 `F.linear` and packed alike), while every call of 2 or more rows agrees bit for bit;
the row doubled costs ~7 us per product. fp32 rows are not doubled (fp32 is exact by test, not by
construction). fp16 has no packed path on CPUs without avx512_fp16 (`F.linear`, row doubled).

Used for inference only (`torch.no_grad` / `inference_mode`); training, a build without the op, or any
device but an x86-64 CPU takes `F.linear`.
"""

from __future__ import annotations

import math
import platform
from collections.abc import Callable
from functools import cache
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakTensorKeyDictionary

if TYPE_CHECKING:
    from specdec.tree import Tree

__all__ = [
    "HALF", "KEY_ALIGN", "MAX_VERIFY_TOKENS", "PACKED_ROWS", "CPULinear", "TreeAttention", "batch_invariant",
    "invariant_attention", "key_padding", "key_scores", "linear_fn", "linear_shapes", "onednn_usable",
    "packed_weight", "use_cpu_linears",
]  # fmt: skip

LinearFn = Callable[..., torch.Tensor]


HALF = (torch.bfloat16, torch.float16)


@cache
def _op_works(dtype: torch.dtype = torch.float32) -> bool:
    """The op and its weight packing exist in this build for `dtype` and agree with F.linear (checked once
    per process and dtype)."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not torch.backends.mkldnn.is_available():
        return False
    try:
        op = torch.ops.mkldnn._linear_pointwise
        g = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(s, generator=g).to(dtype) for s in ((3, 64), (40, 64), (40,)))
        with torch.inference_mode():
            want = F.linear(x, w, b).float()
            packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_HINT)
            tol = 1e-4 if dtype == torch.float32 else 5e-2
            return all(
                torch.allclose(op(x, m, b, "none", [], "").float(), want, atol=tol) for m in (w, packed)
            )
    except (AttributeError, RuntimeError):
        return False


def onednn_usable(device: torch.device | str, dtype: torch.dtype) -> bool:
    """oneDNN linears apply: float32 or bfloat16 on an x86-64 CPU, in a build whose op works for it."""
    return (
        torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16) and _op_works(dtype)
    )


#: products of at most this many rows take the prepacked weight (larger ones, prefills, the plain one)
PACKED_ROWS = 64
#: the batch size oneDNN packs a weight for: 4, 8 and 16 measured alike for products of 1-16 rows
PACK_HINT = 16
_packs: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # weight -> (its state, packed copy)


def packed_weight(w: torch.Tensor) -> torch.Tensor:
    """`w` [N, K] reordered once into oneDNN's blocked layout, kept while `w` lives and made again if `w`
    is changed in place or given new data: every later product reads it as it lies. An inference tensor
    has no version counter, so one changed in place keeps its old pack (weights are not)."""
    # an in-place update bumps the version; `.data = ...` (Module.to) swaps the storage under the object
    state = (-1 if w.is_inference() else w._version), w.data_ptr()
    seen, packed = _packs.get(w, (None, None))
    if seen != state:
        packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), PACK_HINT)
        _packs[w] = (state, packed)
    return packed


def _one_row_doubled(f: LinearFn, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """`f(x, w, b)` for a product of one row, computed as two (see the module docstring: a lone half
    precision row takes a kernel that rounds differently)."""
    out = f(x.reshape(1, -1).expand(2, -1), w, b)[:1]  # [1, N]
    return out.view(*x.shape[:-1], out.shape[-1])


def _onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return F.linear(x, w, b)  # the op has no backward: training keeps the default kernel
    rows = math.prod(x.shape[:-1])
    if rows == 1 and x.dtype != torch.float32:
        return _one_row_doubled(_onednn_linear, x, w, b)
    weight = packed_weight(w) if rows <= PACKED_ROWS else w
    return torch.ops.mkldnn._linear_pointwise(x, weight, b, "none", [], "")


def _paired_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, a one-row product computed as two (half precision on a CPU without the oneDNN op)."""
    if math.prod(x.shape[:-1]) == 1 and not (
        torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)
    ):
        return _one_row_doubled(F.linear, x, w, b)
    return F.linear(x, w, b)


@cache
def linear_fn(device: torch.device | str, dtype: torch.dtype) -> LinearFn:
    """The linear for inference on `device` in `dtype`: on an x86-64 CPU oneDNN's (fp32 / bf16; packed
    weights for up to `PACKED_ROWS` rows), in half precision on a CPU with one-row products computed as
    two (row-invariant); `F.linear` elsewhere."""
    if onednn_usable(device, dtype):
        return _onednn_linear
    return _paired_linear if torch.device(device).type == "cpu" and dtype in HALF else F.linear


class CPULinear(torch.nn.Linear):
    """`nn.Linear` whose inference forward is `linear_fn` of its weight (same parameters, same state
    dict): oneDNN's matmul, one-row products doubled in half precision."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_fn(self.weight.device, self.weight.dtype)(x, self.weight, self.bias)


#: key positions are padded to multiples of this (from absolute position 0) by `invariant_attention`
KEY_ALIGN = 64


def invariant_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    scale: float,
    key_start: int = 0,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention whose result for a query row does not depend on how many query rows the call holds, nor
    on how many masked keys follow its last visible one: a verify of T tokens then gives bit for bit the
    rows T one-token calls give, where the linears of the dtype do too (bf16 / fp16 on CPU; see
    `batch_invariant`). q [B, Hq, T, D]; k, v [B, Hkv, S, D] at absolute positions
    key_start..key_start+S-1; mask bool [B or 1, 1, T, S] (True: visible) or None (all visible);
    `sinks` [Hq]: one more logit per head in every row's softmax whose share is dropped (gpt-oss's
    attention sinks; `_sink_padding`). Returns [B, Hq, T, D].

    Why this holds: query heads sharing a KV head are folded into the rows of one product (no K/V copies);
    the products are plain matmuls in the model dtype (row-invariant where the linears are); the keys are
    padded (masked) on both sides to multiples of KEY_ALIGN counted from absolute position 0, so every
    reduction over keys (scores @ V, the softmax's max and sum in fp32) sees each visible key at the same
    index modulo the alignment and only adds exact zeros for the rest."""
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    g = Hq // Hkv
    rows = q.reshape(B, Hkv, g * T, D)  # query head h = j*g + r of kv head j -> row r*T + t
    s = key_scores(rows, k, scale=scale, softcap=softcap).view(B, Hkv, g, T, S)
    if mask is not None:
        s = s.masked_fill(~mask[:, :, None], float("-inf"))  # mask [B, 1, T, S] -> [B, 1, 1, T, S]
    left, right = key_padding(key_start, S)
    left += _sink_padding(sinks)
    if left or right:
        s = F.pad(s, (left, right), value=float("-inf"))
        v = F.pad(v, (0, 0, left, right))  # [B, Hkv, left+S+right, D]
    if sinks is not None:
        s[..., 0] = sinks.float().view(Hkv, g, 1)  # head h = j*g + r of kv head j
    p = s.softmax(-1).to(v.dtype).view(B, Hkv, g * T, -1)
    return torch.matmul(p, v).view(B, Hq, T, D)


def _sink_padding(sinks: torch.Tensor | None) -> int:
    """Masked keys before the first key block where there are attention sinks: a KEY_ALIGN block of its
    own whose first lane holds the sink's logit, so every key keeps its lane and the sink enters the
    softmax's sums at the same place in any call; its value is a zero row, its share dropped exactly."""
    return 0 if sinks is None else KEY_ALIGN


def key_scores(rows: torch.Tensor, k: torch.Tensor, *, scale: float, softcap: float | None) -> torch.Tensor:
    """fp32 scores rows [..., R, D] x keys [..., S, D] -> [..., R, S]. Each score is one dot product over D,
    the same whatever the other rows and keys of the call (`invariant_attention`)."""
    s = torch.matmul(rows, k.transpose(-1, -2)).float() * scale
    return torch.tanh(s / softcap) * softcap if softcap else s


def key_padding(key_start: int, keys: int) -> tuple[int, int]:
    """(left, right): masked keys that put `keys` keys from absolute position `key_start` on whole
    KEY_ALIGN blocks counted from position 0, so the softmax's max and sum and the product with the
    values meet every visible key in the same lane whatever surrounds it (padding adds exact zeros)."""
    left = key_start % KEY_ALIGN
    return left, (-(left + keys)) % KEY_ALIGN


@cache
def batch_invariant(
    dtype: torch.dtype, device: str = "cpu", shapes: tuple[tuple[int, int], ...] = ((192, 64),)
) -> bool:
    """Whether this machine computes every row of `linear_fn`'s product with weights of `shapes` ([N, K]
    each: pass the model's own, the rounding of a lone row depends on K) and of `invariant_attention` bit
    for bit the same in calls of 1, 2, 3, 8 and 16 rows as in one of 64, in `dtype` (measured once per
    process on random data, key counts crossing an alignment boundary included). A necessary condition;
    `specdec.measure.verify_equals_steps` measures the loaded model itself."""
    g = torch.Generator().manual_seed(0)
    rand = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    f = linear_fn(torch.device(device), dtype)
    with torch.inference_mode():
        for n, k in shapes:
            w, x = rand(min(n, 4096), k), rand(64, k)  # N capped: a 262k-row head is checked by the model
            full = f(x, w, None)
            for m in (1, 2, 3, 8, 16):
                rows = 64 // m * m
                if not torch.equal(
                    torch.cat([f(x[i : i + m], w, None) for i in range(0, rows, m)]), full[:rows]
                ):
                    return False
    P, T = KEY_ALIGN - 5, 16  # the block's keys cross an alignment boundary
    q, k, v = rand(1, 6, T, 32), rand(1, 2, P + T, 32), rand(1, 2, P + T, 32)
    mask = (torch.arange(P, P + T)[:, None] >= torch.arange(P + T)[None, :]).to(device)[None, None]
    full = invariant_attention(q, k, v, mask, scale=0.2)

    def one(t: int) -> torch.Tensor:  # query t of the block alone, with its keys up to itself
        n = P + t + 1
        return invariant_attention(q[:, :, t : t + 1], k[:, :, :n], v[:, :, :n], None, scale=0.2)

    return torch.equal(torch.cat([one(t) for t in range(T)], 2), full)


def linear_shapes(module: torch.nn.Module) -> tuple[tuple[int, int], ...]:
    """The distinct [N, K] weight shapes of the `nn.Linear`s in `module`, for `batch_invariant`."""
    return tuple(sorted({tuple(m.weight.shape) for m in module.modules() if isinstance(m, torch.nn.Linear)}))


#: the most tokens one verify holds (a chain's last token and drafts, a tree's nodes): products of that
#: many rows still take the packed weight, and `specdec.measure.verify_equals_steps` measures every verify
#: up to it
MAX_VERIFY_TOKENS = PACKED_ROWS


class TreeAttention:
    """Which keys each node of a tree verify sees, for a layer whose keys are `ctx` cached positions (the
    newest, ending right before the root) followed by the tree's nodes: the cached ones (within a sliding
    window: those less than `window` positions before the node's own) and the node's ancestors and
    itself.

    `attend` computes each node's row exactly as the node's path verified as a chain computes it, as
    `invariant_attention` does for a chain: the scores come from one product of all nodes with all keys
    (each is one dot product), then each node's scores and values are gathered into its chain's layout
    (the cached keys, then its ancestors by depth), so every reduction over keys (the softmax, the product
    with the values, the nodes as its batch) meets the same terms at the same indices as the chain's. A
    layout shared by all nodes, with masked keys between a node's ancestors, does not: the matmul and
    softmax kernels sum blocks of keys separately, and a key moved to another block changes the rounding
    (SmolLM2-135M bf16: 0.25 on a logit). The values' copy costs nodes x keys per layer. `flat_mask` is
    the same visibility over the cache's own order (the MLX verifier's attention, measured to need no
    layout)."""

    def __init__(self, tree: Tree, root_position: int, device: torch.device | str) -> None:
        depths = tree.depths
        T, D = len(tree), max(depths) + 1
        anc = torch.zeros(T, T, dtype=torch.bool)
        path = torch.zeros(T, D, dtype=torch.long)  # [T, D]: the ancestor of node i at depth e (0 past i)
        for i, p in enumerate(tree.parents):
            if p >= 0:
                anc[i], path[i] = anc[p], path[p]
            anc[i, i] = True
            path[i, depths[i]] = i
        self.size = T
        self.root = root_position
        self.device = torch.device(device)
        self.depth = torch.tensor(depths, device=self.device)  # [T]
        self.positions = self.depth + root_position  # [T] absolute position of each node
        self.ancestors = anc.to(self.device)  # [T, T] node i sees node j
        self.path = path.to(self.device)  # [T, D]
        self.on_path = torch.arange(D, device=self.device)[None, :] <= self.depth[:, None]  # [T, D]
        self._masks: dict[tuple[str, int, int | None], torch.Tensor] = {}

    def _context(self, ctx: int, window: int | None) -> torch.Tensor:
        """[T, ctx] bool: the cached keys each node sees."""
        if window is None:
            return torch.ones(self.size, ctx, dtype=torch.bool, device=self.device)
        key = ("ctx", ctx, window)
        if key not in self._masks:  # asked once per layer of a verify
            kpos = torch.arange(self.root - ctx, self.root, device=self.device)  # [ctx]
            self._masks[key] = kpos[None, :] > self.positions[:, None] - window
        return self._masks[key]

    def flat_mask(self, ctx: int, window: int | None = None) -> torch.Tensor:
        """[T, ctx + T] bool over the cache's order (cached keys, then the nodes): True where a node sees."""
        key = ("flat", ctx, window)
        if key not in self._masks:
            self._masks[key] = torch.cat([self._context(ctx, window), self.ancestors], 1)
        return self._masks[key]

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float,
        softcap: float | None = None,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of the nodes: q [1, Hq, T, D]; k, v [1, Hkv, ctx + T, D] (the cached keys, then the
        nodes'); `sinks` as `invariant_attention`'s. Returns [1, Hq, T, D], each row as its path verified
        as a chain gives it."""
        T, (_, Hq, _, D), Hkv = self.size, q.shape, k.shape[1]
        g, ctx, P = Hq // Hkv, k.shape[2] - T, self.path.shape[1]
        # every node against every key in one product (a score is one dot product, the same in any layout)
        # (rows node-major, so each node's scores come out in runs of g x keys: cheap to gather)
        rows = q[0].view(Hkv, g, T, D).transpose(1, 2).reshape(Hkv, T * g, D)  # [Hkv, T*g, D]
        s_all = key_scores(rows, k[0], scale=scale, softcap=softcap)  # [Hkv, T*g, ctx+T]
        s_all = s_all.view(Hkv, T, g, ctx + T).transpose(0, 1)  # [T, Hkv, g, ctx+T]
        # each node's scores and values in its chain's layout: the cached keys, then its ancestors by
        # depth, padded to whole KEY_ALIGN blocks as `invariant_attention` pads a chain's
        left, right = key_padding(self.root - ctx, ctx + P)
        left += _sink_padding(sinks)
        c0, c1 = left + ctx, left + ctx + P  # [c0, c1): the path's keys
        s = s_all.new_full((T, Hkv, g, c1 + right), float("-inf"))  # [T, Hkv, g, W]
        s[..., left:c0] = s_all[..., :ctx]
        s[..., c0:c1] = torch.gather(s_all[..., ctx:], 3, self.path[:, None, None].expand(T, Hkv, g, P))
        s[..., c0:c1].masked_fill_(~self.on_path[:, None, None], float("-inf"))  # past the node's depth
        if window is not None:
            s[..., left:c0].masked_fill_(
                ~self._context(ctx, window)[:, None, None], float("-inf")
            )  # slid out
        if sinks is not None:
            s[..., 0] = sinks.float().view(Hkv, g)
        p = s.softmax(-1).to(v.dtype)  # [T, Hkv, g, W]
        vals = v.new_empty(T, Hkv, c1 + right, D)  # one copy of the values per node
        vals[:, :, :left], vals[:, :, c1:] = 0, 0  # padding: finite, so its zero weights give exact zeros
        vals[:, :, left:c0] = v[0, :, :ctx]
        vals[:, :, c0:c1] = v[0, :, ctx:][:, self.path].transpose(0, 1)
        out = torch.matmul(p, vals)  # [T, Hkv, g, D]: each node's rows alone against its own values
        return out.permute(1, 2, 0, 3).reshape(1, Hq, T, D)


def use_cpu_linears(module: torch.nn.Module) -> int:
    """Switch every plain `nn.Linear` in `module` whose weight `linear_fn` gives a kernel of its own for
    (a CPU: fp32 / bf16 oneDNN, fp16 row-paired) to `CPULinear` in place; how many.

    The parameters stay the same objects, so tied weights stay tied and training still works (the
    default kernel runs whenever gradients are needed)."""
    n = 0
    for m in module.modules():
        if type(m) is torch.nn.Linear and linear_fn(m.weight.device, m.weight.dtype) is not F.linear:
            m.__class__ = CPULinear
            n += 1
    return n
