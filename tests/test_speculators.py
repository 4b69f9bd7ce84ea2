"""DFlash drafters in the speculators container (`drafting.dflash.speculators`): a public DFlash checkpoint
converted as speculators' own converter does (aux ids = z-lab ids + 1, `transformer_layer_config`,
`speculators_config`, training-only weights beside) drafts exactly as the public one, in both drafter
runtimes, with the full vocabulary (the verifier's head) and with a draft vocabulary (its own `lm_head`
and `d2t`); what the DFlash drafters do not do is refused in one line."""

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
from specdec.drafting.dflash.config import DFlashConfig, save_checkpoint
from specdec.drafting.load import check_drafter
from specdec.engine import DecodeConfig, generate
from specdec.verifiers.hf import HFVerifier

PROMPT = [(5 * i) % 250 + 5 for i in range(20)]
VOCAB = tuple(range(0, 320, 2))  # a draft vocabulary of the even ids


def _public(path: Path, draft_vocab: tuple[int, ...] | None) -> tuple[Path, DFlashConfig, dict]:
    cfg = DFlashConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=96, vocab_size=320, num_target_layers=4, mask_token_id=319, block_size=6,
        target_layer_ids=(0, 2), rope_theta=10000.0, draft_vocab=draft_vocab,
    )  # fmt: skip
    state = random_state(cfg)
    return save_checkpoint(path, cfg, state), cfg, state


def _as_speculators(path: Path, cfg: DFlashConfig, state: dict, head: torch.Tensor | None, **extra) -> Path:
    """What speculators' DFlash converter writes for the public checkpoint (`head`: the draft vocabulary's
    lm_head, the verifier's rows of it)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    layer = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "vocab_size": 320,
             "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": 10000.0,
             "max_position_embeddings": 4096}  # fmt: skip
    K = len(cfg.draft_vocab or ()) or 320
    raw = {
        "architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash",
        "transformer_layer_config": layer, "draft_vocab_size": K, "block_size": cfg.block_size,
        "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids], "mask_token_id": 319,
        "speculators_config": {"algorithm": "dflash", "proposal_methods": [
            {"proposal_type": "greedy", "speculative_tokens": cfg.block_size - 1}],
            "verifier": {"name_or_path": "tiny-llama"}},
        **extra,
    }  # fmt: skip
    weights = {**state, "verifier_norm.weight": torch.ones(64)}
    if head is not None:
        ids = torch.tensor(cfg.draft_vocab)
        weights |= {
            "lm_head.weight": head,
            "d2t": ids - torch.arange(K),
            "t2d": torch.zeros(320, dtype=torch.bool),
        }
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(raw))
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return tinymodels.tiny_llama(tmp_path_factory.mktemp("spec") / "llama")


@pytest.mark.parametrize("vocab", [None, VOCAB], ids=["full-vocab", "draft-vocab"])
@pytest.mark.parametrize("runtime", ["torch", "mlx"])
def test_a_speculators_dflash_drafts_as_the_public_one(tmp_path, llama, vocab, runtime):
    verifier = v = HFVerifier(llama)
    if runtime == "mlx":
        pytest.importorskip("mlx_lm")
        from specdec.verifiers.mlx import MLXVerifier

        v = MLXVerifier(llama)
    folder, cfg, state = _public(tmp_path / "public", vocab)
    head = None
    if vocab is not None:  # the verifier's head rows: the public drafter's read-out of its draft vocabulary
        head = verifier.model.lm_head.weight.detach()[torch.tensor(vocab)].clone()
    spec = _as_speculators(tmp_path / "spec", cfg, state, head)
    plan = check_drafter(str(spec))
    assert plan.kind.name == "dflash" and plan.header.dialect == "speculators"
    assert plan.header.target_layer_ids == (0, 2) and plan.header.own_lm_head == (head is not None)
    public = load_drafter(str(folder), verifier=v, runtime=runtime)
    ours = load_drafter(str(spec), verifier=v, runtime=runtime)
    dc = DecodeConfig(max_new_tokens=24, block_size=6, stop_token_ids=frozenset())
    a, b = generate(v, PROMPT, drafter=public, cfg=dc), generate(v, PROMPT, drafter=ours, cfg=dc)
    ar = generate(v, PROMPT, cfg=DecodeConfig(max_new_tokens=24, block_size=1, stop_token_ids=frozenset()))
    assert a.output_tokens == b.output_tokens == ar.output_tokens
    assert [s.accepted for s in a.decode_steps] == [s.accepted for s in b.decode_steps]
    v.reset()  # the same context in both: the same block logits over the draft vocabulary
    v.set_target_layers(public.target_layer_ids)
    last = v.prefill(PROMPT)
    n = len(PROMPT)
    feats = v.native_features(n) if runtime == "mlx" else v.features(n, device="cpu", dtype=torch.float32)
    for d in (public, ours):
        d.reset()
        d.extend(feats, PROMPT)
    la, lb = (_logits(d.block_logits(last, 5)) for d in (public, ours))
    torch.testing.assert_close(la, lb, atol=1e-5, rtol=1e-5)
    assert public.propose(last, 5) == ours.propose(last, 5)


def _logits(x) -> torch.Tensor:
    return x.float() if isinstance(x, torch.Tensor) else torch.tensor(np.array(x))


@pytest.mark.parametrize(
    ("extra", "says"),
    [({"sample_from_anchor": True}, "sample_from_anchor drafts from the block's first position"),
     ({"aux_hidden_state_layer_ids": [0, 2]}, "aux_hidden_state_layer_ids must be a list of ids >= 1"),
     ({"mask_token_id": None}, "mask_token_id must be an integer")],
)  # fmt: skip
def test_what_the_dflash_drafters_do_not_do_is_one_line(tmp_path, extra, says):
    _, cfg, state = _public(tmp_path / "public", None)
    spec = _as_speculators(tmp_path / "spec", cfg, state, None, **extra)
    with pytest.raises(ValueError, match=says):
        check_drafter(str(spec))


def test_other_speculators_algorithms_are_named(tmp_path):
    for algo, name in (
        ("mlp", "an MLP speculator"),
        ("dspark", "a DSpark drafter"),
        ("mtp", "MTP drafter"),
    ):
        folder = tmp_path / algo
        folder.mkdir()
        (folder / "config.json").write_text(
            json.dumps({"speculators_model_type": algo, "speculators_config": {}})
        )
        with pytest.raises(ValueError, match=f"holds {name}.*speculators format.*does not read yet"):
            check_drafter(str(folder))
