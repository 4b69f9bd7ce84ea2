"""DFlash drafter: the cached incremental path against a slow full recompute, the training forward's
block-sparse mask and chunking, the mask-token rule, and the Drafter adapter against the stub verifier."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from specdec.drafting.dflash.config import FULL, SLIDING, DFlashConfig
from specdec.drafting.dflash.torch import DFlashDrafter, DFlashDraftModel
from specdec.drafting.policy import DraftPolicy
from specdec.engine import DecodeConfig, generate
from specdec.protocols import Drafter
from specdec.verifiers.stub import StubVerifier

V, H = 97, 32
MASK = 96


def make_cfg(**kw) -> DFlashConfig:
    base = dict(
        hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=48, vocab_size=V, num_target_layers=8, mask_token_id=MASK, block_size=6,
        target_layer_ids=(1, 4, 5), rope_theta=10_000.0,
    )  # fmt: skip
    base.update(kw)
    return DFlashConfig(**base)


def make_model(cfg: DFlashConfig, seed: int = 0) -> DFlashDraftModel:
    """Random weights, norms included (all-ones norms would hide a misplaced norm)."""
    torch.manual_seed(seed)
    model = DFlashDraftModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
    return model.eval()


def make_fns(seed: int = 1, dim: int = H, vocab: int = V):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(vocab, dim, generator=g)
    head = torch.randn(vocab, dim, generator=g) * 2 / math.sqrt(dim)
    return (lambda ids: F.embedding(ids, emb)), (lambda h: h @ head.T), emb, head


# ---- a slow reference: no cache, explicit per-pair mask, explicit softmax ------------------------------


def _ref_rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x [T, n, D]; pairs (i, i + D/2) rotated by pos * theta^(-2i/D)."""
    D = x.shape[-1]
    half = D // 2
    ang = pos[:, None].double() * theta ** (-torch.arange(half).double() * 2 / D)  # [T, D/2]
    c, s = ang.cos()[:, None].to(x.dtype), ang.sin()[:, None].to(x.dtype)  # [T, 1, D/2]
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1)


def slow_block_logits(model: DFlashDraftModel, features, last_token, embed_fn, lm_head_fn) -> torch.Tensor:
    """Block logits [bs, V] for context features [S, K*H] (positions 0..S-1), recomputed from scratch."""
    cfg = model.cfg
    S, bs, D = features.shape[0], cfg.block_size, cfg.head_dim
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    ids = torch.tensor([last_token] + [cfg.mask_token_id] * (bs - 1))
    x = embed_fn(ids)  # [bs, H]
    ctx = model.hidden_norm(model.fc(features))  # [S, H]
    pos = torch.arange(S + bs)
    for layer in model.layers:
        a = layer.self_attn
        h = layer.input_layernorm(x)
        both = torch.cat([ctx, h])  # [S+bs, H]: context and block share k_proj / v_proj
        q = _ref_rope(a.q_norm(a.q_proj(h).view(bs, nh, D)), pos[S:], cfg.rope_theta)
        k = _ref_rope(a.k_norm(a.k_proj(both).view(S + bs, nkv, D)), pos, cfg.rope_theta)
        v = a.v_proj(both).view(S + bs, nkv, D)
        k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
        allowed = torch.ones(bs, S + bs, dtype=torch.bool)
        for i in range(bs):
            for j in range(S + bs):
                qp, kp = S + i, j
                if layer.sliding_window is not None and abs(qp - kp) >= layer.sliding_window:
                    allowed[i, j] = False
                if cfg.is_causal and kp > qp:
                    allowed[i, j] = False
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
        att = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(bs, nh * D)
        x = x + a.o_proj(o)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    logits = lm_head_fn(model.norm(x))
    logits[:, cfg.mask_token_id] = float("-inf")
    return logits


# ---- cached inference ------------------------------------------------------------------------------------


def bound(model: DFlashDraftModel, embed_fn, head_fn, **kw) -> DFlashDrafter:
    """A drafter over `model` bound to the embedding / head callbacks (no verifier)."""
    d = DFlashDrafter(model, **kw)
    d.bind_fns(embed_fn, head_fn)
    return d


def feed(d: DFlashDrafter, feats: torch.Tensor) -> None:
    """`d.extend` with features only (DFlash does not read the tokens)."""
    d.extend(feats, [0] * feats.shape[0])


def run_steps(cfg: DFlashConfig, plan, *, capacity=8, total=40, propose_after=None):
    """Drive the proposer through `plan` (("extend", n) / ("rollback", n)) and compare a proposal after
    every step (or after the steps of index in `propose_after`) with the slow reference on the committed
    context."""
    model = make_model(cfg)
    embed_fn, head_fn, _, _ = make_fns()
    feats = torch.randn(total, cfg.feature_dim)
    prop = bound(model, embed_fn, head_fn, capacity=capacity)
    n_ctx, checked = 0, 0
    for i, (op, n) in enumerate(plan):
        if op == "extend":
            feed(prop, feats[n_ctx : n_ctx + n])
            n_ctx += n
        else:
            prop.rollback(n)
            n_ctx -= n
        assert prop.context_len == n_ctx
        if propose_after is not None and i not in propose_after:
            continue  # commits pile up unprojected until the next proposal
        last = (7 * n_ctx) % (V - 1)
        with torch.no_grad():
            want = slow_block_logits(model, feats[:n_ctx], last, embed_fn, head_fn)[1:]
        got = prop.block_logits(last, cfg.block_size - 1)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert prop.propose(last, cfg.block_size - 1) == want.argmax(-1).tolist()
        checked += 1
    return checked


PLAN = [("extend", 5), ("extend", 1), ("extend", 4), ("rollback", 3), ("extend", 7), ("rollback", 1),
        ("extend", 2), ("rollback", 0), ("extend", 9)]  # fmt: skip


def test_cached_matches_full_recompute_with_rollbacks():
    # capacity 8 forces the buffers to double several times along the way
    assert run_steps(make_cfg(), PLAN) == len(PLAN)


def test_commits_are_projected_by_the_next_proposal():
    # several extends, and a rollback into them, between proposals (as behind `+lookup`)
    assert run_steps(make_cfg(), PLAN, propose_after={2, 5, 8}) == 3


def test_empty_context_block():
    # the first proposal may come before any features (block attends only to itself)
    assert run_steps(make_cfg(), [("extend", 0), ("extend", 3), ("rollback", 3)]) == 3


def test_sliding_window_layers_match_reference():
    cfg = make_cfg(num_hidden_layers=3, layer_types=(SLIDING, FULL, SLIDING), sliding_window=4)
    assert run_steps(cfg, PLAN) == len(PLAN)


def test_causal_variant_matches_reference():
    assert run_steps(make_cfg(is_causal=True, layer_types=(SLIDING, FULL), sliding_window=5), PLAN)


def test_sliding_window_ignores_positions_outside_the_window():
    w = 5
    cfg = make_cfg(layer_types=(SLIDING, SLIDING), sliding_window=w)
    model = make_model(cfg)
    embed_fn, head_fn, _, _ = make_fns()
    feats = torch.randn(30, cfg.feature_dim)

    def logits(f):
        p = bound(model, embed_fn, head_fn)
        feed(p, f)
        return p.block_logits(3, cfg.block_size - 1)

    base = logits(feats)
    # block queries sit at 30..35: the first sees keys > 30 - w, so position 30 - w is out of every window
    far, near = feats.clone(), feats.clone()
    far[: 30 - w + 1] += 5 * torch.randn(30 - w + 1, cfg.feature_dim)
    near[30 - w + 1] += 5
    assert torch.equal(logits(far), base)
    assert not torch.allclose(logits(near), base)
    # the same model run as full attention does see the far positions
    full = make_model(make_cfg())
    p1, p2 = bound(full, embed_fn, head_fn), bound(full, embed_fn, head_fn)
    feed(p1, feats)
    feed(p2, far)
    assert not torch.allclose(p1.block_logits(3, 5), p2.block_logits(3, 5))


def test_mask_token_never_proposed():
    cfg = make_cfg()
    model = make_model(cfg)
    embed_fn, _, _, head = make_fns()
    bias = torch.zeros(V)
    bias[MASK] = 1e4  # the mask token is everywhere the argmax of the raw head

    def head_fn(h):
        return h @ head.T + bias

    prop = bound(model, embed_fn, head_fn)
    feed(prop, torch.randn(7, cfg.feature_dim))
    with torch.no_grad():
        assert (head_fn(torch.randn(5, H)).argmax(-1) == MASK).all()
    for n in range(cfg.block_size):
        toks = prop.propose(11, n)
        assert len(toks) == n and MASK not in toks


def test_proposal_limits():
    cfg = make_cfg()
    model = make_model(cfg)
    embed_fn, head_fn, _, _ = make_fns()
    prop = bound(model, embed_fn, head_fn)
    feed(prop, torch.randn(4, cfg.feature_dim))
    whole = prop.propose(2, cfg.block_size - 1)
    assert len(whole) == cfg.block_size - 1
    # fewer tokens: the same full block, truncated
    assert prop.propose(2, 3) == whole[:3]
    assert prop.propose(2, 0) == []
    with pytest.raises(ValueError, match=r"0\.\.5"):
        prop.propose(2, cfg.block_size)
    with pytest.raises(ValueError, match="roll back 9"):
        prop.rollback(9)
    with pytest.raises(ValueError, match=r"\[n, 96\]"):
        feed(prop, torch.randn(3, 10))
    with pytest.raises(RuntimeError, match="not bound"):
        DFlashDrafter(model).propose(2, 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_runs(dtype):
    cfg = make_cfg(layer_types=(SLIDING, FULL), sliding_window=6)
    model = make_model(cfg).to(dtype)
    emb = torch.randn(V, H, dtype=dtype)
    head = (torch.randn(V, H) / math.sqrt(H)).to(dtype)
    prop = bound(model, lambda ids: F.embedding(ids, emb), lambda h: h @ head.T)
    feed(prop, torch.randn(20, cfg.feature_dim, dtype=dtype))
    logits = prop.block_logits(5, 5)
    assert logits.dtype == dtype and torch.isfinite(logits[:, :MASK]).all()
    assert model._inv_freq.dtype == torch.float32  # RoPE angles stay fp32 under .to(dtype)
    toks = prop.propose(5, cfg.block_size - 1)
    assert len(toks) == 5 and all(0 <= t < V and t != MASK for t in toks)


# ---- training forward ------------------------------------------------------------------------------------


def train_setup(seed=0, **kw):
    cfg = make_cfg(**kw)
    model = make_model(cfg, seed)
    embed_fn, head_fn, _, _ = make_fns()
    g = torch.Generator().manual_seed(seed + 5)
    B, T = 2, 26
    feats = torch.randn(B, T, cfg.feature_dim, generator=g)
    ids = torch.randint(0, V - 1, (B, T), generator=g)
    anchors = torch.tensor([[3, 6, 12, 19, 0], [0, 9, 10, 18, 20]])  # overlapping blocks on purpose
    return cfg, model, embed_fn, head_fn, feats, ids, anchors


@pytest.mark.parametrize("kw", [{}, {"layer_types": (SLIDING, FULL), "sliding_window": 4}])
def test_training_forward_equals_cached_inference(kw):
    cfg, model, embed_fn, head_fn, feats, ids, anchors = train_setup(**kw)
    with torch.no_grad():
        out = model.train_logits(feats, ids, anchors, embed_fn, head_fn)  # [B, A, bs, V]
    assert out.shape == (2, 5, cfg.block_size, V)
    for b in range(2):
        for i, a in enumerate(anchors[b].tolist()):
            prop = bound(model, embed_fn, head_fn)
            feed(prop, feats[b, :a])
            want = prop.block_logits(int(ids[b, a]), cfg.block_size - 1)
            got = out[b, i, 1:].clone()
            got[:, MASK] = float("-inf")
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_training_mask_by_perturbation():
    _, model, embed_fn, head_fn, feats, ids, anchors = train_setup()

    def run(f, i):
        with torch.no_grad():
            return model.train_logits(f, i, anchors, embed_fn, head_fn, attn_chunk=2)

    base = run(feats, ids)
    b, blk = 0, 2  # anchor 12 of sequence 0
    a = int(anchors[b, blk])
    # context at and after the anchor is invisible to this block
    later = feats.clone()
    later[b, a:] += 3 * torch.randn_like(later[b, a:])
    out = run(later, ids)
    torch.testing.assert_close(out[b, blk], base[b, blk], rtol=0, atol=0)
    assert not torch.allclose(out[b, blk + 1], base[b, blk + 1])  # a later block does see it
    torch.testing.assert_close(out[1 - b], base[1 - b], rtol=0, atol=0)  # other sequence untouched
    # another block's tokens are invisible: change the anchor token of block 1 (anchor 6)
    ids2 = ids.clone()
    ids2[b, int(anchors[b, 1])] = (ids[b, int(anchors[b, 1])] + 1) % (V - 1)
    out = run(feats, ids2)
    for j in range(anchors.shape[1]):
        if j != 1:
            torch.testing.assert_close(out[b, j], base[b, j], rtol=0, atol=0)
    assert not torch.allclose(out[b, 1], base[b, 1])
    # earlier context is visible
    earlier = feats.clone()
    earlier[b, a - 1] += 3
    assert not torch.allclose(run(earlier, ids)[b, blk], base[b, blk])


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 64])
def test_chunked_equals_unchunked(chunk):
    _, model, embed_fn, head_fn, feats, ids, anchors = train_setup(
        layer_types=(SLIDING, FULL), sliding_window=7
    )
    with torch.no_grad():
        full = model.train_logits(feats, ids, anchors, embed_fn, head_fn)
        part = model.train_logits(feats, ids, anchors, embed_fn, head_fn, attn_chunk=chunk)
    torch.testing.assert_close(part, full, rtol=1e-5, atol=1e-5)


def test_training_forward_backprops_into_drafter_only():
    _, model, _, _, feats, ids, anchors = train_setup()
    model.train()
    _, _, emb, head = make_fns()
    emb.requires_grad_(False)
    logits = model.train_logits(feats, ids, anchors, lambda i: F.embedding(i, emb), lambda h: h @ head.T)
    labels = ids[:, :, None].expand(-1, -1, 1)  # any labels: this checks the graph, not the loss
    loss = F.cross_entropy(logits[:, :, 1].reshape(-1, V), labels[:, : anchors.shape[1]].reshape(-1))
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


# ---- the Drafter adapter against the stub verifier -------------------------------------------------------


def stub_cfg(**kw):
    base = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=96, vocab_size=259, num_target_layers=4, mask_token_id=258, block_size=8,
        target_layer_ids=(1, 2), rope_theta=10_000.0,
    )  # fmt: skip
    base.update(kw)
    return DFlashConfig(**base)


def test_drafter_protocol_and_exact_decode():
    verifier = StubVerifier()
    drafter = DFlashDrafter(make_model(stub_cfg()))
    assert isinstance(drafter, Drafter)
    assert drafter.feature_dim == 128 and drafter.vocab_size == 259 and drafter.context_len == 0
    with pytest.raises(RuntimeError, match="bind"):
        drafter.propose(1, 3)
    drafter.bind(verifier)
    prompt = verifier.tokenizer.encode("speculative decoding, exactly")
    base = generate(verifier, prompt, cfg=DecodeConfig(max_new_tokens=40, block_size=1))
    spec = generate(verifier, prompt, drafter=drafter, cfg=DecodeConfig(max_new_tokens=40, block_size=8))
    assert spec.output_tokens == base.output_tokens  # greedy-exact whatever the (random) drafter says
    n = drafter.context_len  # every committed position but the last step's (the run ended there)
    assert len(prompt) < n < len(prompt) + len(spec.output_tokens)
    drafter.rollback(2)
    assert drafter.context_len == n - 2
    drafter.reset()
    assert drafter.context_len == 0


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"target_layer_ids": (1, 5), "num_target_layers": 8}, r"target layers \[5\]"),
        ({"vocab_size": 300}, "vocabulary size 300"),
        ({"mask_token_id": 259}, "mask_token_id 259"),
        ({"num_target_layers": 6}, "target with 6 layers"),
    ],
)
def test_bind_mismatches_fail_clearly(kw, match):
    drafter = DFlashDrafter(make_model(stub_cfg(**kw)))
    with pytest.raises(ValueError, match=match):
        drafter.bind(StubVerifier())


def test_bind_hidden_size_mismatch():
    cfg = stub_cfg(hidden_size=32, intermediate_size=48)
    with pytest.raises(ValueError, match="width 64"):
        DFlashDrafter(make_model(cfg)).bind(StubVerifier())


def test_drafter_extend_checks_lengths():
    drafter = DFlashDrafter(make_model(stub_cfg()))
    drafter.bind(StubVerifier())
    with pytest.raises(ValueError, match="3 positions but 2 tokens"):
        drafter.extend(torch.randn(3, 128), [1, 2])


# ---- a draft vocabulary (shortlist) ------------------------------------------------------------------------


def test_draft_vocabulary_reads_out_only_its_ids():
    """With a draft vocabulary the verifier's head is cut to K rows at bind time; the proposals must be
    what the full head would give restricted to those ids, and decoding stays exact."""
    verifier = StubVerifier()
    rows = torch.tensor([3, 5, 17, 40, 41, 99, 200, 258])  # the mask (258) too: it must never be proposed
    model = make_model(stub_cfg(draft_vocab=rows.tolist()))
    fast, slow = DFlashDrafter(model), DFlashDrafter(model)
    fast.bind(verifier)  # the verifier builds a [K, H] head
    full = verifier.lm_head_fn(device=torch.device("cpu"), dtype=torch.float32)
    slow.bind_fns(verifier.embed_fn(device=torch.device("cpu"), dtype=torch.float32), full)
    feats = torch.randn(9, fast.feature_dim)
    for d in (fast, slow):
        d.extend(feats, list(range(9)))
    a, b = fast.propose_logits(7, 7), slow.propose_logits(7, 7)  # [7, V]
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    outside = torch.ones(259, dtype=torch.bool)
    outside[rows[:-1]] = False
    assert torch.isinf(a[:, outside]).all() and torch.isfinite(a[:, rows[:-1]]).all()
    tokens = fast.propose(7, 7)
    assert tokens == slow.propose(7, 7) == a.argmax(-1).tolist()
    assert set(tokens) <= set(rows[:-1].tolist())
    prompt = verifier.tokenizer.encode("a shortlist cannot change the output")
    fast.reset()
    base = generate(verifier, prompt, cfg=DecodeConfig(max_new_tokens=40, block_size=1))
    spec = generate(verifier, prompt, drafter=fast, cfg=DecodeConfig(max_new_tokens=40, block_size=8))
    assert spec.output_tokens == base.output_tokens


@pytest.mark.parametrize("rows", [None, [3, 5, 17, 40, 41, 99, 200, 258]])
def test_min_confidence_cuts_where_the_running_probability_falls(rows):
    """The gated block is the greedy block cut before the first position whose running product of
    top-1 probabilities is below the threshold, computed here the slow way from the full logits."""
    verifier = StubVerifier()
    gated = DFlashDrafter(make_model(stub_cfg(draft_vocab=rows)), policy=DraftPolicy(min_confidence=0.3))
    gated.bind(verifier)
    feats = torch.randn(9, gated.feature_dim, generator=torch.Generator().manual_seed(4))
    gated.extend(feats, list(range(9)))
    cuts = set()
    for last in range(0, 259, 7):
        probs = gated.propose_logits(last, 7).softmax(-1)  # [7, V]
        running = probs.max(-1).values.cumprod(0).tolist()
        keep = next((i for i, p in enumerate(running) if p < 0.3), 7)
        want = probs.argmax(-1).tolist()[:keep]
        assert gated.propose(last, 7) == want
        cuts.add(keep)
    assert len(cuts) > 1  # the threshold really cuts at different places for this model
    with pytest.raises(ValueError, match="min_confidence"):
        DFlashDrafter(make_model(stub_cfg()), policy=DraftPolicy(min_confidence=1.5))


def test_gated_and_lookup_first_drafters_stay_exact():
    from specdec.drafting.mix import LookupFirstDrafter

    verifier = StubVerifier()
    prompt = verifier.tokenizer.encode("the cat sat on the mat; the cat sat on the")
    base = generate(verifier, prompt, cfg=DecodeConfig(max_new_tokens=60, block_size=1))
    for thr in (0.0, 0.2, 1.0):
        inner = DFlashDrafter(make_model(stub_cfg()), policy=DraftPolicy(min_confidence=thr))
        hybrid = LookupFirstDrafter(inner, block_size=16)
        assert isinstance(hybrid, Drafter) and hybrid.block_size == 16 and hybrid.name == "dflash+lookup"
        hybrid.bind(verifier)
        spec = generate(verifier, prompt, drafter=hybrid, cfg=DecodeConfig(max_new_tokens=60, block_size=16))
        assert spec.output_tokens == base.output_tokens
        assert hybrid.counts["lookup"] > 0 and hybrid.counts["drafter"] > 0
        assert max(s.drafted for s in spec.decode_steps) > inner.block_size - 1  # lookup runs past a block
        assert inner.context_len == hybrid.context_len == hybrid.lookup.context_len
        if thr == 1.0:  # the DFlash part proposes nothing: what is drafted came from lookup
            assert sum(s.drafted > 0 for s in spec.decode_steps) <= hybrid.counts["lookup"]


def test_load_drafter_lookup_suffix(tmp_path):
    from specdec.api import load_drafter
    from specdec.drafting.mix import LookupFirstDrafter

    verifier = StubVerifier()
    DFlashDrafter(make_model(stub_cfg())).save_pretrained(tmp_path / "d")
    d = load_drafter(f"{tmp_path / 'd'}+lookup", verifier=verifier, block_size=12, min_confidence=0.5)
    assert isinstance(d, LookupFirstDrafter) and d.block_size == 12 and d.drafter.policy.min_confidence == 0.5
    d.propose(1, 11)  # bound: the inner drafter took the verifier's callbacks
    for bad in ("prompt-lookup+lookup", "none+lookup"):
        with pytest.raises(ValueError, match="lookup"):
            load_drafter(bad, verifier=verifier)
    # a cut-off with nothing to cut is refused, not ignored
    for spec in ("prompt-lookup", "none", None):
        with pytest.raises(ValueError, match="min_confidence cuts block drafts"):
            load_drafter(spec, verifier=verifier, min_confidence=0.5)
    with pytest.raises(ValueError, match=r"min_confidence must be in \[0, 1\], got 1.5"):
        load_drafter(str(tmp_path / "d"), verifier=verifier, min_confidence=1.5)
