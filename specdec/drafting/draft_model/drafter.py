"""A small causal LM of the verifier's tokenizer as the drafter (`--drafter model:<name>`).

A draft model is a verifier asked one token at a time: `ModelDrafter` wraps any `Verifier` (HF, MLX, stub)
loaded for the small model, so every family and runtime we verify with can draft, hybrids included, and
its cache rolls back exactly as a verifier's does. The draft cache runs ahead of what is committed: a
proposal of k tokens leaves [last, d1 .. d(k-1)] in it, and `extend` keeps what the verifier accepted of
them (the common prefix with the committed tokens) and rolls back the rest, so an accepted draft is never
computed twice. Tokens must mean the same on both sides: the tokenizers' vocabularies are compared, not
only their sizes (`tokenizer_mismatch`), before the draft model's weights load.

Chances, where a cut reads them (`DraftPolicy`, source "model"), are the draft model's own top-1
probabilities, and a `min_confidence` cut stops drafting at once (each token costs a forward here). At
T > 0 with `--proposal sample` the draft is a walk sampled from the draft model's own distribution at the
request's temperature (`SampledWalk`), with q for the `rejection` rule.

A PARD model (AMD's parallel draft models: a causal LM trained to predict the tokens after its input and
after each of K - 1 appended mask tokens, its config naming the mask as `pard_token`) drafts all K in one
forward instead (`mask_token_id`): [pending, last, MASK x (K-1)] goes through the draft model once, the
logits of its last K positions are the drafts' (each independent of the drafts before it, so at T > 0
they are sampled as rows, `SampledProposals`), and the masks leave the draft cache at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from specdec.drafting.policy import Draft, DraftPolicy, running_cut
from specdec.engine import common_prefix_len
from specdec.protocols import MemoryProbe, RollbackError, Verifier
from specdec.sampling import sample_from

__all__ = [
    "MODEL_BLOCK_SIZE", "ModelDrafter", "check_draft_model", "load_draft_model", "pard_mask_token",
    "tokenizer_mismatch",
]  # fmt: skip

#: the block a draft model drafts in unless --block-size says otherwise: up to 4 tokens a step (each costs a
#: forward of the draft model, so its blocks are short; mlx-lm's default is 2, HF assisted generation's 20
#: with a schedule)
MODEL_BLOCK_SIZE = 5


def _vocab(tok: Any) -> dict[str, int] | None:
    get = getattr(tok, "get_vocab", None)  # HF tokenizers, and mlx_lm's wrapper of one
    return get() if callable(get) else None


def tokenizer_mismatch(draft: Any, target: Any, *, draft_name: str, target_name: str) -> str | None:
    """Why tokens of tokenizer `draft` do not mean the same as those of `target` (None: they do). Two
    vocabularies agree when every token string has the same id in both; tokenizers with no vocabulary to
    compare (the stub's bytes, tiny test models without tokenizer files) agree only with each other's kind."""
    if draft is None and target is None:
        return None  # token ids are all either side has; vocabulary sizes are checked at bind
    if (draft is None) != (target is None):
        which = draft_name if draft is None else target_name
        return f"{which} has no tokenizer, so its token ids cannot be checked against the other's"
    a, b = _vocab(draft), _vocab(target)
    if a is None or b is None:
        if type(draft) is type(target):
            return None
        return (
            f"{draft_name!r} has a {type(draft).__name__} tokenizer, {target_name!r} a "
            f"{type(target).__name__}: a draft model must share the verifier's tokenizer"
        )
    if a == b:
        return None
    differ = sorted(t for t in a.keys() | b.keys() if a.get(t) != b.get(t))
    return (
        f"the tokenizers of {draft_name!r} ({len(a)} tokens) and {target_name!r} ({len(b)} tokens) differ "
        f"in {len(differ)} tokens (e.g. {differ[:3]}): a draft model must share the verifier's tokenizer"
    )


class ModelDrafter:
    """The `Drafter` protocol over a draft model held by a `Verifier` of any runtime."""

    target_layer_ids: tuple[int, ...] = ()
    feature_dim = 0
    vocab_size = None  # checked against the verifier's tokenizer at bind instead (padding rows may differ)

    def __init__(
        self,
        draft: Verifier,
        *,
        block_size: int = MODEL_BLOCK_SIZE,
        policy: DraftPolicy | None = None,
        name: str | None = None,
        path: str | None = None,
        mask_token_id: int | None = None,
    ) -> None:
        """`mask_token_id`: a PARD model's mask token: draft a block in one forward (module docstring)."""
        if block_size < 2:
            raise ValueError(f"a draft model's block size must be >= 2, got {block_size}")
        try:
            draft.check_rollback()
        except RuntimeError as e:
            raise ValueError(f"draft model {draft.model_name!r} cannot draft: {e}") from None
        draft.set_target_layers(())
        self.draft, self.block_size, self.policy = draft, block_size, policy or DraftPolicy()
        self.name = name or f"model:{draft.model_name}"
        self.path = path
        self.runtime = "mlx" if draft.runtime == "mlx" else "torch"
        self.device, self.dtype = torch.device("cpu"), torch.float32  # of the (empty) features it takes
        self._vocab = draft.vocab_size  # ids it may propose: set to the shared range at bind
        self.restarts = 0  # times the draft cache could not roll back exactly and was prefilled again
        self.mask_token_id = mask_token_id
        self.walks = mask_token_id is None  # `SampledWalk`: each AR draft depends on the one before it
        self.reset()

    def describe(self) -> dict[str, Any]:
        """For the result JSON: the draft model, its runtime and dtype, its cut."""
        return {
            "path": self.path,
            "draft_model": {
                "model": self.draft.model_name,
                "runtime": self.draft.runtime,
                "dtype": self.draft.dtype,
                "vocab_size": self.draft.vocab_size,
                "restarts": self.restarts,
                "parallel_mask_token_id": self.mask_token_id,
            },
            **self.policy.describe(),
        }

    @property
    def context_len(self) -> int:
        return len(self._tokens)

    def bind(self, verifier: Verifier) -> None:
        why = tokenizer_mismatch(
            self.draft.tokenizer,
            verifier.tokenizer,
            draft_name=self.draft.model_name,
            target_name=verifier.model_name,
        )
        if why is None and self.draft.tokenizer is None and self.draft.vocab_size != verifier.vocab_size:
            why = f"vocabulary sizes differ ({self.draft.vocab_size} vs {verifier.vocab_size})"
        if why:
            name = self.draft.model_name
            raise ValueError(f"draft model {name!r} cannot draft for {verifier.model_name!r}: {why}")
        # ids past either side's rows are padding (or beyond what the verifier can embed): never proposed
        self._vocab = min(self.draft.vocab_size, verifier.vocab_size)
        self._target_vocab = verifier.vocab_size

    def reset(self) -> None:
        self.draft.reset()
        self._tokens: list[int] = []  # committed context
        self._held: list[int] = []  # what the draft cache holds: committed[:agreed] + speculative tokens
        self._agreed = 0  # leading positions of `_held` known to equal the committed context

    def extend(self, features: torch.Tensor, tokens: Sequence[int]) -> None:
        self._tokens += tokens
        a = self._agreed
        self._agreed = a + common_prefix_len(self._held[a:], self._tokens[a:])
        self._drop(len(self._held) - self._agreed)  # drafts the verifier did not take

    def rollback(self, n: int) -> None:
        if not 0 <= n <= len(self._tokens):
            raise ValueError(f"cannot roll back {n} of {len(self._tokens)} committed positions")
        del self._tokens[len(self._tokens) - n :]
        self._agreed = min(self._agreed, len(self._tokens))
        self._drop(len(self._held) - self._agreed)

    def _drop(self, n: int) -> None:
        """Roll the draft cache back by n (0 too: what it holds is then kept for good, so recurrent and
        sliding-window layers let go of what they kept to undo it); where it cannot be done exactly (past a
        prefill it cannot undo, past a full sliding window) start it over: the next proposal prefills the
        context again."""
        try:
            self.draft.rollback(n)
            del self._held[len(self._held) - n :]
        except RollbackError:
            self.draft.reset()
            self._held, self._agreed = [], 0
            self.restarts += 1

    def _step(self, tokens: list[int], pick: Any) -> int:
        self._held += tokens
        if len(tokens) > 1:
            return self.draft.prefill(tokens, sample=pick)
        # a greedy one-token step may run ahead on an asynchronous runtime (MLX): the next step's input is
        # this one's output (after the last draft the step run ahead is dropped with the rollback)
        return self.draft.verify(tokens, sample=pick, ahead=pick is None)[0]

    def _walk(self, last_token: int, n: int, pick: Any, stop: Any = None) -> list[int]:
        """n tokens after `last_token`, each from `pick` (None: argmax) given the ones before; `stop(i)`
        ends the walk after token i."""
        pending = [*self._tokens[self._agreed :], last_token]  # committed but not yet in the draft cache
        out: list[int] = []
        for i in range(n):
            t = self._step(pending if i == 0 else [out[-1]], pick)
            if not 0 <= t < self._vocab:
                break  # a padding row of the draft model: nothing the verifier could take
            out.append(t)
            if stop is not None and stop(i):
                break
        return out

    def _parallel_logits(self, last_token: int, n: int) -> torch.Tensor:
        """PARD: logits [n, V'] of the n drafts after `last_token`, one forward of [last, MASK x (n-1)]
        after what the draft cache lacks; the masks are rolled back before it returns."""
        rows: list[torch.Tensor] = []

        def keep(logits: torch.Tensor) -> list[int]:  # [T, V]: every row's logits are wanted
            rows.append(logits[-n:, : self._vocab].float().cpu())
            return [0] * logits.shape[0]

        rest = self._tokens[self._agreed :]
        if len(self._held) > self._agreed:  # drafts of an earlier step still held: not committed
            self._drop(len(self._held) - self._agreed)
        if rest:
            self._held += rest
            self.draft.prefill(rest)
        self._held.append(last_token)
        self.draft.verify([last_token, *[self.mask_token_id] * (n - 1)], sample=keep)
        try:
            self.draft.rollback(n - 1)  # the masks: never context (0 too: a window lets go of its undo)
        except RollbackError:
            self.draft.reset()
            self._held, self._agreed = [], 0
            self.restarts += 1
        return rows[0]

    def propose_logits(self, last_token: int, n: int) -> torch.Tensor:
        """Logits [n, V] of the verifier's vocabulary (ids the draft model lacks at -inf): PARD's rows for
        sampled proposals at T > 0 (`SampledProposals`)."""
        logits = self._parallel_logits(last_token, n) if n else torch.zeros(0, self._vocab)
        full = logits.new_full((n, self._target_vocab), float("-inf"))
        full[:, : self._vocab] = logits
        return full

    def propose(self, last_token: int, n: int) -> list[int]:
        if self.mask_token_id is not None:
            if n == 0:
                return []
            probs = self._parallel_logits(last_token, n).softmax(-1)  # [n, V']
            top, tokens = probs.max(-1)
            return self.policy.cut(Draft(tokens.tolist(), "model", top.tolist())).tokens
        if not self.policy.needs_confidence("model"):
            return self._walk(last_token, n, None)
        chances: list[float] = []

        def pick(logits: torch.Tensor) -> list[int]:  # [T, V]: the last row decides
            p = logits[-1, : self._vocab].float().softmax(-1)
            c, t = p.max(-1)
            chances.append(float(c))
            return [int(t)]

        threshold = self.policy.threshold("model")

        def stop(i: int) -> bool:  # token i is where the policy cuts: no forward for what it would drop
            return threshold > 0 and running_cut(chances, threshold) <= i

        tokens = self._walk(last_token, n, pick, stop)
        return self.policy.cut(Draft(tokens, "model", chances[: len(tokens)])).tokens

    def propose_walk(
        self, last_token: int, n: int, *, temperature: float, u: torch.Tensor
    ) -> tuple[list[int], torch.Tensor]:
        """n tokens sampled at `temperature` with uniforms u [n] -> (tokens, q [n, V] of the verifier's
        vocabulary: row i the distribution token i was drawn from given tokens 0..i-1)."""
        rows: list[torch.Tensor] = []

        def pick(logits: torch.Tensor) -> list[int]:
            q = (logits[-1:, : self._vocab].float() / temperature).softmax(-1)  # [1, V']
            rows.append(q[0])
            return sample_from(q, u[len(rows) - 1 : len(rows)].to(q.device)).tolist()

        tokens = self._walk(last_token, n, pick)
        q = torch.zeros(len(tokens), self._target_vocab)
        if tokens:
            q[:, : self._vocab] = torch.stack(rows[: len(tokens)]).cpu()
        return tokens, q

    def memory_probe(self) -> MemoryProbe:
        return self.draft.memory_probe()


def pard_mask_token(folder: Path) -> int | None:
    """The mask token of a PARD model folder (`pard_token`, or `ptd_token_id` in older configs); None for
    any other model."""
    from specdec.formats import identify
    from specdec.models import read_config

    raw = read_config(folder) if (folder / "config.json").is_file() else None
    if raw is None or identify(raw).family != "pard":
        return None
    mask = raw.get("pard_token", raw.get("ptd_token_id"))
    if not isinstance(mask, int) or isinstance(mask, bool):
        raise ValueError(f"{str(folder)!r}: a PARD model's pard_token must be a token id, got {mask!r}")
    return mask


def check_draft_model(name: str) -> None:
    """Before anything loads: `name` (after `model:`) names something a draft model can load from."""
    label = f"model:{name}"
    if not name:
        raise ValueError(f"drafter {label!r}: give a model after 'model:' (a folder, a known name, or stub)")
    if name == "stub":
        return
    from specdec.models import MODELS, is_repo_id

    path = Path(name).expanduser()
    if name in MODELS or (not path.exists() and is_repo_id(name)):
        return  # fetched / resolved when it loads
    if not (path / "config.json").is_file():
        what = "does not exist" if not path.exists() else "has no config.json"
        raise ValueError(
            f"drafter {label!r}: {name!r} {what}; a draft model is an HF model folder, a known name "
            f"({', '.join(sorted(MODELS))}) or a hub repo id"
        )


def check_draft_model_fits(name: str, target: Any, *, folder: Path | None) -> None:
    """Before anything loads: the draft model `name` (after `model:`) against the verifier's model as known
    then (`target`: its `model_name` and `vocab_size`, `specdec.models.model_shape`; `folder`: its folder
    where on disk): another vocabulary size is refused, and where both folders are on disk the tokenizers
    are compared token by token (`tokenizer_mismatch`, as `load_draft_model` does once the verifier is
    loaded)."""
    from specdec.models import local_folder, model_shape

    label = f"model:{name}"
    draft = model_shape("stub" if name == "stub" else "hf", name)
    if draft is not None and draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"drafter {label!r}: its vocabulary has {draft.vocab_size} tokens, the verifier's model "
            f"{target.model_name!r} {target.vocab_size}: a draft model must share the verifier's tokenizer"
        )
    mine = local_folder(name) if name != "stub" else None
    if mine is not None and folder is not None:
        from specdec.verifiers.hf import HFVerifier

        why = tokenizer_mismatch(
            HFVerifier.load_tokenizer(mine),
            HFVerifier.load_tokenizer(folder),
            draft_name=mine.name,
            target_name=target.model_name,
        )
        if why:
            raise ValueError(f"drafter {label!r}: {why}")


def load_draft_model(
    name: str,
    *,
    verifier: Verifier,
    runtime: str = "torch",
    dtype: str = "float32",
    device: str = "cpu",
    block_size: int = MODEL_BLOCK_SIZE,
    policy: DraftPolicy | None = None,
) -> ModelDrafter:
    """The draft model `name` (a folder, a known name, a hub repo id for MLX, or "stub" beside the stub
    verifier) in `runtime` ("torch": transformers; "mlx": mlx_lm), checked against `verifier`'s tokenizer
    before its weights load. Not bound yet."""
    label = f"model:{name}"
    check_draft_model(name)
    try:
        if name == "stub":
            if verifier.runtime != "stub":
                raise ValueError("the stub draft model drafts for the stub verifier only")
            from specdec.verifiers.stub import StubVerifier

            return ModelDrafter(StubVerifier(), block_size=block_size, policy=policy, name=label)
        from specdec.models import resolve_model

        path = resolve_model(name)
        mask = pard_mask_token(path) if isinstance(path, Path) else None
        tok = None
        if isinstance(path, Path):  # a local folder: its tokenizer is checked before the weights load
            from specdec.verifiers.hf import HFVerifier

            tok = HFVerifier.load_tokenizer(path)
            why = tokenizer_mismatch(
                tok, verifier.tokenizer, draft_name=path.name, target_name=verifier.model_name
            )
            if why:
                raise ValueError(why)
        if runtime == "mlx":
            from specdec.verifiers.mlx import MLXVerifier

            draft: Verifier = MLXVerifier(path, dtype=dtype)
        else:
            from specdec.verifiers.hf import HFVerifier

            # the tokenizer checked above, not loaded a second time (None: HFVerifier loads its own)
            draft = HFVerifier(path, dtype=getattr(torch, dtype), device=device, tokenizer=tok)
        if mask is not None and not 0 <= mask < draft.vocab_size:
            raise ValueError(
                f"its PARD mask token {mask} is outside its vocabulary (0..{draft.vocab_size - 1})"
            )
        return ModelDrafter(
            draft, block_size=block_size, policy=policy, name=label, path=str(path), mask_token_id=mask
        )
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        raise ValueError(f"drafter {label!r}: {e}") from None
