"""Tree verification (`--tree`): several candidate continuations verified in one call, exactly.

A tree verify must give every node the logits its root path gets verified as a chain (bit for bit where
the verifier is batch-invariant, bf16 here; to float rounding in fp32), so speculative output equals
autoregressive output token for token whatever tree is proposed: random trees, an all-accepting one, and a
scripted second branch that wins where the top-1 chain goes wrong. At T > 0 the match rule over trees
keeps the verifier's distribution (chi-square against enumeration, with a broken rule that must fail).
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
import torch
from drafters import TreeDrafter
from measured import exact_or_measured_not
from parity import runtime_generate
from test_dflash import make_model, stub_cfg
from test_sampling import (
    ALPHA,
    N_SAMPLES,
    PROMPT,
    ModelDrafter,
    chi2_stat,
    chi2_threshold,
    exact_joint,
)
from tinymodels import tiny_gemma3, tiny_gpt_oss, tiny_llama, tiny_qwen3, tiny_qwen3_5

from specdec.drafting.dflash.torch import DFlashDrafter
from specdec.engine import DecodeConfig, generate
from specdec.kernels import TreeAttention, batch_invariant, invariant_attention
from specdec.sampling import Sampler, SamplingParams, sample_from, warp
from specdec.stream import ChatSession, StreamingEngine
from specdec.tree import Tree, TreeBudget, best_first
from specdec.verifiers.stub import StubConfig, StubVerifier

FAMILIES = {"llama": tiny_llama, "gemma3": tiny_gemma3, "qwen3": tiny_qwen3}


# ---- the tree itself --------------------------------------------------------------------------------------


def test_best_first_takes_nodes_by_path_probability():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 30, generator=g) * 2  # [D, V]
    tree = best_first(7, logits, TreeBudget(20))
    assert len(tree) == 20 and tree.tokens[0] == 7 and tree.parents[0] == -1
    assert all(0 <= p < i for i, p in enumerate(tree.parents[1:], 1))
    assert all(a >= b - 1e-12 for a, b in zip(tree.probs[1:], tree.probs[2:]))  # best first
    logp = logits.log_softmax(-1)
    for i in range(1, len(tree)):  # a node's probability is its path's
        node, want = i, 0.0
        while node > 0:
            want += float(logp[tree.depths[node] - 1, tree.tokens[node]])
            node = tree.parents[node]
        assert tree.probs[i] == pytest.approx(torch.tensor(want).exp().item(), rel=1e-5)
    # the chain of top-1 candidates comes first when it is the most likely path at every length
    sharp = torch.full((4, 10), -5.0).scatter(1, torch.tensor([[1], [2], [3], [4]]), 5.0)
    top = best_first(0, sharp, TreeBudget(5))
    assert top.tokens == [0, 1, 2, 3, 4] and top.parents == [-1, 0, 1, 2, 3] and top.ranks == [0] * 5
    assert best_first(3, logits[:0], TreeBudget(8)).tokens == [3]
    with pytest.raises(ValueError, match="at least 1 node"):
        TreeBudget(0)


def test_auto_budget_keeps_nodes_while_they_pay_for_their_rows():
    class Costs:
        def __init__(self, row: float) -> None:
            self.row = row

        def cost(self, b: int) -> float:
            return 1 + self.row * (b - 1)

    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1))
    free = best_first(0, logits, TreeBudget(16, costs=Costs(0.0)))
    dear = best_first(0, logits, TreeBudget(16, costs=Costs(5.0)))
    assert len(free) == 16 and len(dear) == 1
    mid = best_first(0, logits, TreeBudget(16, costs=Costs(0.05)))
    assert 1 < len(mid) < 16 and min(mid.probs) >= 0.05 * 0.5  # no node far below its row's cost


def test_accept_and_branches():
    tree = Tree([9, 1, 2, 5, 3], [-1, 0, 1, 0, 3])  # 9 -> 1 -> 2 and 9 -> 5 -> 3
    assert tree.depths == [0, 1, 2, 1, 2]
    assert tree.accept([5, 0, 0, 3, 0]) == [0, 3, 4]  # the second branch, to its end
    assert tree.accept([1, 7, 0, 0, 0]) == [0, 1]
    assert tree.accept([4, 0, 0, 0, 0]) == [0]
    merged = tree.with_branch([5, 3, 8])
    assert merged.tokens == [9, 1, 2, 5, 3, 8] and merged.parents[-1] == 4 and merged.ranks[-1] == -1
    with pytest.raises(ValueError, match="parent must come before"):
        Tree([1, 2, 3], [-1, 2, 0])


def test_tree_attention_rows_equal_their_paths_as_chains():
    """The kernel alone, at a real model's head size and contexts across several key blocks: each node's
    row of `TreeAttention.attend` against `invariant_attention` over its path as a chain, bit for bit (a
    layout shared by all nodes failed this on SmolLM2 bf16: a key in another block of 64 rounds the
    blocked sums otherwise). bf16, where the kernel is row-invariant (fp32 matmuls are not here)."""
    dtype = torch.bfloat16
    # measured on both of this project's CPU kinds (AVX-512 with avx512_bf16, and AVX2 only): docs/dtype.md
    assert batch_invariant(dtype)
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    for ctx in (143, 200, 330):
        tree = _random_tree(rng, 100)
        T = len(tree)
        q = torch.randn(1, 9, T, 64, generator=g).to(dtype)
        k, v = (torch.randn(1, 3, ctx + T, 64, generator=g).to(dtype) for _ in range(2))
        sinks = torch.randn(9, generator=g).to(dtype) if ctx == 200 else None  # gpt-oss's
        got = TreeAttention(tree, ctx, "cpu").attend(q, k, v, scale=0.125, sinks=sinks)  # [1, 9, T, 64]
        for i in range(T):
            path = tree.path(i)
            keys = torch.cat([k[:, :, :ctx], k[:, :, [ctx + j for j in path]]], 2)
            vals = torch.cat([v[:, :, :ctx], v[:, :, [ctx + j for j in path]]], 2)
            want = invariant_attention(
                q[:, :, i : i + 1], keys, vals, None, scale=0.125, sinks=sinks
            )  # the chain's last row
            assert torch.equal(got[:, :, i : i + 1], want), (ctx, i)


# ---- tree verify == each path verified as a chain ----------------------------------------------------------


def _random_tree(rng: random.Random, vocab: int) -> Tree:
    n = rng.randint(2, 24)
    return Tree([rng.randrange(3, vocab) for _ in range(n)], [-1] + [rng.randrange(i) for i in range(1, n)])


def _tree_vs_paths(v, forward_tree, trials: int = 6) -> tuple[float, bool]:
    """(max |logit difference|, bit for bit) between a tree verify and each node's path verified as a chain,
    after prompts of random length (past an alignment block and a sliding window)."""
    rng = random.Random(0)
    worst, same = 0.0, True
    for _ in range(trials):
        prompt = [rng.randrange(3, v.vocab_size) for _ in range(rng.randint(5, 90))]
        tree = _random_tree(rng, v.vocab_size)
        v.reset()
        v.forward(prompt)
        got = forward_tree(v, tree)  # [N, V]
        for i in range(len(tree)):
            v.reset()
            v.forward(prompt)
            want = v.forward([tree.tokens[j] for j in tree.path(i)])[-1]
            worst = max(worst, float((want.float() - got[i].float()).abs().max()))
            same = same and torch.equal(want, got[i])
    v.reset()
    return worst, same


def _stub_tree(v: StubVerifier, tree: Tree) -> torch.Tensor:
    return v.forward(tree.tokens, tree=TreeAttention(tree, v.position, "cpu"))


def _hf_tree(v, tree: Tree) -> torch.Tensor:
    return v.forward(tree.tokens, tree=TreeAttention(tree, v.position, v.device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stub_tree_verify_equals_paths_verified_as_chains(dtype):
    v = StubVerifier(dtype=dtype)
    worst, same = _tree_vs_paths(v, _stub_tree)
    assert same if v.batch_invariant else worst < 1e-5, (worst, same)
    if torch.cpu._is_avx512_bf16_supported():  # this CPU kind: bf16 invariant (paired rows), fp32 not
        assert v.batch_invariant == (dtype == torch.bfloat16)


# ---- speculative == autoregressive with trees --------------------------------------------------------------


def _spec_equals_ar(v, prompt: list[int], n: int, *, sampling: SamplingParams | None = None) -> list:
    ar = generate(v, prompt, cfg=DecodeConfig(max_new_tokens=n, block_size=1, sampling=sampling))
    ref = prompt + ar.output_tokens
    steps = []
    start = len(prompt)
    for kind, kw in (
        ("all", {}),
        ("random", {"random_only": True}),
        ("branch", {"wrong_at": (start + 2, start + 9, start + 10, start + 21)}),
    ):
        for nodes in (2, 7, 24):
            d = TreeDrafter(ref, vocab=v.vocab_size, block_size=6, **kw)
            cfg = DecodeConfig(max_new_tokens=n, block_size=6, sampling=sampling, tree=TreeBudget(nodes))
            spec = generate(v, prompt, drafter=d, cfg=cfg)
            assert spec.output_tokens == ar.output_tokens, (kind, nodes)
            # every step that could draft verified a tree within the budget
            assert all(s.tree_nodes <= nodes for s in spec.decode_steps if s.tree_nodes is not None)
            assert sum(s.tree_nodes is None for s in spec.decode_steps) <= 1
            if kind == "all" and nodes >= 6:
                assert all(s.accepted == min(5, s.drafted) for s in spec.decode_steps[:-1])
            steps += [(kind, nodes, s) for s in spec.decode_steps]
    won = [s for kind, nodes, s in steps if kind == "branch" and nodes == 24]
    assert any(s.tree_ranks and 1 in s.tree_ranks for s in won)  # the second branch won in the middle
    return ar.output_tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stub_spec_with_trees_equals_ar(dtype):
    v = StubVerifier(dtype=dtype)
    prompt = v.tokenizer.encode("Trees of drafts, verified in one call. " * 2)
    _spec_equals_ar(v, prompt, 48)
    _spec_equals_ar(v, prompt, 48, sampling=SamplingParams(temperature=0.9, seed=3))  # the match rule


@pytest.mark.hf
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_trees_equal_paths_as_chains_and_spec_equals_ar(tmp_path: Path, family, dtype):
    """A tree verify against each node's path verified as a chain, then speculative decoding with trees
    against AR and transformers' own greedy generate; gemma3's sliding layers (window 16) are passed by
    every prompt but the shortest."""
    pytest.importorskip("transformers")
    from specdec.verifiers.hf import HFVerifier

    v = HFVerifier(FAMILIES[family](tmp_path / family), dtype=dtype)
    worst, same = _tree_vs_paths(v, _hf_tree, trials=4)
    assert same if v.batch_invariant else worst < 1e-5, (worst, same)
    prompt = list(range(3, 33))
    ours = _spec_equals_ar(v, prompt, 40)
    assert ours == runtime_generate(v.model, prompt, 40)  # transformers' own greedy generate
    _spec_equals_ar(v, prompt, 40, sampling=SamplingParams(temperature=1.0, seed=5))


@pytest.mark.hf
def test_hf_sink_models_verify_trees_in_bf16(tmp_path: Path):
    """gpt-oss's attention sinks enter the tree attention as they enter a chain's (`invariant_attention`):
    in bf16, where the HF verifier runs them in its own attention, a tree verify gives each node its path's
    logits bit for bit and trees keep AR's output (sliding windows of 16 passed); in fp32 transformers'
    eager attention runs them and trees are refused (test_hybrid_and_sink_models_refuse_trees)."""
    pytest.importorskip("transformers")
    from specdec.verifiers.hf import HFVerifier

    v = HFVerifier(tiny_gpt_oss(tmp_path / "oss"), dtype=torch.bfloat16)
    if not v.batch_invariant:
        pytest.skip("bf16 verify is not batch-invariant on this CPU")
    assert v.tree_exact
    worst, same = _tree_vs_paths(v, _hf_tree, trials=4)
    assert same, worst
    _spec_equals_ar(v, list(range(3, 33)), 40)


def test_dflash_trees_and_lookup_branches_are_exact(tmp_path: Path):
    from specdec.api import load_drafter

    v = StubVerifier()
    drafter = DFlashDrafter(make_model(stub_cfg()))
    drafter.bind(v)
    prompt = v.tokenizer.encode("def f(x):\n    return x\n\ndef f(x):\n    return x\n\ndef f(")
    base = generate(v, prompt, cfg=DecodeConfig(max_new_tokens=40, block_size=1))
    for d in (drafter, None):
        if d is None:
            drafter.save_pretrained(tmp_path / "d")
            d = load_drafter(f"{tmp_path / 'd'}+lookup", verifier=v, block_size=8)
        cfg = DecodeConfig(max_new_tokens=40, block_size=8, tree=TreeBudget(12))
        spec = generate(v, prompt, drafter=d, cfg=cfg)
        assert spec.output_tokens == base.output_tokens
        nodes = [s.tree_nodes for s in spec.decode_steps if s.tree_nodes is not None]
        assert all(1 <= n <= 12 for n in nodes)
        assert max(nodes) > 8  # branches, not only a chain
    assert d.counts["lookup"] > 0  # lookup's drafts went in as branches


class _MLXRows:
    """An MLX verifier's forward as `_tree_vs_paths` reads it: logits [T, V] as a torch tensor."""

    def __init__(self, v) -> None:
        self.v, self.vocab_size = v, v.vocab_size

    def reset(self) -> None:
        self.v.reset()

    def forward(self, tokens: list[int], tree: TreeAttention | None = None) -> torch.Tensor:
        import mlx.core as mx
        import numpy as np

        logits = self.v._forward(tokens, last_only=False, tree=tree).astype(mx.float32)  # [T, V]
        return torch.from_numpy(np.array(logits))


@pytest.mark.mlx
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mlx_trees_equal_paths_as_chains_and_spec_equals_ar(tmp_path: Path, family, dtype):
    """The MLX verifier: each node at its own position through the layers' RoPE, the tree's mask from
    its caches; bit for bit its paths' logits (mlx-cpu), spec == AR (== mlx_lm's own greedy, fp32)."""
    pytest.importorskip("mlx_lm")
    from parity import mlx_lm_greedy

    from specdec.verifiers.mlx import MLXVerifier

    v = MLXVerifier(FAMILIES[family](tmp_path / family), dtype=dtype)
    assert v.tree_exact  # measured on the model: what `check_tree` asks
    rows = _MLXRows(v)
    worst, same = _tree_vs_paths(
        rows, lambda a, t: a.forward(t.tokens, TreeAttention(t, a.v.position, "cpu")), 3
    )
    assert same, worst
    prompt = list(range(3, 33))
    ours = _spec_equals_ar(v, prompt, 40)
    if dtype == "float32":  # in bf16 mlx_lm's own loop (its prompt step, its caches) rounds otherwise
        assert ours == mlx_lm_greedy(v, prompt, 40)
    _spec_equals_ar(v, prompt, 40, sampling=SamplingParams(temperature=1.0, seed=5))


@pytest.mark.mlx
def test_mlx_sink_models_verify_trees(tmp_path: Path):
    """gpt-oss on the MLX verifier: mlx_lm's attention takes the sinks under the tree's mask from the
    caches (sliding windows of 16 passed); bit for bit its paths' logits, spec == AR == mlx_lm's own
    greedy generation (fp32: mlx-cpu runs its MoE in fp32 only)."""
    pytest.importorskip("mlx_lm")
    from parity import mlx_lm_greedy

    from specdec.verifiers.mlx import MLXVerifier

    v = MLXVerifier(tiny_gpt_oss(tmp_path / "oss"), dtype="float32")
    assert v.tree_exact
    rows = _MLXRows(v)
    worst, same = _tree_vs_paths(
        rows, lambda a, t: a.forward(t.tokens, TreeAttention(t, a.v.position, "cpu")), 3
    )
    assert same, worst
    prompt = list(range(3, 33))
    assert _spec_equals_ar(v, prompt, 40) == mlx_lm_greedy(v, prompt, 40)


# ---- compaction, rollback, reuse ---------------------------------------------------------------------------


@pytest.mark.parametrize("runtime", ["stub", "hf", pytest.param("mlx", marks=pytest.mark.mlx)])
def test_kept_path_then_rollback_and_multi_turn_reuse(tmp_path: Path, runtime):
    """After a tree step the cache holds exactly the accepted path: a stop string that cuts inside the
    step rolls it back, and a second turn reusing the cache equals a fresh decode (gemma3 past its window)."""
    if runtime == "hf":
        pytest.importorskip("transformers")
        from specdec.verifiers.hf import HFVerifier

        v = HFVerifier(tiny_gemma3(tmp_path / "g"), dtype=torch.bfloat16)
        prompts = [list(range(3, 30)), [*range(3, 30), 5, 6, 7]]
    elif runtime == "mlx":
        pytest.importorskip("mlx_lm")
        from specdec.verifiers.mlx import MLXVerifier

        v = MLXVerifier(tiny_gemma3(tmp_path / "g"), dtype="bfloat16")
        prompts = [list(range(3, 30)), [*range(3, 30), 5, 6, 7]]
    else:
        v = StubVerifier()
        prompts = [v.tokenizer.encode("Hello, trees. "), v.tokenizer.encode("Hello, trees. And again: ")]
    ar = [generate(v, p, cfg=DecodeConfig(max_new_tokens=30, block_size=1)).output_tokens for p in prompts]
    d = TreeDrafter(prompts[0] + ar[0], vocab=v.vocab_size, block_size=6, wrong_at=(len(prompts[0]) + 3,))
    # the second turn's prompt starts with the first turn's prompt and output
    second = prompts[0] + ar[0][:-1] + [7, 8]
    want = generate(v, second, cfg=DecodeConfig(max_new_tokens=20, block_size=1)).output_tokens
    engine = StreamingEngine(
        v, d, block_size=6, tree=TreeBudget(9)
    )  # from here on the engine's verifier alone
    first = engine.complete(prompts[0], max_tokens=30)
    assert first.output_tokens == ar[0]
    got = engine.complete(second, max_tokens=20)
    assert got.output_tokens == want and got.reused_tokens > len(prompts[0])
    if runtime == "stub":  # a stop string inside a tree step: the kept path is rolled back to it
        text = v.tokenizer.decode(ar[1])
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        cut = engine.complete(prompts[1], max_tokens=30, stop=stop)
        assert cut.finish_reason == "stop" and text.startswith(cut.text)
        again = engine.complete(prompts[1], max_tokens=30)
        assert again.output_tokens == ar[1]


def test_chat_session_with_trees_equals_fresh_decodes():
    v, ref = StubVerifier(), StubVerifier()  # the same model; the references run on the second
    d = TreeDrafter([], vocab=v.vocab_size, block_size=6, random_only=True)
    session = ChatSession(StreamingEngine(v, d, block_size=6, tree=TreeBudget(6)))
    for turn, msg in enumerate(("Hi", "And then?")):
        ids = session.prompt_ids(msg)
        want = generate(ref, ids, cfg=DecodeConfig(max_new_tokens=24, block_size=1)).output_tokens
        stream = session.send(msg, max_tokens=24)
        stream.text()
        assert stream.result.output_tokens == want
        assert (stream.result.reused_tokens > 0) == (turn > 0)


# ---- T > 0: the match rule over trees keeps the distribution -----------------------------------------------


class TreeModelDrafter(ModelDrafter):
    """test_sampling's drafter (a second stub model's rolled next-token logits per position) as trees."""

    def propose_tree(self, last_token: int, depth: int, budget: TreeBudget) -> Tree:
        return best_first(last_token, self.propose_logits(last_token, depth), budget)


def _tree_joint(v: StubVerifier, sp: SamplingParams) -> Counter:
    drafter, counts = TreeModelDrafter(), Counter()
    for seed in range(N_SAMPLES):
        cfg = DecodeConfig(max_new_tokens=3, block_size=4, stop_token_ids=frozenset(), tree=TreeBudget(6),
                           sampling=SamplingParams(**{**sp.__dict__, "seed": seed}))  # fmt: skip
        counts[tuple(generate(v, PROMPT, drafter=drafter, cfg=cfg).output_tokens)] += 1
    return counts


@pytest.fixture(scope="module")
def small() -> StubVerifier:
    cfg = StubConfig(vocab_size=6, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32,
                     max_context=64, logit_scale=1.5)  # fmt: skip
    return StubVerifier(cfg)


def test_tree_match_rule_distribution_is_exact(small):
    sp = SamplingParams(temperature=1.0)
    stat, df = chi2_stat(_tree_joint(small, sp), exact_joint(small, sp), N_SAMPLES)
    assert stat < chi2_threshold(df, ALPHA), (stat, df)


def test_a_broken_tree_rule_fails_the_same_test(small, monkeypatch):
    """Every node sampled with the uniform of the step's first position (the depth index forgotten): the
    tokens of a step become dependent. Caught."""

    def broken(self, logits, depths, pos):
        p = warp(logits, self.sp)
        return sample_from(p, self.u(0, pos, 1, p).expand(len(depths))).tolist()

    monkeypatch.setattr(Sampler, "verify_tree", broken)
    sp = SamplingParams(temperature=1.0)
    stat, df = chi2_stat(_tree_joint(small, sp), exact_joint(small, sp), N_SAMPLES)
    assert stat > chi2_threshold(df, ALPHA), (stat, df)


# ---- refusals ----------------------------------------------------------------------------------------------


def test_trees_are_refused_where_they_cannot_run(tmp_path: Path, capsys):
    from specdec.api import RunSpec
    from specdec.drafting.load import check_drafter
    from specdec.drafting.lookup.prompt import PromptLookupDrafter

    v = StubVerifier()
    prompt = [1, 2, 3]
    tree = TreeBudget(4)
    with pytest.raises(ValueError, match="cannot propose trees"):
        generate(v, prompt, drafter=PromptLookupDrafter(), cfg=DecodeConfig(block_size=4, tree=tree))
    d = TreeDrafter([], vocab=v.vocab_size, block_size=6)
    for sp, match in (
        (SamplingParams(temperature=1.0, rule="rejection"), "rule rejection needs a chain"),
        (SamplingParams(temperature=1.0, proposal="sample"), "proposal sample needs a chain"),
    ):
        with pytest.raises(ValueError, match=match):
            generate(v, prompt, drafter=d, cfg=DecodeConfig(block_size=4, tree=tree, sampling=sp))
    for kw, match in (
        ({"drafter": "prompt-lookup"}, "needs a DFlash or EAGLE-3 drafter"),
        ({"drafter": "model:smollm2-135m"}, "needs a DFlash or EAGLE-3 drafter"),
        ({"tree": 1}, r"node count 2\.\.64"),
        ({"tree": 65}, r"node count 2\.\.64"),
    ):
        spec = RunSpec(**{"drafter": "x", "tree": 4, **kw})
        with pytest.raises(ValueError, match=match):
            spec._check_tree(check_drafter(kw.get("drafter", "none")))  # the node count is checked first
    # on the command line (a server too: its requests would all be refused), before anything loads
    from specdec.cli import main

    for flags in (["--rule", "rejection"], ["--proposal", "sample"]):
        argv = ["generate", "--verifier", "stub", "--drafter", "x", "--tree", "4", "--prompt", "hi", *flags]
        assert main(argv) == 2 and "--tree verifies with --rule match" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("runtime", "make", "why"),
    [
        pytest.param("hf", tiny_qwen3_5, "Gated DeltaNet", marks=pytest.mark.hf),
        pytest.param("mlx", tiny_qwen3_5, "Gated DeltaNet", marks=pytest.mark.mlx),
        # fp32: transformers' eager attention runs the sinks (bf16: test_hf_sink_models_verify_trees_in_bf16)
        pytest.param(
            "hf", tiny_gpt_oss, "attention sinks run in transformers' 'eager'", marks=pytest.mark.hf
        ),
    ],
)
def test_hybrid_and_sink_models_refuse_trees(tmp_path: Path, runtime, make, why):
    if runtime == "hf":
        pytest.importorskip("transformers")
        from specdec.verifiers.hf import HFVerifier as Verifier
    else:
        pytest.importorskip("mlx_lm")
        from specdec.verifiers.mlx import MLXVerifier as Verifier

    v = Verifier(make(tmp_path / "m"))
    d = TreeDrafter([], vocab=v.vocab_size, block_size=6)
    with pytest.raises(ValueError, match=why):
        generate(v, [3, 4, 5], drafter=d, cfg=DecodeConfig(block_size=4, tree=TreeBudget(4)))


def test_a_tree_verify_measured_inexact_is_refused():
    """Where a verifier's tree verify does not give its paths' logits bit for bit (measured), trees are
    refused with the reason, before any work."""
    v = StubVerifier(dtype=torch.bfloat16)
    v.tree_exact = False  # what the measurement would say on such a machine
    d = TreeDrafter([], vocab=v.vocab_size, block_size=6)
    with pytest.raises(ValueError, match=r"cannot verify trees: .* bit for bit here \(measured\)"):
        generate(v, [3, 4, 5], drafter=d, cfg=DecodeConfig(block_size=4, tree=TreeBudget(4)))


def test_tree_auto_prices_nodes_by_tree_verifies_timed_at_load(tmp_path: Path):
    from specdec.api import RunSpec, load
    from specdec.tree import TREE_AUTO_NODES

    DFlashDrafter(make_model(stub_cfg())).save_pretrained(tmp_path / "d")
    lines: list[str] = []
    m = load(RunSpec(drafter=f"{tmp_path / 'd'}+lookup", tree="auto"), log=lines.append)
    assert m.tree is not None and m.tree.nodes == TREE_AUTO_NODES and m.tree.costs is not None
    assert any("measured tree verifies" in line for line in lines)
    prompt = m.verifier.tokenizer.encode("auto trees, auto trees, auto")
    base = generate(m.verifier, prompt, cfg=DecodeConfig(max_new_tokens=24, block_size=1)).output_tokens
    cfg = DecodeConfig(max_new_tokens=24, block_size=m.block_size, tree=m.tree)
    assert generate(m.verifier, prompt, drafter=m.drafter, cfg=cfg).output_tokens == base
    fixed = load(RunSpec(drafter=str(tmp_path / "d"), tree=6), log=lines.append)
    assert fixed.tree == TreeBudget(6)


@pytest.mark.slow
def test_real_smollm2_trees_in_bf16_equal_ar():
    """SmolLM2-135M bf16 with its bundled drafter, trees of 8: the output equals AR token for token on the
    prompt where trees in a layout shared by all nodes first diverged (HumanEval/11, at its 65th token)."""
    pytest.importorskip("transformers")
    from specdec.api import RunSpec, load
    from specdec.chat import encode_prompt
    from specdec.evals.datasets import load_dataset

    m = load(RunSpec(verifier="hf", model="smollm2-135m", dtype="bfloat16", drafter="bundled:smollm2-135m",
                     tree=8), log=lambda line: None)  # fmt: skip
    if not exact_or_measured_not(m.verifier):  # where bf16 cannot be exact here, measured by the test too
        return
    assert m.verifier.tree_exact
    (rec,) = [r for r in load_dataset("humaneval", 12) if r.id.endswith("/11")]
    ids = encode_prompt(m.verifier, rec.messages)
    ar = generate(m.verifier, ids, cfg=DecodeConfig(max_new_tokens=96, block_size=1)).output_tokens
    cfg = DecodeConfig(max_new_tokens=96, block_size=m.block_size, tree=m.tree)
    spec = generate(m.verifier, ids, drafter=m.drafter, cfg=cfg)
    assert spec.output_tokens == ar
    assert any(s.tree_ranks and any(r > 0 for r in s.tree_ranks) for s in spec.decode_steps)


@pytest.mark.hf
def test_a_model_running_its_own_attention_refuses_trees(tmp_path: Path):
    """`onednn=False` leaves the model exactly as loaded (transformers' attention, not ours): no tree mask
    can reach it, so trees are refused with the reason."""
    pytest.importorskip("transformers")
    from specdec.verifiers.hf import HFVerifier

    v = HFVerifier(tiny_llama(tmp_path / "l"), onednn=False)
    d = TreeDrafter([], vocab=v.vocab_size, block_size=6)
    with pytest.raises(ValueError, match=r"attention \(trees need sdpa\)"):
        generate(v, [3, 4, 5], drafter=d, cfg=DecodeConfig(block_size=4, tree=TreeBudget(4)))


@pytest.mark.hf
def test_tree_exactness_is_measured_on_first_use_and_leaves_a_run_alone(tmp_path: Path):
    """`HFVerifier.tree_exact` is measured when a tree is first asked for, not at load (most runs verify
    chains), and the probe's resets happen aside: a run paused before it (its cache, position and
    captured states) goes on to AR's output as if nothing ran."""
    pytest.importorskip("transformers")
    from specdec.verifiers.hf import HFVerifier

    v = HFVerifier(tiny_llama(tmp_path / "m"), dtype=torch.bfloat16)
    assert v._tree_exact is None  # not measured at load
    prompt = list(range(3, 40))
    want = generate(v, prompt, cfg=DecodeConfig(max_new_tokens=16, block_size=1)).output_tokens
    v.reset()
    v.set_target_layers([0, 1])
    out = [v.prefill(prompt)]
    out += v.verify([out[-1]])
    feats = lambda: v.features(1, device=torch.device("cpu"), dtype=torch.float32)  # noqa: E731  [1, 2*H]
    captured, pos = feats(), v.position
    assert v.tree_exact == v.batch_invariant  # measured now (bf16 here: exact where invariant)
    assert v._tree_exact is not None and v.position == pos
    assert torch.equal(feats(), captured)
    while len(out) < len(want):
        out += v.verify([out[-1]])
    assert out == want
    assert feats().shape[-1] == 2 * v.hidden_size  # the target layers' hooks are back
