"""Bad input: a clear error before any work is done, and nothing written."""

from __future__ import annotations

import pytest
from drafters import ScriptedDrafter

from specdec.api import load_drafter, load_verifier, run
from specdec.cli import main
from specdec.engine import DecodeConfig, generate
from specdec.verifiers.stub import StubConfig, StubVerifier


@pytest.fixture
def v() -> StubVerifier:
    v = StubVerifier(StubConfig(max_context=64))
    v.prefill([1, 2, 3])  # a position != 0 shows whether the engine touched the verifier
    return v


def drafter(**kw) -> ScriptedDrafter:
    args = dict(vocab=259, block_size=8, target_layer_ids=(0, 3), hidden_size=64) | kw
    return ScriptedDrafter([], **args)


@pytest.mark.parametrize(
    ("prompt", "cfg", "d", "match"),
    [
        ([], DecodeConfig(), None, "empty prompt"),
        ([1, 2], DecodeConfig(max_new_tokens=0), None, "max_new_tokens must be >= 1"),
        ([1, 2], DecodeConfig(block_size=0), None, r"block_size must be 1\.\.64"),
        ([1, 2], DecodeConfig(block_size=65), None, r"block_size must be 1\.\.64 \(tokens per verify\)"),
        (
            [1, 2],
            DecodeConfig(block_size=8),
            drafter(hidden_size=32),
            r"width 64, but 2 target layers x hidden size 64",
        ),
        (
            [1, 2],
            DecodeConfig(block_size=8),
            drafter(target_layer_ids=(1, 4)),
            r"target layers \[4\].*0\.\.3",
        ),
        ([1, 2], DecodeConfig(block_size=8), drafter(), None),
        ([1, 2], DecodeConfig(block_size=16), drafter(), "exceeds the drafter's block size 8"),
        ([1, 999], DecodeConfig(), None, "outside the vocabulary"),
        (list(range(64)), DecodeConfig(), None, "leaves no room in the context of 64"),
    ],
)
def test_bad_request(v, prompt, cfg, d, match):
    if match is None:  # the control case: the same drafter with nothing wrong runs
        assert generate(v, prompt, drafter=d, cfg=cfg).output_tokens
        return
    with pytest.raises(ValueError, match=match):
        generate(v, prompt, drafter=d, cfg=cfg)
    assert v.position == 3  # nothing ran


def test_vocab_mismatch(v):
    d = drafter()
    d.vocab_size = 49152
    with pytest.raises(ValueError, match=r"vocabulary size 49152.*has 259"):
        generate(v, [1, 2], drafter=d, cfg=DecodeConfig(block_size=8))


def test_unwritable_output_dir_writes_nothing(tmp_path, v):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is not a directory"):
        run(v, [[1, 2]], out=tmp_path / "file" / "r.json", progress=False)
    assert v.position == 3 and [p.name for p in tmp_path.iterdir()] == ["file"]
    run(v, [[1, 2]], out=tmp_path / "new" / "r.json", progress=False)  # a missing folder is made
    assert (tmp_path / "new" / "r.json").is_file()


def test_unknown_runtime_and_drafter():
    with pytest.raises(ValueError, match="unknown verifier runtime"):
        load_verifier("tensorflow", "x")
    with pytest.raises(ValueError, match="drafter checkpoint folder"):
        load_drafter("/no/such/drafter", verifier=load_verifier("stub"))


def test_cli_errors_are_clear(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    assert main(["generate", "--prompt", "hi", "--out", str(tmp_path / "f" / "r.json")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["generate", "--prompt", "hi", "--max-new-tokens", "0"]) == 2
    assert "argument --max-new-tokens: must be >= 1, got 0" in capsys.readouterr().err


def test_cli_generate(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["generate", "--prompt", "abcabcabc", "--max-new-tokens", "20", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "tau" in err and "tok/s" in err and out.is_file()


def test_image_parts_are_refused_in_one_line():
    """Qwen3.5 checkpoints are multimodal; specdec runs their text model: an image part is a clear error."""
    from specdec.chat import encode_prompt

    v = StubVerifier()
    msgs = [{"role": "user", "content": [{"type": "image", "url": "cat.png"}, {"type": "text", "text": "?"}]}]
    with pytest.raises(ValueError, match=r"messages\[0\]\.content has an image / audio / video part"):
        encode_prompt(v, msgs)
