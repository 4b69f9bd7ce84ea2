"""The drafter spec and the registry of drafter kinds: `--drafter` is parsed once into a `DrafterSpec`, a
checkpoint folder is identified by its config.json and read once per run by its kind, and the kinds are
listed where users look (`specdec --help`)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import specdec.drafting.checkpoint as checkpoint
from specdec.api import RunSpec, load
from specdec.drafting.load import check_drafter
from specdec.drafting.registry import KINDS, READABLE, kind_for, read_checkpoint
from specdec.drafting.spec import DrafterSpec


@pytest.mark.parametrize(
    ("text", "kind", "source", "lookup"),
    [
        (None, "none", "", False),
        ("none", "none", "", False),
        ("prompt-lookup", "prompt-lookup", "", False),
        ("model:smollm2-135m", "model", "smollm2-135m", False),
        ("model:/x/y+lookup", "model", "/x/y", True),
        ("bundled:smollm2-135m+lookup", "checkpoint", "bundled:smollm2-135m", True),
        ("z-lab/Qwen3-8B-DFlash-b16", "checkpoint", "z-lab/Qwen3-8B-DFlash-b16", False),
    ],
)
def test_the_drafter_grammar(text, kind, source, lookup):
    spec = DrafterSpec.parse(text)
    assert (spec.kind, spec.source, spec.lookup) == (kind, source, lookup)
    assert spec.base.lookup is False and spec.base.kind == kind
    assert DrafterSpec.parse(spec) is spec


@pytest.mark.parametrize(
    ("text", "says"),
    [("none+lookup", "'+lookup' goes after"), ("prompt-lookup+lookup", "'+lookup' goes after"),
     ("model:", "give a model after 'model:'"), ("  ", "empty")],
)  # fmt: skip
def test_malformed_drafter_specs_are_one_line(text, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        DrafterSpec.parse(text)


def test_every_readable_format_has_exactly_one_kind():
    from specdec.drafting.formats import Format

    assert {("dflash", "public"), ("dflash2", "public"), ("eagle3", "speculators")} <= READABLE
    for pair in READABLE:
        assert sum(pair in k.formats for k in KINDS) == 1 and kind_for(Format(*pair)) is not None
    assert kind_for(Format("dflash", "speculators")).name == "dflash"
    assert kind_for(Format("dspark", "speculators")) is None and kind_for(Format("medusa", "")) is None
    assert len({k.name for k in KINDS}) == len(KINDS)


def test_a_bundled_checkpoint_is_read_by_its_kind():
    ckpt = read_checkpoint("bundled:smollm2-135m")
    assert ckpt.kind.name == "dflash" and ckpt.header.block_size > 1
    assert ckpt.name == "smollm2-135m-dflash" and (ckpt.folder / "config.json").is_file()
    plan = check_drafter("bundled:smollm2-135m+lookup")
    assert plan.checkpoint is not None and plan.trees and plan.block_size == ckpt.header.block_size


def test_a_run_reads_the_checkpoint_config_once(tmp_path: Path, monkeypatch):
    """`RunSpec.check` reads the checkpoint (config, weights header); `load` builds the drafter from what it
    read (before: the config and the header were read again when the drafter loaded)."""
    from test_hardening import _stub_drafter_folder

    import specdec.drafting.dflash as dflash

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
    assert all(f"{k.name}: " in text for k in KINDS) and "model:<folder" in text
