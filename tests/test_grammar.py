"""Structured output (`specdec.grammar`): the masks against a fresh matcher per row; speculative ==
autoregressive under the same grammar (chains of every acceptance, trees, the stub, HF and MLX verifiers,
T > 0 token for token and by chi-square); drafts cut at the first forbidden token and the forced tokens
drafted for free; 50+ JSON schemas whose every output validates; errors before any work. A mask blind to a
row's drafts fails the same tests."""

from __future__ import annotations

import json
import random
import re
from collections import Counter

import pytest
import torch
from drafters import RandomDrafter, ScriptedDrafter, TreeDrafter

from specdec.engine import DecodeConfig, generate
from specdec.grammar import Constraint, GrammarSpec
from specdec.processors import LogitsParams, Processor
from specdec.sampling import Sampler, SamplingParams
from specdec.tree import TreeBudget
from specdec.verifiers.stub import EOS, StubConfig, StubVerifier

pytest.importorskip("llguidance")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
GRAMMAR = LogitsParams(grammar=GrammarSpec.json_schema(PERSON))


@pytest.fixture(scope="module")
def stub() -> StubVerifier:
    return StubVerifier(StubConfig(max_context=512))


def _prompt(v) -> list[int]:
    return v.tokenizer.encode("A person as JSON:")


def _run(v, drafter, params=GRAMMAR, n=60, block=6, **kw):
    cfg = DecodeConfig(max_new_tokens=n, block_size=block if drafter else 1, logits=params, **kw)
    return generate(v, _prompt(v), drafter=drafter, cfg=cfg)


def _drafters(v, ar: list[int]) -> dict:
    ref = _prompt(v) + ar
    n = len(_prompt(v))
    return {
        "all": ScriptedDrafter(ref, vocab=v.vocab_size, block_size=6),
        "none": ScriptedDrafter(ref, vocab=v.vocab_size, block_size=6, wrong_at=range(len(ref) + 64)),
        "part": ScriptedDrafter(ref, vocab=v.vocab_size, block_size=6, wrong_at=(n + 3, n + 11, n + 20)),
        "random": RandomDrafter(vocab=v.vocab_size, block_size=6),
    }


def _valid(run, schema: dict, tokenizer=None) -> None:
    """The run's text (without the stop token that ended it) parses and validates against `schema`."""
    jsonschema = pytest.importorskip("jsonschema")
    tokens = run.output_tokens[:-1] if run.finish_reason == "stop" else run.output_tokens
    text = tokenizer.decode(tokens) if tokenizer is not None else run.text
    jsonschema.validate(json.loads(text), schema)


# ---- the masks ------------------------------------------------------------------------------------------


def test_masks_equal_a_fresh_matcher_per_row(stub: StubVerifier) -> None:
    """Chains and trees of paths, inside the grammar, leaving it, and past its end: each row's mask is what a
    new matcher fed the committed tokens plus that row's path allows (all tokens where the path leaves the
    grammar or passes its end); the matcher is left where it was."""
    import llguidance

    from specdec.grammar import grammar_tokenizer

    spec, V = GRAMMAR.grammar, stub.vocab_size
    text = json.dumps({"name": "ab", "age": 7, "tags": ["red"]})
    ids = list(text.encode())
    rng = random.Random(0)

    def reference(committed, path):
        m = llguidance.LLMatcher(grammar_tokenizer(stub.tokenizer, V, [EOS]), spec.grammar())
        seq = [*committed, *path]
        if m.validate_tokens(seq) < len(seq) or (path and _stopped_before(m, committed, path)):
            return torch.ones(V, dtype=torch.bool)
        m.consume_tokens(seq)
        bits = torch.tensor(list(m.compute_bitmask()), dtype=torch.uint8)
        allowed = ((bits[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).bool().reshape(-1)[:V]
        return allowed if allowed.any() else torch.ones(V, dtype=torch.bool)

    for cut in [0, 1, 5, 12, len(ids)]:
        c = Constraint(spec, stub.tokenizer, V, [EOS])
        c.commit(ids[:cut])
        rest = [*ids[cut:], EOS]
        chain = [rest[:i] for i in range(min(len(rest), 7) + 1)]
        wrong = [[*p[:-1], ord("~")] for p in chain[1:]]
        pool = [*rest[:3], ord("{"), ord("~")]
        tree = [[rng.choice(pool) for _ in range(rng.randrange(4))] for _ in range(9)]
        for paths in [chain, [()], [*chain, *wrong], tree]:
            got = c.mask(paths)
            want = torch.stack([reference(ids[:cut], list(p)) for p in paths])
            assert torch.equal(got, want), (cut, paths)
            m = c.matcher  # still after the committed tokens (all of them: ended, where only a stop follows)
            assert m.validate_tokens(rest) == len(rest) or (cut == len(ids) and m.is_stopped())


def _stopped_before(m, committed, path) -> bool:
    """Whether the grammar ended before the path's last token (a row past the end)."""
    m2 = m.deep_copy()
    m2.consume_tokens(list(committed))
    for t in path:
        if m2.is_stopped():
            return True
        m2.consume_tokens([t])
    return False


# ---- exact under a grammar: speculative == autoregressive ------------------------------------------------


def test_chains_equal_ar_under_a_grammar(stub: StubVerifier) -> None:
    ar = _run(stub, None)
    assert ar.finish_reason == "stop"
    _valid(ar, PERSON)
    assert ar.output_tokens != _run(stub, None, params=None).output_tokens  # the grammar changes the text
    for name, d in _drafters(stub, ar.output_tokens).items():
        run = _run(stub, d)
        assert run.output_tokens == ar.output_tokens, name
        drafted = sum(s.drafted for s in run.decode_steps)
        accepted = sum(s.accepted for s in run.decode_steps)
        # "none" and "random" still get the forced tokens (the keys, the punctuation) accepted
        assert {"all": accepted == drafted, "none": 0 < accepted < drafted, "part": 0 < accepted < drafted,
                "random": accepted > 0}[name], (name, accepted, drafted)  # fmt: skip


def test_a_mask_blind_to_the_drafts_fails_the_same_test(
    stub: StubVerifier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every row masked as if it were the first: the drafts the grammar forces, accepted on row 0's mask,
    leave the grammar (an error) or part from autoregressive decoding's text."""
    ar = _run(stub, None).output_tokens
    real = Constraint.mask
    monkeypatch.setattr(Constraint, "mask", lambda self, paths: real(self, [()] * len(paths)))
    for name in ["all", "part"]:
        try:
            got = _run(stub, _drafters(stub, ar)[name]).output_tokens
        except ValueError:
            continue
        assert got != ar, name


def test_trees_equal_ar_under_a_grammar(stub: StubVerifier) -> None:
    ar = _run(stub, None).output_tokens
    ref = _prompt(stub) + ar
    for kw in [{}, {"wrong_at": (len(_prompt(stub)) + 4, len(ref) - 6)}, {"random_only": True}]:
        d = TreeDrafter(ref, vocab=stub.vocab_size, block_size=5, **kw)
        run = _run(stub, d, block=5, tree=TreeBudget(nodes=12))
        assert run.output_tokens == ar, kw


def test_sampled_under_a_grammar_equals_plain_sampling_token_for_token(stub: StubVerifier) -> None:
    """T > 0, the `match` rule: the same seed gives the same text with and without speculation."""
    for seed in range(3):
        sp = SamplingParams(temperature=0.8, top_p=0.95, seed=seed)
        ar = _run(stub, None, sampling=sp)
        _valid(ar, PERSON)
        for name, d in _drafters(stub, ar.output_tokens).items():
            assert _run(stub, d, sampling=sp).output_tokens == ar.output_tokens, (seed, name)


def _tiny_vocab_tokenizer():
    """Six tokens (<eos>, a, b, c, x, y) as a byte-level BPE: a grammar over the chi-square stub's vocab."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    core = tokenizers.Tokenizer(
        tokenizers.models.BPE(vocab={"<eos>": 0, "a": 1, "b": 2, "c": 3, "x": 4, "y": 5}, merges=[])
    )
    core.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = tokenizers.decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>")


class _FixedDrafter(ScriptedDrafter):
    """Samples every draft from one fixed q: half on the forbidden y, and b over a where the verifier leans
    to a (0.85), so a cut draft's residual is far from p (the bug this guards is then plain to see)."""

    name = "fixed"

    def propose_logits(self, last_token: int, k: int) -> torch.Tensor:
        q = torch.tensor([0.01, 0.05, 0.43, 0.01, 0.01, 0.49])  # <eos> a b c x y
        return q.log().expand(k, -1).clone()  # [k, V]


def test_sampled_rejection_under_a_grammar_keeps_the_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chi-square of the first three tokens under `x[ab][abc]` (x forced, then a choice of two, then three)
    against plain sampling from the masked distribution, enumerated; drafts sampled from a fixed q (the
    forbidden ones cut, the forced x put in front with q one-hot) and verified by `rejection`. The same test
    fails where a cut draft's rejection is dropped (the bonus drawn from p, not from the residual)."""
    import test_sampling as ts

    from specdec.sampling import warp

    v = StubVerifier(StubConfig(vocab_size=ts.V, hidden_size=16, num_layers=2, num_heads=2,
                                intermediate_size=32, max_context=64, logit_scale=1.5))  # fmt: skip
    v.tokenizer = _tiny_vocab_tokenizer()
    params = LogitsParams(grammar=GrammarSpec("regex", "x[ab][abc]"))
    sp = SamplingParams(temperature=1.0, rule="rejection", proposal="sample")

    def exact() -> dict:
        def dist(prefix):
            v.reset()
            c = Constraint(params.grammar, v.tokenizer, ts.V, [0])
            proc = Processor(params, ts.PROMPT, constraint=c)
            proc.commit(prefix)
            return warp(proc(v.forward([*ts.PROMPT, *prefix], last_only=True), [()]), sp)[0].double()

        out, p1 = {}, dist([])
        for a in p1.nonzero().flatten().tolist():
            p2 = dist([a])
            for b in p2.nonzero().flatten().tolist():
                p3 = dist([a, b])
                for c in p3.nonzero().flatten().tolist():
                    out[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
        return out

    def sampled(n: int) -> Counter:
        counts: Counter = Counter()
        d = _FixedDrafter([], vocab=ts.V, block_size=4)
        for seed in range(n):
            cfg = DecodeConfig(max_new_tokens=3, block_size=4, stop_token_ids=frozenset({0}), logits=params,
                               sampling=SamplingParams(**{**sp.__dict__, "seed": seed}))  # fmt: skip
            counts[tuple(generate(v, ts.PROMPT, drafter=d, cfg=cfg).output_tokens)] += 1
        return counts

    want = exact()
    assert len(want) == 6 and all(k[0] == 4 for k in want)
    stat, df = ts.chi2_stat(sampled(ts.N_SAMPLES), want, ts.N_SAMPLES)
    assert stat < ts.chi2_threshold(df, ts.ALPHA), (stat, df)
    real = Sampler.verify
    monkeypatch.setattr(Sampler, "verify", lambda self, *a, cut=None: real(self, *a))
    stat, df = ts.chi2_stat(sampled(ts.N_BROKEN), want, ts.N_BROKEN)
    assert stat > ts.chi2_threshold(df, ts.ALPHA), (stat, df)


# ---- drafts cut and forced ------------------------------------------------------------------------------


def test_forbidden_drafts_cost_no_verify_rows(stub: StubVerifier, monkeypatch: pytest.MonkeyPatch) -> None:
    """A drafter of random tokens: every row the verifier is given lies inside the grammar (the draft was cut
    before its first forbidden token), and the random drafts it proposed were mostly cut."""
    verified: list[list[int]] = []
    real = type(stub).verify

    def spy(self, tokens, **kw):
        verified.append(list(tokens))
        return real(self, tokens, **kw)

    monkeypatch.setattr(type(stub), "verify", spy)
    run = _run(stub, RandomDrafter(vocab=stub.vocab_size, block_size=6))
    c = Constraint(GRAMMAR.grammar, stub.tokenizer, stub.vocab_size, [EOS])
    c.commit(run.steps[0].tokens)  # the prefill's
    assert len(verified) == len(run.decode_steps)
    for tokens, step in zip(verified, run.decode_steps):
        assert c.allowed_prefix(tokens[1:]) == len(tokens) - 1, tokens  # tokens[0]: the last committed
        c.commit(step.tokens)
    drafted = sum(s.drafted for s in run.decode_steps)
    assert drafted < 5 * len(run.decode_steps)  # far fewer rows than the 5 drafts a step proposed


def test_forced_tokens_are_drafted_for_free(stub: StubVerifier) -> None:
    """A drafter that proposes nothing still gets the grammar's forced text verified in its steps: fewer
    steps than tokens, the same text."""
    ar = _run(stub, None)

    class Silent(ScriptedDrafter):
        def propose(self, last_token, n):
            return []

    run = _run(stub, Silent([], vocab=stub.vocab_size, block_size=6))
    assert run.output_tokens == ar.output_tokens
    assert sum(s.accepted for s in run.decode_steps) >= len('{"name": "", "age": , "tags": []}') // 2
    assert len(run.decode_steps) < len(ar.output_tokens) - 10


def test_a_run_without_stop_tokens_ends_with_the_grammar(stub: StubVerifier) -> None:
    """No stop tokens asked for: the grammar's end token (the tokenizer's EOS) still ends the run, where
    the first version went on and broke the matcher."""
    run = _run(stub, RandomDrafter(vocab=stub.vocab_size, block_size=6), stop_token_ids=frozenset())
    assert run.finish_reason == "stop" and run.output_tokens[-1] == EOS
    assert run.output_tokens == _run(stub, None, stop_token_ids=frozenset()).output_tokens


def test_a_cut_by_max_tokens_says_length(stub: StubVerifier) -> None:
    run = _run(stub, None, n=5)
    assert run.finish_reason == "length" and run.text.startswith('{"')


# ---- every output validates -----------------------------------------------------------------------------

S = {"type": "string", "maxLength": 5}
I = {"type": "integer", "minimum": -50, "maximum": 50}
N = {"type": "number", "minimum": 0, "maximum": 1}


def _obj(**props) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


SCHEMAS = [
    _obj(a=S),
    _obj(a=I),
    _obj(a=N),
    _obj(a={"type": "boolean"}),
    _obj(a={"type": "null"}),
    _obj(a={"enum": ["x", "y", "z"]}),
    _obj(a={"const": "fixed"}),
    _obj(a=S, b=I, c=N),
    _obj(a={"type": "array", "items": I, "maxItems": 3}),
    _obj(a={"type": "array", "items": S, "minItems": 1, "maxItems": 2}),
    _obj(a={"type": "array", "items": _obj(k=I), "maxItems": 2}),
    _obj(a=_obj(b=_obj(c=S))),
    _obj(a=_obj(b=I, c={"type": "array", "items": {"type": "boolean"}, "maxItems": 2})),
    _obj(a={"anyOf": [I, S]}),
    _obj(a={"anyOf": [_obj(x=I), _obj(y=S)]}),
    _obj(a={"oneOf": [{"type": "null"}, I]}),
    _obj(a={"type": "string", "pattern": "^[a-z]{3}$"}),
    _obj(a={"type": "string", "pattern": "^[0-9]{2}-[0-9]{2}$"}),
    _obj(a={"type": "string", "format": "date"}),
    _obj(a={"type": "string", "minLength": 2, "maxLength": 4}),
    _obj(a={"type": "integer", "minimum": 10, "maximum": 20}),
    _obj(a={"type": "integer", "exclusiveMinimum": 0, "maximum": 9}),
    _obj(a={"type": "number", "minimum": -1.5, "maximum": -0.5}),
    _obj(a={"type": ["integer", "null"], "maximum": 5, "minimum": 0}),
    _obj(a={"enum": [1, 2, 3]}),
    _obj(a={"enum": [True, None, "s"]}),
    _obj(a=I, b={"enum": ["p", "q"]}),
    {"type": "object", "properties": {"a": I, "b": S}, "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"a": I}, "additionalProperties": False},
    {"type": "array", "items": I, "maxItems": 4},
    {"type": "array", "items": _obj(n=S), "minItems": 1, "maxItems": 2},
    {"type": "array", "prefixItems": [I, S], "items": False},
    {"enum": ["alpha", "beta"]},
    {"type": "integer", "maximum": 99, "minimum": 0},
    {"type": "string", "maxLength": 8},
    {"type": "boolean"},
    {"$defs": {"p": _obj(x=I)}, **_obj(a={"$ref": "#/$defs/p"}, b={"$ref": "#/$defs/p"})},
    {
        "$defs": {"n": {"anyOf": [I, {"type": "array", "items": {"$ref": "#/$defs/n"}, "maxItems": 2}]}},
        "$ref": "#/$defs/n",
    },
    _obj(id={"type": "string", "pattern": "^[A-Z][0-9]{3}$"}, ok={"type": "boolean"}),
    _obj(point=_obj(x=N, y=N), label=S),
    _obj(items={"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}),
    _obj(a={"allOf": [{"type": "integer"}, {"minimum": 3, "maximum": 4}]}),
    _obj(when={"type": "string", "format": "time"}),
    _obj(mail={"type": "string", "format": "email", "maxLength": 12}),
    _obj(u={"type": "string", "format": "uuid"}),
    _obj(a=_obj(b=_obj(c=_obj(d=I)))),
    _obj(matrix={"type": "array", "items": {"type": "array", "items": I, "maxItems": 2}, "maxItems": 2}),
    _obj(k={"type": "object", "additionalProperties": I, "maxProperties": 2}),
    _obj(
        s={"type": "string", "enum": ["one", "two"]},
        n={"type": "number", "multipleOf": 1, "maximum": 3, "minimum": 0},
    ),
    _obj(flag={"const": True}, v={"anyOf": [{"const": 1}, {"const": "one"}]}),
    _obj(a={"type": ["string", "integer"], "maxLength": 3, "maximum": 9, "minimum": 0}),
    {
        "type": "object",
        "properties": {"req": I, "opt": {"type": "array", "items": S, "maxItems": 1}},
        "required": ["req"],
    },
]


def test_fifty_schemas_every_output_validates(stub: StubVerifier) -> None:
    """A random model writes anything the grammar lets it; every output parses and validates. Blank space
    is never free (JSON's separators are fixed)."""
    assert len(SCHEMAS) >= 50
    lookup = None
    for i, schema in enumerate(SCHEMAS):
        params = LogitsParams(grammar=GrammarSpec.json_schema(schema))
        run = _run(stub, lookup, params=params, n=120)
        assert run.finish_reason == "stop", (i, run.text)
        _valid(run, schema)
        assert not re.search(r"\s\s|\{\s|\s\}|\[\s", run.text), run.text


# ---- errors, before any work ----------------------------------------------------------------------------


def test_a_bad_grammar_is_one_line_before_any_work(
    stub: StubVerifier, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(type(stub), "prefill", lambda *a, **k: pytest.fail("work began before the check"))
    for spec, says in [
        (GrammarSpec("regex", "[a-"), "the regex grammar does not compile: .*unclosed character class"),
        (GrammarSpec("lark", "start: x"), "the lark grammar does not compile: .*unknown name"),
        (GrammarSpec.json_schema({"type": "frobnicate"}), "the json_schema grammar does not compile"),
        (
            GrammarSpec.json_schema({"type": "array", "uniqueItems": True}),
            r"Unimplemented keys: .*uniqueItems",
        ),
    ]:
        with pytest.raises(ValueError, match=says) as e:
            _run(stub, None, params=LogitsParams(grammar=spec))
        assert "\n" not in str(e.value)
    for bad, says in [
        (lambda: GrammarSpec("yaml", "x"), "grammar kind must be one of"),
        (lambda: GrammarSpec.json_schema("{"), "the JSON schema is not JSON"),
        (lambda: GrammarSpec.json_schema("[1]"), "a JSON schema is an object"),
        (lambda: GrammarSpec.choice([]), "choice needs a list of non-empty strings"),
        (lambda: GrammarSpec("regex"), "a regex grammar needs its text"),
    ]:
        with pytest.raises(ValueError, match=says):
            bad()


def test_a_model_without_a_tokenizer_is_refused(stub: StubVerifier, monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = _prompt(stub)
    monkeypatch.setattr(stub, "tokenizer", None)
    with pytest.raises(ValueError, match="structured output needs the model's tokenizer"):
        generate(stub, prompt, cfg=DecodeConfig(block_size=1, logits=GRAMMAR))


def test_choice_regex_and_lark(stub: StubVerifier) -> None:
    for spec, ok in [
        (GrammarSpec.choice(["yes", "no", 'a "quoted" one']), lambda t: t in ("yes", "no", 'a "quoted" one')),
        (GrammarSpec("regex", r"[0-9]{3}-[a-z]{2}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
        (
            GrammarSpec("lark", 'start: "(" D ("," D)* ")"\nD: /[0-9]/'),
            lambda t: re.fullmatch(r"\(\d(,\d)*\)", t),
        ),
    ]:
        run = _run(stub, None, params=LogitsParams(grammar=spec))
        assert run.finish_reason == "stop" and ok(run.text), (spec, run.text)
        d = RandomDrafter(vocab=stub.vocab_size, block_size=4)
        assert _run(stub, d, params=LogitsParams(grammar=spec), block=4).output_tokens == run.output_tokens


# ---- the real verifiers, against their runtimes' own generation under the same grammar -----------------


def _reference_mask(hf_tokenizer, vocab: int, eos: int, n_prompt: int):
    """The reference: llguidance's own matcher, fed each new token of the sequence, masking the next logits
    (how a logits processor in transformers or mlx_lm would do it, one token at a time)."""
    import llguidance
    import llguidance.hf
    import llguidance.torch

    tok = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab, eos_token=eos)
    m = llguidance.LLMatcher(tok, GRAMMAR.grammar.grammar())
    seen = [n_prompt]

    def allowed(sequence: list[int]) -> torch.Tensor:  # [V] bool
        m.consume_tokens(sequence[seen[0] :])
        seen[0] = len(sequence)
        bits = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
        llguidance.torch.fill_next_token_bitmask(m, bits, 0)
        return ((bits[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).bool().reshape(-1)[:vocab]

    return allowed


def _tiny_model(tmp_path):
    from tinymodels import tiny_llama, tiny_tokenizer

    return tiny_tokenizer(tiny_llama(tmp_path / "llama"), bos=1, eos=2)


@pytest.mark.hf
def test_hf_verifier_equals_transformers_generate_under_the_grammar(tmp_path) -> None:
    """fp32, a tiny Llama: our AR and speculative decoding (lookup, scripted, random) under a JSON schema
    equal transformers' `generate` with llguidance's mask as its logits processor."""
    transformers = pytest.importorskip("transformers")
    from specdec.api import load_drafter
    from specdec.verifiers.hf import HFVerifier

    v = HFVerifier(_tiny_model(tmp_path))
    prompt = _prompt(v)
    mask = _reference_mask(v.tokenizer, v.vocab_size, 2, len(prompt))

    class Grammar(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            return scores.masked_fill(~mask(input_ids[0].tolist()), float("-inf"))

    ids = torch.tensor([prompt])
    out = v.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=60,
                           logits_processor=transformers.LogitsProcessorList([Grammar()]), pad_token_id=0,
                           eos_token_id=2)[0, len(prompt):].tolist()  # fmt: skip
    ar = _run(v, None)
    assert ar.output_tokens == out and ar.finish_reason == "stop"
    _valid(ar, PERSON, v.tokenizer)
    lookup = load_drafter("prompt-lookup", verifier=v, block_size=6)
    for d in [lookup, *_drafters(v, ar.output_tokens).values()]:
        assert _run(v, d).output_tokens == ar.output_tokens, d.name


@pytest.mark.mlx
def test_mlx_verifier_equals_mlx_lms_generate_under_the_grammar(tmp_path) -> None:
    """The same tiny Llama in MLX: our AR and speculative decoding equal mlx_lm's `generate_step` with
    llguidance's mask as its logits processor (the mask built from mlx_lm's own tokenizer wrapper)."""
    mx = pytest.importorskip("mlx.core")
    from mlx_lm.generate import generate_step

    from specdec.verifiers.mlx import MLXVerifier

    v = MLXVerifier(_tiny_model(tmp_path))
    prompt = _prompt(v)
    mask = _reference_mask(v.tokenizer._tokenizer, v.vocab_size, 2, len(prompt))

    def grammar(tokens, logits):
        keep = mx.array(mask(tokens.tolist()).numpy())
        return mx.where(keep, logits, -float("inf"))

    gen = generate_step(mx.array(prompt), v.model, max_tokens=60, sampler=lambda lp: mx.argmax(lp, axis=-1),
                        logits_processors=[grammar])  # fmt: skip
    theirs = []
    for t, _ in gen:
        theirs.append(int(t))
        if theirs[-1] == 2:
            break
    ar = _run(v, None)
    assert ar.output_tokens == theirs and ar.finish_reason == "stop"
    _valid(ar, PERSON, v.tokenizer)
    for name, d in _drafters(v, ar.output_tokens).items():
        assert _run(v, d).output_tokens == ar.output_tokens, name


@pytest.mark.slow
@pytest.mark.hf
def test_smollm2_writes_valid_json_with_its_drafter_exactly() -> None:
    """A real model, its bundled drafter plus lookup: equal to AR under each schema, every output valid, and
    the drafts (with the forced tokens) accepted."""
    pytest.importorskip("transformers")
    from specdec.api import bundled_corpus, encode_prompt, load_drafter, load_verifier

    v = load_verifier("hf", "smollm2-135m")
    d = load_drafter("bundled:smollm2-135m+lookup", verifier=v, corpus=bundled_corpus("smollm2-135m"))
    ask = "Describe a fictional person as JSON with their name, age and favourite colours."
    ids = encode_prompt(v, [{"role": "user", "content": ask}])
    for schema in [PERSON, SCHEMAS[10], SCHEMAS[15], SCHEMAS[38]]:
        params = LogitsParams(grammar=GrammarSpec.json_schema(schema))
        ar = generate(v, ids, cfg=DecodeConfig(max_new_tokens=80, block_size=1, logits=params))
        spec = generate(v, ids, drafter=d, cfg=DecodeConfig(max_new_tokens=80, block_size=d.block_size,
                                                             logits=params))  # fmt: skip
        assert spec.output_tokens == ar.output_tokens, schema
        assert ar.finish_reason == "stop", ar.text
        _valid(ar, schema, v.tokenizer)
        assert sum(s.accepted for s in spec.decode_steps) > len(spec.decode_steps)  # more than one a step


def test_the_command_line_flags(tmp_path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """`--json-schema` (inline or a file), `--regex`, `--lark FILE`: the output obeys; a bad one is one line
    before the model loads."""
    import specdec.api as api
    from specdec.cli import main

    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    lark = tmp_path / "g.lark"
    lark.write_text('start: "<" D D ">"\nD: /[0-9]/')
    base = ["generate", "--verifier", "stub", "--prompt", "Person:", "--max-new-tokens", "60"]
    for flags, ok in [
        (["--json-schema", str(schema)], lambda t: _valid_text(t, PERSON)),
        (["--json-schema", json.dumps(PERSON)], lambda t: _valid_text(t, PERSON)),
        (["--regex", "[xyz]{5}"], lambda t: re.fullmatch("[xyz]{5}", t)),
        (["--lark", str(lark)], lambda t: re.fullmatch(r"<\d\d>", t)),
    ]:
        assert main([*base, *flags]) == 0, flags
        assert ok(capsys.readouterr().out.strip()), flags
    monkeypatch.setattr(api, "load", lambda *a, **k: pytest.fail("the model loaded before the check"))
    for flags, says in [
        (["--regex", "[a-"], "the regex grammar does not compile"),
        (["--json-schema", "{x"], "--json-schema: the JSON schema is not JSON"),
        (["--json-schema", str(tmp_path / "none.json")], "--json-schema: cannot read"),
        (["--lark", str(schema)], "the lark grammar does not compile"),
    ]:
        assert main([*base, *flags]) == 2, flags
        err = capsys.readouterr().err
        assert says in err and err.count("\n") <= 2, (flags, err)


def _valid_text(text: str, schema: dict) -> bool:
    pytest.importorskip("jsonschema").validate(json.loads(text), schema)
    return True


@pytest.mark.hf
def test_generate_prints_the_reply_without_its_stop_token(tmp_path, capsys) -> None:
    """`specdec generate` on a model whose stop token has a name (the tiny tokenizer's): the regex's answer
    alone, as a reader sees it (it printed "abc<bos>", SmolLM2's "...<|im_end|>")."""
    from tinymodels import tiny_llama, tiny_tokenizer

    from specdec.cli import main

    model = tiny_tokenizer(tiny_llama(tmp_path / "llama"), bos=1, eos=2)
    args = ["generate", "--verifier", "hf", "--model", str(model), "--prompt", "x", "--regex", "[a-c]{3}"]
    assert main(args) == 0
    out = capsys.readouterr().out.strip()
    assert re.fullmatch("[a-c]{3}", out), out


def test_the_stub_needs_no_transformers(stub: StubVerifier, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wheel with the serve extra and without hf: structured output on the stub's own tokenizer works
    (llguidance's HF adapter imports transformers; it was imported for every tokenizer and failed)."""
    import sys

    from specdec import grammar

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    monkeypatch.delitem(sys.modules, "llguidance.hf", raising=False)
    monkeypatch.setattr(grammar, "_TOKENIZERS", type(grammar._TOKENIZERS)())
    run = _run(stub, None)
    assert run.finish_reason == "stop"
    _valid(run, PERSON)


@pytest.mark.hf
def test_eagle3_and_mtp_drafters_equal_ar_under_a_grammar_and_processors(tmp_path) -> None:
    """The drafters that read the verifier's hidden states (an EAGLE-3 checkpoint on a tiny Llama, a
    tiny Qwen3.5's own MTP layer), under a grammar with penalties and a bias: speculation equals
    autoregressive decoding token for token, greedy and sampled by rejection, and the drafters drafted."""
    pytest.importorskip("transformers")
    import eagle3ckpt
    import tinymodels

    from specdec.drafting.load import load_drafter
    from specdec.verifiers.hf import HFVerifier

    llama = tinymodels.tiny_tokenizer(tinymodels.tiny_llama(tmp_path / "llama"))
    qwen = tinymodels.add_mtp(tinymodels.tiny_tokenizer(
        tinymodels.tiny_qwen3_5(tmp_path / "qwen", multimodal=False, layers=4)))  # fmt: skip
    e3 = eagle3ckpt.tiny_eagle3(tmp_path / "e3", target_hidden=64, vocab=320, aux=[1, 2, 4])
    words = GrammarSpec("regex", "[a-z]{2,6}( [a-z]{2,6}){3,6}[.!]")
    params = LogitsParams(grammar=words, logit_bias={70: 0.8}, repetition_penalty=1.2, presence_penalty=0.3)
    for folder, kind in [(llama, str(e3)), (qwen, "mtp")]:
        v = HFVerifier(folder)
        d = load_drafter(kind, verifier=v)
        prompt = v.tokenizer.encode("Say a few words:")

        def text(run, v=v) -> str:  # without the stop token
            return v.tokenizer.decode(run.output_tokens, skip_special_tokens=True)

        for sp in [None, SamplingParams(temperature=1.0, seed=4, rule="rejection", proposal="sample")]:
            cfg = dict(max_new_tokens=60, logits=params, sampling=sp)
            ar = generate(v, prompt, cfg=DecodeConfig(block_size=1, **cfg))
            spec = generate(v, prompt, drafter=d, cfg=DecodeConfig(block_size=4, **cfg))
            assert ar.finish_reason == "stop" and re.fullmatch(words.source, text(ar)), ar.text
            if sp is None:  # at T > 0 rejection's output is the same distribution, not the same tokens
                assert spec.output_tokens == ar.output_tokens, kind
            assert re.fullmatch(words.source, text(spec)), spec.text
            assert sum(s.drafted for s in spec.decode_steps) > 0, kind


def test_grammars_per_request_in_a_batch_equal_their_solo_runs() -> None:
    """Requests with different grammars (a schema, a regex, none), drafters and sampling, batched on the
    stub: each equals its own run alone, and the requests' verifies did share forwards."""
    from measured import batch_or_refused, shared

    from specdec.batch import Request, generate_many

    v = StubVerifier(dtype=torch.bfloat16)  # as test_batch's stub case
    batch = batch_or_refused(v)
    if batch is None:  # refused where this machine's measurement says rows depend on the call (checked)
        return
    schema = LogitsParams(grammar=GrammarSpec.json_schema(json.dumps(PERSON)), presence_penalty=0.5)
    words = LogitsParams(grammar=GrammarSpec("regex", "[a-z]{2,6}( [a-z]{2,6}){2,5}\\."))
    reject = SamplingParams(temperature=1.0, seed=2, rule="rejection", proposal="sample")

    def requests() -> list[Request]:
        out = []
        for i, (logits, sp) in enumerate([(schema, None), (words, reject), (None, None), (schema, reject)]):
            d = RandomDrafter(vocab=v.vocab_size, block_size=5, seed=i)
            cfg = DecodeConfig(max_new_tokens=80, block_size=5, logits=logits, sampling=sp)
            out.append(Request(prompt=v.tokenizer.encode(f"Request {i}:"), cfg=cfg, drafter=d))
        return out

    want = [generate(v, r.prompt, drafter=r.drafter, cfg=r.cfg).output_tokens for r in requests()]
    since = batch.forwards.copy()
    got = generate_many(batch, requests())
    assert [g.output_tokens for g in got] == want
    assert shared(batch, since) > 1
