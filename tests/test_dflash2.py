"""DFlash2 drafters (the public `DFlash2DraftModel` format) in both drafter runtimes.

The reference is written here from the format's description (`specdec.drafting.dflash.dflash2`'s docstring),
slowly and without a cache: every convolution tap, candidate score and attention pair spelled out. The
fast paths (cached block forward, vectorised convolution, the selector's walk; torch and MLX) must
match it; speculative output with a random DFlash2 drafter must equal autoregressive output; a sampled
walk verified with the `rejection` rule must keep the verifier's distribution (chi-square, with a broken
walk as the negative control).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_dflash import PLAN, _ref_rope, bound, feed, make_fns, make_model

from specdec.drafting.dflash.config import DFlash2Config, DFlashConfig, check_checkpoint, load_config
from specdec.drafting.dflash.torch import DFlashDrafter
from specdec.engine import DecodeConfig, generate
from specdec.verifiers.stub import StubConfig, StubVerifier

V, H, MASK = 97, 32, 96
D2 = DFlash2Config(
    conv_kernel_size=3, conv_group_size=8, selector_rank=8, selector_top_k=5, output_multiplier=0.8,
    final_logit_softcapping=12.0, input_embedding_scale=1.5,
)  # fmt: skip


def make_cfg(**kw) -> DFlashConfig:
    base = dict(
        hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=48, vocab_size=V, num_target_layers=8, mask_token_id=MASK, block_size=6,
        target_layer_ids=(1, 4, 5), rope_theta=10_000.0, dflash2=D2,
    )  # fmt: skip
    return DFlashConfig(**(base | kw))


# ---- the slow reference ----------------------------------------------------------------------------------


def slow_conv(conv, x: torch.Tensor, h: torch.Tensor, side: int) -> torch.Tensor:
    """out[t] = sum_j (base[side, j] + dynamic(h)[t, side, j, group]) * x[t - j], tap by tap."""
    bs, _ = x.shape
    taps, g = conv.taps, conv.group
    dyn = conv.kernel_projection(h).view(bs, 2, taps, -1)  # [bs, 2, taps, G]
    out = torch.zeros_like(x)
    for t in range(bs):
        for j in range(taps):
            if t - j >= 0:
                per_channel = conv.base_kernel[side, j] + dyn[t, side, j].repeat_interleave(g)  # [H]
                out[t] = out[t] + per_channel * x[t - j]
    return out


def slow_hidden(model, features, last_token, embed_fn) -> torch.Tensor:
    """Block hidden states [bs, H] after the final norm, for context features [S, K*H], from scratch."""
    cfg = model.cfg
    S, bs, D = features.shape[0], cfg.block_size, cfg.head_dim
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    x = embed_fn(torch.tensor([last_token] + [cfg.mask_token_id] * (bs - 1))) * D2.input_embedding_scale
    ctx = model.hidden_norm(model.fc(features))  # [S, H]
    pos = torch.arange(S + bs)
    for layer in model.layers:
        a = layer.self_attn
        h = layer.input_layernorm(x)
        hc = slow_conv(layer.attention_conv, h, h, 0)
        both = torch.cat([ctx, hc])
        q = _ref_rope(a.q_norm(a.q_proj(hc).view(bs, nh, D)), pos[S:], cfg.rope_theta)
        k = _ref_rope(a.k_norm(a.k_proj(both).view(S + bs, nkv, D)), pos, cfg.rope_theta)
        v = a.v_proj(both).view(S + bs, nkv, D)
        k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
        att = (torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)).softmax(-1)  # non-causal, no window
        o = a.o_proj(torch.einsum("hqk,khd->qhd", att, v).reshape(bs, nh * D))
        x = x + slow_conv(layer.attention_conv, o, h, 1)
        h = layer.post_attention_layernorm(x)
        m = layer.mlp(slow_conv(layer.mlp_conv, h, h, 0))
        x = x + slow_conv(layer.mlp_conv, m, h, 1)
    return model.norm(x)


def slow_logits(hidden: torch.Tensor, head_fn) -> torch.Tensor:
    cap = D2.final_logit_softcapping
    return torch.tanh(head_fn(hidden) * D2.output_multiplier / cap) * cap


def slow_walk(model, hidden: torch.Tensor, logits: torch.Tensor, first: int) -> list[int]:
    """Greedy: at each position the candidate (top-k by logit) with the best logit + low-rank term."""
    sel, out, prev = model.candidate_selector, [], first
    proj = sel.hidden_projection(hidden)  # [n, R]
    for p in range(logits.shape[0]):
        cands = sorted(range(logits.shape[1]), key=lambda c: -float(logits[p, c]))[: sel.top_k]
        scores = {}
        for c in cands:
            term = sum(
                float(sel.predecessor_codebook[prev, r])
                * float(proj[p, r])
                * float(sel.successor_codebook[c, r])
                for r in range(proj.shape[1])
            )
            scores[c] = float(logits[p, c]) + term
        prev = max(cands, key=lambda c: scores[c])
        out.append(prev)
    return out


@torch.no_grad()
def test_cached_block_and_walk_match_the_slow_reference():
    """Logits (1e-4) and greedy walks over extend / rollback sequences; the walk differs from the
    logits' own argmax somewhere (the selector's term is not idle)."""
    model = make_model(make_cfg())
    embed_fn, head_fn, _, _ = make_fns()
    feats = torch.randn(40, model.cfg.feature_dim)
    prop = bound(model, embed_fn, head_fn, capacity=8)
    n_ctx, differs = 0, False
    for op, n in PLAN:
        if op == "extend":
            feed(prop, feats[n_ctx : n_ctx + n])
        else:
            prop.rollback(n)
        n_ctx += n if op == "extend" else -n
        last = (7 * n_ctx) % (V - 1)
        hidden = slow_hidden(model, feats[:n_ctx], last, embed_fn)[1:]  # [bs-1, H]
        want = slow_logits(hidden, head_fn)
        torch.testing.assert_close(prop.block_logits(last, 5), want, rtol=1e-4, atol=1e-4)
        walk = slow_walk(model, hidden, want, last)
        assert prop.propose(last, 5) == walk
        assert prop.propose(last, 2) == walk[:2]  # a shorter walk is the same walk's start
        differs |= walk != want.argmax(-1).tolist()
    assert differs


@torch.no_grad()
def test_walk_chances_and_sampled_distribution():
    """The walk's chances are its own softmax at the chosen candidates; a sampled walk draws each token
    from its row of q, which sums to one over the candidates and is 0 elsewhere."""
    model = make_model(make_cfg())
    embed_fn, head_fn, _, _ = make_fns()
    prop = bound(model, embed_fn, head_fn)
    feed(prop, torch.randn(12, model.cfg.feature_dim))
    greedy = prop.walk(11, 5)
    best = greedy.candidates.gather(1, greedy.probs.argmax(-1, keepdim=True))[:, 0]  # [5]
    assert torch.equal(greedy.tokens, best)  # greedy takes each position's most likely candidate
    assert torch.allclose(greedy.chances(), greedy.probs.max(-1).values)
    u = torch.tensor([0.1, 0.5, 0.9, 0.3, 0.7])
    sampled = prop.walk(11, 5, temperature=0.8, u=u)
    q = sampled.dense(V)  # [5, V]
    assert torch.allclose(q.sum(-1), torch.ones(5)) and int((q > 0).sum(-1).max()) <= D2.selector_top_k
    assert all(q[i, t] > 0 for i, t in enumerate(sampled.tokens.tolist()))
    assert prop.walk(11, 5, temperature=0.8, u=u).tokens.tolist() == sampled.tokens.tolist()  # seeded


# ---- the public format -----------------------------------------------------------------------------------


def public_config(cfg: DFlashConfig) -> dict:
    """config.json as the public DFlash2 checkpoints write it (z-lab/dflash tests/fixtures)."""
    raw = cfg.to_dict()
    assert raw["architectures"] == ["DFlash2DraftModel"]
    for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "output_multiplier"):
        assert k in raw["dflash_config"]
    return raw


def test_checkpoint_round_trip_and_one_line_errors(tmp_path):
    from safetensors.torch import load_file, save_file

    cfg = make_cfg()
    path = DFlashDrafter(make_model(cfg)).save_pretrained(tmp_path / "d2")
    assert load_config(path) == cfg and public_config(cfg)["dflash_config"]["selector_top_k"] == 5
    keys = load_file(str(path / "model.safetensors")).keys()
    assert "candidate_selector.predecessor_codebook" in keys  # bare tensors, as the public format
    assert "layers.1.mlp_conv.kernel_projection.weight" in keys
    assert check_checkpoint(path) == cfg
    raw = json.loads((path / "config.json").read_text())
    del raw["dflash_config"]["selector_rank"]
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad/config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"DFlash2 config is missing \['dflash_config.selector_rank'\]"):
        load_config(tmp_path / "bad")
    state = load_file(str(path / "model.safetensors"))
    state["layers.0.attention_conv.base_kernel"] = torch.zeros(2, 2, H)  # 2 taps, the config says 3
    del state["candidate_selector.successor_codebook"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing 1 weights: \['candidate_selector.successor_codebook'\]"):
        check_checkpoint(path)
    with pytest.raises(ValueError, match="conv_group_size 5 does not divide hidden_size 32"):
        make_cfg(
            dflash2=DFlash2Config(conv_kernel_size=2, conv_group_size=5, selector_rank=4, selector_top_k=3)
        )
    with pytest.raises(ValueError, match="draft vocabulary is not supported for DFlash2"):
        make_cfg(draft_vocab=(1, 2, 3))


# ---- the engine: exact at T = 0, the verifier's distribution at T > 0 -------------------------------------


def stub_drafter(v: StubVerifier, *, top_k: int = 3) -> DFlashDrafter:
    cfg = make_cfg(hidden_size=v.hidden_size, vocab_size=v.vocab_size, num_target_layers=v.num_layers,
                   mask_token_id=v.vocab_size - 1, target_layer_ids=(0, 1), block_size=4,
                   dflash2=DFlash2Config(conv_kernel_size=2, conv_group_size=8, selector_rank=4,
                                         selector_top_k=top_k))  # fmt: skip
    drafter = DFlashDrafter(make_model(cfg, seed=1))
    drafter.bind(v)
    return drafter


def test_speculative_equals_autoregressive_on_the_stub():
    v = StubVerifier()
    prompt = v.tokenizer.encode("DFlash2 drafts a walk. DFlash2 drafts a walk.")
    cfg = DecodeConfig(max_new_tokens=48, stop_token_ids=frozenset())
    ar = generate(v, prompt, cfg=cfg).output_tokens
    res = generate(
        v, prompt, drafter=stub_drafter(v, top_k=8), cfg=DecodeConfig(**{**cfg.__dict__, "block_size": 4})
    )
    assert res.output_tokens == ar and sum(s.drafted for s in res.decode_steps) > 0


@pytest.mark.slow
@pytest.mark.parametrize("broken", [False, True], ids=["walk", "broken-walk"])
def test_sampled_walk_with_rejection_keeps_the_verifiers_distribution(monkeypatch, broken):
    """Chi-square of the first three tokens against the exact distribution (tests/test_sampling.py's
    harness), drafts sampled from the walk and verified by `rejection`. Negative control: a walk that
    reports its q rows shifted by one candidate must fail."""
    from test_sampling import V as SV
    from test_sampling import check_walk_distribution

    small = dict(hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32, max_context=64)
    v = StubVerifier(StubConfig(vocab_size=SV, logit_scale=1.5, **small))
    check_walk_distribution(v, stub_drafter(v), DFlashDrafter, monkeypatch, broken=broken)


def test_rollback_and_multi_turn_reuse_equal_fresh_runs():
    """The engine keeps the DFlash2 drafter's context across turns (prefix reuse, rolled back where the
    history differs): each turn equals a fresh run."""
    from specdec.stream import StreamingEngine

    v = StubVerifier()
    engine = StreamingEngine(v, stub_drafter(v, top_k=8))
    ids = v.tokenizer.encode("A walk from the last committed token. A walk from the")
    r1 = engine.complete(ids, max_tokens=24, stop_token_ids=frozenset())
    for nxt in (
        [*ids, *r1.output_tokens, *v.tokenizer.encode(" next")],
        [*ids[:9], *v.tokenizer.encode("x y")],
    ):
        r = engine.complete(nxt, max_tokens=24, stop_token_ids=frozenset())
        cfg = DecodeConfig(max_new_tokens=24, block_size=4, stop_token_ids=frozenset())
        assert r.reused_tokens > 0
        assert r.output_tokens == generate(StubVerifier(), nxt, drafter=stub_drafter(StubVerifier(), top_k=8),
                                           cfg=cfg).output_tokens  # fmt: skip


def test_hub_id_loads_from_the_local_hub_cache_offline(tmp_path):
    import os
    import subprocess
    import sys

    pytest.importorskip("huggingface_hub")
    from test_apple import _hub_cache

    folder = stub_drafter(StubVerifier()).save_pretrained(tmp_path / "d2")
    cache = _hub_cache(tmp_path / "hub", "z-lab/tiny-dflash2", folder)
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    code = (
        "from specdec.api import load_drafter, load_verifier; "
        "d = load_drafter('z-lab/tiny-dflash2', verifier=load_verifier('stub')); "
        "print(d.cfg.architecture, d.walks)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["DFlash2DraftModel", "True"]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
@pytest.mark.parametrize("runtime", ["hf", "mlx"])
def test_real_models_speculative_equals_autoregressive(model, runtime, tmp_path):
    """A random DFlash2 checkpoint shaped for the real model (its layers, width, vocabulary) drafts on
    the real verifier: output equals autoregressive output; with an MLX verifier in both drafter runtimes,
    which propose the same tokens with the same acceptance."""
    from specdec.api import load_drafter, load_verifier
    from specdec.chat import encode_prompt

    if runtime == "mlx":
        pytest.importorskip("mlx_lm")
    v = load_verifier(runtime, model, dtype="float32")
    d2 = DFlash2Config(
        conv_kernel_size=2, conv_group_size=16, selector_rank=32, selector_top_k=8, output_multiplier=0.5
    )
    cfg = make_cfg(hidden_size=v.hidden_size, vocab_size=v.vocab_size, num_target_layers=v.num_layers,
                   mask_token_id=v.vocab_size - 1, target_layer_ids=(1, v.num_layers // 2, v.num_layers - 2),
                   num_attention_heads=8, num_key_value_heads=2, head_dim=64, intermediate_size=256,
                   block_size=8, dflash2=d2)  # fmt: skip
    path = DFlashDrafter(make_model(cfg, seed=3)).save_pretrained(tmp_path / "d2")
    prompt = encode_prompt(
        v, [{"role": "user", "content": "Write a function that reverses a list in Python."}]
    )
    run = DecodeConfig(max_new_tokens=12, block_size=4)  # mlx-cpu verifies slowly: a short run
    ar = generate(v, prompt, cfg=DecodeConfig(max_new_tokens=12)).output_tokens
    results = []
    for drafter_runtime in ("torch", "mlx") if runtime == "mlx" else ("torch",):
        d = load_drafter(str(path), verifier=v, runtime=drafter_runtime)
        results.append(generate(v, prompt, drafter=d, cfg=run))
        assert results[-1].output_tokens == ar, drafter_runtime
    accept = [[s.acceptance_length for s in r.steps] for r in results]
    assert all(a == accept[0] for a in accept)
