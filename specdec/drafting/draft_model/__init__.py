"""A small causal LM of the verifier's tokenizer as the drafter (`--drafter model:<name>`), PARD's
parallel draft models included (a block per forward).

    drafter.py  the drafter over any verifier runtime, and the checks before it loads
    entry.py    its registry entry (`MODEL_KIND`)
"""
