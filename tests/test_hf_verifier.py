"""HFVerifier against transformers' own forward and `generate(do_sample=False)`.

Fast tests use tiny random Llama / Gemma 3 folders (Gemma window 16, prompts of 40 tokens, so every run
goes past the window); the slow ones use SmolLM2-135M and Gemma-3-270M fetched by `specdec.models`.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from drafters import RandomDrafter, ScriptedDrafter  # noqa: E402
from tinymodels import tiny_gemma3, tiny_llama  # noqa: E402

from specdec.engine import DecodeConfig, generate  # noqa: E402
from specdec.protocols import RollbackError, Verifier  # noqa: E402
from specdec.verifiers.hf import HFVerifier  # noqa: E402

pytestmark = pytest.mark.hf

N_NEW = 40


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("hf")
    return {
        "llama": tiny_llama(root / "llama"),
        "llama_tied": tiny_llama(root / "llama_tied", seed=1, tie=True),
        "gemma": tiny_gemma3(root / "gemma", sliding_window=16),
    }


@pytest.fixture(scope="module")
def verifiers(folders) -> dict[str, HFVerifier]:
    return {k: HFVerifier(p) for k, p in folders.items()}


def prompt_of(n: int, seed: int = 1, vocab: int = 320) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_generate(v: HFVerifier, prompt: list[int], n: int) -> list[int]:
    out = v.model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False, max_new_tokens=n, pad_token_id=0,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def refs(verifiers) -> dict[str, list[int]]:
    out = {k: hf_generate(verifiers[k], prompt_of(40), N_NEW) for k in ("llama", "gemma")}
    assert all(len(r) >= 30 for r in out.values()), "tiny model stops early: pick another prompt seed"
    return out


def make_drafter(kind: str, ref_seq: list[int], p_len: int, bs: int, v: HFVerifier, layers: tuple[int, ...]):
    kw = dict(vocab=v.vocab_size, block_size=bs, target_layer_ids=layers, hidden_size=v.hidden_size)
    if kind == "all":
        return ScriptedDrafter(ref_seq, **kw)
    if kind == "none":
        return RandomDrafter(seed=3, **kw)
    wrong = {p_len + i for i in (1, 2, 6, 13, 14, 15, 22)}  # scattered and consecutive misses
    return ScriptedDrafter(ref_seq, wrong_at=wrong, **kw)


# ---- greedy equivalence ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["all", "none", "part"])
@pytest.mark.parametrize("bs", [1, 4, 8])
@pytest.mark.parametrize("name", ["llama", "gemma"])
def test_greedy_equivalence_with_hf_generate(verifiers, refs, name, bs, kind):
    v, prompt, ref = verifiers[name], prompt_of(40), refs[name]
    layers = (0, 2, v.num_layers - 1)
    drafter = make_drafter(kind, prompt + ref, len(prompt), bs, v, layers)
    res = generate(v, prompt, drafter=drafter, cfg=DecodeConfig(max_new_tokens=N_NEW, block_size=bs))
    assert res.output_tokens == ref
    steps = res.decode_steps
    if kind == "all" and bs > 1:
        assert all(s.accepted == s.drafted for s in steps)
    if kind == "part" and bs > 2:
        assert 0 < sum(s.accepted for s in steps) < sum(s.drafted for s in steps)
    if bs > 1:
        # the drafter got exactly the committed positions' features (incremental vs one-shot kernels: close)
        full = torch.cat(drafter.features)  # [P + n, K*H]
        seq = prompt + ref
        assert drafter.tokens == seq[: full.shape[0]]
        v.set_target_layers(layers)
        v.reset()
        v.prefill(seq[: full.shape[0]])
        torch.testing.assert_close(full, v.features(full.shape[0], device="cpu", dtype=torch.float32))


# ---- features ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "gemma"])
def test_features_are_raw_decoder_layer_outputs(verifiers, name):
    v = verifiers[name]
    L, H = v.num_layers, v.hidden_size
    seq = prompt_of(48, seed=5)
    with torch.inference_mode():
        ref = v.model(torch.tensor([seq]), output_hidden_states=True)
    hs = ref.hidden_states  # L+1 entries; the last one is after the final norm
    v.set_target_layers(range(L))
    v.reset()
    v.prefill(seq[:40])  # past the tiny Gemma window of 16
    got = v.features(40, device="cpu", dtype=torch.float32).view(40, L, H)
    for li in range(L - 1):
        torch.testing.assert_close(got[:, li], hs[li + 1][0, :40])
    last = got[:, L - 1]  # raw output of the last layer: the final norm turns it into hidden_states[L]
    torch.testing.assert_close(v.model.model.norm(last), hs[L][0, :40])
    assert not torch.allclose(last, hs[L][0, :40])
    # a verify call: features of exactly its own positions, in the order asked for
    v.set_target_layers((L - 1, 1))
    v.verify(seq[40:48])
    got = v.features(8, device="cpu", dtype=torch.float32)
    assert got.shape == (8, 2 * H)
    torch.testing.assert_close(got[:, H:], hs[2][0, 40:48])
    torch.testing.assert_close(v.model.model.norm(got[:, :H]), hs[L][0, 40:48])
    assert v.features(3, device="cpu", dtype=torch.float64).shape == (3, 2 * H)


def test_no_hooks_without_target_layers(verifiers):
    v = verifiers["llama"]
    v.set_target_layers(())

    def n_hooks() -> int:  # transformers keeps hooks of its own on the layers
        return sum(len(la._forward_hooks) for la in v.model.model.layers)

    base = n_hooks()
    v.set_target_layers((1, 2, 1))
    assert n_hooks() == base + 2
    v.set_target_layers(())
    assert n_hooks() == base
    v.reset()
    v.prefill(prompt_of(5))
    with pytest.raises(RuntimeError, match="set_target_layers"):
        v.features(1, device="cpu", dtype=torch.float32)


def test_prefill_computes_the_head_on_the_last_position_only(verifiers):
    v = verifiers["gemma"]
    seen: list[tuple[int, ...]] = []
    h = v.model.lm_head.register_forward_hook(lambda m, a, o: seen.append(tuple(a[0].shape)))
    try:
        v.reset()
        v.prefill(prompt_of(40))
        v.verify(prompt_of(5, seed=2))
    finally:
        h.remove()
    assert seen == [(1, 1, v.hidden_size), (1, 5, v.hidden_size)]


# ---- rollback ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "gemma"])
def test_rollback_then_repeat_exact(verifiers, name):
    v = verifiers[name]
    layers = (0, v.num_layers - 1)
    v.set_target_layers(layers)
    v.check_rollback()
    v.reset()
    v.prefill(prompt_of(40))  # Gemma: the window (16) has wrapped long ago
    for n in (8, 3, 1, 8):
        p0, block = v.position, prompt_of(n, seed=9 + n)
        a = v.forward(block).clone()
        fa = v.features(n, device="cpu", dtype=torch.float32).clone()
        assert v.position == p0 + n
        v.rollback(n)
        assert v.position == p0
        b = v.forward(block)  # same shapes, same kernels: bit-identical
        torch.testing.assert_close(b, a, rtol=0, atol=0)
        torch.testing.assert_close(v.features(n, device="cpu", dtype=torch.float32), fa, rtol=0, atol=0)
        v.rollback(n // 2)  # keep part of it: positions move on consistently
        assert v.position == p0 + n - n // 2
    # what stays in the cache is the committed sequence: the next logits equal a full recompute
    kept = v.position
    nxt = prompt_of(4, seed=77)
    got = v.forward(nxt)
    seq = _committed(v, kept)
    with torch.inference_mode():
        full = v.model(torch.tensor([seq + nxt])).logits[0, -4:]
    torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-4)
    assert got.argmax(-1).tolist() == full.argmax(-1).tolist()


@pytest.mark.parametrize("name", ["llama", "gemma"])
def test_growing_cache_equals_transformers_own(verifiers, name):
    """Our full-attention cache layer (a buffer grown by doubling, written in place) against transformers'
    `DynamicLayer` (a concatenation per append): the same logits bit for bit, over verifies and partial
    rollbacks that cross two regrowths of the buffer (at 256 and 512 positions)."""
    from transformers.cache_utils import DynamicLayer

    v = verifiers[name]
    v.set_target_layers(())

    def run(plain: bool) -> list[torch.Tensor]:
        v.reset()
        grown = [type(la).__name__ == "GrowingLayer" for la in v._cache.layers]
        assert any(grown)
        if plain:
            v._cache.layers = [DynamicLayer() if g else la for g, la in zip(grown, v._cache.layers)]
        out, rng = [v.forward(prompt_of(250)).clone()], torch.Generator().manual_seed(0)
        while v.position < 600:
            out.append(v.forward(prompt_of(8, seed=v.position)).clone())
            v.rollback(int(torch.randint(0, 8, (), generator=rng)))
        return out

    ours, theirs = run(plain=False), run(plain=True)
    assert len(ours) == len(theirs) > 60
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    v.reset()


def test_growing_cache_refuses_a_positive_crop(verifiers):
    """transformers' legacy `crop(max_length)` (a positive size) is refused, as its own layer refuses it."""
    v = verifiers["llama"]
    v.set_target_layers(())
    v.reset()
    v.prefill(prompt_of(10))
    layer = v._cache.layers[0]
    assert type(layer).__name__ == "GrowingLayer"
    with pytest.raises(ValueError, match="crop takes minus the positions to remove, got 3"):
        layer.crop(3)
    assert layer.get_seq_length() == v.position == 10  # nothing was cut
    v.reset()


def _committed(v: HFVerifier, n: int) -> list[int]:
    """The token sequence test_rollback_then_repeat_exact leaves in the cache."""
    seq = prompt_of(40)
    for m in (8, 3, 1, 8):
        block = prompt_of(m, seed=9 + m)
        seq += block[: m - m // 2]
    assert len(seq) == n
    return seq


def test_rollback_limits(verifiers):
    g, ll = verifiers["gemma"], verifiers["llama"]
    for v in (g, ll):
        v.set_target_layers(())
        v.reset()
        v.rollback(0)  # fresh cache: nothing to do
        v.prefill(prompt_of(40))
        v.verify(prompt_of(4, seed=3))
        with pytest.raises(ValueError, match="roll back"):
            v.rollback(v.position + 1)
    # full attention keeps everything: any depth is exact
    ll.rollback(10)
    assert ll.position == 34
    # past the window the sliding layers keep only what was appended since the last rollback (which trims
    # them back to the window): refuse to go deeper, never corrupt
    g.rollback(0)
    g.verify(prompt_of(4, seed=4))
    with pytest.raises(RollbackError, match="sliding-window"):  # the contract: callers re-prefill
        g.rollback(5)
    g.rollback(4)
    assert g.position == 44


def test_recurrent_layers_refused_at_load(verifiers):
    """A model with recurrent layers other than Gated DeltaNet (here LFM2's short convolutions) is refused
    with the reason before any work: a crop could not roll their state back exactly."""
    cfg = transformers.AutoConfig.for_model(
        "lfm2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, layer_types=["conv", "full_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    with pytest.raises(
        ValueError, match=r"layer types \['conv'\] whose state the HF verifier cannot roll back"
    ):
        HFVerifier(transformers.AutoModelForCausalLM.from_config(cfg))
    from transformers.cache_utils import StaticLayer

    v = verifiers["llama"]  # a cache layer of another class (by any route) is refused before a drafter runs
    v.reset()
    v._cache.layers[0] = StaticLayer(max_cache_len=8)
    try:
        with pytest.raises(RuntimeError, match="StaticLayer"):
            v.check_rollback()
    finally:
        v.reset()


# ---- embed / lm head -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "llama_tied", "gemma"])
def test_embed_and_lm_head_reproduce_the_model(verifiers, name):
    v = verifiers[name]
    L = v.num_layers
    seq = torch.tensor(prompt_of(24, seed=4))
    emb, head = v.embed_fn(device="cpu", dtype=torch.float32), v.lm_head_fn(device="cpu", dtype=torch.float32)
    with torch.inference_mode():
        torch.testing.assert_close(emb(seq), v.model.get_input_embeddings()(seq), rtol=0, atol=0)
        logits = v.model(seq[None]).logits[0]
    v.set_target_layers((L - 1,))
    v.reset()
    v.verify(seq.tolist())
    raw = v.features(24, device="cpu", dtype=torch.float32)  # [24, H]
    torch.testing.assert_close(head(v.model.model.norm(raw)), logits, rtol=1e-5, atol=1e-5)
    # bf16 callbacks follow the same recipe in bf16
    emb16 = v.embed_fn(device="cpu", dtype=torch.bfloat16)
    assert emb16(seq).dtype == torch.bfloat16
    torch.testing.assert_close(emb16(seq).float(), emb(seq), rtol=2e-2, atol=2e-2)


def test_gemma_scale_and_softcap(verifiers):
    v = verifiers["gemma"]
    seq = torch.tensor(prompt_of(6))
    w = v.model.get_input_embeddings().weight
    torch.testing.assert_close(v.embed_fn(device="cpu", dtype=torch.float32)(seq), w[seq] * 64**0.5)
    h = torch.randn(5, v.hidden_size) * 50
    capped = v.lm_head_fn(device="cpu", dtype=torch.float32)(h)
    assert capped.abs().max() <= 30.0
    torch.testing.assert_close(capped, torch.tanh(h @ v.model.lm_head.weight.T / 30.0) * 30.0)


def test_tied_head_shares_one_copy(verifiers):
    v = verifiers["llama_tied"]
    v.embed_fn(device="cpu", dtype=torch.bfloat16)
    v.lm_head_fn(device="cpu", dtype=torch.bfloat16)
    assert len([k for k in v._weights if k[2] == torch.bfloat16]) == 1


# ---- attributes and errors ---------------------------------------------------------------------------------


def test_attributes(verifiers, folders):
    g = verifiers["gemma"]
    assert isinstance(g, Verifier)
    assert (g.runtime, g.dtype, g.vocab_size, g.hidden_size, g.num_layers) == ("hf", "float32", 320, 64, 6)
    assert g.max_context == 1024 and g.eos_token_ids == frozenset({1}) and g.tokenizer is None
    assert g.model_name == "gemma"
    rec = g.memory_probe().read()
    assert set(rec) >= {"bytes", "source", "kind"}
    # EOS ids: config and generation_config together (Gemma 3 lists <end_of_turn> too)
    path = folders["gemma"]
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [1, 106]}))
    try:
        assert HFVerifier(path).eos_token_ids == frozenset({1, 106})
    finally:
        (path / "generation_config.json").write_text(json.dumps(gen))


def test_bad_inputs(verifiers, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        HFVerifier(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        HFVerifier(tmp_path)
    (tmp_path / "t5").mkdir()
    transformers.T5Config(d_model=16, num_layers=1, num_heads=2, d_kv=8, d_ff=32).save_pretrained(
        tmp_path / "t5"
    )
    with pytest.raises(ValueError, match=r"unsupported architecture.*t5"):
        HFVerifier(tmp_path / "t5")
    v = verifiers["llama"]
    with pytest.raises(ValueError, match="out of range"):
        v.set_target_layers((0, 4))
    v.set_target_layers(())
    v.reset()
    with pytest.raises(ValueError, match="context overflow"):
        v.prefill([5] * (v.max_context + 1))
    assert v.position == 0


# ---- real models (slow) ------------------------------------------------------------------------------------


def _long_text() -> str:
    facts = [f"{i} times {i} is {i * i}, and {i} plus {i} is {2 * i}." for i in range(2, 60)]
    return (
        "Here is a table of small arithmetic facts, one per line.\n" + "\n".join(facts) + "\n60 times 60 is"
    )


@pytest.fixture(scope="module")
def real(request):
    from specdec.models import fetch

    return lambda name: HFVerifier(fetch(name))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_real_model_greedy_equivalence(real, name):
    v = real(name)
    tok = v.tokenizer
    if name == "gemma3-270m":
        prompt = tok.encode(_long_text())
        assert len(prompt) > 600  # past the 512-token sliding window
    else:
        msgs = [{"role": "user", "content": "Write a short poem about the sea."}]
        prompt = list(
            tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        )
    n = 24
    ref = hf_generate(v, prompt, n)
    assert len(ref) == n or ref[-1] in v.eos_token_ids
    layers = (1, v.num_layers // 2, v.num_layers - 1)
    for kind in ("all", "none", "part"):
        drafter = make_drafter(kind, prompt + ref, len(prompt), 8, v, layers)
        res = generate(v, prompt, drafter=drafter, cfg=DecodeConfig(max_new_tokens=n, block_size=8))
        assert res.output_tokens == ref, (kind, tok.decode(res.output_tokens), tok.decode(ref))
        if kind == "all":
            assert len(res.decode_steps) <= -(-(len(ref) - 1) // 7)


@pytest.mark.parametrize("name", ["llama", "gemma"])
def test_cpu_kernels_keep_the_models_output(folders, verifiers, refs, name):
    """oneDNN linears + masked GQA (the default on CPU) against the model exactly as transformers loads it."""
    from specdec.kernels import onednn_usable

    plain = HFVerifier(folders[name], onednn=False)
    assert plain.model.config._attn_implementation == "sdpa"
    assert type(plain.model.get_output_embeddings()) is torch.nn.Linear
    fast = verifiers[name]
    assert fast.model.config._attn_implementation == "specdec_sdpa"
    if onednn_usable("cpu", torch.float32):
        assert type(fast.model.get_output_embeddings()).__name__ == "CPULinear"
    assert hf_generate(plain, prompt_of(40), N_NEW) == refs[name]  # refs: the fast verifier's generate
    prompt, block = prompt_of(40), prompt_of(8, seed=2)
    for v in (plain, fast):
        v.set_target_layers((0, 1))
        v.reset()
        v.prefill(prompt)
    a, b = plain.forward(block), fast.forward(block)  # [8, V]: a multi-token, masked verify
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    fa, fb = (v.features(8, device=torch.device("cpu"), dtype=torch.float32) for v in (plain, fast))
    torch.testing.assert_close(fb, fa, atol=1e-4, rtol=1e-4)
    fast.set_target_layers(())
