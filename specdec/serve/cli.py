"""`specdec serve`: its options, the listening socket (bound before any work), loading and running."""

from __future__ import annotations

import argparse
import socket
import sys
from typing import Any

from specdec.api import load
from specdec.args import (
    add_drafter_args,
    add_sampling_args,
    add_template_args,
    add_verifier_args,
    at_least,
    or_auto,
    read_chat_template,
    run_spec,
    sampling_of,
)
from specdec.chat import set_chat_template
from specdec.drafting.registry import DrafterSpec
from specdec.extras import require
from specdec.serve.app import BYTES_PER_POSITION, build_app
from specdec.stream import StreamingEngine

__all__ = ["add_serve_args", "cmd_serve", "listen_socket"]


def add_serve_args(p: argparse.ArgumentParser) -> None:
    add_verifier_args(p)
    add_drafter_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=at_least(0, 65535), default=8000)
    p.add_argument("--served-model-name", help="the model id clients send (default: the verifier's name)")
    p.add_argument(
        "--max-queue", type=at_least(0), default=16, help="requests that may wait (0: none); past that: 503"
    )
    p.add_argument("--max-context", type=at_least(2), help="positions per request (default: the model's)")
    p.add_argument(
        "--default-max-tokens", type=at_least(1), default=512, help="when a request gives no max_tokens"
    )
    p.add_argument("--no-reuse", action="store_true", help="prefill every prompt whole (no prefix reuse)")
    p.add_argument(
        "--max-request-bytes",
        type=at_least(1024),
        help="request bodies past this are refused (413) before they are read whole or tokenized "
        f"(default: {BYTES_PER_POSITION} bytes per position of the context, at least 1 MiB)",
    )
    p.add_argument(
        "--max-batch",
        type=or_auto(at_least(1, 16)),
        default="auto",
        help="requests served at once, their verifies in one forward (exact or refused; "
        "docs/batching.md); auto (default): as many as raise the rate measured at start, 1 where "
        "a batch cannot be exact",
    )
    add_template_args(p, tools=True)
    add_sampling_args(p)  # defaults for requests that leave them out; --rule / --proposal apply to all
    p.set_defaults(min_confidence=None)  # `_min_confidence`: as the main job where not given


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host`:`port` (0: any free port), for uvicorn to serve on; a bad host or a port
    in use is a one-line ValueError here, before any model loads (uvicorn would say so only after)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart may rebind at once
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def cmd_serve(args: argparse.Namespace) -> int:
    """Load, serve until SIGINT / SIGTERM; exit code 1 if the worker thread ever died."""
    require("specdec serve", "serve")  # a wheel without the extra: one line, before the port is bound
    sock = listen_socket(args.host, args.port)  # before any work
    try:
        return _serve_on(sock, args)
    finally:
        sock.close()


def _serve_on(sock: socket.socket, args: argparse.Namespace) -> int:
    import uvicorn

    sampling = sampling_of(args)
    template = read_chat_template(args)  # before any model loads
    args.min_confidence = _min_confidence(args)
    spec = run_spec(args)
    batchable = spec.tree is None
    if args.max_batch != "auto" and args.max_batch > 1 and not batchable:  # before anything loads
        raise ValueError("--max-batch verifies chains: drop --tree (docs/batching.md)")
    m = load(spec)
    verifier = m.verifier
    if template is not None:
        set_chat_template(verifier.tokenizer, template)
    engines = _engines(spec, m, args, batchable=batchable)
    server: Any = None
    died: list[BaseException] = []

    def on_death(e: BaseException) -> None:
        died.append(e)
        if server is not None:
            server.should_exit = True

    app = build_app(
        engines,
        model_name=args.served_model_name,
        max_queue=args.max_queue,
        default_max_tokens=args.default_max_tokens,
        sampling=sampling,
        on_death=on_death,
        max_request_bytes=args.max_request_bytes,
        tool_parser=args.tool_call_parser,
    )
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    name = args.served_model_name or verifier.model_name
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    print(f"specdec serve: {name} on http://{url_host}:{port}/v1", flush=True)
    server.run(sockets=[sock])
    if died:
        print(f"error: the engine worker died: {type(died[0]).__name__}: {died[0]}", file=sys.stderr)
        return 1
    return 0


def _min_confidence(args: argparse.Namespace) -> float | str:
    """`--min-confidence` as given; else on a CPU, for a bundled drafter's chains, "auto" (drafts cut where
    they commit the most tokens per verify cost, measured at start, as the main job cuts them: on this
    project's AVX-512-bf16 CPU the batched server's eight clients got 2.7-3.1x the serial one's rate so in
    single runs, 2.0-2.4x with whole blocks, docs/batching.md); 0 (whole blocks) otherwise."""
    if args.min_confidence is not None:
        return args.min_confidence
    bundled = DrafterSpec.parse(args.drafter).base.bundled is not None
    return "auto" if bundled and args.device == "cpu" and args.tree is None else 0.0


def _engines(spec: Any, m: Any, args: argparse.Namespace, *, batchable: bool) -> list[StreamingEngine]:
    """The engines that serve: the loaded one, or with `--max-batch N` N on sequences of one batch
    (`specdec.batch.batch_of`), each with a drafter of its own (refused in one line where the batch cannot
    be exact; trees are refused before anything loads). `auto`: as many as
    `costs.choose_max_batch` measures worth it here, 1 where a batch cannot be (said on stderr)."""
    reuse = not args.no_reuse
    n, batch = _batch_size(m, args.max_batch, batchable=batchable, cut=spec.auto_cut)
    if n == 1:
        return [StreamingEngine.from_loaded(m, max_context=args.max_context, reuse=reuse)]
    from specdec.api import drafter_for

    engines = []
    for seq in (batch.sequence() for _ in range(n)):  # each with a drafter bound to its own sequence
        d = None if m.drafter is None else drafter_for(spec, seq, dtype=m.dtype, costs=m.costs)
        engines.append(
            StreamingEngine(seq, d, block_size=m.block_size, max_context=args.max_context, reuse=reuse)
        )
    return engines


def _batch_size(m: Any, asked: int | str, *, batchable: bool, cut: bool = False) -> tuple[int, Any]:
    """(requests at once, their batch or None) for `--max-batch`: as asked, or for `auto` measured here,
    with steps of the drafter's block or (`cut`: drafts cut by cost) of what a cut step verified on a
    warm-up decode here (`costs.cut_step_tokens`)."""
    from specdec.batch import batch_of

    if asked != "auto":
        return (asked, batch_of(m.verifier)) if asked > 1 else (1, None)
    try:
        if not batchable:
            raise ValueError("a batch verifies chains (--tree asked for trees)")
        batch = batch_of(m.verifier)
    except ValueError as e:
        print(f"max batch 1: {e}", file=sys.stderr)
        return 1, None
    from specdec.costs import choose_max_batch, cut_step_tokens, measure_costs

    draft_s = measure_costs(m.verifier, m.drafter, context=128, sizes=(1, 2), reps=3)[1] if m.drafter else 0.0
    block = cut_step_tokens(m.verifier, m.drafter, m.block_size) if cut and m.drafter else m.block_size
    n, why = choose_max_batch(batch, block=block, draft_s=draft_s or 0.0)
    print(f"max batch {n}: {why}", file=sys.stderr)
    return n, batch if n > 1 else None
