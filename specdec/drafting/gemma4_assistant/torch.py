"""A Gemma-4 assistant drafter in PyTorch, beside the HF verifier (what a step computes:
`gemma4_assistant.config`). The assistant's decoder layers are transformers' own (`Gemma4AssistantForCausalLM`
loaded from the checkpoint); the K/V it attends over are views of the verifier's cache (`SharedKV`), the
hidden state it starts from the verifier's last-layer output of the last committed position through the
verifier's own final norm. It keeps those outputs and the committed count, nothing else: a rollback only
moves the count.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from specdec.drafting.gemma4_assistant.config import AssistantConfig, LastRow, fit_verifier, kv_window
from specdec.drafting.policy import DraftPolicy
from specdec.kernels import MAX_VERIFY_TOKENS, use_cpu_linears
from specdec.protocols import MemoryProbe, Verifier
from specdec.sampling import sample_from

__all__ = ["AssistantDrafter", "load_assistant_model"]


def load_assistant_model(folder: str | Path, *, device: Any, dtype: torch.dtype) -> Any:
    """transformers' `Gemma4AssistantForCausalLM` (`Gemma4UnifiedAssistantForCausalLM`: the same model over
    the unified text layers) of a checkpoint `read_assistant` checked, quietly, eval."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, output_loading_info=True)
    finally:
        hf_logging.set_verbosity(level)
    if info["missing_keys"]:
        raise ValueError(f"Gemma-4 assistant {str(folder)!r} lacks {sorted(info['missing_keys'])[:4]}")
    model = model.to(device).eval().requires_grad_(False)
    use_cpu_linears(model)  # torch's own one-row product is ~4x slower on a CPU (docs/drafters.md)
    return model


class AssistantDrafter:
    """The `Drafter` protocol over a Gemma-4 assistant (module docstring); `from_pretrained` loads one."""

    runtime = "torch"
    walks = True  # each draft is drawn from the state the one before it left

    def __init__(
        self,
        model: Any,
        cfg: AssistantConfig,
        *,
        name: str,
        policy: DraftPolicy | None,
        block_size: int | None,
    ) -> None:
        self.model, self.cfg, self.name = model, cfg, name
        self.policy = policy or DraftPolicy()
        self.block_size = min(block_size or cfg.block_size, MAX_VERIFY_TOKENS)
        self.vocab_size = cfg.vocab_size
        self.feature_dim = cfg.backbone_hidden_size
        self.target_layer_ids: tuple[int, ...] = ()  # the verifier's last layer, fixed by `bind`
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.path: str | None = None
        self.verifier: Any = None
        self._ctx = LastRow(cfg.backbone_hidden_size)
        if cfg.ordered:  # [C, V/C] the tokens of each centroid
            self._clusters = model.masked_embedding.token_ordering.long().view(cfg.num_centroids, -1)

    @classmethod
    def from_pretrained(
        cls,
        folder: str | Path,
        cfg: AssistantConfig,
        *,
        device: Any = "cpu",
        dtype: torch.dtype = torch.float32,
        policy: DraftPolicy | None = None,
        block_size: int | None = None,
    ) -> AssistantDrafter:
        d = cls(
            load_assistant_model(folder, device=device, dtype=dtype),
            cfg,
            name=Path(folder).name,
            policy=policy,
            block_size=block_size,
        )
        d.path = str(folder)
        return d

    # ---- binding and the context --------------------------------------------------------------------------

    def bind(self, verifier: Verifier) -> None:
        """Check `verifier` is a Gemma 4 this assistant fits, whose cache it can read; take its embedding,
        final norm and the K/V source layers; keep its sliding layers `window + 1` positions deep."""
        self._sources = fit_verifier(self.cfg, verifier, name=self.name, runtime="torch")
        self.target_layer_ids = (verifier.num_layers - 1,)
        self.verifier = verifier
        self.embed_fn = verifier.embed_fn(device=self.device, dtype=self.dtype)
        # the verifier's own final norm, in its dtype (`protocols.FinalNorm`; `fit_verifier` took an HF one)
        self._final_norm: Callable[[torch.Tensor], torch.Tensor] = verifier.final_norm_fn(  # type: ignore[attr-defined]
            device=self.device, dtype=self.dtype
        )
        self.reset()

    @property
    def context_len(self) -> int:
        return self._ctx.n

    def reset(self) -> None:
        self._ctx.reset()

    def extend(self, features: torch.Tensor, tokens: Any) -> None:
        """Keep the last-layer outputs [n, H] of the committed positions (only the last one is read)."""
        self._ctx.extend(features, len(tokens))

    def rollback(self, n: int) -> None:
        self._ctx.rollback(n)

    # ---- drafting -----------------------------------------------------------------------------------------

    def _shared(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The verifier's K/V the assistant's layers read, per layer type (views; cast only where the
        assistant runs in another dtype or device than the verifier)."""
        v, out = self.verifier, {}
        for t, layer in self._sources.items():
            k, val = v.shared_kv(layer, last=kv_window(self.cfg, t))
            out[t] = (k.to(self.device, self.dtype), val.to(self.device, self.dtype))
        return out

    def _head(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """out [1, H] -> logits [1, S] and the token ids they are of ([S]; None: the whole vocabulary)."""
        m = self.model
        if not self.cfg.ordered:
            return m.lm_head(out), None
        top = m.masked_embedding.centroids(out).topk(self.cfg.top_k, dim=-1).indices  # [1, k]
        ids = self._clusters[top[0]].reshape(-1)  # [k * V/C] the chosen centroids' tokens
        return out @ m.lm_head.weight[ids].T, ids  # [1, S]

    @torch.inference_mode()
    def _walk(self, last_token: int, n: int, pick: Callable[..., torch.Tensor]) -> list[int]:
        """n drafts after `last_token`: `pick(logits [1, S], ids [S] | None, i)` chooses the index [1] of
        draft i among the S candidates (`ids`: their token ids; None: the whole vocabulary)."""
        P = self._ctx.n
        if n <= 0 or P == 0:
            return []
        m, kv = self.model, self._shared()
        h = self._final_norm(self._ctx.last())  # [1, Hb] the target's hidden at P - 1
        tok = torch.tensor([last_token], device=self.device)
        pos = torch.tensor([[P]], device=self.device)  # every step at the last token's position
        masks = None
        drafts = []
        for i in range(n):
            x = m.pre_projection(torch.cat([self.embed_fn(tok), h], -1)[None])  # [1, 1, H]
            masks = masks if masks is not None else m.create_attention_masks(x, None, kv)
            out = m.model(
                inputs_embeds=x, attention_mask=masks, position_ids=pos, shared_kv_states=kv, use_cache=False
            ).last_hidden_state[0]  # [1, H]
            logits, ids = self._head(out)
            j = pick(logits, ids, i)  # [1]
            tok = j if ids is None else ids[j]
            drafts.append(tok)
            h = m.post_projection(out)  # [1, Hb]
        return torch.cat(drafts).tolist()  # the one sync of a proposal

    def propose(self, last_token: int, n: int) -> list[int]:
        """Up to n greedy drafts, cut by the draft policy with each draft's top-1 chance."""
        if not 0 <= n < self.block_size:
            raise ValueError(f"can propose 0..{self.block_size - 1} tokens per step, asked for {n}")
        cut, tops = self.policy.needs_confidence("dflash"), []

        def greedy(logits: torch.Tensor, ids: torch.Tensor | None, i: int) -> torch.Tensor:
            if cut:
                tops.append(logits.float().softmax(-1).max(-1).values)
            return logits.argmax(-1)

        tokens = self._walk(last_token, n, greedy)
        return self.policy.block_cut(tokens, torch.cat(tops).tolist() if cut and tops else None)

    def propose_walk(
        self, last_token: int, n: int, *, temperature: float, u: torch.Tensor
    ) -> tuple[list[int], torch.Tensor]:
        """n drafts sampled at `temperature` with uniforms u [n] -> (tokens, q [n, V]: row i the distribution
        draft i was drawn from; a centroid head's q is 0 outside its chosen centroids)."""
        qs: list[torch.Tensor] = []

        def sample(logits: torch.Tensor, ids: torch.Tensor | None, i: int) -> torch.Tensor:
            q = (logits.float() / temperature).softmax(-1)  # [1, S]
            qs.append(q if ids is None else q.new_zeros(1, self.vocab_size).index_copy_(1, ids, q))
            return sample_from(q, u[i : i + 1].to(q.device))

        tokens = self._walk(last_token, n, sample)
        return tokens, (torch.cat(qs).cpu() if qs else torch.zeros(0, self.vocab_size))

    def memory_probe(self) -> MemoryProbe:
        from specdec.memory import probe_for_module

        return probe_for_module(self.model)

    def describe(self) -> dict[str, Any]:
        """For the result JSON: where from, the head, the layers whose K/V it reads."""
        return {
            "path": self.path,
            "architecture": "gemma4-assistant",
            "head": "centroid-sparse" if self.cfg.ordered else "dense",
            "kv_layers": dict(getattr(self, "_sources", {})),
            **self.policy.describe(),
        }
