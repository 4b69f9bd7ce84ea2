"""The split MTP kind's registry entry (`registry.KINDS`): a model's MTP layers in a folder of their own, as
mlx-vlm 0.7.10 writes them (`python -m mlx_vlm convert --mtp`, or its `split_qwen3_5_mtp`): config.json
with `model_type` qwen3_5_mtp and the model's `text_config`, `model.safetensors` with `fc`, the three norms
and `layers.0.*` in MLX's layout (norms shifted as the model's zero-centred ones, experts stacked),
quantized where the conversion was (`quantization` in config.json); read by `specdec.drafting.mtp.torch`'s
`read_split`, run in MLX beside the MLX verifier of that model by `specdec.drafting.mtp.mlx` (the same
drafter as `--drafter mtp`). The verifier's own MTP layers, unsplit, are `--drafter mtp`
(`MTP_KIND`): they live in the verifier's runtime, and the drafter runs there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specdec.drafting.kind import DrafterKind
from specdec.drafting.mtp.torch import (
    MTP_BLOCK_SIZE,
    SplitMtp,
    check_mtp_folder,
    check_split_fits,
    read_split,
)

__all__ = ["MTP_KIND", "MTP_SPLIT_KIND"]


def _load_own(plan: Any, *, verifier: Any, policy: Any, block_size: int | None, **_: Any) -> Any:
    """The verifier's own layers, in the verifier's runtime."""
    if verifier.runtime == "mlx":
        from specdec.drafting.mtp.mlx import MLXMtpDrafter

        return MLXMtpDrafter(verifier, policy=policy, block_size=block_size)
    from specdec.drafting.mtp.torch import MtpDrafter

    return MtpDrafter.for_verifier(verifier, policy=policy, block_size=block_size)


def _fits_own(header: Any, target: Any, name: str, target_folder: Path | None) -> None:
    if target_folder is not None:  # the weights are the model's: checked where its folder is on disk
        check_mtp_folder(target_folder)


MTP_KIND = DrafterKind(
    name="mtp",
    summary="the verifier's own multi-token-prediction layers (Qwen3.5 / 3.6 / Qwen3-Next)",
    loop="chain",
    needs="a model with MTP layers: its last hidden state, embeddings and LM head",
    runtimes=("torch", "mlx"),
    word="mtp",
    fits=_fits_own,
    load=_load_own,
)


def _load(ckpt: Any, *, runtime: str, policy: Any, block_size: Any, **_: Any) -> Any:
    from specdec.drafting.mtp.mlx import MLXMtpDrafter

    drafter = MLXMtpDrafter(policy=policy, block_size=block_size, split=ckpt.header)
    drafter.name = ckpt.name
    return drafter


def _describe(h: SplitMtp) -> dict[str, Any]:
    q = h.quantization
    return {
        "made for": f"a Qwen3.5 / 3.6 / Qwen3-Next of hidden size {h.hidden_size}, {h.num_layers} layers, "
        f"vocabulary {h.vocab_size}",
        "reads": "the verifier's last hidden state (after its final norm), the next token's embedding; "
        "drafts through the verifier's LM head",
        "mtp layers": f"{h.layers} (the first chained)",
        "drafts per step": f"{MTP_BLOCK_SIZE - 1} (--block-size to change)",
        "weights": h.weights_file
        + (f" ({q['bits']}-bit, groups of {q['group_size']}, {q.get('mode', 'affine')})" if q else ""),
    }


MTP_SPLIT_KIND = DrafterKind(
    name="mtp-split",
    summary="a model's MTP layers split into a folder of their own (mlx-vlm's qwen3_5_mtp)",
    loop="chain",
    formats=frozenset({("mtp", "split")}),
    needs="the last hidden state, embeddings and LM head of the MLX verifier of the model it was split from",
    runtimes=("mlx",),
    trees=False,
    read=lambda folder, raw, fmt: read_split(Path(folder), raw),
    fits=lambda header, target, name, _folder: check_split_fits(header, target, name),
    load=_load,
    describe=_describe,
)
