"""MLXVerifier: the Verifier protocol over an mlx_lm model (fp32/bf16/fp16 or quantized).

Contract (beyond `specdec.protocols.Verifier`):
- Loads with `mlx_lm.load` (or `mlx_lm.utils.load_model` with `tokenizer` None when the folder has no
  tokenizer files), copying config fields that transformers 5 moved under `rope_parameters` (and Gemma 3's
  `layer_types` pattern) to where mlx_lm reads them.
- Hidden states: for the duration of a forward, the entries of `model.layers` at `target_layer_ids` are
  replaced by transparent taps that record their output (element 0 of a tuple) and forward attribute
  access; the list is restored afterwards, so the module tree is never changed between calls.
- `prefill` runs the LM head on the last position only (the last decoder layer's output is sliced before
  the final norm), in chunks of `prefill_chunk` tokens; `verify` runs one `model(ids[None], cache=...)`;
  greedy argmax on the MLX side, `.tolist()` is the sync point.
- Run-ahead (the autoregressive fast path, pipelined as `mlx_lm.generate_step` does): a greedy
  one-token `verify(..., ahead=True)` with no features to capture queues the forward of its own result
  (`mx.async_eval`) before it syncs, so the device computes step n+1 while the host finishes step n.
  The next `verify` of that same token takes the queued result; anything else (another token, prefill,
  rollback, reset) first trims the queued position off the cache, which is exact for the plain caches
  it is used with. `position` never counts the queued position.
- Rollback is exact for every cache it builds, or refused: `check_rollback` raises RuntimeError naming the
  cache types (other recurrent / SSM caches, rotating caches of unverified architectures). Every rollback
  checks that each layer's cache offset moved by exactly n.
- Gated DeltaNet layers (Qwen3.5 / 3.6, Qwen3-Next: an ArraysCache with the conv window and the recurrent
  state) roll back by replay (`Recurrent`): a call of at most `MAX_VERIFY_TOKENS` tokens keeps the layer's
  state from before the call and its input projections' outputs; a rollback restores that state and runs
  mlx_lm's own mixer over the accepted prefix again, which recomputes the conv window and the recurrence
  (the same per-token steps) but no projection. What the calls since the last rollback appended can be
  undone (one verify; the one-token steps of a draft model), back to a call longer than that.
- Checkpoints as transformers 5 saves them load too (`_transformers_layout`: Qwen3.5-MoE experts one by
  one, gpt-oss experts input-major), as do text-only Qwen3.5 configs (`specdec.models.config_fixes`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import torch
from mlx_lm.models.cache import (
    ArraysCache,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from specdec.bridges.mlx import (
    MLX_DTYPES,
    dequantized_weight,
    dtype_name,
    head_module,
    make_embed_fn,
    make_lm_head_fn,
    materialize,
    text_model,
    to_torch,
)
from specdec.compat import cast_params, config_fixes, model_classes
from specdec.formats import refuse_as_model
from specdec.kernels import MAX_VERIFY_TOKENS, TreeAttention
from specdec.measure import trees_equal_chains, verify_equals_steps
from specdec.memory import mlx_probe
from specdec.protocols import (
    EmbedFn,
    LMHeadFn,
    MemoryProbe,
    ProbeCall,
    RollbackError,
    SampleFn,
    check_call,
    check_layer_ids,
)
from specdec.tree import Tree
from specdec.verifiers.mlx_cache import (
    ATTENTION_LAYER_TYPES,
    EXACT_CACHES,
    WINDOW_MASK_FROM_ARGS,
    Recurrent,
    Tap,
    TreeCache,
    TreeRoPE,
)

__all__ = ["MLX_DTYPES", "MLXVerifier"]


class MLXVerifier:
    """Verifier protocol over an mlx_lm model (see module docstring)."""

    runtime = "mlx"
    path: Path | None = None  # the folder it was loaded from, where it was (`from_model`: none)

    def __init__(
        self,
        path_or_repo: str | Path,
        *,
        dtype: str | None = None,
        max_context: int | None = None,
        prefill_chunk: int = 2048,
        recast_quantized: bool = False,
    ) -> None:
        """`dtype` casts the floating-point parameters (None: as stored); a quantized model keeps its scales
        and biases as stored unless `recast_quantized`."""
        from mlx_lm.utils import _download, load_model, load_tokenizer

        path = _download(str(path_or_repo))  # local folders are returned as they are
        config = json.loads((path / "config.json").read_text())
        refuse_as_model(path, config)  # a drafter folder, not a model
        model, config = load_model(path, model_config=config_fixes(config), get_model_classes=model_classes)
        tok_files = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
        tokenizer = None
        if any((path / f).exists() for f in tok_files):  # as mlx_lm.load does
            tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
        self._setup(
            model,
            config,
            tokenizer=tokenizer,
            name=str(path_or_repo),
            dtype=dtype,
            max_context=max_context,
            prefill_chunk=prefill_chunk,
            recast_quantized=recast_quantized,
        )
        self.path: Path | None = path  # the folder it was loaded from (`--drafter mtp` reads it again)

    @classmethod
    def from_model(
        cls,
        model: nn.Module,
        config: dict[str, Any],
        *,
        tokenizer: Any = None,
        name: str = "in-memory",
        dtype: str | None = None,
        max_context: int | None = None,
        prefill_chunk: int = 2048,
    ) -> MLXVerifier:
        """Wrap an already built mlx_lm model (tests, custom loading)."""
        self = cls.__new__(cls)
        self._setup(
            model,
            config,
            tokenizer=tokenizer,
            name=name,
            dtype=dtype,
            max_context=max_context,
            prefill_chunk=prefill_chunk,
        )
        return self

    def _setup(
        self,
        model: nn.Module,
        config: dict[str, Any],
        *,
        tokenizer: Any,
        name: str,
        dtype: str | None,
        max_context: int | None,
        prefill_chunk: int,
        recast_quantized: bool = False,
    ) -> None:
        if dtype is not None:
            if dtype not in MLX_DTYPES:
                raise ValueError(f"dtype {dtype!r} not supported; choose one of {sorted(MLX_DTYPES)}")
            cast_params(model, MLX_DTYPES[dtype], recast_quantized=recast_quantized)
        # evaluate every array here: MLX >= 0.32 keeps default streams per thread, and a lazy array (a cast,
        # a RoPE's frequencies computed in its constructor) made on this thread cannot be evaluated on the
        # thread that decodes (a server's, an app's)
        materialize(model)
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.model, self.config, self.tokenizer = model, config, tokenizer
        self.model_name = Path(name).name or name
        self.prefill_chunk = prefill_chunk
        tm = text_model(model)
        self.model_type = str(getattr(tm, "model_type", config.get("model_type", "?")))
        args = getattr(tm, "args", None)
        text_cfg = config.get("text_config", config)
        self.vocab_size = int(getattr(args, "vocab_size", None) or text_cfg["vocab_size"])
        self.hidden_size = int(getattr(args, "hidden_size", None) or text_cfg["hidden_size"])
        self.num_layers = len(model.layers)
        inner = getattr(tm, "model", None)
        emb = getattr(inner, "embed_tokens", None)
        self.dtype = dtype_name(emb(mx.array([0])).dtype) if emb is not None else "?"
        limit = (
            max_context or text_cfg.get("max_position_embeddings") or config.get("max_position_embeddings")
        )
        if not limit:
            raise ValueError(f"{name}: config has no max_position_embeddings; pass max_context=")
        unwindowed = self.model_type == "gemma2" or (
            self.model_type in ("qwen3", "qwen3_moe") and text_cfg.get("use_sliding_window")
        )
        if unwindowed:
            # mlx_lm's gemma2 / qwen3 / qwen3_moe attend to everything (no sliding window): they are the
            # real model only within one window, so that is all they may hold
            limit = min(int(limit), int(text_cfg.get("sliding_window") or limit))
        self.max_context = int(limit)
        if tokenizer is not None:
            eos = set(tokenizer.eos_token_ids)
        else:
            e = config.get("eos_token_id")
            eos = set(e if isinstance(e, list) else [] if e is None else [e])
        self.eos_token_ids = frozenset(int(t) for t in eos)
        self._layer_ids: tuple[int, ...] = ()
        self._feats: mx.array | None = None  # [T, K*H] of the last call
        self._weights: dict[tuple[str, str, torch.dtype], torch.Tensor] = {}
        self._invariant: bool | None = None
        self._tree_exact: bool | None = None
        self._tree_size = 0  # nodes of the last verify_tree
        self._recurrent = self._recurrent_mixers()
        self.reset()

    @property
    def batch_invariant(self) -> bool:
        """Whether a verify of up to MAX_VERIFY_TOKENS tokens gives the logits of one-token steps bit for bit,
        for this model on this machine (`specdec.measure.verify_equals_steps`, as every verifier measures
        it; here on first use, on caches of its own). mlx-cpu 0.32: yes in fp32, bf16 and 4-bit; Metal's
        quantized kernels differ by row count (qmv / qmm)."""
        if self._invariant is None:
            self._invariant = verify_equals_steps(self)
        return self._invariant

    # ---- cache ---------------------------------------------------------------------------------------

    def _recurrent_mixers(self) -> dict[int, Recurrent]:
        """Layer index -> the stand-in of its Gated DeltaNet mixer (`linear_attn`), for the layers whose
        cache entry is an ArraysCache; empty when the model has none, or when its caches do not line up
        one to one with its layers (then `check_rollback` refuses it)."""
        layers, start = self._layer_list()
        cache = make_prompt_cache(self.model)
        if len(cache) != self.num_layers:
            return {}
        out = {}
        for i, c in enumerate(cache):
            mixer = getattr(layers[start + i], "linear_attn", None)
            if type(c) is ArraysCache and isinstance(mixer, nn.Module):
                out[i] = Recurrent(mixer, [n for n in mixer if n.startswith("in_proj")])
        return out

    def _make_cache(self) -> list[Any]:
        cache = make_prompt_cache(self.model)
        if self.model_type in WINDOW_MASK_FROM_ARGS:  # see WINDOW_MASK_FROM_ARGS
            cache = [KVCache() if type(c) is RotatingKVCache else c for c in cache]
        return cache

    @property
    def position(self) -> int:
        return self._pos

    def reset(self) -> None:
        self._cache = self._make_cache()
        self._pos, self._feats = 0, None
        self._ahead: tuple[int, mx.array] | None = None  # (token fed ahead, its greedy successor [1])
        # a queued step must be trimmable, which a recurrent layer's state is not
        self.run_ahead = all(type(c) in EXACT_CACHES for c in self._cache)
        self._commit()  # positions the recurrent layers can undo: those of the calls since the last rollback

    def _inexact_caches(self) -> list[str]:
        return sorted(
            {
                type(c).__name__
                for i, c in enumerate(self._cache)
                if type(c) not in EXACT_CACHES and not (type(c) is ArraysCache and i in self._recurrent)
            }
        )

    def check_rollback(self) -> None:
        bad = self._inexact_caches()
        if bad:
            text_cfg = self.config.get("text_config", self.config)
            types = sorted({str(t) for t in text_cfg.get("layer_types") or ()} - ATTENTION_LAYER_TYPES)
            layers = f" for its layer types {types} (recurrent / linear-attention state)" if types else ""
            raise RuntimeError(
                f"{self.model_name} (mlx_lm {self.model_type!r}) uses cache types {bad}{layers}, which "
                "cannot be rolled back exactly; speculative decoding needs them trimmable. Run it without a "
                "drafter (block_size 1)."
            )

    def rollback(self, n: int) -> None:
        if not 0 <= n <= self._pos:
            raise ValueError(f"cannot roll back {n} of {self._pos} cached positions")
        if n == 0:
            self._commit()
            return
        self._drop_ahead()
        self.check_rollback()
        if self._recurrent:
            if n > self._recorded:
                raise RollbackError(
                    f"cannot roll back {n} positions exactly: the recurrent layers of {self.model_name} can "
                    f"undo the last {self._recorded} positions only (calls since the last rollback, each "
                    f"of at most {MAX_VERIFY_TOKENS})"
                )
            for r in self._recurrent.values():
                r.replay(self._recorded - n)
            # start the replay now: it runs while the drafter works, not inside the next verify
            mx.async_eval([self._cache[i].cache for i in self._recurrent])
        self._trim(n)
        self._pos -= n
        self._recorded = 0

    def _advance(self, T: int, *, recorded: bool) -> None:
        """After a call of T tokens the recurrent layers `recorded` (or not: none before it can be undone)."""
        self._pos += T
        if recorded:
            self._recorded += T
        else:
            self._commit()

    def _commit(self) -> None:
        """What the recurrent layers recorded is kept: a later rollback cannot reach into it."""
        for r in self._recurrent.values():
            r.forget()
        self._recorded = 0

    def _drop_ahead(self) -> None:
        """Trim the queued run-ahead position (if any) off the cache; `position` is unchanged."""
        if self._ahead is not None:
            self._ahead = None
            self._trim(1)

    def _trim(self, n: int) -> None:
        for i, c in enumerate(self._cache):
            if i in self._recurrent:
                continue  # restored by its replay
            before = c.offset
            got = c.trim(n)
            if got != n or c.offset != before - n:  # never silent (mlx-lm #1423)
                raise RollbackError(
                    f"rollback of {n} moved layer {i}'s {type(c).__name__} from {before} to {c.offset} "
                    f"(trim returned {got})"
                )

    # ---- forward -------------------------------------------------------------------------------------

    def set_target_layers(self, layer_ids: Sequence[int]) -> None:
        self._layer_ids = check_layer_ids(layer_ids, self.num_layers, self.model_name)

    def _layer_list(self) -> tuple[list[Any], int]:
        """The model's own list of decoder layers and where `model.layers[0]` sits in it. Pipeline models
        (mlx_lm `PipelineMixin`: qwen3_moe, deepseek_v3, glm4_moe, ...) return a fresh slice
        `layers[start_idx:end_idx]` from `model.layers`: a tap put into that copy would never run."""
        layers = self.model.layers
        if layers is self.model.layers:
            return layers, 0
        inner = getattr(text_model(self.model), "model", None)
        own = getattr(inner, "layers", None)
        if not isinstance(own, list) or not hasattr(inner, "start_idx"):
            raise ValueError(
                f"mlx_lm {self.model_type!r}: `model.layers` is rebuilt on every access and its source list "
                "was not found, so decoder-layer outputs cannot be captured"
            )
        return own, int(inner.start_idx)

    @contextmanager
    def _tapped(self, store: dict[int, mx.array], *, last_only: bool, record: bool = False) -> Iterator[None]:
        """Decoder layers tapped for their outputs and, with `record`, recurrent mixers recorded."""
        layers, start = self._layer_list()  # the model's own list
        last = self.num_layers - 1
        wrap = set(self._layer_ids) | ({last} if last_only else set())
        originals = {i: layers[start + i] for i in wrap}
        mixers = {i: layers[start + i] for i in self._recurrent} if record else {}
        for i, r in self._recurrent.items() if record else ():
            mixers[i]["linear_attn"] = r
        for i in wrap:
            slot = i if i in self._layer_ids else None
            layers[start + i] = Tap(originals[i], store, slot, last_only and i == last)
        try:
            yield
        finally:
            for i, layer in originals.items():
                layers[start + i] = layer
            for i, layer in mixers.items():
                layer["linear_attn"] = self._recurrent[i].mixer

    def _forward(
        self, tokens: Sequence[int] | mx.array, *, last_only: bool, tree: TreeAttention | None = None
    ) -> mx.array:
        """Append `tokens` to the cache; logits [T, V] (or [1, V] with last_only). Sets the features. With
        `tree`, `tokens` are a tree's nodes: positions by depth, each seeing the cache and its ancestors."""
        ids = tokens if isinstance(tokens, mx.array) else mx.array(tokens, dtype=mx.int32)  # [T]
        T = ids.shape[0]
        check_call(T, self._pos, self.max_context)
        store: dict[int, mx.array] = {}
        record = bool(self._recurrent) and T <= MAX_VERIFY_TOKENS
        cache = self._cache if tree is None else [TreeCache(c, tree) for c in self._cache]
        # the ropes first: they are swapped inside the decoder layers, which `_tapped` then stands in for
        with self._tree_ropes(tree), self._tapped(store, last_only=last_only, record=record):
            logits = self.model(ids[None], cache=cache)  # [1, T|1, V]
        self._advance(T, recorded=record)
        # [T, K*H], layers in the order asked for
        self._feats = (
            mx.concatenate([store[i] for i in self._layer_ids], axis=-1)[0] if self._layer_ids else None
        )
        return logits[0]

    @contextmanager
    def _tree_ropes(self, tree: TreeAttention | None) -> Iterator[None]:
        """With a tree, every attention layer's RoPE places each node at its own position (`TreeRoPE`)."""
        if tree is None:
            yield
            return
        positions = mx.array(tree.positions.tolist(), dtype=mx.int32)  # [T]
        attns = [layer["self_attn"] for layer in self._layer_list()[0]]
        ropes = [attn["rope"] for attn in attns]
        for attn, rope in zip(attns, ropes):
            attn["rope"] = TreeRoPE(rope, positions)
        try:
            yield
        finally:
            for attn, rope in zip(attns, ropes):
                attn["rope"] = rope

    def check_tree(self) -> None:
        why = self._tree_unsupported() or (
            None
            if self.tree_exact
            else "a tree verify does not give its paths' logits bit for bit here (measured)"
        )
        if why:
            raise ValueError(
                f"{self.model_name} (mlx_lm {self.model_type!r}) cannot verify trees: {why}; use a chain"
            )

    def _tree_unsupported(self) -> str | None:
        """Why this model's layers cannot verify a tree at all (None: they can; exactness is measured)."""
        why, layers = None, self._layer_list()[0]
        if self._recurrent:
            why = "its Gated DeltaNet layers would need a tree-aware recurrent state"
        elif any(type(c) is not KVCache for c in self._cache):
            why = f"its caches {sorted({type(c).__name__ for c in self._cache})} are not plain KV caches"
        elif not all(isinstance(la, dict) and "rope" in la.get("self_attn", {}) for la in layers):
            why = "its decoder layers have no `self_attn.rope` to place the nodes by depth"
        return why

    @property
    def tree_exact(self) -> bool:
        """Whether a tree verify gives every node bit for bit the logits of its path verified as a chain,
        on this model here (`specdec.measure.trees_equal_chains`; on first use, on caches of its own; a
        model whose masks do not come from its cache fails it too)."""
        if self._tree_exact is None:
            self._tree_exact = self._tree_unsupported() is None and trees_equal_chains(self)
        return self._tree_exact

    def probe_logits(self, calls: Sequence[ProbeCall]) -> list[torch.Tensor | None]:
        """`specdec.measure`'s calls on caches of their own (this verifier's stay as they are): the model
        itself (tapped only to keep the prompt's last row), each call's logits as a zero-copy torch view."""
        cache, pos, out = self._make_cache(), 0, []
        for n, call in enumerate(calls):
            if isinstance(call, int):
                for c in cache:
                    c.trim(call)
                pos -= call
                out.append(None)
                continue
            ids = mx.array(list(call.tokens if isinstance(call, Tree) else call), dtype=mx.int32)[None]
            if isinstance(call, Tree):
                att = TreeAttention(call, pos, "cpu")
                with self._tree_ropes(att):
                    logits = self.model(ids, cache=[TreeCache(c, att) for c in cache])  # [1, N, V]
            else:
                with self._tapped({}, last_only=True) if n == 0 else nullcontext():  # a prompt: its last row
                    logits = self.model(ids, cache=cache)  # [1, T|1, V]
            pos += ids.shape[1]
            out.append(to_torch(logits[0]))
        return out

    def verify_tree(self, tree: Tree, *, sample: SampleFn | None = None) -> list[int]:
        self._drop_ahead()
        logits = self._forward(tree.tokens, last_only=False, tree=TreeAttention(tree, self._pos, "cpu"))
        self._tree_size = len(tree)
        return self._pick(logits, sample)  # [N]

    def keep_path(self, path: Sequence[int]) -> None:
        T, n = self._tree_size, len(path)
        for c in self._cache:  # plain KV caches (`check_tree`): move the path's slots down, drop the rest
            p0 = c.offset - T
            rows = mx.array([p0 + i for i in path], dtype=mx.int32)
            c.keys[..., p0 : p0 + n, :] = c.keys[..., rows, :]
            c.values[..., p0 : p0 + n, :] = c.values[..., rows, :]
            c.offset = p0 + n
        self._pos -= T - n
        self._tree_size = 0
        if self._feats is not None:
            self._feats = self._feats[mx.array(list(path), dtype=mx.int32)]  # [n, K*H]

    def prefill(self, tokens: Sequence[int], *, sample: SampleFn | None = None) -> int:
        self._drop_ahead()
        feats: list[mx.array] = []
        for s in range(0, len(tokens), self.prefill_chunk):
            logits = self._forward(tokens[s : s + self.prefill_chunk], last_only=True)  # [1, V]
            if self._feats is not None:
                feats.append(self._feats)
            # later chunks need this chunk's cache; evaluate it now so the graph stays one chunk deep
            mx.eval([c.state for c in self._cache], feats)
        self._feats = mx.concatenate(feats, axis=0) if len(feats) > 1 else (feats[0] if feats else None)
        return self._pick(logits, sample)[-1]

    def verify(
        self, tokens: Sequence[int], *, sample: SampleFn | None = None, ahead: bool = False
    ) -> list[int]:
        queued = self._ahead
        one = ahead and len(tokens) == 1 and sample is None and not self._layer_ids and self.run_ahead
        if queued is not None and one and queued[0] == tokens[0]:
            self._ahead, self._pos = None, self._pos + 1  # the queued step is this one
            out = queued[1]  # [1], computed or in flight
        else:
            self._drop_ahead()
            logits = self._forward(tokens, last_only=False)  # [T, V]
            if not one:
                return self._pick(logits, sample)
            out = mx.argmax(logits, axis=-1).astype(mx.int32)  # [1]
            mx.async_eval(out)
        if self._pos < self.max_context:  # queue the next step on this one's (still lazy) result
            nxt = mx.argmax(self._forward(out, last_only=False), axis=-1).astype(mx.int32)  # [1]
            mx.async_eval(nxt)
            self._pos -= 1  # the queued position is not committed
        else:
            nxt = None
        token = out.item()  # the sync point: waits for this step only
        self._ahead = (token, nxt) if nxt is not None else None
        return [token]

    def _pick(self, logits: mx.array, sample: SampleFn | None) -> list[int]:
        """The verifier's token at each row of logits [T, V]: argmax on the MLX side, or `sample` on a
        zero-copy torch view. Evaluates the captured features in the same graph."""
        extra = [] if self._feats is None else [self._feats]
        if sample is not None:
            mx.eval(logits, *extra)
            return sample(to_torch(logits))  # [T, V] torch on CPU, the model's dtype
        out = mx.argmax(logits, axis=-1)  # [T]
        mx.eval(out, *extra)
        return out.tolist()  # the sync point

    def features(self, n: int, *, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
        return to_torch(self.native_features(n), device=device, dtype=dtype)  # [n, K*H]

    def native_features(self, n: int) -> mx.array:
        """[n, K*H] features of the last call as an mx.array (lazy; for an MLX drafter: nothing crosses)."""
        if self._feats is None:
            raise RuntimeError("no features captured: call set_target_layers() before prefill/verify")
        if not 0 <= n <= self._feats.shape[0]:
            raise ValueError(f"asked for {n} feature rows, the last call captured {self._feats.shape[0]}")
        return self._feats[:n]

    def keep_window(self, n: int) -> None:
        """`SharedKV`: the sliding layers hold every position here already (plain KVCaches)."""
        if any(type(c) is RotatingKVCache for c in self._cache):
            raise ValueError(
                f"{self.model_name}'s sliding layers keep a rotating window; none is handed over"
            )

    def shared_kv(self, layer: int, *, last: int | None = None) -> tuple[mx.array, mx.array]:
        """`SharedKV`: layer `layer`'s cached keys and values [1, H_kv, T, D] (slices of its cache)."""
        c = self._cache[layer] if layer < len(self._cache) else None
        if type(c) not in EXACT_CACHES or c.keys is None:
            raise ValueError(
                f"layer {layer} of {self.model_name} holds no keys (KV-shared, or nothing cached)"
            )
        start = 0 if last is None else max(c.offset - last, 0)
        return c.keys[:, :, start : c.offset], c.values[:, :, start : c.offset]

    # ---- drafter callbacks ---------------------------------------------------------------------------

    def _weight(self, which: str, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
        """[V, H] embedding or head weight on device/dtype, built once; a tied head shares the embedding's."""
        head = head_module(self.model)  # raises ValueError for architectures it cannot rebuild
        inner = text_model(self.model).model
        if which == "head" and head is inner.embed_tokens:
            which = "embed"
        key = (which, str(torch.device(device)), dtype)
        if key not in self._weights:
            module = inner.embed_tokens if which == "embed" else head
            self._weights[key] = to_torch(dequantized_weight(module), device=device, dtype=dtype)  # [V, H]
        return self._weights[key]

    def embed_fn(self, *, device: torch.device | str, dtype: torch.dtype) -> EmbedFn:
        return make_embed_fn(
            self.model, device=device, dtype=dtype, weight=self._weight("embed", device, dtype)
        )

    def lm_head_fn(
        self, *, device: torch.device | str, dtype: torch.dtype, rows: torch.Tensor | None = None
    ) -> LMHeadFn:
        return make_lm_head_fn(
            self.model, device=device, dtype=dtype, weight=self._weight("head", device, dtype), rows=rows
        )

    def memory_probe(self) -> MemoryProbe:
        return mlx_probe()
