"""Drafting: everything that proposes tokens for the verifier to check.

    checkpoint.py   the public DFlash checkpoint format (config.json + model.safetensors), its checks
    formats.py      what a checkpoint folder is from its config.json: other drafter formats named, not misread
    dflash.py       the PyTorch DFlash drafter (model, block proposer, `Drafter` adapter)
    dflash2.py      what DFlash2 adds to the backbone: the dynamic convolutions, the candidate selector
    dflash_mlx.py   the same drafter in MLX, beside an MLX verifier (imports mlx)
    lookup.py       prompt lookup (no weights) and its measured chances of acceptance
    ngrams.py       corpus n-grams: what the verifier's own answers put after the last few tokens
    policy.py       the one draft policy: where a draft is cut, whose draft a step verifies
    mix.py          `LookupFirstDrafter`: lookup, then corpus n-grams, then DFlash, by the policy
    model.py        a small causal LM of the verifier's tokenizer as the drafter (`model:<name>`)

Importing this package imports none of them.
"""
