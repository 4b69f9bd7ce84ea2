"""Medusa heads (`drafting.medusa`), the kind added as `docs/architecture.md`'s recipe says: its folder,
one registry line, its package line and these tests. On a tiny random Llama with tiny random heads in
vLLM's layout (per-head or shared LM heads, biases or none, a truncated draft vocabulary, the
`medusa_heads.` prefix): drafts and logits equal an independent computation from transformers' own
normed hidden states through accept-all / accept-none / partial steps and rollbacks; output equals
transformers' greedy generation, with and without "+lookup", and seeded T > 0 match; every malformed
checkpoint is one line before the verifier loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

import parity
import tinymodels
from drafters import scripted_steps

from specdec.api import RunSpec, load_drafter
from specdec.drafting.medusa.torch import MedusaDrafter
from specdec.engine import DecodeConfig, generate
from specdec.sampling import SamplingParams
from specdec.verifiers.hf import HFVerifier

PROMPT = [(7 * i) % 250 + 5 for i in range(24)]
HEADS = 4


def write_medusa(
    folder: Path, model: torch.nn.Module, *, seed: int = 0, layers: int = 1, bias: bool = True,
    shared: bool = False, keep: int | None = None, prefix: str = "", own_head: bool = False,
    config: dict | None = None,
) -> Path:  # fmt: skip
    """A Medusa checkpoint for `model` in vLLM's layout. `own_head`: zero residual layers and the model's
    own LM head in every head (each head then drafts the model's next token again); `keep`: a draft
    vocabulary of the first `keep` ids, reversed (a `token_map` that is not the identity)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    H, V = model.config.hidden_size, model.config.vocab_size
    K = keep or V
    token_map = torch.arange(K).flip(0)
    t: dict[str, torch.Tensor] = {}
    for i in range(HEADS):
        for j in range(layers):
            t[f"{prefix}blocks.{i}.layers.{j}.weight"] = (
                torch.zeros(H, H) if own_head else torch.randn(H, H, generator=g) * 0.2
            )
            if bias:
                t[f"{prefix}blocks.{i}.layers.{j}.bias"] = torch.randn(H, generator=g) * 0.1
        if i == 0 or not shared:
            head = model.lm_head.weight.detach().clone() if own_head else torch.randn(V, H, generator=g)
            t[f"{prefix}lm_heads.{i}.weight"] = head[token_map] if keep else head
    if keep:
        t[f"{prefix}token_map"] = token_map
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in t.items()}, folder / "model.safetensors")
    cfg = {
        "architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": H, "vocab_size": V,
        "num_heads": HEADS, "num_hidden_layers": layers, "medusa_fc_bias": bias, "original_lm_head": shared,
        "truncated_vocab_size": K, "logit_scale": 1.5,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps({**cfg, **(config or {})}))
    return folder


VARIANTS = {
    "plain": {},
    "two_layers_no_bias": {"layers": 2, "bias": False},
    "shared_truncated_prefixed": {"shared": True, "keep": 200, "prefix": "medusa_heads."},
}


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return tinymodels.tiny_llama(tmp_path_factory.mktemp("medusa") / "llama")


@pytest.fixture(scope="module")
def v(llama) -> HFVerifier:
    return HFVerifier(llama)


def reference(v: HFVerifier, folder: Path):
    """Drafts and logits recomputed from scratch: transformers' own `hidden_states[-1]` (after the final
    norm) at the last committed position, each head's residual layers and LM head in plain fp32 loops."""
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    w = {
        k.removeprefix("medusa_heads."): x.float() for k, x in load_file(folder / "model.safetensors").items()
    }

    @torch.no_grad()
    def ref(tokens, feats, last, k):
        h = v.model(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0, -1].float()
        drafts, logits = [], []
        for i in range(k):
            x = h
            for j in range(cfg["num_hidden_layers"]):
                b = w.get(f"blocks.{i}.layers.{j}.bias", torch.zeros_like(x))
                x = x + F.silu(x @ w[f"blocks.{i}.layers.{j}.weight"].T + b)
            head = w[f"lm_heads.{0 if cfg['original_lm_head'] else i}.weight"]
            lg = x @ head.T * cfg["logit_scale"]
            logits.append(lg)
            top = int(lg.argmax())
            drafts.append(int(w["token_map"][top]) if "token_map" in w else top)
        return drafts, torch.stack(logits)

    return ref


def run(v, drafter=None, *, n: int = 24, block: int = HEADS + 1, sampling=None):
    cfg = DecodeConfig(max_new_tokens=n, block_size=block if drafter else 1, stop_token_ids=frozenset(),
                       sampling=sampling)  # fmt: skip
    return generate(v, PROMPT, drafter=drafter, cfg=cfg)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_drafts_equal_an_independent_computation(v, tmp_path, variant):
    folder = write_medusa(tmp_path / variant, v.model, **VARIANTS[variant])
    d = load_drafter(str(folder), verifier=v)
    assert isinstance(d, MedusaDrafter) and d.target_layer_ids == (v.num_layers - 1,)
    assert d.block_size == HEADS + 1
    scripted_steps(
        d, v, reference(v, folder), prompt=PROMPT, k=HEADS, logits=lambda d, last, k: d.head_logits(k)
    )


def test_output_is_greedy_and_seeded_match(v, tmp_path):
    own = parity.runtime_generate(v.model, PROMPT, 24)
    for kw in ({}, {"own_head": True, "bias": False}):
        folder = write_medusa(tmp_path / f"m{len(kw)}", v.model, **kw)
        d = load_drafter(str(folder), verifier=v)
        got = run(v, d)
        assert got.output_tokens == own
        assert sum(s.drafted for s in got.decode_steps) >= len(got.decode_steps) - 1  # it drafted each step
        assert run(v, load_drafter(f"{folder}+lookup", verifier=v)).output_tokens == own
    match = SamplingParams(temperature=0.9, seed=4, rule="match")
    assert run(v, d, sampling=match).output_tokens == run(v, sampling=match).output_tokens


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"config": {"medusa_num_heads": 4}}, "FasterDecoding's layout"),
        ({"config": {"num_heads": 0}}, "no valid num_heads"),
        ({"config": {"truncated_vocab_size": 100000}}, "truncated_vocab_size"),
        ({"config": {"medusa_fc_bias": "yes"}}, "medusa_fc_bias"),
        ({"config": {"num_hidden_layers": 2}}, "has no 'blocks.0.layers.1.weight'"),
        ({"config": {"hidden_size": 32}}, "is [64, 64] in model.safetensors, not [32, 32]"),
    ],
)
def test_a_malformed_checkpoint_is_one_line_before_anything_loads(v, tmp_path, change, says):
    folder = write_medusa(tmp_path / "m", v.model, **change)
    with pytest.raises(ValueError, match=None) as e:
        RunSpec(verifier="hf", model=str(tmp_path / "nowhere"), drafter=str(folder)).check()
    assert says in str(e.value) and "\n" not in str(e.value), e.value


def test_a_misfit_or_another_runtime_is_refused_before_loading(llama, v, tmp_path):
    folder = write_medusa(tmp_path / "m", v.model, keep=320, config={"vocab_size": 512})
    with pytest.raises(ValueError, match="vocabulary 512; 'llama' has 64 and 320"):
        RunSpec(verifier="hf", model=str(llama), drafter=str(folder)).check()
    ok = write_medusa(tmp_path / "ok", v.model)
    with pytest.raises(ValueError, match=r"\(medusa\) runs in \['torch'\]"):
        RunSpec(verifier="mlx", model=str(llama), drafter=str(ok), drafter_runtime="mlx").check()
    out = subprocess.run(
        [sys.executable, "-m", "specdec", "inspect-drafter", str(ok), "--model", str(llama)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0 and "(medusa; torch)" in out.stdout and "fits llama: yes" in out.stdout, out


def test_the_kind_is_reached_only_through_the_registry():
    """The recipe held: nothing outside the kind's folder imports it but the registry's table."""
    from test_architecture import _graph

    users = {m for m, deps in _graph().items() for d in deps if d.startswith("specdec.drafting.medusa")}
    assert {m for m in users if not m.startswith("specdec.drafting.medusa")} == {"specdec.drafting.registry"}


def test_any_verifier_that_hands_its_final_norm_runs_it(tmp_path):
    """The kind needs a capability (`protocols.FinalNorm`), not a runtime: the stub verifier declares it
    too, and its greedy output comes back exactly, with drafts verified (the repeat-the-bonus heads)."""
    from types import SimpleNamespace

    from drafters import greedy_reference

    from specdec.verifiers.stub import StubVerifier

    stub = StubVerifier()
    shape = SimpleNamespace(
        config=SimpleNamespace(hidden_size=64, vocab_size=259),
        lm_head=SimpleNamespace(weight=stub.model.head),
    )
    for kw in ({}, {"own_head": True, "bias": False}):
        d = load_drafter(str(write_medusa(tmp_path / f"s{len(kw)}", shape, **kw)), verifier=stub)
        got = run(stub, d)
        assert got.output_tokens == greedy_reference(stub, PROMPT, 24)
        assert sum(s.drafted for s in got.decode_steps) > 0
