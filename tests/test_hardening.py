"""What a hostile but realistic user does: requests that used to kill the server, sliding windows that cannot
roll back, the README's own commands, outputs that are not ours, and flags that used to give tracebacks.
Each case was a reproduced failure (issue 15) before its fix."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from tinymodels import tiny_gemma3, tiny_tokenizer

from specdec.args import run_command
from specdec.cli import main
from specdec.drafting.dflash.config import DFlashConfig, save_checkpoint
from specdec.models import GEMMA3_CHAT_TEMPLATE
from specdec.protocols import RollbackError
from specdec.stream import ChatSession, StreamingEngine
from specdec.verifiers.stub import StubVerifier

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
from test_server import _serve  # noqa: E402

CLI = [sys.executable, "-m", "specdec.cli"]


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Gemma 3 (sliding window 16) with a byte tokenizer and Gemma's real chat template."""
    path = tiny_gemma3(tmp_path_factory.mktemp("gemma3") / "m", sliding_window=16)
    return tiny_tokenizer(path, chat_template=GEMMA3_CHAT_TEMPLATE)


def _hf(path: Path):
    from specdec.verifiers.hf import HFVerifier

    return HFVerifier(path)


def _stub_drafter_folder(path: Path, block_size: int = 4) -> Path:
    """A random DFlash checkpoint that binds to the stub verifier (block size 4)."""
    from test_checkpoint import random_state

    cfg = DFlashConfig(
        hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=32, vocab_size=259, num_target_layers=4, mask_token_id=258, block_size=block_size,
        target_layer_ids=(1, 2),
    )  # fmt: skip
    return save_checkpoint(path, cfg, random_state(cfg))


# ---- 1. no request takes the server down ------------------------------------------------------------------


def _chat(url: str, messages: list, **kw) -> httpx.Response:
    body = {"messages": messages, "max_tokens": 6, **kw}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def test_lone_surrogates_and_template_errors_are_400s_and_the_server_lives(gemma_dir):
    v = _hf(gemma_dir)
    ok = [{"role": "user", "content": "hello"}]
    for s in _serve(StreamingEngine(v), model_name="g"):
        want = _chat(s.url, ok).json()["choices"][0]["message"]["content"]
        # valid JSON, no valid text: the tokenizer raised TypeError and the worker thread died
        r = httpx.post(
            s.url + "/v1/chat/completions", timeout=60,
            content=b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 4}',
        )  # fmt: skip
        assert r.status_code == 400 and "lone surrogate" in r.json()["error"]["message"]
        # Gemma's template refuses two user turns in a row (jinja2 TemplateError)
        r = _chat(s.url, [*ok, {"role": "user", "content": "again"}])
        assert r.status_code == 400 and "roles must alternate" in r.json()["error"]["message"]
        r = _chat(s.url, [{"role": "wizard", "content": "hi"}])
        assert r.status_code == 400 and "role must be one of" in r.json()["error"]["message"]
        body = json.dumps({"prompt": "x\udcff", "max_tokens": 2})  # ASCII JSON with a \udcff escape
        r = httpx.post(s.url + "/v1/completions", content=body, timeout=60)
        assert r.status_code == 400
        assert httpx.get(s.url + "/health").json()["status"] == "ok"
        assert _chat(s.url, ok).json()["choices"][0]["message"]["content"] == want


def test_an_internal_error_is_that_requests_500(monkeypatch):
    engine = StreamingEngine(StubVerifier())
    for s in _serve(engine, model_name="stub"):
        worker = s.app.state.worker
        real = engine.encode

        def broken(prompt, **kw):
            raise KeyError("a bug of ours")

        monkeypatch.setattr(engine, "encode", broken)
        r = _chat(s.url, [{"role": "user", "content": "hi"}])
        assert r.status_code == 500 and "KeyError" in r.json()["error"]["message"]
        monkeypatch.setattr(engine, "encode", real)
        assert _chat(s.url, [{"role": "user", "content": "hi"}]).status_code == 200
        assert worker.alive


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_worker_shows_in_health_and_calls_on_death():
    from starlette.testclient import TestClient

    from specdec.serve import build_app

    class Poison:  # not a Job: the worker loop itself (outside any request) fails on it
        cancel = threading.Event()

        @property
        def ids(self):
            raise SystemError("the loop itself broke")

        def emit(self, *a):
            pass

    deaths: list[BaseException] = []
    app = build_app(StreamingEngine(StubVerifier()), model_name="stub", on_death=deaths.append)
    worker = app.state.worker
    with worker._lock:
        worker.waiting.append(Poison())
        worker._lock.notify_all()
    worker._threads[0].join(timeout=10)
    assert not worker.alive and isinstance(deaths[0], SystemError)
    with TestClient(app) as c:
        r = c.get("/health")
        assert r.status_code == 503 and "worker died" in r.json()["error"]
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503  # refused at once instead of hanging


class _Slow(StubVerifier):
    def verify(self, *a, **kw):
        time.sleep(0.02)
        return super().verify(*a, **kw)


def _queue_test(engines: int, max_queue: int) -> None:
    """`engines` slow engines each take a long request; `max_queue` more wait, the next is refused; stop
    returns promptly, every running or waiting request cancelled."""
    import asyncio

    from specdec.sampling import SamplingParams
    from specdec.serve import Job, Worker, parse_request

    worker = Worker([StreamingEngine(_Slow()) for _ in range(engines)], max_queue=max_queue)
    loop = asyncio.new_event_loop()
    params = parse_request(
        {"prompt": "x", "max_tokens": 500}, chat=False, model="stub", defaults=SamplingParams()
    )
    jobs = [Job(params=params, loop=loop) for _ in range(engines + max_queue + 1)]
    assert all(worker.submit(j) for j in jobs[:engines])
    deadline = time.time() + 10
    while len(worker.running) < engines:  # each engine takes one
        assert time.time() < deadline
        time.sleep(0.01)
    assert all(worker.submit(j) for j in jobs[engines:-1]) and not worker.submit(jobs[-1])
    t0 = time.perf_counter()
    worker.stop()
    assert time.perf_counter() - t0 < 10 and not any(t.is_alive() for t in worker._threads)
    assert all(j.cancel.is_set() for j in jobs[:-1])
    loop.close()


def test_stop_returns_promptly_with_a_full_queue():
    _queue_test(engines=1, max_queue=1)


def test_two_engines_run_two_requests_and_queue_past_them():
    """A worker of two engines (`--max-batch 2`) runs two requests at once and queues past them."""
    _queue_test(engines=2, max_queue=1)


def test_max_queue_zero_means_no_waiting():
    from specdec.serve import Worker

    w = Worker(StreamingEngine(StubVerifier()), max_queue=0)
    running = object()
    w.running.add(running)  # pretend a request is running
    assert w.submit(object()) is False  # type: ignore[arg-type]
    w.running.discard(running)
    w.stop()


def test_sigterm_stops_the_server(tmp_path):
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.Popen(
        [*CLI, "serve", "--verifier", "stub", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.time() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline and proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.2)
        body = {"prompt": "x", "max_tokens": 1000, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30) as r:
            next(r.iter_lines())  # a request is running
            proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal it caught (exit -15 or 0)
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
    finally:
        proc.kill()


# ---- 2. one rollback contract: windows that cannot reach back re-prefill -----------------------------------


def test_hf_rollback_past_a_full_window_raises_rollback_error(gemma_dir):
    v = _hf(gemma_dir)
    v.prefill(list(range(5, 45)))  # 40 positions, window 16: full
    v.verify([7, 8, 9])
    v.rollback(2)  # within the last call: exact
    with pytest.raises(RollbackError, match="sliding-window"):
        v.rollback(10)


def _fresh(v, prompt, n):
    v.reset()
    return StreamingEngine(v, reuse=False).complete(prompt, max_tokens=n)


@pytest.mark.parametrize("runtime", ["hf", "mlx"])
def test_windowed_models_reuse_or_reprefill_exactly(gemma_dir, runtime):
    if runtime == "mlx":
        pytest.importorskip("mlx_lm")
        from specdec.verifiers.mlx import MLXVerifier

        v = MLXVerifier(gemma_dir)
    else:
        v = _hf(gemma_dir)
    prompt = list(range(3, 43))  # longer than the window
    want = _fresh(v, prompt, 4).output_tokens
    e = StreamingEngine(v)
    assert e.complete(prompt, max_tokens=4).output_tokens == want
    assert e.complete(prompt, max_tokens=4).output_tokens == want  # was "cannot roll back ... exactly"
    longer = [*prompt, *want, 9, 10]
    assert e.complete(longer, max_tokens=5).output_tokens == _fresh(v, longer, 5).output_tokens
    # a stop string cut past the window: the next request still answers like a fresh engine
    text = e.complete([{"role": "user", "content": "abc"}], max_tokens=12)
    stop = text.text[3:5] if len(text.text) >= 5 else None
    if stop:
        e.complete([{"role": "user", "content": "abc"}], max_tokens=12, stop=[stop])
    again = e.complete([{"role": "user", "content": "abc"}], max_tokens=12)
    assert again.output_tokens == text.output_tokens
    # a conversation that outgrows the window turn after turn
    session = ChatSession(StreamingEngine(v))
    for turn in ("first turn here", "and a second", "third"):
        r = session.send(turn, max_tokens=8)
        r.text()
        fresh = _fresh(v, session.engine.encode(session.messages[:-1]), 8)
        assert r.result.output_tokens == fresh.output_tokens


def test_windowed_server_answers_every_request(gemma_dir):
    v = _hf(gemma_dir)
    msgs = [{"role": "user", "content": "x" * 30}]  # past the window of 16
    for s in _serve(StreamingEngine(v), model_name="g"):
        first = _chat(s.url, msgs, max_tokens=8)
        assert first.status_code == 200, first.text
        for _ in range(3):  # failed and succeeded by turns before the fix
            r = _chat(s.url, msgs, max_tokens=8)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]


# ---- 3. the block size defaults to the drafter's everywhere ------------------------------------------------


def test_block_size_defaults_to_the_drafters(tmp_path, capsys):
    folder = _stub_drafter_folder(tmp_path / "d")
    out = tmp_path / "r.json"
    argv = ["generate", "--drafter", str(folder), "--prompt", "hello", "--max-new-tokens", "8"]
    assert main([*argv, "--out", str(out)]) == 0, capsys.readouterr().err  # was: 16 exceeds 4
    assert json.loads(out.read_text())["config"]["block_size"] == 4
    import argparse

    from specdec.api import load
    from specdec.args import run_spec
    from specdec.serve import add_serve_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    m = load(run_spec(p.parse_args(["--drafter", str(folder)])))
    assert m.block_size == m.drafter.block_size == 4


# ---- 4-5. outputs: nothing that is not ours is replaced, earlier steps are never truncated -----------------


@pytest.mark.parametrize("kind", ["fifo", "symlink", "dir"])
def test_out_must_be_a_regular_file(tmp_path, capsys, kind):
    target = tmp_path / "r.json"
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "symlink":
        (tmp_path / "elsewhere.json").write_text("mine")
        target.symlink_to(tmp_path / "elsewhere.json")
    else:
        target.mkdir()
    assert main(["generate", "--prompt", "hi", "--max-new-tokens", "4", "--out", str(target)]) == 2
    assert "error:" in capsys.readouterr().err
    assert {"fifo": target.is_fifo(), "symlink": target.is_symlink(), "dir": target.is_dir()}[kind]
    if kind == "symlink":
        assert (tmp_path / "elsewhere.json").read_text() == "mine"


def test_a_refused_or_interrupted_run_keeps_the_earlier_result_and_steps(tmp_path, monkeypatch):
    out = tmp_path / "r.json"
    assert main(["generate", "--prompt", "hello", "--max-new-tokens", "6", "--out", str(out)]) == 0
    before = (out.read_bytes(), (tmp_path / "r.steps.jsonl").read_bytes())
    # refused: a prompt that does not fit the context
    assert main(["generate", "--prompt", "x" * 5000, "--out", str(out)]) == 2
    assert (out.read_bytes(), (tmp_path / "r.steps.jsonl").read_bytes()) == before
    interrupt_after_steps(monkeypatch, 3)
    assert main(["generate", "--prompt", "hello", "--max-new-tokens", "20", "--out", str(out)]) == 1
    assert (out.read_bytes(), (tmp_path / "r.steps.jsonl").read_bytes()) == before


def interrupt_after_steps(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """Every run from now on is interrupted (KeyboardInterrupt, as Ctrl-C) at its step n + 1."""
    import specdec.engine as engine

    real, calls = engine.StepRecord, []

    def interrupting(**kw):
        calls.append(1)
        if len(calls) % (n + 1) == 0:
            raise KeyboardInterrupt
        return real(**kw)

    monkeypatch.setattr(engine, "StepRecord", interrupting)


def test_a_full_disk_at_the_result_keeps_the_earlier_result_and_steps(tmp_path, monkeypatch, capsys):
    """ENOSPC while the final result is written: the steps of the new run must not take the name of the
    old ones (they were renamed before the result was written, so an old result sat beside new steps)."""
    import errno

    import specdec.records as records

    out = tmp_path / "r.json"
    assert main(["generate", "--prompt", "hello", "--max-new-tokens", "2", "--out", str(out)]) == 0
    before = (out.read_bytes(), (tmp_path / "r.steps.jsonl").read_bytes())

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(records.os, "fsync", full)
    assert main(["generate", "--prompt", "hello there", "--max-new-tokens", "14", "--out", str(out)]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert (out.read_bytes(), (tmp_path / "r.steps.jsonl").read_bytes()) == before
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".r.json.")]  # no temp file left


# ---- 6-7. one-line errors, before any work --------------------------------------------------------------


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_truncated_weights_are_errors_not_tracebacks(tmp_path, gemma_dir, capsys):
    folder = _stub_drafter_folder(tmp_path / "d")
    _truncate(folder / "model.safetensors")
    assert main(["generate", "--drafter", str(folder), "--prompt", "hi"]) == 2
    assert "cannot read" in capsys.readouterr().err
    model = tmp_path / "m"
    shutil.copytree(gemma_dir, model)
    _truncate(model / "model.safetensors")
    assert main(["generate", "--verifier", "hf", "--model", str(model), "--prompt", "hi"]) == 2
    assert "cannot load the weights" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["generate", "--messages", "[{'role': 'user'}]"], "--messages is not valid JSON"),
        (["generate", "--messages", '["hi"]'], "messages[0] must be an object"),
        (["generate", "--messages", '[{"role": "user"}]'], "content must be a string"),
        (["generate", "--messages", '[{"role": "robot", "content": "x"}]'], "role must be one of"),
        (["generate", "--prompt", "a\udcffb"], "lone surrogate"),
        (["generate", "--prompt", "hi", "--temperature", "inf"], "finite"),
        (["generate", "--prompt", "hi", "--seed", "-1"], "--seed"),
        (["generate", "--prompt", "hi", "--block-size", "0"], "--block-size"),
        (["serve", "--port", "99999"], "--port"),
        (["serve", "--block-size", "0"], "--block-size"),
        (["serve", "--default-max-tokens", "0"], "--default-max-tokens"),
        (["serve", "--max-context", "0"], "--max-context"),
        (["serve", "--max-queue", "-1"], "--max-queue"),
        (["eval", "--out", "{tmp}/ev", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["bench-verify", "--sizes", "0"], "--sizes"),
        (["bench-verify", "--sizes", "1,x"], "--sizes"),
        (["bench-verify", "--contexts", "-5"], "--contexts"),
    ],
)
def test_bad_flags_are_one_line_errors(argv, words, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "ev").exists()  # eval made no empty folder


def test_out_and_cache_dir_are_checked_before_any_model_loads(tmp_path, capsys):
    missing = str(tmp_path / "no-such-model")
    (tmp_path / "file").write_text("")
    out = str(tmp_path / "file" / "r.json")
    assert main(["generate", "--verifier", "hf", "--model", missing, "--prompt", "hi", "--out", out]) == 2
    assert "is not a directory" in capsys.readouterr().err  # not the model's error: nothing was loaded
    assert main(["fetch", "smollm2-135m", "--cache-dir", str(tmp_path / "file")]) == 2
    assert "is a file" in capsys.readouterr().err


def test_interrupt_is_exit_1_and_os_errors_are_one_line(capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    def unreadable(args):
        raise PermissionError(13, "Permission denied", "/some/file")

    assert run_command(interrupted, None) == 1 and "interrupted" in capsys.readouterr().err
    assert run_command(unreadable, None) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: PermissionError") and err.count("\n") == 1


def test_init_from_a_truncated_checkpoint_is_an_error(tmp_path):
    from specdec.drafting.dflash.config import load_checkpoint

    folder = _stub_drafter_folder(tmp_path / "d")
    _truncate(folder / "model.safetensors")
    with pytest.raises(ValueError, match="cannot read"):
        load_checkpoint(folder)


def test_sampling_rules_are_one_set():
    from specdec.sampling import SamplingParams

    for bad in (dict(temperature=float("inf")), dict(temperature=float("nan")), dict(seed=-1)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    torch.manual_seed(0)


# ---- the fuzz test: random JSON, unicode, roles and parameters against two servers -------------------------

hyp = pytest.importorskip("hypothesis")
st = hyp.strategies

_text = st.one_of(st.text(max_size=12), st.text(st.characters(exclude_categories=()), max_size=6))
_scalar = st.one_of(st.none(), st.booleans(), st.integers(-5, 2**64), st.floats(allow_nan=True), _text)
_message = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "assistant", "system", "tool", "wizard", ""]), _scalar)},
    optional={"content": st.one_of(_text, _scalar, st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                                   "text": _text})))},
)  # fmt: skip
_body = st.fixed_dictionaries(
    {},
    optional={
        "messages": st.one_of(st.lists(_message, max_size=4), _scalar),
        "prompt": st.one_of(_text, st.lists(st.integers(-3, 400), max_size=6), _scalar),
        "max_tokens": st.one_of(st.integers(-2, 6), _scalar),
        "temperature": st.one_of(st.floats(-1, 3), _scalar),
        "top_p": _scalar, "top_k": _scalar, "min_p": _scalar, "seed": _scalar, "n": _scalar,
        "stop": st.one_of(_text, st.lists(_text, max_size=3), _scalar),
        "stream": st.one_of(st.booleans(), _scalar),
        "model": st.one_of(st.just("m"), _scalar),
    },
)  # fmt: skip


def _fuzz(url: str) -> None:
    ok = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 6}
    want = httpx.post(url + "/v1/chat/completions", json=ok, timeout=60).json()

    @hyp.settings(max_examples=40, deadline=None, derandomize=True, database=None)
    @hyp.given(body=_body, chat=st.booleans())
    def one(body: dict, chat: bool) -> None:
        if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 6:
            body["max_tokens"] = 6  # keep each request short
        body.setdefault("max_tokens", 6)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        r = httpx.post(url + path, content=json.dumps(body), timeout=60)
        assert r.status_code in (200, 400, 404), (body, r.status_code, r.text)
        if r.status_code != 200:
            assert r.json()["error"]["message"]
        assert httpx.get(url + "/health").json()["status"] == "ok"

    one()
    assert httpx.post(url + "/v1/chat/completions", json=ok, timeout=60).json()["choices"] == want["choices"]


def test_fuzzed_requests_always_get_an_answer(gemma_dir):
    for engine in (StreamingEngine(StubVerifier()), StreamingEngine(_hf(gemma_dir))):
        for s in _serve(engine, model_name="m"):
            _fuzz(s.url)


# ---- issue 37: what a new user hit ------------------------------------------------------------------------


def _busy_port() -> tuple[object, int]:
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock, sock.getsockname()[1]


def test_refused_before_any_model_loads(tmp_path, gemma_dir, capsys):
    """Each of these used to fail only after loading (or with a traceback, or not at all). The model is a
    folder that does not exist: an error about it would mean the model was tried first."""
    missing = str(tmp_path / "no-such-model")
    hf = ["--verifier", "hf", "--model", missing]
    bad_config = _stub_drafter_folder(tmp_path / "d")
    ok_drafter = _stub_drafter_folder(tmp_path / "ok")  # made for the stub: vocabulary 259
    (bad_config / "config.json").write_text('{"hidden_size": 64,\n "x": "a\tb"}')  # a raw tab: invalid JSON
    sock, port = _busy_port()
    cases = [
        (["generate", *hf, "--drafter", str(bad_config), "--prompt", "hi"], f"{bad_config / 'config.json'}"),
        (["generate", "--verifier", "stub", "--model", "nosuch-model", "--prompt", "hi"], "model of its own"),
        (
            ["demo", "--verifier", "hf", "--model", missing, "--drafter-runtime", "mlx"],
            "needs --verifier mlx",
        ),
        (["serve", *hf, "--port", str(port)], f"cannot listen on 127.0.0.1:{port}"),
        (["serve", *hf, "--host", "no-such-host.invalid"], "cannot listen on no-such-host.invalid"),
        (["generate", *hf, "--device", "nosuchdevice", "--prompt", "hi"], "device 'nosuchdevice'"),
    ]
    other = tmp_path / "other-model"  # config.json on disk, weights that would fail to load
    shutil.copytree(gemma_dir, other)
    _truncate(other / "model.safetensors")
    cases.append((["generate", "--verifier", "hf", "--model", str(other), "--drafter", str(ok_drafter),
                   "--prompt", "hi"], "vocabulary size 259"))  # fmt: skip
    if not torch.cuda.is_available():
        cases.append(
            (["generate", *hf, "--device", "cuda", "--prompt", "hi"], "'cuda' is not available here")
        )
    try:
        for argv, words in cases:
            assert main(argv) == 2, argv
            err = capsys.readouterr().err
            assert words in err and err.count("\n") == 1 and "Traceback" not in err, (argv, err)
    finally:
        sock.close()


def test_a_deeply_nested_body_is_a_400_and_the_server_lives():
    deep = "[" * 200_000 + "]" * 200_000
    for s in _serve(StreamingEngine(StubVerifier()), model_name="stub"):
        r = httpx.post(
            s.url + "/v1/chat/completions", content=deep, headers={"content-type": "application/json"}
        )
        assert r.status_code == 400 and "nests too deeply" in r.json()["error"]["message"]
        assert _chat(s.url, [{"role": "user", "content": "hi"}]).status_code == 200


def test_generate_says_which_dtype_and_why(capsys):
    assert main(["generate", "--prompt", "hi", "--max-new-tokens", "2"]) == 0  # auto: by this CPU
    assert re.search(r"^dtype (float32|bfloat16) \(.+\)$", capsys.readouterr().err, re.M)
