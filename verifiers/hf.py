"""The Verifier protocol on a transformers causal LM (Llama, Gemma 3/4, Qwen3, and kin), batch 1.

The KV cache is a transformers 5 `DynamicCache` built from the model's config, so Gemma's sliding layers
get `DynamicSlidingWindowLayer`s exactly as `model.generate` does; its plain full-attention layers are
swapped for `GrowingLayer`s, which append in place instead of copying the cache each step. Rollback is
`cache.crop(-n)`; for the sliding layers it is exact past the window only because
`activate_past_recording()` is switched on when the cache is made: each layer then keeps every position
appended since its last crop, and the crop after a verify both drops the rejected positions and trims
the layer back to `sliding_window - 1` entries. Hence a rollback may reach back at most over the
positions appended since the previous rollback (all the engine ever needs); asking for more once a
window is full raises instead of silently corrupting the cache.

Gemma 4's KV-shared layers get a `DummyLayer` (no cache of their own: they attend over their producer
layer's keys/values), which holds nothing to roll back.

Gated DeltaNet layers (Qwen3.5 / 3.6, Qwen3-Next: `linear_attention`) roll back with transformers' own
recording: a call of at most `MAX_VERIFY_TOKENS` tokens runs their recurrence token by token, as one-token
steps do, and keeps the state after each position, and the conv layers keep their inputs until the next
crop, which takes the state and conv window of the accepted prefix and lets the rest go. Longer calls
(prefills) take transformers' chunked kernel and keep no states: a rollback into one raises
`RollbackError`. Chosen over re-running the accepted prefix from a saved state (the MLX verifier's way)
because transformers computes the per-position states anyway; the cost is measured in docs/hybrids.md.

Features are the raw outputs of the chosen decoder layers (`model.model.layers[l]`, i.e. HF
`hidden_states[l+1]`, and for the last layer the output *before* the final norm), captured by forward
hooks that exist only while target layers are set, for exactly the positions of the last call.
`prefill` computes the LM head on the last position only (`logits_to_keep=1`). On models with KV-shared
layers `logits_to_keep` is passed as position indices instead of an int: with an int, transformers'
Gemma 4 runs the KV-shared layers on the kept positions only (their features would be cut to the last
position) and, up to transformers 5.24, fails outright when the model has no per-layer inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from specdec.kernels import (
    MAX_VERIFY_TOKENS,
    TreeAttention,
    batch_invariant,
    linear_fn,
    linear_shapes,
    use_cpu_linears,
)
from specdec.measure import probe_own_cache, trees_equal_chains, verify_equals_steps
from specdec.memory import probe_for_module
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
from specdec.verifiers.hf_parts import (
    TREE,
    attend_invariant,
    growing_layer,
    has_sinks,
    language_model,
    sdpa_gqa,
    set_attention,
    text_part,
    wide_sliding_layer,
)

__all__ = ["EXACT_ROLLBACK_LAYER_TYPES", "HFVerifier"]

#: `config.layer_types` entries whose cache layer `crop` restores exactly: attention with a KV cache, and
#: Gated DeltaNet (`linear_attention`: Qwen3.5 / 3.6, Qwen3-Next) with one recurrent state kept per
#: verified position (see `HFVerifier.forward`).
EXACT_ROLLBACK_LAYER_TYPES = frozenset(
    {"full_attention", "sliding_attention", "chunked_attention", "linear_attention"}
)


def _as_ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def _check_layer_types(cfg: Any, name: str) -> None:
    """ValueError for a model with layers this verifier cannot roll back exactly (SSM / convolution /
    other recurrent state than Gated DeltaNet's), before any weights load."""
    bad = sorted(
        {str(t) for t in getattr(cfg, "layer_types", None) or () if t not in EXACT_ROLLBACK_LAYER_TYPES}
    )
    if bad:
        raise ValueError(
            f"{name} ({cfg.model_type}) has layer types {bad} whose state the HF verifier cannot roll back "
            f"exactly; it runs {sorted(EXACT_ROLLBACK_LAYER_TYPES)}"
        )


class HFVerifier:
    """Verifier on `AutoModelForCausalLM`: a model folder (or a loaded model), fp32 on CPU by default."""

    runtime = "hf"

    def __init__(
        self,
        model_path_or_model: str | Path | torch.nn.Module,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        tokenizer: Any = None,
        onednn: bool = True,
        invariant: bool | None = None,
    ) -> None:
        """`onednn`: on a CPU, run the model's linears with `specdec.kernels.linear_fn` (oneDNN in fp32 and
        bf16: a verify of several tokens costs much less; in half precision a one-row product computed as
        two, which rounds like the rows of a verify) and, without `invariant`, let grouped-query attention
        read the shared K/V heads under a mask instead of copying them (bit-identical); a model object
        passed in is switched in place. Off: the model runs exactly as loaded.

        `invariant` (None: on for bf16 / fp16 on a CPU): attention through
        `specdec.kernels.invariant_attention`, so a verify of several tokens gives each position bit for bit
        what a one-token verify gives wherever the linears are invariant too. `batch_invariant` says
        whether a verify equals one-token steps bit for bit on this model here, measured at load
        (`specdec.measure.verify_equals_steps`); speculative output then equals autoregressive output
        token for token in that dtype."""
        if isinstance(model_path_or_model, torch.nn.Module):
            model = language_model(model_path_or_model).to(device=device, dtype=dtype)
            path = getattr(model.config, "_name_or_path", "") or type(model).__name__
        else:
            path = str(model_path_or_model)
            model = self._load(Path(path), dtype=dtype, device=device)
            if tokenizer is None:
                tokenizer = self.load_tokenizer(Path(path))
        self.model = model.eval()
        cpu = torch.device(device).type == "cpu"
        half = dtype in (torch.bfloat16, torch.float16)
        invariant = half and cpu if invariant is None else invariant
        if onednn and cpu:
            use_cpu_linears(model)
        switched = bool(invariant) and set_attention(model, "specdec_invariant", attend_invariant, sinks=True)
        # ours also where it changes nothing (not on a CPU): a tree verify attends through it
        sdpa = not invariant and (onednn or not cpu) and set_attention(model, "specdec_sdpa", sdpa_gqa)
        self._own_attention = switched or sdpa  # what `check_tree` asks
        self.config = cfg = model.config.get_text_config(decoder=True)
        _check_layer_types(cfg, Path(path).name or path)  # a model object; a folder is checked before loading
        base = getattr(model, "model", None)
        layers = getattr(base, "layers", None)
        if not isinstance(layers, torch.nn.ModuleList) or model.get_output_embeddings() is None:
            raise ValueError(
                f"unsupported architecture {type(model).__name__} (model_type {cfg.model_type!r}): "
                "HFVerifier needs a decoder-only causal LM with `model.model.layers` and an LM head "
                "(Llama, Gemma 3/4, Qwen3, ...)"
            )
        self._layers: torch.nn.ModuleList = layers
        self.model_name = Path(path).name or path
        self.dtype = str(dtype).removeprefix("torch.")
        self.device = torch.device(device)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.hidden_size = int(cfg.hidden_size)
        self.num_layers = len(layers)
        self.max_context = int(getattr(cfg, "max_position_embeddings", None) or 2**31 - 1)
        gen = getattr(model, "generation_config", None)
        eos = _as_ids(getattr(cfg, "eos_token_id", None)) | _as_ids(getattr(gen, "eos_token_id", None))
        self.eos_token_ids = frozenset(eos)
        self.tokenizer = tokenizer
        # Gemma 4: layers from here on reuse an earlier layer's KV (see module docstring)
        self._kv_shared = int(getattr(cfg, "num_kv_shared_layers", 0) or 0) > 0
        self._layer_ids: tuple[int, ...] = ()
        self._hooks: list[Any] = []
        self._captured: dict[int, torch.Tensor] = {}  # layer id -> [T, H] of the last call
        self._weights: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}
        self._window_keep = 0  # sliding layers keep at least this many positions (`keep_window`)
        self.reset()
        # measured on this model here (a verify vs one-token steps), not inferred from a toy shape
        self.batch_invariant = (
            switched
            and batch_invariant(dtype, str(device), linear_shapes(model))
            and verify_equals_steps(self)
        )
        self._tree_exact: bool | None = None  # measured on first use (`tree_exact`): most runs verify chains

    # ---- loading -------------------------------------------------------------------------------------

    @staticmethod
    def _load(path: Path, *, dtype: torch.dtype, device: str | torch.device) -> torch.nn.Module:
        if not path.is_dir():
            raise FileNotFoundError(
                f"model folder {str(path)!r} does not exist; give a local HF folder (with config.json) or "
                "fetch one with specdec.models.fetch / resolve_model"
            )
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{str(path)!r} has no config.json: it is not a transformers model folder"
            )
        from transformers import AutoConfig, AutoModelForCausalLM

        from specdec.formats import refuse_as_model
        from specdec.models import read_config

        raw = read_config(path)
        if raw is not None:  # a drafter folder: transformers would build a random model from it
            refuse_as_model(path, raw)
        config, text_only = text_part(AutoConfig.from_pretrained(path))
        _check_layer_types(config.get_text_config(decoder=True), path.name)  # before the weights load
        from transformers.utils import logging as hf_logging

        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # its load report: a missing weight is our one-line error below
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, config=config, output_loading_info=True, **text_only
            )
        except ValueError as e:  # transformers' "Unrecognized configuration class ..."
            raise ValueError(
                f"unsupported architecture in {str(path)!r} (model_type {config.model_type!r}): "
                f"AutoModelForCausalLM cannot load it ({e})"
            ) from e
        except Exception as e:  # safetensors' SafetensorError, OSError: truncated or unreadable weights
            raise ValueError(f"cannot load the weights in {str(path)!r}: {type(e).__name__}: {e}") from None
        finally:
            hf_logging.set_verbosity(level)
        missing = sorted(info["missing_keys"])
        if missing:  # transformers would run them as random numbers
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ValueError(
                f"the checkpoint in {str(path)!r} lacks {len(missing)} of the model's weights "
                f"({', '.join(missing[:5])}{more}): truncated or converted incompletely"
            )
        return model.to(device)

    @staticmethod
    def load_tokenizer(path: Path) -> Any:
        names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
        if not any((path / n).is_file() for n in names):
            return None  # e.g. tiny random test models
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)

    # ---- protocol ------------------------------------------------------------------------------------

    @property
    def position(self) -> int:
        return self._pos

    def set_target_layers(self, layer_ids: Sequence[int]) -> None:
        ids = check_layer_ids(layer_ids, self.num_layers, self.model_name)
        for h in self._hooks:
            h.remove()
        self._hooks, self._captured = [], {}
        self._layer_ids = ids
        for i in sorted(set(self._layer_ids)):
            self._hooks.append(self._layers[i].register_forward_hook(self._recorder(i)))

    def _recorder(self, i: int):
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            out = output[0] if isinstance(output, tuple) else output  # [1, T, H]
            self._captured[i] = out[0]

        return hook

    def check_rollback(self) -> None:
        from transformers import cache_utils

        # DummyLayer: KV-shared, holds nothing; LinearAttentionLayer: recording (see `forward`); the last two
        # are newer than some transformers 5 releases, whose models then have none of them
        names = ("DynamicLayer", "DynamicSlidingWindowLayer", "DummyLayer", "LinearAttentionLayer")
        exact = tuple(getattr(cache_utils, n) for n in names if hasattr(cache_utils, n))
        odd = sorted(
            {
                type(la).__name__
                for la in self._cache.layers
                if type(la) not in exact and not getattr(la, "exact_rollback", False)  # ours (hf_parts)
            }
        )
        if odd:
            raise RuntimeError(
                f"{self.model_name} ({self.config.model_type}) uses cache layers {odd} that cannot be "
                f"rolled back exactly; only {[c.__name__ for c in exact]} can"
            )

    def reset(self) -> None:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

        self._cache = kv = DynamicCache(config=self.model.config)
        grow = growing_layer()  # in place of the plain layers (the sliding and shared ones stay as they are)
        kv.layers = [grow() if type(la) is DynamicLayer else la for la in kv.layers]
        self._widen_sliding(kv.layers)
        # sliding layers keep what a verify appended until the crop that follows it, linear-attention
        # layers their conv inputs and the recurrent states `forward` asks for (see module docstring)
        self._linear = [la for la in kv.layers if isinstance(la, LinearAttentionCacheLayerMixin)]
        if not self._linear:
            kv.activate_past_recording()  # the one form older transformers (e.g. 5.17) know too
        else:
            try:
                kv.activate_past_recording(recurrent_states_to_keep=0)
            except TypeError:
                import transformers

                raise RuntimeError(
                    f"transformers {transformers.__version__} cannot keep the recurrent states of "
                    f"{self.model_name}'s linear-attention layers for an exact rollback; install a newer one "
                    "(5.25 is tested)"
                ) from None
        self._pos = 0
        self._since_crop = 0  # positions appended since the last crop: how far a rollback may reach
        self._tree_size = 0  # nodes of the last verify_tree
        self._recorded = 0  # of those, the last ones with a recurrent state each (linear layers)
        self._captured = {}

    def check_tree(self) -> None:
        why = None
        if self._linear:
            why = "its linear-attention (Gated DeltaNet) layers would need a tree-aware recurrent state"
        elif not self._own_attention:
            runs = self.model.config._attn_implementation
            why = (
                f"its attention sinks run in transformers' {runs!r} attention in {self.dtype} (specdec's "
                "takes them in bf16 / fp16 on a CPU)"
                if has_sinks(self.model)
                else f"it runs {runs!r} attention (trees need sdpa)"
            )
        elif not self.tree_exact:
            why = f"its {self.dtype} tree verify does not give its paths' logits bit for bit here (measured)"
        if why:
            name = f"{self.model_name} ({self.config.model_type})"
            raise ValueError(f"{name} cannot verify trees: {why}; use a chain")

    @property
    def tree_exact(self) -> bool:
        """Whether a tree verify gives each node bit for bit its path's logits verified as a chain on this
        model here (`specdec.measure.trees_equal_chains`; measured where the verify is batch-invariant,
        which is where bit for bit is the claim). Measured on first use, aside from the run's cache."""
        if self._tree_exact is None:
            self._tree_exact = self._measure_aside(trees_equal_chains) if self.batch_invariant else True
        return self._tree_exact

    def _measure_aside(self, measure: Any) -> Any:
        """`measure(self)` (which resets the cache) with the cache, position and captured states of the
        run before it put back after."""
        saved, ids = dict(vars(self)), self._layer_ids
        try:
            return measure(self)
        finally:
            vars(self).update(saved)
            self.set_target_layers(ids)  # the hooks the probe removed
            self._captured = saved["_captured"]

    def verify_tree(self, tree: Tree, *, sample: SampleFn | None = None) -> list[int]:
        logits = self.forward(tree.tokens, tree=TreeAttention(tree, self._pos, self.device))  # [N, V]
        self._tree_size = len(tree)
        return sample(logits) if sample else logits.argmax(-1).tolist()

    @torch.inference_mode()
    def keep_path(self, path: Sequence[int]) -> None:
        T, n = self._tree_size, len(path)
        rows = torch.tensor(path, device=self.device)
        for la in self._cache.layers:
            if getattr(la, "is_sliding", False):  # keeps all since the last crop
                if la.is_initialized:
                    la.keys = torch.cat([la.keys[:, :, :-T], la.keys[:, :, -T:][:, :, rows]], 2)
                    la.values = torch.cat([la.values[:, :, :-T], la.values[:, :, -T:][:, :, rows]], 2)
                    la.cumulative_length -= T - n
            elif getattr(la, "exact_rollback", False):  # ours: GrowingLayer
                la.keep_last(T, rows)
        self._pos -= T - n
        self._since_crop -= T - n
        self._tree_size = 0
        self._captured = {i: c[rows] for i, c in self._captured.items()}  # [n, H] each

    def _check_call(self, tokens: Sequence[int]) -> int:
        """A call of `tokens` fits the cache: their count, or ValueError."""
        check_call(len(tokens), self._pos, self.max_context)
        return len(tokens)

    @torch.inference_mode()
    def forward(
        self, tokens: Sequence[int], *, last_only: bool = False, tree: TreeAttention | None = None
    ) -> torch.Tensor:
        """Append `tokens` to the cache; logits [T, V] (or [1, V] with last_only). With `tree`, `tokens` are
        a tree's nodes: positions by depth, each seeing the cache and its ancestors (`hf_parts`)."""
        T = self._check_call(tokens)
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)  # [1, T]
        self._captured = {}
        self._record(T)
        pos = None if tree is None else tree.positions[None]  # [1, T]
        reset = TREE.set(tree)  # read by our attention functions, on this thread only
        try:
            out = self.model(
                input_ids=ids,
                cache=self._cache,
                use_cache=True,
                logits_to_keep=self._keep(T, last_only),
                position_ids=pos,
            )
        finally:
            TREE.reset(reset)
        self._advance(T)
        return out.logits[0]  # [T, V]

    def _keep(self, T: int, last_only: bool) -> int | torch.Tensor:
        """`logits_to_keep` for a call of T tokens: indices, not an int, on models with KV-shared layers (see
        module docstring)."""
        if self._kv_shared:
            return torch.arange(T - 1 if last_only else 0, T, device=self.device)
        return 1 if last_only else 0

    def _record(self, T: int) -> None:
        """Before a call of T tokens: a verify (at most MAX_VERIFY_TOKENS) keeps one recurrent state per
        position in every linear-attention layer and runs the recurrence token by token, as one-token
        steps do; a prefill keeps none and takes transformers' chunked kernel, so a rollback cannot reach
        into it."""
        for la in self._linear:
            la.recurrent_states_to_keep = T if T <= MAX_VERIFY_TOKENS else 0

    def _advance(self, T: int) -> None:
        """After a call of T tokens: the positions cached, and how far a rollback may reach."""
        self._pos += T
        self._since_crop += T
        self._recorded = self._recorded + T if T <= MAX_VERIFY_TOKENS else 0

    def probe_logits(self, calls: Sequence[ProbeCall]) -> list[torch.Tensor | None]:
        """`specdec.measure`'s calls on this verifier's own cache from empty (at load; leaves it reset)."""
        return probe_own_cache(self, calls, self.device)

    def prefill(self, tokens: Sequence[int], *, sample: SampleFn | None = None) -> int:
        logits = self.forward(tokens, last_only=True)  # [1, V]
        return sample(logits)[0] if sample else int(logits[-1].argmax())

    def verify(
        self, tokens: Sequence[int], *, sample: SampleFn | None = None, ahead: bool = False
    ) -> list[int]:
        logits = self.forward(tokens)  # [T, V]; `ahead` buys nothing on a synchronous runtime
        return sample(logits) if sample else logits.argmax(-1).tolist()

    def rollback(self, n: int) -> None:
        if not 0 <= n <= self._pos:
            raise ValueError(f"cannot roll back {n} of {self._pos} cached positions")
        if n > self._since_crop and self._window_full():
            raise RollbackError(
                f"cannot roll back {n} positions exactly: the sliding-window layers of {self.model_name} "
                f"only keep the {self._since_crop} positions appended since the last rollback"
            )
        if n > self._recorded and self._linear:
            raise RollbackError(
                f"cannot roll back {n} positions exactly: the linear-attention layers of {self.model_name} "
                f"hold a recurrent state for the last {self._recorded} positions only"
            )
        if n == 0 and self._since_crop == 0:
            return  # nothing appended since the last crop (crop on a fresh cache would fail)
        self._cache.crop(-n)  # crop(0) still trims the sliding / linear layers back to what they need
        self._pos -= n
        self._since_crop = self._recorded = 0

    def _window_full(self) -> bool:
        return any(
            getattr(la, "is_sliding", False) and la.get_seq_length() >= la.sliding_window
            for la in self._cache.layers
        )

    def keep_window(self, n: int) -> None:
        """`SharedKV`: sliding layers keep at least n positions (a fresh cache is made where they would
        have to start now)."""
        if n > self._window_keep:
            self._window_keep = n
            self._widen_sliding(self._cache.layers)  # hold at least what they held: exact from here

    def _widen_sliding(self, layers: Sequence[Any]) -> None:
        """The sliding layers of `layers` keep `_window_keep` positions (none asked: as transformers')."""
        if self._window_keep:
            for la in layers:
                if getattr(la, "is_sliding", False):
                    wide_sliding_layer(la, self._window_keep)

    def shared_kv(self, layer: int, *, last: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`SharedKV`: layer `layer`'s cached keys and values [1, H_kv, T, D] (views)."""
        la = self._cache.layers[layer]
        if not getattr(la, "is_initialized", False) or la.keys is None:
            raise ValueError(
                f"layer {layer} of {self.model_name} holds no keys (KV-shared, or nothing cached)"
            )
        k, v = la.keys, la.values  # the cached positions (a sliding layer: the most recent), in order
        if last is not None:
            if getattr(la, "is_sliding", False) and k.shape[-2] < min(last, self._pos):
                raise ValueError(f"layer {layer} holds {k.shape[-2]} positions, {last} asked (keep_window)")
            k, v = k[:, :, -last:], v[:, :, -last:]
        return k, v

    def features(self, n: int, *, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        if not self._layer_ids:
            raise RuntimeError("no features captured: call set_target_layers() before prefill/verify")
        if not self._captured:
            raise RuntimeError("no features captured yet: call prefill() or verify() first")
        # [n, K*H], layers in the order asked for
        return torch.cat([self._captured[i][:n] for i in self._layer_ids], -1).to(device=device, dtype=dtype)

    def _weight(self, w: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """`w` on device/dtype, converted once (a tied head and embedding share one copy)."""
        key = (w.data_ptr(), torch.device(device), dtype)
        if key not in self._weights:
            self._weights[key] = w.detach().to(device=device, dtype=dtype)
        return self._weights[key]

    def embed_fn(self, *, device: torch.device, dtype: torch.dtype) -> EmbedFn:
        emb = self.model.get_input_embeddings()
        weight = self._weight(emb.weight, device, dtype)  # [V, H]
        scale = getattr(emb, "embed_scale", None)  # Gemma: sqrt(H), applied in the model dtype
        if scale is None:
            return lambda ids: F.embedding(ids, weight)
        s = scale.to(emb.weight.dtype).to(device=device, dtype=dtype)
        return lambda ids: F.embedding(ids, weight) * s

    def final_norm_fn(
        self, *, device: torch.device, dtype: torch.dtype
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        norm = self.model.get_decoder().norm
        where = next(norm.parameters())  # in the model's own dtype and device, as its forward runs it
        return lambda x: norm(x.to(device=where.device, dtype=where.dtype)).to(device=device, dtype=dtype)

    def lm_head_fn(
        self, *, device: torch.device, dtype: torch.dtype, rows: torch.Tensor | None = None
    ) -> LMHeadFn:
        head = self.model.get_output_embeddings()
        weight = self._weight(head.weight, device, dtype)  # [V, H]; tied heads share the embedding
        bias = None if head.bias is None else self._weight(head.bias, device, dtype)
        if rows is not None:  # a draft vocabulary: logits [..., K] of these ids only
            rows = rows.to(device=weight.device)
            weight, bias = weight[rows], None if bias is None else bias[rows]  # [K, H], [K]
        cap = getattr(self.config, "final_logit_softcapping", None)
        linear = linear_fn(device, dtype)
        if cap is None:
            return lambda h: linear(h, weight, bias)
        return lambda h: torch.tanh(linear(h, weight, bias) / cap) * cap

    def memory_probe(self) -> MemoryProbe:
        return probe_for_module(self.model)

    @torch.no_grad()  # not inference_mode: the features go on into autograd (the drafter's fc)
    def batch_features(
        self, ids: torch.Tensor, layer_ids: Sequence[int], *, topk: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Teacher-forced features of a batch, for training: ids [B, T] right-padded (causal attention, so
        a sequence never sees the padding after it) -> features [B, T, K*H] of `layer_ids` (as `features`
        gives them), and with `topk` the log-probs [B, T, k] and ids [B, T, k] of the verifier's top-k next
        tokens at every position. Leaves the verifier's cache alone. Without `topk` the LM head is skipped."""
        ids_ = check_layer_ids(layer_ids, self.num_layers, self.model_name)
        got: dict[int, torch.Tensor] = {}

        def tap(i: int):
            def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
                got[i] = output[0] if isinstance(output, tuple) else output  # [B, T, H]

            return hook

        hooks = [self._layers[i].register_forward_hook(tap(i)) for i in sorted(set(ids_))]
        try:
            x = ids.to(self.device)
            if topk:
                logits = self.model(input_ids=x, use_cache=False).logits  # [B, T, V], soft-capped
                top = torch.log_softmax(logits.float(), -1).topk(topk, dim=-1)
            else:
                self.model.model(input_ids=x, use_cache=False)
        finally:
            for h in hooks:
                h.remove()
        feats = torch.cat([got[i] for i in ids_], -1)  # [B, T, K*H]
        if not topk:
            return feats, None, None
        return feats, top.values, top.indices

    def generate_many(
        self, items: Iterable[tuple[Any, Sequence[int], int]], *, max_len: int, rows: int = 128
    ) -> Iterator[tuple[Any, list[int]]]:
        """Greedy responses for training data, continuously batched (`hf_generate`)."""
        from specdec.verifiers.hf_generate import generate_many

        return generate_many(self.model, items, stop_ids=self.eos_token_ids, rows=rows, max_len=max_len)
