"""What a hostile probe of the engine, the command line and the API found (issue 49: 511 cases, 15 bugs).
Each test here reproduced its bug before the fix."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from drafters import ScriptedDrafter, TreeDrafter

from specdec.api import load_drafter
from specdec.engine import DecodeConfig, generate
from specdec.stream import ChatSession, Engine
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
    a, b = Engine(v, d), Engine(v, d)
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
        engine, out = Engine(v, d), []
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
    a, b = Engine(v), Engine(v)
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

    from specdec.drafting.dflash_mlx import MLXDFlashDrafter
    from specdec.models import GEMMA3_CHAT_TEMPLATE
    from specdec.verifiers.mlx import MLXVerifier

    path = tinymodels.tiny_tokenizer(
        tinymodels.tiny_llama(tmp_path / "llama"), chat_template=GEMMA3_CHAT_TEMPLATE
    )

    def engine() -> Engine:
        v = MLXVerifier(path)
        d = MLXDFlashDrafter.from_pretrained(_checkpoint(tmp_path / "d", v, draft_vocab=False))
        d.bind(v)
        return Engine(v, d)

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
    if not v.batch_invariant:
        pytest.skip("a bf16 stub verify is not batch-invariant on this CPU (measured): runs take fp32 here")
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

    x, w = torch.randn(64, 64).bfloat16(), torch.ones(64).bfloat16()
    rows = torch.cat([_old_bf16_norm(x[i : i + 1], w, 1e-6) for i in range(64)])
    if torch.equal(_old_bf16_norm(x, w, 1e-6), rows):
        pytest.skip("this CPU's bf16 rsqrt rounds alike in every call size")
    monkeypatch.setattr(stub, "_rms_norm", _old_bf16_norm)
    assert not stub.StubVerifier(dtype=torch.bfloat16).batch_invariant


def test_a_bf16_stub_chat_session_after_an_edited_first_message_equals_a_fresh_run():
    v = _bf16_stub()
    engine = Engine(v, load_drafter("prompt-lookup", verifier=v))
    session = ChatSession(engine)
    for text in ("Tell me about the sea, the sea and the sea.", "And the sky?"):
        session.send(text, max_tokens=48).text()
    session.messages[0]["content"] = "Tell me about the moon, the moon and the moon."
    edited = session.send("And the stars?", max_tokens=48)
    edited.text()
    fresh = Engine(StubVerifier(dtype=torch.bfloat16), None).complete(edited.prompt_ids, max_tokens=48)
    assert edited.result.reused_tokens > 0 and edited.result.output_tokens == fresh.output_tokens
