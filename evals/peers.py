"""The peers of `specdec eval`: other loops, same process, same clock, run right after our two runs of each
prompt, their speedups against our AR baseline.

- runtime hf: `hf-generate` (plain greedy `model.generate`) and `hf-prompt-lookup` (`model.generate(...,
  prompt_lookup_num_tokens=10)`, HF assisted generation);
- runtime mlx: `mlx_lm-stream_generate` (greedy), the MLX AR reference;
- with a draft model: the runtime's own speculative decoding with it (`mlx_lm-speculative`, `hf-assisted`);
- beside an MLX verifier with a drafter checkpoint: `mlx-vlm-speculative`, mlx-vlm's own speculative
  decoding (an optional peer, never a dependency of the runtime) with the same model folder (its own copy
  of the weights) and the same checkpoint through its own drafter loader (DFlash, DFlash2, DSpark, EAGLE-3,
  native and split MTP, Gemma-4 assistants), greedy. Where it cannot (not installed, a family whose hidden
  states its loop does not capture, a drafter it cannot bind) the peer is skipped with mlx-vlm's reason in
  one line, found before the eval starts by a two-token probe. Its steps come from mlx-vlm's round
  counters (its prefill yields the first token, each round its accepted drafts and one of its own);
  `+lookup` is ours alone: the peer runs the neural drafter by itself;
- `drafter_peer`: our own loop with another drafter (the other drafter runtime, chains beside trees).
Their tokens are timed with a streamer (HF) or per yielded token (mlx_lm, mlx-vlm): `ttft_s` is the time to
the first emitted chunk, `tokens_per_s` counts the tokens after that first chunk over the time from it to
the last chunk (our convention: tokens after the first over decode time), and `e2e_tokens_per_s` is all
new tokens over the whole call.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specdec.engine import DecodeConfig, generate
from specdec.protocols import Drafter, Verifier
from specdec.records import summarize

__all__ = ["PROMPT_LOOKUP_NUM_TOKENS", "VLM", "PeerRun", "drafter_peer", "peer_runners"]

PROMPT_LOOKUP_NUM_TOKENS = 10
VLM = "mlx-vlm-speculative"

PeerRun = Callable[[list[int]], dict[str, Any]]


class _TimingStreamer:
    """HF streamer that timestamps every chunk of new tokens (the first `put` is the prompt)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock, self.times, self.counts, self._prompt_seen = clock, [], [], False

    def put(self, value: Any) -> None:
        t = self.clock()
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(t)
        self.counts.append(int(value.numel()))

    def end(self) -> None:
        pass


def _peer_figures(tokens: list[int], t0: float, times: list[float], counts: list[int], t_end: float) -> dict:
    after_first = sum(counts[1:])
    decode_s = times[-1] - times[0] if times else 0.0
    return {
        "output_tokens": tokens,
        "n_output_tokens": len(tokens),
        "ttft_s": times[0] - t0 if times else None,
        "decode_s": decode_s,
        "n_after_first": after_first,
        "tokens_per_s": after_first / decode_s if after_first and decode_s > 0 else None,
        "total_s": t_end - t0,
        "e2e_tokens_per_s": len(tokens) / (t_end - t0) if tokens and t_end > t0 else None,
    }


def _hf_peer(verifier: Verifier, cfg: DecodeConfig, **gen_kw: Any) -> PeerRun:
    import torch

    model = verifier.model  # type: ignore[attr-defined]
    device = next(model.parameters()).device
    stops = sorted(cfg.stop_token_ids if cfg.stop_token_ids is not None else verifier.eos_token_ids)

    def run(ids: list[int]) -> dict[str, Any]:
        x = torch.tensor([ids], dtype=torch.long, device=device)
        streamer = _TimingStreamer(time.perf_counter)
        probe = verifier.memory_probe()
        probe.reset()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=cfg.max_new_tokens,
                eos_token_id=stops, pad_token_id=stops[0] if stops else None, streamer=streamer, **gen_kw,
            )  # fmt: skip
        t_end = time.perf_counter()
        rec = _peer_figures(out[0, len(ids) :].tolist(), t0, streamer.times, streamer.counts, t_end)
        return {**rec, "peak_memory": probe.read()}

    return run


def _mlx_peer(verifier: Verifier, cfg: DecodeConfig, **gen_kw: Any) -> PeerRun:
    """mlx_lm's own loop; with `draft_model` / `num_draft_tokens` its speculative decoding, whose steps and
    acceptance are counted from the responses' `from_draft`: each verify step yields its accepted drafts and
    one token of its own (its prefill yields none), and a run cut by max_tokens may end inside a step."""
    from mlx_lm import stream_generate

    model, tok = verifier.model, verifier.tokenizer  # type: ignore[attr-defined]

    def run(ids: list[int]) -> dict[str, Any]:
        probe = verifier.memory_probe()
        probe.reset()
        tokens, times, own, last_drafted = [], [], 0, False
        t0 = time.perf_counter()
        # greedy (no sampler); the last response carries the EOS token or the max_tokens-th token
        for r in stream_generate(model, tok, prompt=ids, max_tokens=cfg.max_new_tokens, **gen_kw):
            times.append(time.perf_counter())
            tokens.append(int(r.token))
            own += not r.from_draft
            last_drafted = bool(r.from_draft)
        t_end = time.perf_counter()
        rec = _peer_figures(tokens, t0, times, [1] * len(times), t_end)
        if gen_kw.get("draft_model") is not None and tokens:
            rec |= {"n_steps": own + last_drafted, "acceptance_sum": len(tokens)}
        return {**rec, "peak_memory": probe.read()}

    return run


def _draft_model_peers(
    verifier: Verifier, drafter: Drafter | None, cfg: DecodeConfig
) -> tuple[dict[str, PeerRun], dict[str, str]]:
    """With a draft model (`--drafter model:...`) in the verifier's runtime: the runtime's own speculative
    decoding with the same draft model and draft length, what users compare us with (mlx_lm's
    `draft_model`, transformers' assisted generation)."""
    from specdec.drafting.draft_model.drafter import ModelDrafter

    if not isinstance(drafter, ModelDrafter):
        return {}, {}
    d, k = drafter.draft, min(cfg.block_size, drafter.block_size) - 1
    if verifier.runtime == "mlx" and d.runtime == "mlx":
        from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

        name = "mlx_lm-speculative"
        if not all(can_trim_prompt_cache(make_prompt_cache(m)) for m in (verifier.model, d.model)):  # type: ignore[attr-defined]
            return {}, {name: "skipped: mlx_lm's speculative decoding needs trimmable caches in both models"}
        run = _mlx_peer(verifier, cfg, draft_model=d.model, num_draft_tokens=k)  # type: ignore[attr-defined]
        return {name: run}, {
            name: f"mlx_lm.stream_generate, draft_model {d.model_name}, {k} draft tokens, greedy"
        }
    if verifier.runtime == "hf" and d.runtime == "hf":
        gc = d.model.generation_config  # type: ignore[attr-defined]
        # a fixed draft length, as ours: no schedule, no confidence cut
        gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = k, "constant"
        gc.assistant_confidence_threshold = 0.0
        name = "hf-assisted"
        run = _hf_peer(verifier, cfg, assistant_model=d.model)  # type: ignore[attr-defined]
        return {name: run}, {
            name: f"transformers assisted generation, assistant {d.model_name}, {k} tokens, greedy"
        }
    return {}, {
        "draft-model-peer": f"skipped: the draft model runs in {d.runtime}, the verifier in "
        f"{verifier.runtime}"
    }


def drafter_peer(verifier: Verifier, drafter: Drafter, cfg: DecodeConfig) -> PeerRun:
    """Our own loop with another drafter (e.g. the same checkpoint in the other drafter runtime), run as
    a peer so that it is interleaved with the main drafter and the AR baseline on every prompt."""

    def run(ids: list[int]) -> dict[str, Any]:
        t0 = time.perf_counter()
        res = generate(verifier, ids, drafter=drafter, cfg=cfg, prompt_id="peer")
        t_end = time.perf_counter()
        s = summarize([res])
        return {
            "output_tokens": res.output_tokens,
            "n_output_tokens": len(res.output_tokens),
            "ttft_s": s["ttft_s"],
            "decode_s": s["decode_s"],
            "n_after_first": len(res.output_tokens) - 1 if res.output_tokens else 0,
            "tokens_per_s": s["tokens_per_s"],
            "total_s": t_end - t0,
            "e2e_tokens_per_s": len(res.output_tokens) / (t_end - t0) if res.output_tokens else None,
            "n_steps": s["n_steps"],
            "acceptance_sum": sum(st.acceptance_length for st in res.decode_steps),
            "peak_memory": s["peak_memory_bytes_max"].get("drafter"),  # from the drafter runtime's probe
        }

    return run


def peer_runners(
    verifier: Verifier, cfg: DecodeConfig, drafter: Drafter | None = None
) -> tuple[dict[str, PeerRun], dict[str, str]]:
    """({name: run(prompt ids) -> figures}, {name: description}) for the verifier's runtime (stub: none),
    for a draft model the runtime's own speculative decoding with it, for a drafter checkpoint beside an
    MLX verifier mlx-vlm's (module docstring)."""
    runs, notes = _runtime_peers(verifier, cfg)
    for more, more_notes in (_draft_model_peers(verifier, drafter, cfg), _vlm_peers(verifier, drafter, cfg)):
        runs, notes = runs | more, notes | more_notes
    return runs, notes


def _runtime_peers(verifier: Verifier, cfg: DecodeConfig) -> tuple[dict[str, PeerRun], dict[str, str]]:
    if verifier.runtime == "hf":
        return (
            {
                "hf-generate": _hf_peer(verifier, cfg),
                "hf-prompt-lookup": _hf_peer(
                    verifier, cfg, prompt_lookup_num_tokens=PROMPT_LOOKUP_NUM_TOKENS
                ),
            },
            {
                "hf-generate": "transformers model.generate, greedy (the runtime's own AR loop)",
                "hf-prompt-lookup": f"transformers assisted generation, prompt_lookup_num_tokens="
                f"{PROMPT_LOOKUP_NUM_TOKENS}, greedy",
            },
        )
    if verifier.runtime == "mlx":
        if verifier.tokenizer is None:
            return {}, {"mlx_lm-stream_generate": "skipped: the model folder has no tokenizer"}
        return (
            {"mlx_lm-stream_generate": _mlx_peer(verifier, cfg)},
            {"mlx_lm-stream_generate": "mlx_lm.stream_generate, greedy (the runtime's own AR loop)"},
        )
    return {}, {}


# ---- mlx-vlm ------------------------------------------------------------------------------------------


def _drafter_folder(verifier: Verifier, drafter: Drafter | None) -> str | None:
    """The checkpoint mlx-vlm would load for `drafter` beside the MLX `verifier` (the neural drafter behind
    `+lookup`): its folder, a split MTP folder, or for `--drafter mtp` the model's own (mlx-vlm splits the
    layers out itself). None for drafters without one (prompt lookup, n-grams, draft models: mlx_lm's own
    peer covers those)."""
    from specdec.drafting.draft_model.drafter import ModelDrafter
    from specdec.drafting.mix import LookupFirstDrafter
    from specdec.drafting.mtp.mlx import MLXMtpDrafter

    inner = drafter.drafter if isinstance(drafter, LookupFirstDrafter) else drafter
    if inner is None or isinstance(inner, ModelDrafter):
        return None
    if isinstance(inner, MLXMtpDrafter):
        return str(inner.split.folder) if inner.split is not None else getattr(verifier, "path", None)
    return getattr(inner, "path", None)


def _vlm_peers(
    verifier: Verifier, drafter: Drafter | None, cfg: DecodeConfig
) -> tuple[dict[str, PeerRun], dict[str, str]]:
    """mlx-vlm's own speculative decoding with the same model folder and drafter checkpoint (module
    docstring): ({VLM: run}, {VLM: description}), ({}, {VLM: "skipped: why"}) where mlx-vlm cannot run
    it, ({}, {}) where there is nothing to compare (no MLX verifier, no drafter checkpoint)."""
    if verifier.runtime != "mlx":
        return {}, {}
    folder, model_path = _drafter_folder(verifier, drafter), getattr(verifier, "path", None)
    if folder is None or model_path is None:
        return {}, {}
    try:
        import mlx_vlm
    except ImportError:
        return {}, {VLM: "skipped: mlx-vlm is not installed (pip install mlx-vlm)"}
    try:
        model, draft, kind = _vlm_load(str(model_path), folder)
        list(_vlm_tokens(model, draft, kind, [1, 2, 3], 2, cfg))  # a probe: its loop fails at its first round
    except Exception as e:  # mlx-vlm's own errors, whatever they are: the eval goes on without it
        why = " ".join(f"{type(e).__name__}: {e}".split())[:200]
        return {}, {VLM: f"skipped: mlx-vlm {mlx_vlm.__version__} cannot run it here ({why})"}
    stops = set(cfg.stop_token_ids if cfg.stop_token_ids is not None else verifier.eos_token_ids)

    def run(ids: list[int]) -> dict[str, Any]:
        from mlx_vlm.speculative.common import speculative_stats_since, speculative_stats_snapshot

        probe = verifier.memory_probe()
        probe.reset()
        snap, tokens, times = speculative_stats_snapshot(draft), [], []
        t0 = time.perf_counter()
        for t in _vlm_tokens(model, draft, kind, ids, cfg.max_new_tokens, cfg):
            times.append(time.perf_counter())
            tokens.append(t)
            if t in stops:
                break
        t_end = time.perf_counter()
        rounds, _, _ = speculative_stats_since(draft, snap)
        rec = _peer_figures(tokens, t0, times, [1] * len(times), t_end)
        return {**rec, "n_steps": rounds or 0, "acceptance_sum": max(len(tokens) - 1, 0),
                "peak_memory": probe.read()}  # fmt: skip

    what = f"mlx-vlm {mlx_vlm.__version__} generate_step, draft_model {Path(folder).name} ({kind}), greedy"
    return {VLM: run}, {VLM: f"{what}; its own copy of the model"}


def _vlm_load(model_path: str, folder: str) -> tuple[Any, Any, str]:
    """mlx-vlm's model, drafter and drafter kind, checked by mlx-vlm against each other."""
    from mlx_vlm.speculative.drafters import load_drafter, validate_drafter_compatibility
    from mlx_vlm.utils import load

    model, _ = load(model_path)
    draft, kind = load_drafter(folder)
    validate_drafter_compatibility(model, draft, kind)
    return model, draft, kind


def _vlm_tokens(model: Any, draft: Any, kind: str, ids: list[int], n: int, cfg: DecodeConfig) -> Any:
    """mlx-vlm's greedy speculative generation of `n` tokens after `ids`, token by token."""
    import mlx.core as mx
    from mlx_vlm.generate.ar import generate_step

    gen = generate_step(mx.array([ids]), model, None, None, max_tokens=n, temperature=0.0, draft_model=draft,
                        draft_kind=kind, draft_block_size=cfg.block_size)  # fmt: skip
    for t, _ in gen:
        yield int(t)
