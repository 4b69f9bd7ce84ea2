"""Gemma-4 assistant drafters (`drafting.gemma4_assistant`) on tiny random Gemma 4 targets (dense
E2B-like with KV-shared layers, MoE 26B-like with K=V full layers) and tiny random assistants (dense and
centroid-sparse heads), fp32, sliding windows far shorter than the contexts. Drafts and logits equal
transformers 5.25's `SinglePositionMultiTokenCandidateGenerator` (Google's code path) recomputed from the
committed tokens at every step, through scripted accept-all / none / partial steps and rollbacks and
through real decoding; output equals transformers' own greedy generation; T > 0 seeded match; multi-turn
reuse with edited history; the centroid head equals the dense head where its centroids hold the argmax;
misfits are one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
import parity
import tinymodels
from drafters import assert_turns_equal_fresh_runs, scripted_steps

from specdec.api import load_drafter
from specdec.drafting.gemma4_assistant.torch import AssistantDrafter
from specdec.engine import DecodeConfig, generate
from specdec.sampling import SamplingParams
from specdec.verifiers.hf import HFVerifier

W = 8  # the sliding window: contexts pass it several times
PROMPT = [(7 * i) % 250 + 5 for i in range(30)]
KINDS = {"dense": dict(), "ordered": dict(ordered=True), "moe": dict(moe=True),
         "unified": dict(unified=True, ordered=True)}  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("g4a")
    out = {
        "target": tinymodels.tiny_gemma4(root / "target", sliding_window=W),
        "target-moe": tinymodels.tiny_gemma4(root / "target-moe", sliding_window=W, moe=True),
        "target-unified": tinymodels.tiny_gemma4_unified(root / "target-unified", sliding_window=W),
    }
    for k, kw in KINDS.items():
        out[k] = tinymodels.tiny_gemma4_assistant(root / k, sliding_window=W, seed=1, **kw)
    return out


def target_of(folders, kind: str) -> Path:
    return folders[f"target-{kind}" if kind in ("moe", "unified") else "target"]


def run(v, drafter=None, *, n: int = 24, prompt=PROMPT, sampling=None):
    cfg = DecodeConfig(max_new_tokens=n, block_size=drafter.block_size if drafter else 1,
                       stop_token_ids=frozenset(), sampling=sampling)  # fmt: skip
    return generate(v, prompt, drafter=drafter, cfg=cfg)


def transformers_candidates(target: torch.nn.Module, folder: Path):
    """`ref(tokens, last, k) -> (drafts, logits [k, V])`: transformers' own candidate generator for the
    assistant in `folder`, handed the target's outputs of a fresh forward over the committed `tokens`
    (what its loop hands it after a prefill)."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator

    assistant = AutoModelForCausalLM.from_pretrained(folder).eval()  # gemma4_(unified_)assistant

    @torch.no_grad()
    def ref(tokens, last, k):
        assistant.generation_config.num_assistant_tokens = k
        gen = SinglePositionMultiTokenCandidateGenerator(
            assistant, target.get_input_embeddings(), GenerationConfig(max_length=10_000)
        )
        ids = torch.tensor([[*tokens, last]])
        out = target(input_ids=ids[:, :-1], output_hidden_states=True, return_shared_kv_states=True)
        cand, logits = gen.get_candidates(ids, model_kwargs={}, model_outputs=out, is_first_iteration=False,
                                          n_last_matches=0)  # fmt: skip
        return cand[0, ids.shape[1] :].tolist(), logits[0]

    return ref


def our_logits(drafter: AssistantDrafter, last: int, k: int) -> torch.Tensor:
    """The greedy walk's logits [k, V], a centroid head's filled as transformers fills them (the row's
    least selected logit - 1 outside its centroids)."""
    rows = []

    def pick(logits, ids, i):
        row = logits[0].float()
        if ids is not None:
            row = row.new_full((drafter.vocab_size,), float(row.min()) - 1.0).index_copy_(0, ids, row)
        rows.append(row)
        return logits.argmax(-1)

    drafter._walk(last, k, pick)
    return torch.stack(rows)


@pytest.mark.parametrize("kind", list(KINDS))
def test_drafts_equal_transformers_candidate_generator(folders, kind):
    v = HFVerifier(target_of(folders, kind))
    d = load_drafter(str(folders[kind]), verifier=v)
    assert isinstance(d, AssistantDrafter) and d.target_layer_ids == (5,)
    assert d._sources == ({"full_attention": 5, "sliding_attention": 4} if kind == "moe"
                          else {"full_attention": 2, "sliding_attention": 3})  # fmt: skip
    ref = transformers_candidates(v.model, folders[kind])
    # atol: each step feeds the last one's output back, which grows the ~1e-6 difference of K/V cached by
    # verifies from those of the reference's fresh forward to ~2e-4 by the fourth draft
    steps = scripted_steps(d, v, lambda tokens, feats, last, k: ref(tokens, last, k), prompt=PROMPT,
                           logits=our_logits, atol=1e-3)  # fmt: skip
    assert len(steps) == 9


def checked(cls: type) -> type:
    """`cls` checking every proposal of a real decode against transformers' candidates for the committed
    tokens (followed through extend / rollback), then steering the verify: the first `ACCEPT[i]` drafts
    replaced by the greedy continuation (`oracle`) and the rest made wrong, so the verifier rolls back
    0..k positions in turn, sliding layers cropped after each."""

    class Checked(cls):
        def reset(self) -> None:
            super().reset()
            self.tokens: list[int] = []
            self.checked = 0

        def extend(self, features, tokens) -> None:
            super().extend(features, tokens)
            self.tokens += list(tokens)

        def rollback(self, n: int) -> None:
            super().rollback(n)
            del self.tokens[len(self.tokens) - n :]

        def propose(self, last_token: int, n: int) -> list[int]:
            got = super().propose(last_token, n)
            assert got == self.ref(self.tokens, last_token, n)[0], len(self.tokens)
            a = min(ACCEPT[self.checked % len(ACCEPT)], len(got))
            self.checked += 1
            true = self.oracle[len(self.tokens) + 1 : len(self.tokens) + 1 + len(got)]
            return true[:a] + [(t + 1) % 300 for t in true[a:]]

    return Checked


ACCEPT = [4, 0, 2, 4, 1, 3, 0]


def check_real_decode(v, d, ref, own: list[int]) -> None:
    d.__class__ = checked(type(d))
    d.ref, d.oracle = ref, [*PROMPT, *own, *([0] * 8)]
    d.reset()
    out = run(v, d, n=40)
    assert out.output_tokens == own
    assert d.checked >= 8 and {s.accepted for s in out.steps if s.phase == "decode"} >= {0, 1, 2, 3, 4}


@pytest.mark.parametrize("kind", list(KINDS))
def test_output_is_transformers_greedy_each_block_its_candidates(folders, kind):
    """Real decoding: every block equals transformers' candidates for what is committed, after verifies
    that roll back 0..k positions; the output is transformers' own greedy generation."""
    v = HFVerifier(target_of(folders, kind))
    d = load_drafter(str(folders[kind]), verifier=v)
    own = parity.runtime_generate(v.model, PROMPT, 40)
    check_real_decode(v, d, transformers_candidates(v.model, folders[kind]), own)


def test_sampled_match_turns_and_lookup(folders):
    v = HFVerifier(folders["target"])
    d = load_drafter(str(folders["ordered"]), verifier=v)
    match = SamplingParams(temperature=0.9, seed=4, rule="match", proposal="sample")
    assert run(v, d, sampling=match).output_tokens == run(v, sampling=match).output_tokens
    own = run(v).output_tokens
    cut = load_drafter(f"{folders['ordered']}+lookup", verifier=v, min_confidence=0.5)
    assert run(v, cut).output_tokens == own
    assert_turns_equal_fresh_runs(v, d, PROMPT, lambda ids: run(v, prompt=ids, n=12).output_tokens)
    assert d.describe()["head"] == "centroid-sparse"


def test_centroid_head_equals_dense_head_where_its_centroids_hold_the_argmax(folders):
    """The same weights read densely (`use_ordered_embeddings` off) give the same argmax wherever the
    chosen centroids hold the dense argmax, and the same logits at the tokens they hold."""
    v = HFVerifier(folders["target"])
    sparse = load_drafter(str(folders["ordered"]), verifier=v)
    dense = load_drafter(str(folders["ordered"]), verifier=v)
    dense.cfg = type(dense.cfg)(**{**dense.cfg.__dict__, "ordered": False})
    v.set_target_layers(sparse.target_layer_ids)
    v.prefill(PROMPT)
    feats = v.features(len(PROMPT), device=torch.device("cpu"), dtype=torch.float32)
    held = 0
    for d in (sparse, dense):
        d.reset()
        d.extend(feats, PROMPT)
    for last in range(5, 300, 3):
        got = []
        for d in (sparse, dense):
            d._walk(last, 1, lambda lg, ids, i: got.append((lg[0], ids)) or lg.argmax(-1))  # noqa: B023
        (ls, ids), (ld, _) = got
        torch.testing.assert_close(ls, ld[ids])
        if int(ld.argmax()) in ids.tolist():
            held += 1
            assert int(ids[ls.argmax()]) == int(ld.argmax())
    assert held >= 10


def test_refusals(folders, tmp_path):
    from specdec.drafting.load import check_drafter, check_drafter_fits
    from specdec.models import model_shape

    plan = check_drafter(str(folders["dense"]))
    check_drafter_fits(plan, model_shape("hf", str(folders["target"])))
    llama = tinymodels.tiny_llama(tmp_path / "llama")
    with pytest.raises(ValueError, match="a Gemma-4 assistant; llama is a 'llama' model"):
        load_drafter(str(folders["dense"]), verifier=HFVerifier(llama))
    with pytest.raises(ValueError, match=r"full_attention layers read K/V of \(1, 32\).*has \(2, 32\)"):
        load_drafter(str(folders["dense"]), verifier=HFVerifier(folders["target-moe"]))
    wide = tinymodels.tiny_qwen3(tmp_path / "qwen3")
    with pytest.raises(ValueError, match="Gemma-4 assistant; qwen3 is a 'qwen3' model"):
        load_drafter(str(folders["dense"]), verifier=HFVerifier(wide))


@pytest.mark.slow
@pytest.mark.parametrize("broken", [False, True], ids=["walk", "broken-walk"])
def test_sampled_walk_with_rejection_keeps_the_verifiers_distribution(tmp_path, monkeypatch, broken):
    """Chi-square of the first three tokens against the exact distribution (tests/test_sampling.py's
    harness) on a Gemma 4 of the harness's vocabulary, drafts sampled from the centroid-sparse assistant's
    walk and verified by `rejection`. Negative control: q rows shifted by one token must fail."""
    from test_sampling import N_WALK_EVEN, check_walk_distribution
    from test_sampling import V as SV

    t = tinymodels.tiny_gemma4(tmp_path / "t", sliding_window=2, vocab=SV)
    a = tinymodels.tiny_gemma4_assistant(
        tmp_path / "a", sliding_window=2, vocab=SV, ordered=True, centroids=3
    )
    v = HFVerifier(t)
    d = load_drafter(str(a), verifier=v)
    check_walk_distribution(v, d, AssistantDrafter, monkeypatch, broken=broken, n=N_WALK_EVEN)


# ---- the MLX drafter beside the MLX verifier ------------------------------------------------------------


def mlx_logits(drafter, last: int, k: int) -> torch.Tensor:
    """`our_logits` of the MLX drafter."""
    import mlx.core as mx
    import numpy as np

    picked, rows = [], []

    def pick(logits, ids, i):
        picked.append((logits[0], ids))
        return mx.argmax(logits, axis=-1)

    drafter._walk(last, k, pick)
    for logits, ids in picked:
        row = torch.tensor(np.array(logits))
        if ids is not None:
            at = torch.tensor(np.array(ids)).long()
            row = row.new_full((drafter.vocab_size,), float(row.min()) - 1.0).index_copy_(0, at, row)
        rows.append(row)
    return torch.stack(rows)


@pytest.mark.parametrize("kind", list(KINDS))
def test_mlx_drafts_equal_transformers_candidate_generator(folders, kind):
    """The MLX drafter on the MLX verifier's own K/V and hidden states: transformers' candidates, logits
    to 1e-3, through the scripted steps and rollbacks."""
    pytest.importorskip("mlx_lm")
    from specdec.drafting.gemma4_assistant.mlx import MLXAssistantDrafter
    from specdec.verifiers.mlx import MLXVerifier

    v = MLXVerifier(target_of(folders, kind))
    d = load_drafter(str(folders[kind]), verifier=v, runtime="mlx")
    assert isinstance(d, MLXAssistantDrafter) and d.runtime == "mlx"
    ref = transformers_candidates(HFVerifier(target_of(folders, kind)).model, folders[kind])
    steps = scripted_steps(d, v, lambda tokens, feats, last, k: ref(tokens, last, k), prompt=PROMPT,
                           logits=mlx_logits, atol=1e-3)  # fmt: skip
    assert len(steps) == 9


def test_mlx_output_is_mlx_lms_own_greedy_each_block_its_candidates_and_turns(folders):
    pytest.importorskip("mlx_lm")
    from specdec.verifiers.mlx import MLXVerifier

    v = MLXVerifier(folders["target"])
    d = load_drafter(str(folders["ordered"]), verifier=v, runtime="mlx")
    ref = transformers_candidates(HFVerifier(folders["target"]).model, folders["ordered"])
    check_real_decode(v, d, ref, parity.mlx_lm_greedy(v, PROMPT, 40))
    d = load_drafter(str(folders["ordered"]), verifier=v, runtime="mlx")
    match = SamplingParams(temperature=0.9, seed=4, rule="match", proposal="sample")
    assert run(v, d, sampling=match).output_tokens == run(v, sampling=match).output_tokens
    assert_turns_equal_fresh_runs(v, d, PROMPT, lambda ids: run(v, prompt=ids, n=12).output_tokens)
    with pytest.raises(ValueError, match="runs in PyTorch beside the HF verifier and in MLX"):
        load_drafter(str(folders["ordered"]), verifier=v)


def test_kv_shapes_in_both_config_forms():
    """Released configs name the full layers' K/V shape at the top (`global_head_dim`, with K = V
    `num_global_key_value_heads`); transformers 5.25 writes per-layer overrides, keyed by the index
    zero-padded to the widest one."""
    from specdec.drafting.gemma4_assistant.config import gemma4_text, kv_shape, kv_source_layers

    types = (["sliding_attention"] * 5 + ["full_attention"]) * 2
    released = {"layer_types": types, "num_key_value_heads": 1, "head_dim": 256, "global_head_dim": 512,
                "attention_k_eq_v": True, "num_global_key_value_heads": 4,
                "num_kv_shared_layers": 4}  # fmt: skip
    padded = {"05": {"head_dim": 512, "num_key_value_heads": 4}, "11": {"head_dim": 512}}
    saved = {"layer_types": types, "num_key_value_heads": 1, "head_dim": 256, "num_kv_shared_layers": 4,
             "per_layer_config": padded}  # fmt: skip
    for text in (released, saved):
        assert kv_source_layers(text) == {"full_attention": 5, "sliding_attention": 7}
        assert (kv_shape(text, 5), kv_shape(text, 7)) == ((4, 512), (1, 256))
    # fields left out take transformers' defaults, layer_types its five-to-one pattern
    bare = gemma4_text({"num_hidden_layers": 12, "num_kv_shared_layers": 4, "layer_types": None})
    assert bare["layer_types"] == types and kv_shape(bare, 5) == (4, 256) and bare["sliding_window"] == 512


def test_cost_benchmark_runs(tmp_path, capsys):
    """`python -m specdec.evals.assistant_cost` (docs/drafters.md), on the tiny shape."""
    import json

    from specdec.evals.assistant_cost import main

    out = tmp_path / "cost.json"
    args = ["--sizes", "tiny", "--runtimes", "hf", "--reps", "3", "--context", "40", "--out", str(out)]
    assert main(args) == 0
    hf = json.loads(out.read_text())["sizes"]["tiny"]["hf"]
    assert hf["assistant_ms"]["7"] > hf["assistant_ms"]["1"] > 0 and hf["handover_ms"] >= 0


def test_broken_assistant_checkpoints_are_one_line_before_anything_loads(folders, tmp_path):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from specdec.drafting.load import check_drafter

    def broken(name: str, edit_config=None, edit_weights=None) -> str:
        folder = tmp_path / name
        shutil.copytree(folders["ordered"], folder)
        if edit_config:
            cfg = json.loads((folder / "config.json").read_text())
            edit_config(cfg)
            (folder / "config.json").write_text(json.dumps(cfg))
        if edit_weights:
            sd = load_file(str(folder / "model.safetensors"))
            edit_weights(sd)
            save_file(sd, str(folder / "model.safetensors"))
        return str(folder)

    def narrow(sd):
        sd["pre_projection.weight"] = sd["pre_projection.weight"][:, :64].contiguous()

    cases = [
        (broken("a", lambda c: c.pop("text_config")), "config.json has no text_config"),
        (broken("b", lambda c: c["text_config"].update(num_kv_shared_layers=1)), "every layer must"),
        (broken("c", lambda c: c.update(num_centroids=7)), "7 centroids, top 4, do not split"),
        (broken("d", None, lambda sd: sd.pop("post_projection.weight")), "lacks post_projection"),
        (broken("e", None, narrow), r"has \[32, 64\] for pre_projection.weight \[32, 128\]"),
    ]
    for folder, says in cases:
        with pytest.raises(ValueError, match=says):
            check_drafter(folder)
    cut = broken("f")
    data = (Path(cut) / "model.safetensors").read_bytes()
    (Path(cut) / "model.safetensors").write_bytes(data[: len(data) // 3])
    with pytest.raises(ValueError, match="truncated or not safetensors"):
        check_drafter(cut)


@pytest.mark.parametrize("rt", ["hf", pytest.param("mlx", marks=pytest.mark.mlx)])
def test_shared_kv_refusals_are_one_line(folders, rt):
    """`SharedKV` where it has nothing to hand over: nothing cached yet, a KV-shared layer (no keys of its
    own), a sliding layer asked for more positions than it keeps (HF, without `keep_window`), a rotating
    window (MLX: a cache kind the verifier only keeps for architectures it does not widen)."""
    if rt == "hf":
        v = HFVerifier(folders["target"])
    else:
        pytest.importorskip("mlx_lm")
        from specdec.verifiers.mlx import MLXVerifier

        v = MLXVerifier(folders["target"])
    with pytest.raises(ValueError, match=r"layer 0 of .* holds no keys"):
        v.shared_kv(0)
    v.prefill(list(PROMPT) * 4)  # past the sliding window
    assert v.shared_kv(0)[0].shape[-2] > 0  # a sliding layer holds keys now
    with pytest.raises(ValueError, match=rf"layer {v.num_layers - 1} of .* holds no keys"):
        v.shared_kv(v.num_layers - 1)  # the last layers are KV-shared
    if rt == "hf":  # a rollback crops a sliding layer to its window (transformers' own crop)

        def crop() -> None:
            v.reset()
            v.prefill(list(PROMPT) * 4)
            v.verify([5, 6, 7])
            v.rollback(2)

        crop()
        with pytest.raises(ValueError, match=r"layer 0 holds \d+ positions, \d+ asked \(keep_window\)"):
            v.shared_kv(0, last=W + 4)
        v.keep_window(W + 4)
        crop()
        assert v.shared_kv(0, last=W + 4)[0].shape[-2] == W + 4  # kept once asked
    else:
        from mlx_lm.models.cache import RotatingKVCache

        v._cache[0] = RotatingKVCache(max_size=W)  # as mlx_lm makes it for unwidened architectures
        with pytest.raises(ValueError, match="sliding layers keep a rotating window; none is handed over"):
            v.keep_window(W + 1)


@pytest.mark.slow
@pytest.mark.mlx
@pytest.mark.parametrize("broken", [False, True], ids=["walk", "broken-walk"])
def test_mlx_sampled_walk_with_rejection_keeps_the_verifiers_distribution(tmp_path, monkeypatch, broken):
    """The chi-square above with the MLX assistant beside the MLX verifier; the exact distribution is
    transformers' fp32 forward of the same checkpoint (enumerated). Negative control: shifted q rows."""
    pytest.importorskip("mlx_lm")
    from test_sampling import N_WALK_EVEN, check_walk_distribution
    from test_sampling import V as SV

    from specdec.drafting.gemma4_assistant.mlx import MLXAssistantDrafter
    from specdec.verifiers.mlx import MLXVerifier

    t = tinymodels.tiny_gemma4(tmp_path / "t", sliding_window=2, vocab=SV)
    a = tinymodels.tiny_gemma4_assistant(
        tmp_path / "a", sliding_window=2, vocab=SV, ordered=True, centroids=3
    )
    v = MLXVerifier(t)
    d = load_drafter(str(a), verifier=v, runtime="mlx")
    assert isinstance(d, MLXAssistantDrafter)
    check_walk_distribution(
        v, d, MLXAssistantDrafter, monkeypatch, broken=broken, reference=HFVerifier(t), n=N_WALK_EVEN
    )


def test_mlx_vlm_peer_runs_the_assistant_and_stays_greedy(tmp_path):
    """`specdec eval`'s mlx-vlm peer beside the MLX verifier with an assistant, on a vision-language Gemma 4
    checkpoint: mlx-vlm 0.7.10's own speculative output is the greedy one here (no recurrent layers;
    compare tests/test_mtp.py's Qwen3.5, where it parts from it). mlx-vlm reads the full layers' head size
    from `global_head_dim`, as released configs carry it (transformers 5.25 writes per-layer overrides)."""
    pytest.importorskip("mlx_vlm")
    import json

    from specdec.evals.peers import VLM, peer_runners
    from specdec.verifiers.mlx import MLXVerifier

    text = tinymodels.tiny_gemma4(tmp_path / "text", sliding_window=W)
    folders = (
        tinymodels.with_vision(tmp_path / "target", text),
        tinymodels.tiny_gemma4_assistant(tmp_path / "a", sliding_window=W, seed=1),
    )
    for f in folders:
        cfg = json.loads((f / "config.json").read_text())
        cfg["text_config"]["global_head_dim"] = 32
        (f / "config.json").write_text(json.dumps(cfg))
    v = MLXVerifier(tinymodels.tiny_tokenizer(folders[0]))
    d = load_drafter(str(folders[1]), verifier=v, runtime="mlx")
    runners, notes = peer_runners(v, DecodeConfig(max_new_tokens=32, block_size=d.block_size,
                                                  stop_token_ids=frozenset()), d)  # fmt: skip
    assert "(mtp), greedy" in notes[VLM], notes  # mlx-vlm runs assistants as its kind "mtp"
    got = runners[VLM](PROMPT)
    assert got["output_tokens"] == parity.mlx_lm_greedy(v, PROMPT, 32) == run(v, d, n=32).output_tokens
    assert got["n_steps"] > 0
