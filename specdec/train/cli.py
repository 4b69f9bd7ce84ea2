"""`specdec train` (wired by specdec.cli) and `python -m specdec.train` (e.g. under torchrun)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from specdec.args import Parser, at_least, finite, run_main
from specdec.train.loop import TrainConfig, dist_setup, train

__all__ = ["add_train_args", "cmd_train", "main"]


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x.strip())


def add_train_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = TrainConfig()
    p.add_argument(
        "--data", required=True, help="corpus folder (`python -m specdec.train.corpus`, or --prompts)"
    )
    p.add_argument("--out", required=True, help="output folder: checkpoint-NNNNNN/ and train_log.jsonl")
    g = p.add_argument_group("verifier and corpus")
    g.add_argument("--verifier", choices=("stub", "hf", "mlx"), required=True, help="computes the features")
    g.add_argument("--model", help="verifier model: short name or folder")
    g.add_argument(
        "--prompts", help="build --data first from this prompt file (JSONL messages/text, or lines)"
    )
    g.add_argument("--max-new-tokens", type=at_least(1), default=512, help="response budget of --prompts")
    g.add_argument("--max-len", type=at_least(2), default=3072, help="prompt + response at most (--prompts)")
    g.add_argument(
        "--stages", type=lambda s: tuple(s.split(",")), help="corpus stages to train on (default all)"
    )
    g.add_argument("--max-sequences", type=at_least(1), help="train on the first N sequences only")
    g.add_argument("--build-only", action="store_true")
    t = p.add_argument_group("drafter and training")
    t.add_argument("--num-layers", type=at_least(1), default=d.num_layers)
    t.add_argument("--heads", type=at_least(1))
    t.add_argument("--kv-heads", type=at_least(1))
    t.add_argument("--head-dim", type=at_least(1))
    t.add_argument("--intermediate-size", type=at_least(1))
    t.add_argument("--block-size", type=at_least(2), default=d.block_size)
    t.add_argument("--target-layer-ids", type=_ints, help="verifier layers the drafter reads, e.g. 1,9,17")
    t.add_argument("--mask-token-id", type=at_least(0))
    t.add_argument(
        "--draft-vocab",
        type=at_least(1),
        dest="draft_vocab_size",
        help="read out only the K ids the verifier writes most in the data (faster to train and run)",
    )
    t.add_argument("--lr", type=finite(0), default=d.lr)
    t.add_argument("--steps", type=at_least(1))
    t.add_argument("--epochs", type=finite(0), default=d.epochs)
    t.add_argument(
        "--batch-size", type=at_least(1), default=d.batch_size, help="sequences per step, all processes"
    )
    t.add_argument("--max-anchors", type=at_least(1), default=d.max_anchors)
    t.add_argument("--attn-chunk", type=at_least(1))
    t.add_argument(
        "--recompute",
        action=argparse.BooleanOptionalAction,
        help="recompute anchor chunks in the backward to save memory (default: on CUDA only)",
    )
    t.add_argument("--gamma", type=finite(0))
    t.add_argument("--kl-weight", type=finite(0), default=d.kl_weight)
    t.add_argument(
        "--repeat-weight",
        type=finite(0),
        default=d.repeat_weight,
        help="loss weight of positions whose token repeats earlier text (what lookup would draft); 1: none",
    )
    t.add_argument(
        "--repeat-anchors",
        type=finite(0),
        default=d.repeat_anchors,
        help="anchors whose next token repeats earlier text are drawn this many times as likely; 1: uniform",
    )
    t.add_argument("--seed", type=at_least(0), default=d.seed)
    t.add_argument(
        "--init-from",
        help="checkpoint folder of the same drafter shape to start from (fresh optimizer); one with fewer "
        "layers grows: new layers after its own start as the identity",
    )
    t.add_argument(
        "--init-layers",
        type=_ints,
        help="or start the drafter's layers as copies of these verifier layers, one per drafter layer, e.g. "
        "28,29 (a drafter of the verifier's hidden size and layer shape; HF verifier)",
    )
    t.add_argument("--device")
    t.add_argument("--save-every", type=at_least(1))
    t.add_argument("--eval-every", type=at_least(1))
    t.add_argument("--holdout", type=at_least(0), default=d.holdout)
    t.add_argument("--no-resume", action="store_true")
    t.add_argument("--no-progress", action="store_true")
    return p


def cmd_train(args: argparse.Namespace) -> int:
    from specdec.api import load_verifier

    cfg = TrainConfig(
        num_layers=args.num_layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate_size=args.intermediate_size,
        block_size=args.block_size,
        target_layer_ids=args.target_layer_ids,
        mask_token_id=args.mask_token_id,
        lr=args.lr,
        draft_vocab_size=args.draft_vocab_size,
        stages=args.stages,
        max_sequences=args.max_sequences,
        steps=args.steps,
        epochs=args.epochs,
        batch_size=args.batch_size,
        max_anchors=args.max_anchors,
        attn_chunk=args.attn_chunk,
        recompute=args.recompute,
        gamma=args.gamma,
        kl_weight=args.kl_weight,
        repeat_weight=args.repeat_weight,
        repeat_anchors=args.repeat_anchors,
        seed=args.seed,
        init_from=args.init_from,
        init_layers=args.init_layers,
        device=args.device,
        out_dir=args.out,
        save_every=args.save_every,
        eval_every=args.eval_every,
        holdout=args.holdout,
        resume=not args.no_resume,
        progress=not args.no_progress,
    )
    cfg.validate()
    ctx = dist_setup(args.device)  # under torchrun: one process group for building and training
    try:
        # the verifier computes every batch's features, so it runs where the drafter trains (a CUDA run
        # with the verifier left on the CPU would spend nearly all its time there)
        verifier = load_verifier(args.verifier, args.model, device=str(ctx.device))
        if args.prompts:
            if ctx.main:  # one builder; the other processes wait for the finished corpus
                from specdec.train.corpus import build_from_prompts

                build_from_prompts(
                    args.data,
                    verifier,
                    args.prompts,
                    budget=args.max_new_tokens,
                    max_len=args.max_len,
                    progress=not args.no_progress,
                )
            ctx.barrier()
        if args.build_only:
            return 0
        path = train(verifier, args.data, cfg)
        if ctx.main:
            print(path)
    finally:
        ctx.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = Parser(prog="python -m specdec.train", description="Train a DFlash drafter.")
    add_train_args(p)
    p.set_defaults(func=cmd_train)
    return run_main(p, argv)
