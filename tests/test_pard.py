"""PARD parallel draft models (`--drafter model:<PARD folder>`, `ModelDrafter(mask_token_id=...)`): a block
of K drafts in one forward of [last, MASK x (K-1)], equal to the reference (K full forwards of the same
model from an empty cache, the i-th with i masks appended), through accepted, rejected and rolled-back
steps; output equal to the runtime's own greedy generation on the HF and MLX verifiers; T > 0 seeded
match; a PARD folder given as a drafter checkpoint is pointed at `model:`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdec.api import load_drafter
from specdec.drafting.draft_model.drafter import ModelDrafter
from specdec.drafting.load import check_drafter
from specdec.engine import DecodeConfig, generate
from specdec.sampling import SamplingParams
from specdec.verifiers.stub import StubConfig, StubVerifier

PROMPT = [(11 * i) % 250 + 3 for i in range(30)]


def reference(make, context: list[int], last: int, n: int, mask: int) -> list[int]:
    """The n drafts after `last`: draft i is the argmax after [context, last, MASK x i], each from a fresh
    model (no cache), restricted to the ids both sides have."""
    out = []
    for i in range(n):
        m = make()
        m.set_target_layers(())
        out.append(m.prefill([*context, last, *[mask] * i]))
    return out


class Checked(ModelDrafter):
    """A PARD drafter whose every proposal is checked against `reference` on the committed context."""

    def setup(self, make) -> None:
        self.make, self.checked = make, 0

    def propose(self, last_token: int, n: int) -> list[int]:
        got = super().propose(last_token, n)
        assert got == reference(self.make, list(self._tokens), last_token, n, self.mask_token_id)
        self.checked += 1
        return got


def _run(v, drafter=None, *, n: int = 24, block: int = 5, sampling=None, prompt=PROMPT):
    cfg = DecodeConfig(max_new_tokens=n, block_size=block if drafter else 1, stop_token_ids=frozenset(),
                       sampling=sampling)  # fmt: skip
    return generate(v, prompt, drafter=drafter, cfg=cfg)


def test_stub_pard_drafts_equal_the_reference_and_output_equals_ar():
    small = StubConfig(
        vocab_size=259, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=3
    )
    v = StubVerifier()

    def make():
        return StubVerifier(small)

    d = Checked(make(), mask_token_id=258, block_size=5)
    d.setup(make)
    d.bind(v)
    res = _run(v, d)
    assert res.output_tokens == _run(v).output_tokens and d.checked >= len(res.decode_steps) - 1
    # the same model as verifier and PARD drafter: draft 1 is always the verifier's own next token
    same = Checked(make(), mask_token_id=258, block_size=5)
    same.setup(make)
    vs = make()
    same.bind(vs)
    res = _run(vs, same)
    assert res.output_tokens == _run(vs).output_tokens
    assert all(s.accepted >= 1 for s in res.decode_steps[:-1]), [s.accepted for s in res.decode_steps]
    match = SamplingParams(temperature=0.8, seed=2, rule="match", proposal="sample")
    assert _run(v, d, sampling=match).output_tokens == _run(v, sampling=match).output_tokens
    rej = SamplingParams(temperature=0.8, seed=2, rule="rejection", proposal="sample")
    assert len(_run(v, d, sampling=rej).output_tokens) == 24


transformers = pytest.importorskip("transformers")
import parity  # noqa: E402
import tinymodels  # noqa: E402

from specdec.verifiers.hf import HFVerifier  # noqa: E402


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Qwen3 target and a PARD model of its tokenizer (another seed, `pard_token` in its config)."""
    root = tmp_path_factory.mktemp("pard")
    target = tinymodels.tiny_tokenizer(tinymodels.tiny_qwen3(root / "target"))
    pard = tinymodels.tiny_tokenizer(tinymodels.tiny_qwen3(root / "pard", seed=1))
    raw = json.loads((pard / "config.json").read_text())
    (pard / "config.json").write_text(json.dumps({**raw, "pard_token": 319}))
    return target, pard


@pytest.mark.parametrize("rt", ["hf", "mlx"])
def test_pard_on_the_real_runtimes(folders, rt):
    target, pard = folders
    if rt == "mlx":
        pytest.importorskip("mlx_lm")
        from specdec.verifiers.mlx import MLXVerifier

        v, make = MLXVerifier(target), lambda: MLXVerifier(pard)
        own = parity.mlx_lm_greedy(v, PROMPT, 24)
    else:
        v, make = HFVerifier(target), lambda: HFVerifier(pard)
        own = parity.runtime_generate(v.model, PROMPT, 24)
    d = load_drafter(f"model:{pard}", verifier=v, runtime="mlx" if rt == "mlx" else "torch", block_size=5)
    assert isinstance(d, ModelDrafter) and d.mask_token_id == 319 and not d.walks
    assert d.describe()["draft_model"]["parallel_mask_token_id"] == 319
    checked = Checked(d.draft, mask_token_id=319, block_size=5)
    checked.setup(make)
    checked.bind(v)
    res = _run(v, checked)
    assert res.output_tokens == own and checked.checked >= len(res.decode_steps) - 1
    assert checked.restarts == 0


def test_a_pard_folder_as_a_checkpoint_points_at_model(folders):
    _, pard = folders
    with pytest.raises(ValueError, match=r"a PARD parallel draft model.*pass --drafter model:"):
        check_drafter(str(pard))
