"""The drafter spec and the registry of drafter kinds: `--drafter` is parsed once into a `DrafterSpec`, a
checkpoint folder is identified by its config.json and read once per run by its kind, and the kinds are
listed where users look (`specdec --help`)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import specdec.drafting.dflash.config as checkpoint
from specdec.api import RunSpec, load
from specdec.drafting.load import check_drafter
from specdec.drafting.registry import KINDS, READABLE, DrafterSpec, kind_for, plan, read_checkpoint


@pytest.mark.parametrize(
    ("text", "word", "source", "lookup"),
    [
        (None, "none", "", False),
        ("none", "none", "", False),
        ("prompt-lookup", "prompt-lookup", "", False),
        ("mtp+lookup", "mtp", "", True),
        ("model:smollm2-135m", "model", "smollm2-135m", False),
        ("model:/x/y+lookup", "model", "/x/y", True),
        ("bundled:smollm2-135m+lookup", "", "bundled:smollm2-135m", True),
        ("z-lab/Qwen3-8B-DFlash-b16", "", "z-lab/Qwen3-8B-DFlash-b16", False),
    ],
)
def test_the_drafter_grammar(text, word, source, lookup):
    spec = DrafterSpec.parse(text)
    assert (spec.word, spec.source, spec.lookup) == (word, source, lookup)
    assert spec.base.lookup is False and spec.base.word == word
    assert DrafterSpec.parse(spec) is spec
    if word:  # a word's kind is the registry entry of that word: the one table decides
        assert plan(spec if word != "model" else "model:stub").kind.word.removesuffix(":") == word


def test_every_drafter_value_is_an_entry_of_one_table():
    """The grammar's words and the checkpoint kinds are entries of `KINDS`, each with its loop; a word's
    kind and a checkpoint's kind are found the same way (`plan`), and the old names still work, warning."""
    assert [k.word for k in KINDS if k.word] == ["none", "prompt-lookup", "model:", "mtp"]
    assert {k.loop for k in KINDS} == {"none", "lookup", "model", "chain", "block", "assistant"}
    assert len({k.name for k in KINDS}) == len(KINDS)
    assert plan("bundled:smollm2-135m+lookup").kind.loop == "block"
    with pytest.warns(DeprecationWarning, match="DrafterSpec.kind"):
        assert DrafterSpec.parse("bundled:x").kind == "checkpoint"
    with pytest.warns(DeprecationWarning, match="moved to specdec.drafting.registry"):
        from specdec.drafting.spec import DrafterSpec as Old
    assert Old is DrafterSpec


@pytest.mark.parametrize(
    ("text", "says"),
    [("none+lookup", "'+lookup' goes after"), ("prompt-lookup+lookup", "'+lookup' goes after"),
     ("model:", "give a model after 'model:'"), ("  ", "empty")],
)  # fmt: skip
def test_malformed_drafter_specs_are_one_line(text, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        DrafterSpec.parse(text)


def test_every_readable_format_has_exactly_one_kind():
    from specdec.formats import Format

    assert {("dflash", "public"), ("dflash2", "public"), ("eagle3", "speculators")} <= READABLE
    for pair in READABLE:
        assert sum(pair in k.formats for k in KINDS) == 1 and kind_for(Format(*pair)) is not None
    assert kind_for(Format("dflash", "speculators")).name == "dflash"
    assert kind_for(Format("dspark", "speculators")) is None and kind_for(Format("eagle", "")) is None
    assert len({k.name for k in KINDS}) == len(KINDS)


def test_a_bundled_checkpoint_is_read_by_its_kind():
    ckpt = read_checkpoint("bundled:smollm2-135m")
    assert ckpt.kind.name == "dflash" and ckpt.header.block_size > 1
    assert ckpt.name == "smollm2-135m-dflash" and (ckpt.folder / "config.json").is_file()
    plan = check_drafter("bundled:smollm2-135m+lookup")
    assert plan.folder is not None and plan.trees and plan.block_size == ckpt.header.block_size


def test_a_run_reads_the_checkpoint_config_once(tmp_path: Path, monkeypatch):
    """`RunSpec.check` reads the checkpoint (config, weights header); `load` builds the drafter from what it
    read (before: the config and the header were read again when the drafter loaded)."""
    from test_hardening import _stub_drafter_folder

    import specdec.drafting.dflash.torch as dflash

    folder = _stub_drafter_folder(tmp_path / "d")
    reads: list[str] = []
    real = checkpoint.load_config

    def counted(path):
        reads.append(str(path))
        return real(path)

    monkeypatch.setattr(checkpoint, "load_config", counted)  # what check_checkpoint calls
    monkeypatch.setattr(dflash, "load_config", counted)  # what the drafter's loader would call
    m = load(RunSpec(verifier="stub", drafter=str(folder)), log=lambda _: None)
    assert m.drafter is not None and m.drafter.name == "d"
    assert reads == [str(folder)]


def test_specdec_help_lists_the_kinds():
    out = subprocess.run([sys.executable, "-m", "specdec", "--help"], capture_output=True, text=True).stdout
    text = " ".join(out.split())
    assert all(f"{k.name}: " in text for k in KINDS if k.formats) and "model:<folder" in text


def test_the_old_flat_names_still_import_and_warn():
    """One release of grace for the flat room's names: the module itself (not a copy), with a warning."""
    import importlib

    import specdec.drafting.dflash.config as config
    import specdec.drafting.dflash.torch as torch_drafter

    for old, new in (("specdec.drafting.checkpoint", config), ("specdec.drafting.formats", None)):
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=f"{old} moved to"):
            got = importlib.import_module(old)
        assert got is (new or importlib.import_module("specdec.formats"))
    with pytest.warns(DeprecationWarning, match="specdec.drafting.dflash.DFlashDrafter moved to"):
        from specdec.drafting.dflash import DFlashDrafter
    assert DFlashDrafter is torch_drafter.DFlashDrafter
    with pytest.raises(ImportError):  # what the old module did not have is not made up
        from specdec.drafting.dflash import nothing_of_that_name  # noqa: F401
