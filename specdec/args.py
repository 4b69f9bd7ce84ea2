"""Command-line options shared by `specdec generate / eval / serve / demo` and the replay tool, declared
once, and the one place that turns an error into a one-line message.

Values are checked by argparse itself where a type can say it (counts >= 1, ports, finite numbers), so a
bad flag is refused before any model loads. `--block-size` defaults to the drafter's own block size
everywhere (prompt lookup, which has none, drafts blocks of 16). Commands give their own defaults for
`--verifier`, `--model` and `--drafter` (the replay tool is about the bundled drafter).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from specdec.api import DRAFTER_RUNTIMES, LOOKUP_BLOCK_SIZE, RUNTIMES, RunSpec
from specdec.drafting.draft_model.drafter import MODEL_BLOCK_SIZE
from specdec.extras import missing_extra
from specdec.grammar import GrammarSpec
from specdec.kernels import MAX_VERIFY_TOKENS
from specdec.processors import LogitsParams
from specdec.sampling import PROPOSALS, RULES, SamplingParams

__all__ = [
    "Parser",
    "add_drafter_args",
    "add_logits_args",
    "add_max_new_tokens",
    "add_sampling_args",
    "add_template_args",
    "add_verifier_args",
    "at_least",
    "finite",
    "grammar_of",
    "int_list",
    "logits_of",
    "read_chat_template",
    "read_file_arg",
    "run_command",
    "run_main",
    "run_spec",
    "sampling_of",
]


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error (`<prog>: error: ... (see --help)`) instead of the usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def at_least(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """argparse type: an integer in [lo, hi]."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(
                f"must be {lo}..{hi}, got {v}" if hi else f"must be >= {lo}, got {v}"
            )
        return v

    return parse


def int_list(lo: int, hi: int | None = None) -> Callable[[str], list[int]]:
    """argparse type: comma-separated integers, each in [lo, hi]."""
    one = at_least(lo, hi)
    return lambda text: [one(x) for x in text.split(",")]


def finite(lo: float = -math.inf, hi: float = math.inf) -> Callable[[str], float]:
    """argparse type: a finite number in [lo, hi]."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(v) or not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be a finite number in [{lo:g}, {hi:g}], got {text}")
        return v

    return parse


def or_auto(parse: Callable[[str], float]) -> Callable[[str], float | str]:
    """argparse type: "auto" or what `parse` accepts."""
    return lambda text: "auto" if text == "auto" else parse(text)


def add_verifier_args(p: argparse.ArgumentParser, *, runtime: str = "stub", model: str | None = None) -> None:
    p.add_argument("--verifier", choices=RUNTIMES, default=runtime)
    p.add_argument(
        "--model",
        default=model,
        help="short name (smollm2-135m, gemma3-270m), local HF folder or mlx repo id",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        help="float32 | bfloat16 | float16 | auto (bf16 on a CPU with AMX or avx512_bf16 where the verify is "
        "batch-invariant, i.e. exact; else fp32)",
    )
    p.add_argument("--device", default="cpu", help="torch device of the drafter (and of an hf verifier)")


def add_drafter_args(p: argparse.ArgumentParser, *, drafter: str = "prompt-lookup") -> None:
    p.add_argument(
        "--drafter",
        default=drafter,
        help="'none' (autoregressive), 'prompt-lookup', 'bundled:<model>', a DFlash checkpoint folder or hub "
        "id, or 'model:<folder | name>': a small LM of the verifier's tokenizer drafting token by token; "
        "append '+lookup' to a DFlash drafter or draft model for prompt lookup where the text repeats",
    )
    p.add_argument(
        "--block-size",
        type=or_auto(at_least(1, MAX_VERIFY_TOKENS)),
        help=f"default: the drafter's ({LOOKUP_BLOCK_SIZE} for prompt lookup, {MODEL_BLOCK_SIZE} for a draft "
        "model); auto: from --costs",
    )
    p.add_argument(
        "--drafter-runtime",
        choices=DRAFTER_RUNTIMES,
        default="torch",
        help="torch: the PyTorch drafter on --device (any verifier; a draft model in transformers); mlx: "
        "the same checkpoint (or draft model, in mlx_lm) run in MLX beside an MLX verifier, nothing "
        "crossing to torch",
    )
    p.add_argument(
        "--min-confidence",
        type=or_auto(finite(0, 1)),
        default=0.0,
        help="cut DFlash blocks where the drafter's running top-1 probability falls below this (0: whole "
        "blocks). Worth it where verifying several tokens costs far more than one, as on CPUs; auto: cut "
        "every draft where it commits the most tokens per verify cost (see --costs)",
    )
    p.add_argument(
        "--tree",
        type=or_auto(at_least(2, MAX_VERIFY_TOKENS)),
        help="verify a tree of up to N drafts per step (the last token included) built best first from the "
        "drafter's candidates at each block position, instead of one chain (DFlash drafters, optionally "
        "+lookup; attention-only models); auto: as many as pay for their verify cost (tree verifies timed at "
        "load, or the --costs table)",
    )
    p.add_argument(
        "--costs",
        metavar="JSON",
        help="a verify cost table (`specdec bench-verify --out`) for --block-size / --min-confidence auto; "
        "without it they time this verifier's verifies at load (a few seconds)",
    )
    p.add_argument(
        "--corpus",
        metavar="DIR",
        help="with a '+lookup' drafter, where lookup has nothing draft by n-grams of this corpus of the "
        "verifier's own answers (a `specdec train` corpus folder, or bundled:<model> for a bundled one), and "
        "price lookup's drafts by how often they are accepted in it",
    )
    p.add_argument(
        "--corpus-cut",
        type=finite(0, 1),
        default=0.4,
        help="end a corpus n-gram draft where its running share (how often the corpus continued so) "
        "falls below this",
    )


def add_max_new_tokens(p: argparse.ArgumentParser, *, default: int) -> None:
    """`--max-new-tokens`, with the command's own default (a quick demo, one prompt, a benchmark)."""
    p.add_argument(
        "--max-new-tokens", type=at_least(1), default=default, help=f"per answer (default {default})"
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=finite(0), default=0.0, help="0: greedy (exact verifier argmax)")
    p.add_argument("--top-p", type=finite(0, 1), default=1.0)
    p.add_argument("--top-k", type=at_least(0), default=0, help="0: off")
    p.add_argument("--min-p", type=finite(0, 1), default=0.0)
    p.add_argument("--seed", type=at_least(0, 2**63 - 1), default=0)
    p.add_argument(
        "--rule",
        choices=RULES,
        default="match",
        help="T>0 verification: 'match' (same seed = same output as no speculation) or 'rejection'",
    )
    p.add_argument(
        "--proposal", choices=PROPOSALS, default="argmax", help="T>0: how the drafter picks drafts"
    )


def add_template_args(p: argparse.ArgumentParser, *, tools: bool) -> None:
    """A chat template in place of the model's and (`tools`) the call syntax to parse."""
    p.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template in place of the model's")
    if tools:
        from specdec.tools import SYNTAXES

        p.add_argument(
            "--tool-call-parser",
            choices=sorted(SYNTAXES),
            help="the model's tool call syntax (default: detected from its chat template)",
        )


def read_chat_template(args: argparse.Namespace) -> str | None:
    """--chat-template's text, read before any model loads (one line where it cannot be)."""
    return read_file_arg(args.chat_template, "--chat-template") if args.chat_template is not None else None


def add_logits_args(p: argparse.ArgumentParser) -> None:
    """Logit bias and penalties, applied inside verification (`specdec.processors`)."""
    p.add_argument("--logit-bias", metavar="JSON", help='{"token id": bias, ...}, bias in [-100, 100]')
    p.add_argument("--repetition-penalty", type=finite(0), default=1.0, help="CTRL's, >1 penalizes (1: off)")
    p.add_argument("--presence-penalty", type=finite(-2, 2), default=0.0, help="OpenAI's, -2..2")
    p.add_argument("--frequency-penalty", type=finite(-2, 2), default=0.0, help="OpenAI's, -2..2")
    p.add_argument(
        "--penalty-context",
        type=at_least(1),
        help="penalize the last N tokens of prompt and output (mlx_lm's windows; default: the output for "
        "presence / frequency, prompt and output for repetition)",
    )
    g = p.add_mutually_exclusive_group()  # structured output (`specdec.grammar`)
    g.add_argument("--json-schema", metavar="FILE|JSON", help="the output validates against this JSON schema")
    g.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    g.add_argument("--regex", metavar="RE", help="the output matches this regular expression")
    g.add_argument("--lark", metavar="FILE", help="the output is a sentence of this Lark grammar")


def logits_of(args: argparse.Namespace) -> LogitsParams | None:
    """The options of `add_logits_args`, checked against the model's vocabulary where it is known before
    loading; None where none changes a logit."""
    bias = {}
    if args.logit_bias is not None:
        try:
            bias = json.loads(args.logit_bias)
        except json.JSONDecodeError as e:
            raise ValueError(f"--logit-bias is not JSON: {e.msg} at column {e.colno}") from None
        if not isinstance(bias, dict):
            raise ValueError('--logit-bias must be a JSON object {"token id": bias, ...}')
    p = LogitsParams(
        logit_bias=bias,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        penalty_context=args.penalty_context,
        grammar=grammar_of(args),
    )
    from specdec.models import model_shape

    shape = model_shape(args.verifier, args.model)
    if shape is not None:
        p.check_bias(shape.vocab_size)
    return p if p.active else None


def grammar_of(args: argparse.Namespace) -> GrammarSpec | None:
    """The structured-output option of `add_logits_args`, compiled (again against the model's tokenizer
    when the run starts, before any work)."""
    spec = _grammar_of(args)
    if spec is not None:
        spec.check()
    return spec


def _grammar_of(args: argparse.Namespace) -> GrammarSpec | None:
    if args.json_object:
        return GrammarSpec("json_object")
    if args.regex is not None:
        return GrammarSpec("regex", args.regex)
    if args.lark is not None:
        return GrammarSpec("lark", read_file_arg(args.lark, "--lark"))
    if args.json_schema is None:
        return None
    text = args.json_schema
    if not text.lstrip().startswith("{"):
        text = read_file_arg(text, "--json-schema")
    try:
        return GrammarSpec.json_schema(text)
    except ValueError as e:
        raise ValueError(f"--json-schema: {e}") from None


def read_file_arg(path: str, flag: str) -> str:
    """The text of the file an option names (one line where it cannot be read)."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag}: cannot read {path!r}: {getattr(e, 'strerror', None) or e}") from None


def sampling_of(args: argparse.Namespace) -> SamplingParams:
    """The sampling options (with the drafter's: a tree is verified by the match rule of argmax trees)."""
    if args.tree is not None and (args.rule, args.proposal) != ("match", "argmax"):
        raise ValueError("--tree verifies with --rule match and --proposal argmax; give those, or no --tree")
    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        rule=args.rule,
        proposal=args.proposal,
    )


def run_spec(args: argparse.Namespace) -> RunSpec:
    """The `specdec.api.RunSpec` the verifier and drafter options give (`add_verifier_args`,
    `add_drafter_args`); `specdec.api.load` checks and loads it."""
    return RunSpec(
        verifier=args.verifier,
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        drafter=args.drafter,
        drafter_runtime=args.drafter_runtime,
        block_size=args.block_size,
        costs=args.costs,
        min_confidence=0.0 if args.min_confidence is None else args.min_confidence,  # None: not given
        corpus=args.corpus,
        corpus_cut=args.corpus_cut,
        tree=args.tree,
    )


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if isinstance(e, (ValueError, RuntimeError)) else f"{type(e).__name__}: {text}"


def run_main(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> int:
    """Parse `argv` and run the chosen command (`args.func`) with `run_command`; a bad flag is exit code 2
    (argparse has said why), `--help` 0."""
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    return run_command(args.func, args)


def run_command(func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a command; what a user can cause becomes `error: <one line>` on stderr and exit code 2 (bad
    input, missing or unreadable files), an interrupt exit code 1."""
    try:
        return func(args)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 1
    except ModuleNotFoundError as e:  # an optional extra not installed: say which, or it is ours
        line = missing_extra(e)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return 2
    except (ValueError, OSError, RuntimeError) as e:
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
