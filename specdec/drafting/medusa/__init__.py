"""Medusa heads (arXiv 2401.10774), in vLLM's layout: k small residual heads over the verifier's last
hidden state, head i guessing the token i + 2 places ahead, all in one step (no chain).

    config.py   the checkpoint: config.json and the weights' header, checked before anything loads
    torch.py    the drafter in PyTorch, beside the HF verifier
    entry.py    its registry entry (`MEDUSA_KIND`)
"""
