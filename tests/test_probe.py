"""What a hostile probe of the engine, the command line and the API found (issue 49: 511 cases, 15 bugs).
Each test here reproduced its bug before the fix."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from drafters import ScriptedDrafter, TreeDrafter
from measured import exact_or_measured_not

from specdec.api import RunSpec, check_drafter, load_drafter
from specdec.cli import main
from specdec.engine import DecodeConfig, generate
from specdec.stream import ChatSession, StreamingEngine
from specdec.tree import TreeBudget
from specdec.verifiers.stub import StubVerifier


def test_ctrl_c_while_torch_imports_is_one_line_and_exit_1():
    """The console script imports torch (seconds) inside its own interrupt handling; an import hook stands
    in for the key press, at the same moment each time."""
    code = textwrap.dedent("""
        import sys
        class Interrupt:
            def find_spec(self, name, path=None, target=None):
                if name == "torch":
                    raise KeyboardInterrupt
        sys.meta_path.insert(0, Interrupt())
        from specdec.console import main
        sys.exit(main(["generate", "--verifier", "stub", "--prompt", "hi"]))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stderr) == (1, "error: interrupted\n")


# ---- two engines on one loaded model ----------------------------------------------------------------------


def _fresh(text: str, n: int, drafter_spec: str = "prompt-lookup") -> list[int]:
    """What a model of its own decodes for `text`: the reference."""
    v = StubVerifier()
    d = load_drafter(drafter_spec, verifier=v)
    ids = v.tokenizer.encode(text)
    cfg = DecodeConfig(max_new_tokens=n, block_size=d.block_size if d else 1)
    return generate(v, ids, drafter=d, cfg=cfg).output_tokens


def test_an_engine_does_not_reuse_a_cache_another_engine_overwrote():
    """Engine B's run leaves the shared cache at the very position engine A's left it: A used to take B's
    keys for its own conversation's start."""
    v = StubVerifier()
    d = load_drafter("prompt-lookup", verifier=v)
    a, b = StreamingEngine(v, d), StreamingEngine(v, d)
    first = a.complete("Hello there, how", max_tokens=20)
    b.complete("Jello where, who", max_tokens=20)  # same length: the same position afterwards
    assert first.finish_reason == "length" and v.position == len(a.cached_tokens)
    turn2 = "Hello there, how" + v.tokenizer.decode(first.output_tokens) + " and then?"
    second = a.complete(turn2, max_tokens=20)
    assert second.reused_tokens == 0  # prefilled again
    assert second.output_tokens == _fresh(turn2, 20)
    third = a.complete(turn2 + "!", max_tokens=8)  # nobody else ran since: reused again
    assert third.reused_tokens > 0 and third.output_tokens == _fresh(turn2 + "!", 8)


def test_two_threads_with_engines_on_one_model_each_get_their_own_text():
    v = StubVerifier()
    d = load_drafter("prompt-lookup", verifier=v)
    texts = ["The cat sat on the ", "A different prompt, "]
    got: dict[int, list] = {}

    def conversation(k: int) -> None:
        engine, out = StreamingEngine(v, d), []
        for i in range(12):
            try:
                out.append(engine.complete(texts[k] + str(i), max_tokens=16).output_tokens)
            except Exception as e:  # reported by the comparison below
                out.append(repr(e))
        got[k] = out

    threads = [threading.Thread(target=conversation, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for k, text in enumerate(texts):
        assert got[k] == [_fresh(text + str(i), 16) for i in range(12)]


def test_two_streams_of_two_engines_iterated_in_turn_on_one_thread_are_refused():
    v = StubVerifier()
    a, b = StreamingEngine(v), StreamingEngine(v)
    s = a.stream("Hello", max_tokens=8)
    next(s)  # a's run holds the model
    with pytest.raises(RuntimeError, match="in use by another run on this thread"):
        next(b.stream("World", max_tokens=8))
    s.close()
    assert b.complete("World", max_tokens=8).output_tokens == _fresh("World", 8, "none")


@pytest.mark.mlx
def test_the_mlx_drafter_decodes_turns_on_threads_of_their_own(tmp_path: Path):
    """An app that runs each turn on a thread of its own (a worker per request, `async for`): the MLX drafter
    used to leave its cache lazy on the first thread, and the second failed with 'There is no Stream(cpu, N)
    in current thread'."""
    pytest.importorskip("mlx_lm")
    import tinymodels
    from test_dflash_mlx import _checkpoint

    from specdec.drafting.dflash.mlx import MLXDFlashDrafter
    from specdec.models import GEMMA3_CHAT_TEMPLATE
    from specdec.verifiers.mlx import MLXVerifier

    path = tinymodels.tiny_tokenizer(
        tinymodels.tiny_llama(tmp_path / "llama"), chat_template=GEMMA3_CHAT_TEMPLATE
    )

    def engine() -> StreamingEngine:
        v = MLXVerifier(path)
        d = MLXDFlashDrafter.from_pretrained(_checkpoint(tmp_path / "d", v, draft_vocab=False))
        d.bind(v)
        return StreamingEngine(v, d)

    prompts, threaded, results = [[1, 5, 9, 14], [1, 5, 9, 14, 20, 3]], engine(), {}

    def turn(k: int) -> None:
        try:
            results[k] = threaded.complete(prompts[k], max_tokens=12).output_tokens
        except Exception as e:  # reported by the comparison below
            results[k] = repr(e)

    for k in range(2):
        t = threading.Thread(target=turn, args=(k,))
        t.start()
        t.join(timeout=120)
    main = engine()
    assert [results[0], results[1]] == [main.complete(p, max_tokens=12).output_tokens for p in prompts]

    async def chat(session: ChatSession, text: str) -> str:
        return "".join([ev.delta async for ev in session.send(text, max_tokens=8)])

    session = ChatSession(engine())  # each `async for` decodes on a new worker thread
    replies = [asyncio.run(chat(session, text)) for text in ("hi", "and then?")]
    assert len(session.messages) == 4 and replies[1] == session.messages[-1]["content"]


# ---- the bf16 stub verifier, exact in every size it accepts --------------------------------------------


def _old_bf16_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _bf16_stub() -> StubVerifier:
    v = StubVerifier(dtype=torch.bfloat16)
    assert exact_or_measured_not(v), "the bf16 stub is batch-invariant on both of this project's CPU kinds"
    return v


def test_the_bf16_stub_chains_and_trees_of_up_to_64_tokens_equal_autoregressive():
    """A bf16 norm (torch's vectorised bf16 rsqrt from 32 rows) made --tree 32 and blocks of 32+ differ (11 of
    these 20 runs did)."""
    v = _bf16_stub()
    for text in ("The quick brown fox jumps over", "Hello world, this is", "def f(x):\n    return",
                 "Once upon a time", "1, 2, 3, 4,"):  # fmt: skip
        prompt = v.tokenizer.encode(text)
        ar = generate(v, prompt, cfg=DecodeConfig(max_new_tokens=120, block_size=1)).output_tokens
        ref = [*prompt, *ar]
        for block in (33, 64):
            d = ScriptedDrafter(ref, vocab=v.vocab_size, wrong_at=(len(prompt) + 40,), block_size=block)
            out = generate(v, prompt, drafter=d, cfg=DecodeConfig(max_new_tokens=120, block_size=block))
            assert out.output_tokens == ar and max(s.drafted for s in out.steps) == block - 1, (text, block)
        for nodes in (32, 64):
            d = TreeDrafter(ref, vocab=v.vocab_size, wrong_at=(len(prompt) + 5,), block_size=16)
            cfg = DecodeConfig(max_new_tokens=120, block_size=16, tree=TreeBudget(nodes))
            out = generate(v, prompt, drafter=d, cfg=cfg)
            assert out.output_tokens == ar and max(s.tree_nodes or 0 for s in out.steps) == nodes, (
                text,
                nodes,
            )


def test_the_load_time_measurement_sees_a_kernel_that_rounds_from_32_rows(monkeypatch):
    import specdec.verifiers.stub as stub

    def from_32_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """A norm whose kernel rounds otherwise from 32 rows on (as torch's vectorised bf16 rsqrt did on
        one CPU kind), whatever this CPU's own rsqrt does."""
        out = _old_bf16_norm(x, weight, eps)
        return out * (1 + 2**-7) if x.reshape(-1, x.shape[-1]).shape[0] >= 32 else out

    monkeypatch.setattr(stub, "_rms_norm", from_32_rows)
    assert not stub.StubVerifier(dtype=torch.bfloat16).batch_invariant


def test_a_bf16_stub_chat_session_after_an_edited_first_message_equals_a_fresh_run():
    v = _bf16_stub()
    engine = StreamingEngine(v, load_drafter("prompt-lookup", verifier=v))
    session = ChatSession(engine)
    for text in ("Tell me about the sea, the sea and the sea.", "And the sky?"):
        session.send(text, max_tokens=48).text()
    session.messages[0]["content"] = "Tell me about the moon, the moon and the moon."
    edited = session.send("And the stars?", max_tokens=48)
    edited.text()
    fresh = StreamingEngine(StubVerifier(dtype=torch.bfloat16), None).complete(
        edited.prompt_ids, max_tokens=48
    )
    assert edited.result.reused_tokens > 0 and edited.result.output_tokens == fresh.output_tokens


# ---- the one-line refusals: before anything loads, naming what is wrong ---------------------------------


def _cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    err = capsys.readouterr().err
    return rc, err


def _one_line_error(rc: int, err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:") or "Traceback" in line]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error:"), err
    return lines[0]


def _dflash_folder(path: Path, **config: object) -> Path:
    """The stub-sized DFlash checkpoint of the hardening tests, its config.json patched with `config`."""
    from test_hardening import _stub_drafter_folder

    folder = _stub_drafter_folder(path)
    raw = json.loads((folder / "config.json").read_text())
    for k, v in config.items():
        if v is _DROP:
            raw.pop(k)
        else:
            raw[k] = v
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


_DROP = object()
_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "vocab_size": 259}
FORMATS = {
    # EAGLE-3 folders (speculators, SGLang, yuhuili), speculators' DFlash and DSpark are read now:
    # test_eagle3.py, test_speculators.py, test_dspark.py
    "speculators dspark": ({"speculators_model_type": "dspark", "speculators_config": {}},
                           "a DSpark drafter (speculators format), which specdec does not read yet"),
    # Medusa in FasterDecoding's layout (a pickle): named, not unpickled; vLLM's is read (test_medusa.py)
    "medusa": ({"medusa_num_heads": 4, "medusa_num_layers": 1},
               "holds Medusa heads in FasterDecoding's layout (medusa_num_heads, a pickled"),
    # read now (test_gemma4_assistant.py): a folder without its text config is named as one
    "gemma4 unified assistant": ({"model_type": "gemma4_unified_assistant"},
                                 "assistant 'gemma4-unified-assistant': config.json has no text_config"),
    # mlx-vlm's split qwen3_5_mtp folders are read now (test_mtp.py); a split without its model's config,
    # or of a family specdec does not read, is named
    "split mtp": ({"model_type": "qwen3_5_mtp"},
                  "split MTP folder 'split-mtp': config.json lacks the model's text_config"),
    "split nemotron mtp": ({"model_type": "nemotron_h_mtp"},
                           "holds MTP layers of model_type 'nemotron_h_mtp'; specdec reads ['qwen3_5_mtp']"),
    "qwen3.5 with mtp": ({"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
                          "text_config": {"mtp_num_hidden_layers": 1}},
                         "to draft with its MTP layers, load it as --model and pass --drafter mtp (HF "
                         "verifier); to draft with it token by token, pass --drafter model:"),
    "causal lm": ({**_LLAMA, "architectures": ["LlamaForCausalLM"]},
                  "a causal LM (model_type 'llama', architectures ['LlamaForCausalLM']), not a drafter "
                  "checkpoint; to draft with it token by token, pass --drafter model:"),
    "pard": ({**_LLAMA, "architectures": ["Qwen3ForCausalLM"], "pard_token": 151669},
             "a PARD parallel draft model"),
    "unknown": ({"foo": 1}, "an unrecognised checkpoint; specdec reads DFlash / DFlash2 checkpoints"),
}  # fmt: skip


@pytest.mark.parametrize("kind", FORMATS)
def test_other_drafter_formats_are_named_not_diagnosed_as_broken_dflash(kind, tmp_path: Path, capsys):
    config, says = FORMATS[kind]
    folder = tmp_path / kind.replace(" ", "-")
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=re.escape(says)):
        check_drafter(str(folder))
    line = _one_line_error(
        *_cli(capsys, "generate", "--verifier", "stub", "--drafter", str(folder), "--prompt", "x")
    )
    assert says in line and "DFlash config is missing" not in line


def test_a_drafter_folder_given_as_the_model_is_refused_before_transformers_builds_a_random_model(
    tmp_path: Path, capsys
):
    folder = _dflash_folder(tmp_path / "d")
    line = _one_line_error(
        *_cli(capsys, "generate", "--verifier", "hf", "--model", str(folder), "--prompt", "x")
    )
    assert (
        "holds a DFlash drafter (public format), not a model: it drafts for one (pass it as --drafter)"
        in line
    )
    from specdec.verifiers.hf import HFVerifier

    with pytest.raises(ValueError, match="not a model"):
        HFVerifier(folder)


CONFIGS = {
    "no kv heads": ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer, got 0"),
    "null hidden size": ({"hidden_size": None}, "hidden_size must be a positive integer, got None"),
    "dflash_config a string": ({"dflash_config": "oops"}, "dflash_config must be an object, got 'oops'"),
    "head_dim a string": ({"head_dim": "16"}, "head_dim must be a positive integer, got '16'"),
    "huge block": ({"block_size": 100000}, "block_size 100000 is not 2..64"),
}


@pytest.mark.parametrize("case", CONFIGS)
def test_malformed_dflash_configs_are_one_line(case, tmp_path: Path, capsys):
    patch, says = CONFIGS[case]
    folder = _dflash_folder(tmp_path / "d", **patch)
    line = _one_line_error(
        *_cli(capsys, "generate", "--verifier", "stub", "--drafter", str(folder), "--prompt", "x")
    )
    assert says in line


def test_a_checkpoint_missing_a_weight_is_refused_as_model_and_as_draft_model(tmp_path: Path):
    import tinymodels
    from safetensors.torch import load_file, save_file

    from specdec.verifiers.hf import HFVerifier

    path = tinymodels.tiny_tokenizer(tinymodels.tiny_llama(tmp_path / "m"))
    full = HFVerifier(path)
    (weights,) = path.glob("*.safetensors")
    state = load_file(weights)
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, weights, metadata={"format": "pt"})
    says = r"lacks 1 of the model's weights \(model.layers.1.mlp.down_proj.weight\)"
    with pytest.raises(ValueError, match=says):
        HFVerifier(path)
    with pytest.raises(ValueError, match=says):
        load_drafter(f"model:{path}", verifier=full)


def test_links_at_the_staging_paths_of_old_are_never_written_through(tmp_path: Path, capsys):
    victim = tmp_path / "victim"
    victim.write_text("mine\n")
    for name in ("r.steps.jsonl.tmp", ".r.json.tmp", ".r.steps.jsonl.tmp"):
        (tmp_path / name).symlink_to(victim)
    rc, err = _cli(capsys, "generate", "--verifier", "stub", "--prompt", "hi", "--max-new-tokens", "4",
                   "--out", str(tmp_path / "r.json"))  # fmt: skip
    assert rc == 0, err
    assert victim.read_text() == "mine\n"
    steps = tmp_path / "r.steps.jsonl"
    assert steps.is_file() and not steps.is_symlink() and len(steps.read_text().splitlines()) >= 2


@pytest.mark.parametrize("flags", [["--temperature", "1e-40"], ["--temperature", "1", "--top-p", "1e-300"]])
def test_degenerate_sampling_gives_the_top_token_not_empty_text(flags, capsys):
    """Both used to make an all-NaN distribution: 16 tokens of nothing."""
    argv = ["generate", "--verifier", "stub", "--prompt", "The cat", "--max-new-tokens", "16"]
    assert main(argv) == 0
    greedy = capsys.readouterr().out
    assert main([*argv, *flags]) == 0
    assert capsys.readouterr().out == greedy and greedy.strip()


def test_degenerate_sampling_over_the_server_is_the_greedy_answer():
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from test_server import _serve

    for s in _serve(StreamingEngine(StubVerifier()), model_name="stub"):
        url, body = s.url + "/v1/completions", {"prompt": "The cat", "max_tokens": 12}
        texts = [
            httpx.post(url, json={**body, **kw}, timeout=60).json()["choices"][0]["text"]
            for kw in ({}, {"temperature": 1e-40}, {"temperature": 1.0, "top_p": 1e-300})
        ]
        assert texts[0].strip() and texts == [texts[0]] * 3


def test_a_truncated_corpus_chunk_or_record_is_named_before_the_model_loads(tmp_path: Path):
    from specdec.bundled import bundled_corpus

    corpus = tmp_path / "corpus"
    shutil.copytree(bundled_corpus("smollm2-135m"), corpus)
    chunk = next(corpus.glob("turn1/chunk-*.npz"))
    chunk.write_bytes(chunk.read_bytes()[:1000])
    spec = RunSpec(
        verifier="hf", model="smollm2-135m", drafter="bundled:smollm2-135m+lookup", corpus=str(corpus)
    )
    with pytest.raises(ValueError, match=re.escape(f"corpus file {str(chunk)!r} cannot be read")):
        spec.check()
    (corpus / "corpus.json").write_text("{not json")
    with pytest.raises(
        ValueError, match=re.escape(f"{str(corpus / 'corpus.json')!r} is not a JSON corpus record")
    ):
        spec.check()


@pytest.mark.parametrize("relative", [{"1": 0, "2": 0}, {"1": -1.0, "2": -2.0}])
def test_zero_or_negative_verify_costs_are_one_line(relative, tmp_path: Path, capsys):
    table = tmp_path / "T.json"
    table.write_text(json.dumps({"relative": {"128": relative}}))
    folder = _dflash_folder(tmp_path / "d")
    line = _one_line_error(*_cli(capsys, "generate", "--verifier", "stub", "--drafter", str(folder),
                                 "--tree", "auto", "--costs", str(table), "--prompt", "x"))  # fmt: skip
    assert "verify costs must be positive finite numbers" in line


def test_a_draft_model_or_corpus_of_another_model_is_refused_before_the_model_loads():
    """Both used to be refused only after the verifier loaded (98 s / 28 s); the known models' shapes
    are known without fetching them."""
    with pytest.raises(
        ValueError, match=r"its vocabulary has 262144 tokens, the verifier's model 'smollm2-135m' 49152"
    ):
        RunSpec(verifier="hf", model="smollm2-135m", drafter="model:gemma3-270m").check()
    with pytest.raises(ValueError, match=r"written by .*gemma.* not by the verifier's model 'smollm2-135m'"):
        RunSpec(
            verifier="hf",
            model="smollm2-135m",
            drafter="bundled:smollm2-135m+lookup",
            corpus="bundled:gemma3-270m",
        ).check()


def test_an_empty_out_is_refused(capsys):
    line = _one_line_error(*_cli(capsys, "generate", "--verifier", "stub", "--prompt", "x", "--out", ""))
    assert "the output path is empty" in line


def test_replay_refuses_a_block_larger_than_its_drafters_before_the_model_loads(tmp_path: Path, capsys):
    from specdec.evals.replay import main as replay

    folder = _dflash_folder(tmp_path / "d")  # block size 4
    rc = replay(["--verifier", "stub", "--drafter", str(folder), "--block-size", "6"])
    line = _one_line_error(rc, capsys.readouterr().err)
    assert "--block-size 6 exceeds drafter" in line and "block size 4" in line
    assert replay(["--verifier", "stub", "--drafter", str(folder), "--block-size", "100"]) == 2


@pytest.mark.mlx
@pytest.mark.parametrize("family", ["gemma4", "gemma4_moe"])
def test_an_mlx_gemma4_loaded_on_one_thread_decodes_on_another(tmp_path: Path, family):
    """mlx_lm's Gemma 4 keeps its proportional RoPE's frequencies as a lazy private array made when the
    model is built; decoding on another thread (a server's worker, an app's) failed with 'There is no
    Stream(cpu, 0) in current thread' (found as a draft model in a batch). The verifier evaluates every
    array of the model where it loads it, parameters or not."""
    pytest.importorskip("mlx_lm")
    import tinymodels

    from specdec.engine import DecodeConfig, generate
    from specdec.verifiers.mlx import MLXVerifier

    folder = tinymodels.tiny_gemma4(tmp_path / family, moe=family == "gemma4_moe")
    v = MLXVerifier(folder, dtype="float32")
    cfg = DecodeConfig(max_new_tokens=6, block_size=1)
    got: dict[str, object] = {}

    def run() -> None:
        try:
            got["tokens"] = generate(v, [5, 6, 7, 8], cfg=cfg).output_tokens
        except Exception as e:  # reported by the comparison below
            got["tokens"] = repr(e)

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=120)
    assert (
        got["tokens"] == generate(MLXVerifier(folder, dtype="float32"), [5, 6, 7, 8], cfg=cfg).output_tokens
    )
