"""Drafting: everything that proposes tokens for the verifier to check. A kind of drafter is a folder of
its own; what kinds share sits here.

    spec.py         the `--drafter` grammar, parsed once into a typed value
    registry.py     the one table of drafter kinds (every `--drafter` value), and reading a checkpoint once
    kind.py         `DrafterKind`: what a registry entry is
    load.py         from a checked spec to a bound drafter
    formats.py      what a checkpoint folder is from its config.json: other drafter formats named
    policy.py       the one draft policy: where a draft is cut, whose draft a step verifies
    mix.py          `LookupFirstDrafter`: lookup, then corpus n-grams, then the drafter, by the policy
    chain.py        chain drafters' rows and their rollback (EAGLE-3, MTP); `chain_mlx.py` in MLX
    layers.py       torch building blocks the networks share (RMSNorm, RoPE, attention); `layers_mlx.py`
    rope.py, fields.py  RoPE frequencies and scaling; config field checks
    moved.py        the old flat names, deprecated

    dflash/  eagle3/  gemma4_assistant/  mtp/  draft_model/  lookup/   one folder per kind

Importing this package imports none of them.
"""

from specdec.drafting import moved

moved.install()
