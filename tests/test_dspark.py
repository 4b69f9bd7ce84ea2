"""DSpark drafters (`drafting.dflash.dspark`): a DFlash backbone with a Markov head and a confidence head.
Drafts equal mlx-vlm 0.7.10's `dspark` drafter step by step on a tiny random checkpoint; output equals AR
and the runtimes' own greedy generation on the HF and MLX verifiers with both drafter runtimes; the
confidence head feeds the draft policy's cut; the rejection rule keeps the verifier's distribution with
sampled walks (chi-square, failing negative control); unsupported variants are one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
import tinymodels
from test_checkpoint import random_state

from specdec.api import load_drafter
from specdec.drafting.dflash.config import DFlashConfig
from specdec.drafting.dflash.dspark import DSparkParams
from specdec.drafting.dflash.torch import DFlashDrafter
from specdec.drafting.load import check_drafter
from specdec.drafting.policy import running_cut
from specdec.engine import DecodeConfig, generate
from specdec.sampling import SamplingParams
from specdec.verifiers.hf import HFVerifier

PROMPT = [(9 * i) % 250 + 4 for i in range(26)]
GAMMA = 5  # proposals per block


def dspark_folder(path: Path, *, hidden=64, vocab=320, target_layers=4, ids=(0, 2), anchor=True,
                  confidence=True, with_markov=True, embed=False, **extra) -> Path:  # fmt: skip
    """A random DSpark checkpoint in the deepseek-ai / mlx-vlm layout, its Markov head scaled to matter."""
    from safetensors.torch import save_file

    params = DSparkParams(markov_rank=8, confidence_head=confidence, confidence_with_markov=with_markov,
                          sample_from_anchor=anchor, own_embeddings=embed)  # fmt: skip
    cfg = DFlashConfig(
        hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=96, vocab_size=vocab, num_target_layers=target_layers, mask_token_id=vocab - 1,
        block_size=GAMMA + 1, target_layer_ids=ids, rope_theta=10000.0, dspark=params,
    )  # fmt: skip
    state = random_state(cfg)
    scale = {"markov": 0.3, "embed_tokens": 0.05, "confidence_head": 0.002}
    state = {k: v * next((f for n, f in scale.items() if n in k), 1.0) for k, v in state.items()}
    state = {("model." + k if k.startswith("layers.0") else k): v for k, v in state.items()}  # a prefix: read
    path.mkdir(parents=True)
    save_file(state, str(path / "model.safetensors"))
    dflash = {"projector_type": "dspark", "mask_token_id": vocab - 1, "target_layer_ids": list(ids),
              "num_target_layers": target_layers, "block_size": GAMMA, "markov_rank": 8,
              "markov_head_type": "vanilla", "enable_confidence_head": confidence,
              "confidence_head_with_markov": with_markov, "sample_from_anchor": anchor}  # fmt: skip
    raw = {"architectures": ["DSparkModel"], "model_type": "qwen3", "hidden_size": hidden,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "intermediate_size": 96, "vocab_size": vocab, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "max_position_embeddings": 4096, "tie_word_embeddings": True,
           "dflash_config": {**dflash, **extra}}  # fmt: skip
    (path / "config.json").write_text(json.dumps(raw))
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return tinymodels.tiny_llama(tmp_path_factory.mktemp("dspark") / "llama")


@pytest.mark.parametrize("variant", ["anchor+confidence", "no-anchor", "own-embeddings"])
def test_drafts_equal_mlx_vlm(tmp_path, llama, variant):
    pytest.importorskip("mlx_vlm")
    import mlx.core as mx
    from mlx_vlm.speculative.drafters.dspark.config import DSparkConfig
    from mlx_vlm.speculative.drafters.dspark.dspark import DSparkDraftModel
    from mlx_vlm.speculative.drafters.qwen3_dflash.dflash import DFlashDraftModel as VlmDFlash

    from specdec.verifiers.mlx import MLXVerifier

    opts = {"no-anchor": dict(anchor=False, confidence=False), "own-embeddings": dict(embed=True)}.get(
        variant, {}
    )
    folder = dspark_folder(tmp_path / "ds", **opts)
    v = MLXVerifier(llama)
    peer = DSparkDraftModel(DSparkConfig.from_dict(json.loads((folder / "config.json").read_text())))
    weights = peer.sanitize(mx.load(str(folder / "model.safetensors")))
    peer.load_weights(list(weights.items()), strict=False)
    # its own bind also asks the target for mlx-vlm's speculative cache rollback, which mlx_lm's models lack
    VlmDFlash.bind(peer, v.model)
    caches = peer.make_cache()
    for runtime in ("mlx", "torch"):
        d = load_drafter(str(folder), verifier=v, runtime=runtime)
        assert d.block_size == GAMMA + 1 and d.walks
    ours = {rt: load_drafter(str(folder), verifier=v, runtime=rt) for rt in ("mlx", "torch")}
    v.reset()
    v.set_target_layers((0, 2))
    last = v.prefill(PROMPT)
    new = v.native_features(len(PROMPT))
    for d in ours.values():
        d.reset()
    for step in range(6):
        ours["mlx"].extend(new, [0] * new.shape[0])
        ours["torch"].extend(torch.tensor(np.array(new)), [0] * new.shape[0])
        want = peer.draft_block(last, new[None], caches, GAMMA + 1, lambda lg: mx.argmax(lg, axis=-1))[
            0
        ].tolist()
        got = {rt: d.propose(last, GAMMA) for rt, d in ours.items()}
        assert got["mlx"] == got["torch"] == want, (step, got, want)
        commit = [last, *want[: step % GAMMA]]  # accept 0, 1, 2, ... of the drafts
        target = v.verify(commit)
        new = v.native_features(len(commit))
        last = target[-1]


@pytest.mark.parametrize("rt", ["hf", "mlx"])
def test_output_is_the_runtimes_own_and_the_confidence_head_cuts(tmp_path, llama, rt):
    import parity

    folder = dspark_folder(tmp_path / "ds")
    if rt == "mlx":
        from specdec.verifiers.mlx import MLXVerifier

        v, runtimes = MLXVerifier(llama), ("torch", "mlx")
        own = parity.mlx_lm_greedy(v, PROMPT, 24)
    else:
        v, runtimes = HFVerifier(llama), ("torch",)
        own = parity.runtime_generate(v.model, PROMPT, 24)
    cfg = DecodeConfig(max_new_tokens=24, block_size=GAMMA + 1, stop_token_ids=frozenset())
    for runtime in runtimes:
        d = load_drafter(str(folder), verifier=v, runtime=runtime)
        assert generate(v, PROMPT, drafter=d, cfg=cfg).output_tokens == own, runtime
        cut = load_drafter(str(folder), verifier=v, runtime=runtime, min_confidence=0.5)
        assert generate(v, PROMPT, drafter=cut, cfg=cfg).output_tokens == own, runtime
        # the cut reads the confidence head: the drafts kept are those before its running product < 0.5
        v.reset()
        v.set_target_layers(cut.target_layer_ids)
        last = v.prefill(PROMPT)
        feats = (
            v.native_features(len(PROMPT))
            if runtime == "mlx"
            else v.features(len(PROMPT), device="cpu", dtype=torch.float32)
        )
        cut.reset()
        cut.extend(feats, PROMPT)
        tokens, chances, _ = cut.dspark_walk(last, GAMMA)
        chances = (chances if isinstance(chances, torch.Tensor) else torch.tensor(np.array(chances))).tolist()
        assert chances != [1.0] * GAMMA and all(0 < c < 1 for c in chances)
        tokens = tokens.tolist()
        assert cut.propose(last, GAMMA) == tokens[: running_cut(chances, 0.5)]
        match = SamplingParams(temperature=0.9, seed=3, rule="match", proposal="sample")
        m = DecodeConfig(max_new_tokens=16, block_size=GAMMA + 1, stop_token_ids=frozenset(), sampling=match)
        ar = DecodeConfig(max_new_tokens=16, block_size=1, stop_token_ids=frozenset(), sampling=match)
        assert (
            generate(v, PROMPT, drafter=d, cfg=m).output_tokens == generate(v, PROMPT, cfg=ar).output_tokens
        )


@pytest.mark.slow
@pytest.mark.parametrize("broken", [False, True], ids=["walk", "broken-walk"])
def test_sampled_walk_with_rejection_keeps_the_verifiers_distribution(tmp_path, monkeypatch, broken):
    from test_sampling import V as SV
    from test_sampling import check_walk_distribution

    from specdec.verifiers.stub import StubConfig, StubVerifier

    v = StubVerifier(StubConfig(vocab_size=SV, logit_scale=1.5, hidden_size=64, num_layers=3, num_heads=4,
                                intermediate_size=32, max_context=64))  # fmt: skip
    folder = dspark_folder(tmp_path / "ds", vocab=SV, target_layers=3, ids=(0, 1))
    d = load_drafter(str(folder), verifier=v)
    check_walk_distribution(v, d, DFlashDrafter, monkeypatch, broken=broken)


@pytest.mark.parametrize(
    ("extra", "says"),
    [({"markov_head_type": "gated"}, "markov_head_type 'gated' is not read"),
     ({"attention_sink_bias": True}, "attention sinks"),
     ({"draft_window_size": 64}, "a draft window"),
     ({"target_layer_ids": [0, 9]}, "target_layer_ids [9] outside")],
)  # fmt: skip
def test_unsupported_variants_are_one_line(tmp_path, extra, says):
    folder = dspark_folder(tmp_path / "ds", **extra)
    with pytest.raises(ValueError, match=says.replace("[", r"\[").replace("]", r"\]")):
        check_drafter(str(folder))
