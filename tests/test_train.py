"""Drafter training against the stub verifier: learning raises acceptance, chunked == unchunked (loss and
gradients, and both == the model's own `train_logits`), 2-process DDP == 1 process, resume == uninterrupted,
a warm start begins at its checkpoint, online features are the verifier's own (batched HF == one by one),
soft labels line up, bad settings raise."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from specdec.drafting.dflash.torch import DFlashDrafter, DFlashDraftModel
from specdec.engine import DecodeConfig, generate
from specdec.train import (
    Batch,
    TargetFeatures,
    TrainConfig,
    TrainData,
    acceptance_length,
    block_loss,
    build_from_prompts,
    collate,
    default_gamma,
    drafter_config,
    load_prompts,
    position_weights,
    sample_anchors,
    train,
)
from specdec.verifiers.stub import StubVerifier

LAYERS = (1, 2)
PROMPTS = [f"Prompt {i}: a few words on topic {i * 7}." for i in range(16)]


@pytest.fixture(scope="module")
def stub() -> StubVerifier:
    return StubVerifier()


@pytest.fixture(scope="module")
def data(stub: StubVerifier, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A corpus of 16 stub prompts with 64 greedy response tokens each."""
    root = tmp_path_factory.mktemp("data")
    (root / "p.txt").write_text("\n".join(PROMPTS) + "\n")
    build_from_prompts(
        root / "corpus", stub, root / "p.txt", budget=64, max_len=256, chunk_size=6, progress=False
    )
    return root / "corpus"


def tiny(out: Path, **kw) -> TrainConfig:
    base = dict(
        num_layers=1, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, block_size=8,
        target_layer_ids=LAYERS, batch_size=4, max_anchors=16, lr=3e-3, out_dir=str(out), progress=False,
        seed=0,
    )  # fmt: skip
    base.update(kw)
    return TrainConfig(**base)


def log_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


# ---- learning ----------------------------------------------------------------------------------------------


def test_training_raises_acceptance(stub: StubVerifier, data: Path, tmp_path: Path) -> None:
    cfg = tiny(tmp_path / "run", steps=200, log_every=25)
    ckpt = train(stub, data, cfg)
    assert ckpt == tmp_path / "run" / "checkpoint-000200" and (ckpt / "model.safetensors").is_file()
    prompts = [s.ids[: s.prompt_len].tolist() for s in TrainData(data).sequences[:8]]  # the corpus' own
    torch.manual_seed(0)
    untrained = DFlashDraftModel(drafter_config(cfg, TrainData(data).verifier))
    tau0 = acceptance_length(stub, untrained, prompts, max_new_tokens=48)["acceptance_length"]
    tau1 = acceptance_length(stub, ckpt, prompts, max_new_tokens=48)["acceptance_length"]
    rows = log_rows(tmp_path / "run")
    curve = "\n".join(
        f"step {r['step']:3d}  loss {r['loss_mean']:.2f}  acc {r['acc_mean']:.2f}  tf {r['tf_tau_mean']:.2f}"
        for r in rows
    )
    print(f"\n{curve}\nacceptance length untrained {tau0:.2f} -> trained {tau1:.2f}")
    assert rows[-1]["loss_mean"] < rows[0]["loss_mean"] and rows[-1]["acc_mean"] > rows[0]["acc_mean"]
    assert tau1 > tau0 + 0.5, (tau0, tau1)


def test_held_out_evaluation(stub: StubVerifier, data: Path, tmp_path: Path) -> None:
    cfg = tiny(tmp_path, steps=4, holdout=2, eval_every=2, eval_prompts=1, eval_max_new_tokens=16)
    train(stub, data, cfg)
    evals = [r for r in log_rows(tmp_path) if "eval" in r]
    assert [r["step"] for r in evals] == [2, 4]
    for r in evals:
        assert 0 <= r["eval"]["acc"] <= 1 and 1 <= r["eval"]["tf_tau"] <= 8 and 1 <= r["eval"]["tau"] <= 8


# ---- the loss ---------------------------------------------------------------------------------------------


def _model_and_batch(stub, data: Path, *, seed: int = 0) -> tuple[DFlashDraftModel, Batch, object, object]:
    cfg = tiny(Path("unused"))
    td = TrainData(data)
    torch.manual_seed(seed)
    model = DFlashDraftModel(drafter_config(cfg, td.verifier))
    with torch.no_grad():  # non-trivial norms so a misplaced one shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
    idx = [0, 5]
    anchors = [
        sample_anchors(td.sequences[i].prompt_len, len(td.sequences[i].ids), 8, n, 7)
        for i, n in zip(idx, (12, 9))
    ]
    cpu = torch.device("cpu")
    batch = collate(td, idx, anchors, features=TargetFeatures(stub, LAYERS), device=cpu)
    return (
        model,
        batch,
        stub.embed_fn(device=cpu, dtype=torch.float32),
        stub.lm_head_fn(device=cpu, dtype=torch.float32),
    )


def _loss_and_grads(model, batch, embed_fn, head_fn, chunk, recompute=True):
    model.zero_grad(set_to_none=True)
    r = block_loss(
        model, batch, embed_fn, head_fn, gamma=default_gamma(8), attn_chunk=chunk, checkpoint=recompute
    )
    loss = r["loss_sum"] / r["weight_sum"]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, r


def test_chunked_equals_unchunked_and_train_logits(stub, data: Path) -> None:
    model, batch, embed_fn, head_fn = _model_and_batch(stub, data)
    l_all, g_all, r_all = _loss_and_grads(model, batch, embed_fn, head_fn, None)
    for recompute in (True, False):  # chunks recomputed in the backward or kept
        l_chk, g_chk, r_chk = _loss_and_grads(model, batch, embed_fn, head_fn, 5, recompute)  # 3 chunks
        torch.testing.assert_close(l_chk, l_all, rtol=1e-5, atol=1e-6)
        for n in g_all:
            torch.testing.assert_close(g_chk[n], g_all[n], rtol=1e-4, atol=1e-6, msg=n)
        assert r_chk["correct"] == r_all["correct"] and r_chk["accept_sum"] == r_all["accept_sum"]
    # reference: the model's own training forward, loss written out by hand
    logits = model.train_logits(batch.features, batch.ids, batch.anchors, embed_fn, head_fn)  # [B,A,bs,V]
    tpos = (batch.anchors[:, :, None] + torch.arange(1, 8)).clamp(max=batch.ids.shape[1] - 1)
    labels = torch.gather(batch.ids, 1, tpos.flatten(1)).view_as(tpos)
    nll = F.cross_entropy(logits[:, :, 1:].flatten(0, 2), labels.flatten(), reduction="none").view_as(labels)
    w = batch.valid[:, :, None] * position_weights(8, default_gamma(8))
    torch.testing.assert_close(l_all, (nll * w).sum() / w.sum(), rtol=1e-5, atol=1e-6)
    # repeat_weight: positions whose token repeats earlier text weigh that much more (chunked or not)
    from specdec.train.loss import repeats

    w3 = w * (1 + 2 * torch.gather(repeats(batch.ids).float(), 1, tpos.flatten(1)).view_as(tpos))
    r3 = block_loss(model, batch, embed_fn, head_fn, gamma=default_gamma(8), attn_chunk=5, repeat_weight=3.0)
    assert (w3 > w).any()  # the stub's answers repeat themselves somewhere
    assert r3["weight_sum"] == r_all["weight_sum"]  # the same normaliser: repeats weigh more in the sum
    torch.testing.assert_close(r3["loss_sum"], (nll * w3).sum(), rtol=1e-5, atol=1e-5)


def test_position_weights_and_gamma() -> None:
    assert [default_gamma(b) for b in (8, 10, 16)] == [4, 5, 7]
    w = position_weights(16, 7.0)
    assert w.shape == (15,) and w[0] == 1 and torch.allclose(w[1], torch.exp(torch.tensor(-1 / 7)))


def test_anchors_only_where_a_full_block_of_response_exists() -> None:
    a = sample_anchors(prompt_len=10, length=30, block_size=8, max_anchors=100, seed=0)
    assert a.tolist() == list(range(9, 23))  # prompt_len-1 .. length-bs, all of them
    b = sample_anchors(prompt_len=10, length=30, block_size=8, max_anchors=5, seed=3)
    assert len(b) == 5 and b.tolist() == sorted(b.tolist()) and set(b.tolist()) <= set(a.tolist())
    assert len(sample_anchors(prompt_len=10, length=16, block_size=8, max_anchors=5, seed=0)) == 0


# ---- features ---------------------------------------------------------------------------------------------


def test_features_are_the_verifiers_own(stub: StubVerifier, data: Path) -> None:
    td = TrainData(data)
    idx = [3, 0, 7]
    batch = collate(
        td, idx, [torch.tensor([5])] * 3, features=TargetFeatures(stub, LAYERS), device=torch.device("cpu")
    )
    for b, i in enumerate(idx):
        ids = td.sequences[i].ids.tolist()
        stub.set_target_layers(LAYERS)
        stub.reset()
        stub.prefill(ids)
        want = stub.features(len(ids), device=torch.device("cpu"), dtype=torch.float32)
        torch.testing.assert_close(batch.features[b, : len(ids)], want)
    stub.set_target_layers(())


@pytest.mark.hf
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_hf_batched_features_equal_one_by_one(tmp_path: Path, family: str) -> None:
    pytest.importorskip("transformers")
    from tinymodels import tiny_gemma3, tiny_llama

    from specdec.verifiers.hf import HFVerifier

    v = HFVerifier((tiny_llama if family == "llama" else tiny_gemma3)(tmp_path / "m"))  # gemma3: window 16
    g = torch.Generator().manual_seed(0)
    lengths = [40, 13, 27]
    ids = torch.zeros(3, 40, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.randint(3, 300, (n,), generator=g)
    layers = (0, 2, 3)
    feats, lp, ti = TargetFeatures(v, layers, topk=4)(ids, lengths, device=torch.device("cpu"))
    for b, n in enumerate(lengths):
        v.set_target_layers(layers)
        v.reset()
        seen = []
        v.verify(ids[b, :n].tolist(), sample=lambda x, seen=seen: seen.append(x) or x.argmax(-1).tolist())
        want = v.features(n, device=torch.device("cpu"), dtype=torch.float32)
        torch.testing.assert_close(feats[b, :n], want, rtol=1e-4, atol=1e-4)
        top = torch.log_softmax(seen[0].float(), -1).topk(4, dim=-1)
        torch.testing.assert_close(lp[b, :n], top.values, rtol=1e-4, atol=1e-4)
        assert torch.equal(ti[b, :n, 0], top.indices[:, 0])


def test_kl_soft_labels(stub: StubVerifier, data: Path, tmp_path: Path) -> None:
    td = TrainData(data)
    batch = collate(td, [0, 1], [torch.tensor([9])] * 2, features=TargetFeatures(stub, LAYERS, topk=8),
                    device=torch.device("cpu"))  # fmt: skip
    for b in range(2):
        s = td.sequences[b]
        resp = range(
            s.prompt_len - 1, len(s.ids) - 1
        )  # greedy answers: the top-1 after p is the token at p+1
        assert [int(batch.topk_ids[b, p, 0]) for p in resp] == [int(s.ids[p + 1]) for p in resp]
    train(stub, data, tiny(tmp_path / "run", steps=2, batch_size=3, kl_weight=0.5))
    assert all(r["loss"] > 0 for r in log_rows(tmp_path / "run"))


# ---- data parallel, resume --------------------------------------------------------------------------------


def _cli_args(data: Path, out: Path) -> list[str]:
    return [
        "--verifier", "stub", "--data", str(data), "--out", str(out), "--steps", "3", "--num-layers", "1",
        "--heads", "4", "--kv-heads", "2", "--intermediate-size", "128", "--block-size", "8",
        "--target-layer-ids", "1,2", "--batch-size", "4", "--max-anchors", "16", "--lr", "3e-3",
        "--no-progress",
    ]  # fmt: skip


def test_ddp_two_processes_equal_one(stub, data: Path, tmp_path: Path) -> None:
    single = train(stub, data, tiny(tmp_path / "one", steps=3, lr=3e-3))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "specdec.train", *_cli_args(data, tmp_path / "two")]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = log_rows(tmp_path / "one"), log_rows(tmp_path / "two")
    assert [r["step"] for r in two] == [1, 2, 3]
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (one, two)
        assert b["acc"] == pytest.approx(a["acc"], abs=1e-6)
    from safetensors.torch import load_file

    w1 = load_file(single / "model.safetensors")
    w2 = load_file(tmp_path / "two" / "checkpoint-000003" / "model.safetensors")
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-3, atol=1e-5, msg=k)


def test_resume_continues_identically(stub, data: Path, tmp_path: Path) -> None:
    train(stub, data, tiny(tmp_path / "a", steps=6, save_every=3))
    (tmp_path / "b").mkdir()
    shutil.copytree(tmp_path / "a" / "checkpoint-000003", tmp_path / "b" / "checkpoint-000003")
    train(stub, data, tiny(tmp_path / "b", steps=6, save_every=3))
    a, b = log_rows(tmp_path / "a"), log_rows(tmp_path / "b")
    assert [r["step"] for r in b] == [4, 5, 6]
    for ra, rb in zip(a[3:], b):
        assert (ra["loss"], ra["acc"], ra["lr"]) == (rb["loss"], rb["acc"], rb["lr"])
    from safetensors.torch import load_file

    wa = load_file(tmp_path / "a" / "checkpoint-000006" / "model.safetensors")
    wb = load_file(tmp_path / "b" / "checkpoint-000006" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_init_from_starts_from_the_checkpoint(stub, data: Path, tmp_path: Path) -> None:
    first = train(stub, data, tiny(tmp_path / "a", steps=30))
    # a learning rate too small to move the weights: the run ends where the checkpoint started it
    train(stub, data, tiny(tmp_path / "b", steps=2, lr=1e-12, init_from=str(first)))
    from safetensors.torch import load_file

    wa = load_file(first / "model.safetensors")
    wb = load_file(tmp_path / "b" / "checkpoint-000002" / "model.safetensors")
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=0, atol=1e-6, msg=k)
    a, b = log_rows(tmp_path / "a"), log_rows(tmp_path / "b")
    assert b[0]["loss"] < a[0]["loss"]  # same first batch, trained weights
    # a deeper run grows the checkpoint: the same first loss (the new layer starts as the identity), its
    # layer 0 is the checkpoint's, and the new layer learns
    deeper = train(stub, data, tiny(tmp_path / "g", num_layers=2, steps=2, init_from=str(first)))
    assert log_rows(tmp_path / "g")[0]["loss"] == pytest.approx(b[0]["loss"], rel=1e-5)
    wg = load_file(deeper / "model.safetensors")
    torch.testing.assert_close(wg["fc.weight"], wa["fc.weight"], rtol=0, atol=1e-2)
    assert wg["layers.1.mlp.down_proj.weight"].abs().max() > 0  # moved off its zero start
    with pytest.raises(ValueError, match=r"differs from this run's in .*'num_hidden_layers'"):
        train(stub, data, tiny(tmp_path / "c", num_layers=1, steps=1, init_from=str(deeper)))  # shallower
    with pytest.raises(FileNotFoundError, match="does not exist"):
        train(stub, data, tiny(tmp_path / "c", steps=1, init_from=str(tmp_path / "missing")))
    assert not (tmp_path / "c").exists()  # refused before anything is written


def test_grown_drafter_computes_what_the_checkpoint_computed(stub, data: Path) -> None:
    from specdec.train import grow_layers

    small, batch, embed_fn, head_fn = _model_and_batch(stub, data)
    big = DFlashDraftModel(dataclasses.replace(small.cfg, num_hidden_layers=3, layer_types=None))
    big.load_state_dict(grow_layers(small.state_dict(), big))
    args = (batch.features, batch.ids, batch.anchors, embed_fn, head_fn)
    torch.testing.assert_close(big.train_logits(*args), small.train_logits(*args), rtol=1e-5, atol=1e-5)


# ---- corpus from a prompt file ----------------------------------------------------------------------------


def test_prompt_file_formats(tmp_path: Path) -> None:
    jsonl = tmp_path / "p.jsonl"
    rows = [{"id": "a", "messages": [{"role": "user", "content": "hi"}]}, {"id": "b", "text": "x" * 40}]
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert load_prompts(jsonl) == [("a", rows[0]["messages"]), ("b", [{"role": "user", "content": "x" * 40}])]
    txt = tmp_path / "p.txt"
    txt.write_text("first\n\nsecond\n")
    assert load_prompts(txt) == [("0", [{"role": "user", "content": "first"}]),
                                 ("2", [{"role": "user", "content": "second"}])]  # fmt: skip
    (tmp_path / "bad.jsonl").write_text('{"id": 1, "messages": [{"role": "user"}]}\n')
    with pytest.raises(ValueError, match="content must be a string"):
        load_prompts(tmp_path / "bad.jsonl")


# ---- errors -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"block_size": 1}, "block_size"),
        ({"lr": 0}, "lr"),
        ({"attn_chunk": 0}, "attn_chunk"),
        ({"max_anchors": 0}, "max_anchors"),
        ({"steps": 0}, "steps"),
        ({"warmup_ratio": 1.0}, "warmup_ratio"),
        ({"max_sequences": 0}, "max_sequences"),
    ],
)
def test_bad_config_raises(kw: dict, match: str, stub, data: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=match):
        train(stub, data, tiny(tmp_path, **kw))


def test_bad_settings_against_the_data(stub: StubVerifier, data: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="target_layer_ids"):
        train(stub, data, tiny(tmp_path, target_layer_ids=(9,)))
    with pytest.raises(ValueError, match="fewer than batch_size"):
        train(stub, data, tiny(tmp_path, batch_size=16, holdout=4))
    with pytest.raises(ValueError, match="mask_token_id"):
        train(stub, data, tiny(tmp_path, mask_token_id=stub.vocab_size))
    with pytest.raises(ValueError, match="not the one"):
        train(StubVerifier(StubVerifier().cfg.__class__(hidden_size=32)), data, tiny(tmp_path))
    with pytest.raises(ValueError, match="no stages"):
        train(stub, data, tiny(tmp_path, stages=("turn9",)))
    with pytest.raises(FileNotFoundError, match="not a corpus"):
        train(stub, tmp_path / "nothing", tiny(tmp_path))
    assert not any(tmp_path.iterdir())


def test_draft_vocabulary_training(stub: StubVerifier, data: Path, tmp_path: Path) -> None:
    """--draft-vocab K: the drafter reads out the K ids most written in the training responses (ties by
    prompt count, then id), learns on them, and is stored with them; it then drafts only those ids."""
    cfg = tiny(tmp_path / "run", steps=60, draft_vocab_size=24, log_every=20)
    ckpt = train(stub, data, cfg)
    d = TrainData(data)
    resp: Counter[int] = Counter()
    prompt: Counter[int] = Counter()
    for s in d.sequences:
        resp.update(s.ids[s.prompt_len :].tolist())
        prompt.update(s.ids[: s.prompt_len].tolist())
    mask = stub.vocab_size - 1
    ranked = sorted((t for t in range(stub.vocab_size) if t != mask), key=lambda t: (-resp[t], -prompt[t], t))
    drafter = DFlashDrafter.from_pretrained(ckpt)
    assert drafter.model.draft_vocab.tolist() == sorted(ranked[:24])
    rows = log_rows(tmp_path / "run")
    assert rows[-1]["acc_mean"] > rows[0]["acc_mean"]
    drafter.bind(stub)
    prompt_ids = d.sequences[0].ids[: d.sequences[0].prompt_len].tolist()
    base = generate(stub, prompt_ids, cfg=DecodeConfig(max_new_tokens=32, block_size=1))
    spec = generate(stub, prompt_ids, drafter=drafter, cfg=DecodeConfig(max_new_tokens=32, block_size=8))
    assert spec.output_tokens == base.output_tokens
    assert any(s.accepted for s in spec.steps if s.phase == "decode")
    # a warm start on other training data keeps the ids the checkpoint learned, where a cold start on
    # that data picks others
    other = dict(steps=1, draft_vocab_size=24, holdout=6, seed=1)
    cold = DFlashDrafter.from_pretrained(train(stub, data, tiny(tmp_path / "cold", **other)))
    warm = DFlashDrafter.from_pretrained(
        train(stub, data, tiny(tmp_path / "warm", init_from=str(ckpt), **other))
    )
    assert cold.model.draft_vocab.tolist() != drafter.model.draft_vocab.tolist()
    assert warm.model.draft_vocab.tolist() == drafter.model.draft_vocab.tolist()
    first = log_rows(tmp_path / "warm")[0]  # the warm start is evaluated before its first step
    assert first["step"] == 0 and first["eval"]["acc"] > 0
    with pytest.raises(ValueError, match="draft_vocab"):
        train(stub, data, tiny(tmp_path / "x", init_from=str(ckpt), steps=1, draft_vocab_size=20))
    with pytest.raises(ValueError, match="draft_vocab_size"):
        train(stub, data, tiny(tmp_path / "x", draft_vocab_size=0))
    with pytest.raises(ValueError, match="below the vocabulary size"):
        train(stub, data, tiny(tmp_path / "x", draft_vocab_size=stub.vocab_size))
    with pytest.raises(ValueError, match="kl_weight > 0 with a draft_vocab_size"):
        train(stub, data, tiny(tmp_path / "x", draft_vocab_size=24, kl_weight=1.0))
    assert not (tmp_path / "x").exists()  # refused before anything is written


def test_recompute_flag_defaults_to_the_device() -> None:
    import argparse

    from specdec.train.cli import add_train_args

    p = add_train_args(argparse.ArgumentParser())
    base = ["--data", "d", "--out", "o", "--verifier", "stub"]
    assert p.parse_args(base).recompute is None  # None: on CUDA only (TrainConfig.recompute)
    assert p.parse_args([*base, "--recompute"]).recompute is True
    assert p.parse_args([*base, "--no-recompute"]).recompute is False


def test_cli_loads_the_verifier_on_the_training_device(
    stub, data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The verifier computes every batch's features, so `--device` must place it too (it once stayed on the
    CPU under `--device cuda`). Our own loader is wrapped to see where it is asked to load."""
    import specdec.api
    from specdec.train.cli import main

    asked: list[str] = []
    real = specdec.api.load_verifier
    monkeypatch.setattr(
        specdec.api, "load_verifier", lambda *a, device="cpu", **kw: asked.append(device) or real(*a, **kw)
    )
    assert main([*_cli_args(data, tmp_path / "run"), "--device", "cpu:0"]) == 0  # not the default "cpu"
    assert asked == ["cpu:0"]


@pytest.mark.hf
def test_init_layers_copies_verifier_layers(tmp_path):
    """`--init-layers`: drafter layer j starts as verifier layer ids[j] (its weights, q/k norms at one), the
    final norm the verifier's, fc reading the features of the target layer below the first copied one."""
    pytest.importorskip("transformers")
    import tinymodels

    from specdec.drafting.dflash.config import DFlashConfig
    from specdec.drafting.dflash.torch import DFlashDraftModel
    from specdec.train.loop import layers_from_verifier
    from specdec.verifiers.hf import HFVerifier

    v = HFVerifier(tinymodels.tiny_llama(tmp_path / "llama"))
    cfg = DFlashConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=320, num_target_layers=4, mask_token_id=0, block_size=4,
        target_layer_ids=(0, 1, 3), rope_theta=10_000.0,
    )  # fmt: skip
    model = DFlashDraftModel(cfg)
    state = layers_from_verifier(model, v, (2, 3))
    model.load_state_dict(state)
    src = v.model.model.layers
    assert torch.equal(state["layers.0.self_attn.q_proj.weight"], src[2].self_attn.q_proj.weight)
    assert torch.equal(state["layers.1.mlp.down_proj.weight"], src[3].mlp.down_proj.weight)
    assert torch.equal(state["layers.1.self_attn.k_norm.weight"], torch.ones(16))
    assert torch.equal(state["norm.weight"], v.model.model.norm.weight)
    fc = state["fc.weight"]  # [64, 3 * 64]: the second target layer (1) is the last below layer 2
    assert torch.equal(fc[:, 64:128], torch.eye(64)) and not fc[:, :64].any() and not fc[:, 128:].any()
    with pytest.raises(ValueError, match="give 2 ids"):
        layers_from_verifier(model, v, (3,))


def test_repeats_marks_what_lookup_would_draft():
    from specdec.train.loss import repeats

    ids = torch.tensor([[1, 2, 3, 4, 9, 1, 2, 3, 4, 1, 2, 3, 5]])
    # after the second "1 2 3" comes 4 as after the first (repeat); after the third comes 5, not 4 (no repeat)
    assert repeats(ids)[0].nonzero().flatten().tolist() == [8]
    assert not repeats(torch.tensor([[7, 7, 7]])).any()  # nothing before the first n tokens


def test_new_train_options_are_checked(tmp_path):
    """`repeat_weight` and `init_layers` are refused in the one-line TrainConfig error before any work."""
    with pytest.raises(ValueError, match=r"^invalid TrainConfig: repeat_weight must be > 0, got 0"):
        tiny(tmp_path, repeat_weight=0.0).validate()
    with pytest.raises(ValueError, match="give init_from or init_layers, not both"):
        tiny(tmp_path, init_from="x", init_layers=(0,)).validate()
    from specdec.drafting.dflash.config import DFlashConfig
    from specdec.drafting.dflash.torch import DFlashDraftModel
    from specdec.train.loop import layers_from_verifier

    cfg = DFlashConfig(
        hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=259, num_target_layers=4, mask_token_id=258, block_size=4,
        target_layer_ids=(0,), rope_theta=10_000.0,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"init_layers needs an HF verifier .* got 'stub'"):
        layers_from_verifier(DFlashDraftModel(cfg), StubVerifier(), (1,))


def test_repeat_anchors_start_more_blocks_inside_repeats(stub: StubVerifier, data: Path, tmp_path: Path):
    """`repeat_anchors` W draws anchors whose next token repeats earlier text W times as likely; held-out
    evaluation keeps its uniform anchors, and the default draw is the uniform one it always was."""
    w = torch.ones(30, dtype=torch.float64)
    w[[10, 12, 15, 20, 21]] = 1e12  # these five, all but surely
    assert sample_anchors(10, 30, 8, 5, 3, weights=w).tolist() == [10, 12, 15, 20, 21]
    assert sample_anchors(10, 30, 8, 5, 3, weights=torch.ones(30)).tolist() != []  # all positive: fine
    from specdec.train.data import seed_of
    from specdec.train.loop import _Run, dist_setup
    from specdec.train.loss import repeats

    td = TrainData(data)

    def run(w: float) -> _Run:
        cfg = tiny(tmp_path / f"w{w}", steps=2, repeat_anchors=w, max_anchors=8, holdout=2)
        return _Run(stub, td, cfg, drafter_config(cfg, td.verifier), dist_setup("cpu"))

    uniform, weighted = run(1.0), run(50.0)

    def share(r: _Run, step: int) -> float:  # share of anchors whose first label repeats earlier text
        hits = total = 0
        for i in r.train_idx:
            rep = repeats(torch.tensor([td.sequences[i].ids.tolist()]))[0]
            a = r.anchors_for(i, step)
            hits, total = hits + int(rep[a + 1].sum()), total + len(a)
        return hits / total

    assert share(weighted, 0) > share(uniform, 0) + 0.2
    for i in uniform.held:
        assert torch.equal(uniform.anchors_for(i, -1), weighted.anchors_for(i, -1))
    i = uniform.train_idx[0]
    s = td.sequences[i]
    want = sample_anchors(s.prompt_len, len(s.ids), 8, 8, seed_of(0, 3, 0, i))
    assert torch.equal(uniform.anchors_for(i, 0), want)
    with pytest.raises(ValueError, match="repeat_anchors must be > 0, got 0"):
        tiny(tmp_path, repeat_anchors=0.0).validate()


def test_a_non_finite_loss_stops_training_and_keeps_the_good_checkpoints(
    stub: StubVerifier, data: Path, tmp_path: Path
) -> None:
    """`--repeat-weight 1e308` trained NaN from its first step and saved a NaN drafter that loaded fine."""
    out = tmp_path / "run"
    train(stub, data, tiny(out, steps=4, save_every=1, keep_checkpoints=4))
    for late in ("checkpoint-000003", "checkpoint-000004"):  # as if it had stopped after step 2
        shutil.rmtree(out / late)
    good = load_file(out / "checkpoint-000002" / "model.safetensors")
    with pytest.raises(RuntimeError, match=r"training stopped at step 3: the loss .* is not finite"):
        train(stub, data, tiny(out, steps=4, save_every=1, keep_checkpoints=4, repeat_weight=1e308))
    assert [p.name for p in sorted(out.glob("checkpoint-*"))] == ["checkpoint-000001", "checkpoint-000002"]
    after = load_file(out / "checkpoint-000002" / "model.safetensors")
    assert all(torch.equal(good[k], after[k]) for k in good)


def test_checkpoints_are_staged_in_a_fresh_folder_never_through_a_planted_link(
    stub: StubVerifier, data: Path, tmp_path: Path
) -> None:
    victim, out = tmp_path / "victim", tmp_path / "run"
    victim.mkdir()
    out.mkdir()
    (out / ".tmp-checkpoint-000001").symlink_to(victim)  # where a save used to stage step 1
    train(stub, data, tiny(out, steps=1))
    assert list(victim.iterdir()) == [] and (out / "checkpoint-000001" / "model.safetensors").is_file()
    assert not list(out.glob(".checkpoint-*.tmp"))  # nothing left staged
