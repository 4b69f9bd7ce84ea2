"""`specdec serve`: an OpenAI-compatible HTTP server over `specdec.stream.StreamingEngine`s: one, or with
`--max-batch N` N engines on sequences of one batch (`specdec.batch`), their verifies in one forward.

Endpoints: POST /v1/chat/completions and /v1/completions (SSE with "stream": true), GET /v1/models,
/health, /metrics (JSON; Prometheus text with ?format=prometheus or Accept: text/plain).

Contract:
- Each engine serves requests one at a time, in arrival order from one queue, on a worker thread of its
  own; with N engines N requests run at once (each a member of the batch while it runs, so their
  verifies share forwards: exact, or the batch is refused at start). At most `max_queue` requests wait
  for a free engine. Past that a request gets 503 with a message saying so (and a Retry-After header).
  All model and tokenizer work happens on the worker threads.
- The engine keeps its cache between requests, so a chat client that resends the conversation only pays
  for the new tokens (longest-common-prefix reuse, exact: see `specdec.stream`).
- A client that disconnects (streaming or not, running or still queued) cancels its generation within one
  engine step; the next request is served normally.
- Request fields: messages | prompt, max_tokens (or max_completion_tokens), temperature, top_p, top_k,
  min_p, seed, stop (string or list), stream, stream_options.include_usage, n (1 only), logit_bias,
  presence_penalty, frequency_penalty, repetition_penalty, penalty_context (`specdec.processors`, applied
  inside verification: exact under speculation). OpenAI fields it does not honour (logprobs, tools, a
  non-text response_format, echo, best_of, suffix) are refused unless they ask for nothing
  (`protocol.UNHONOURED`); other unknown fields are ignored. max_tokens policy (as vLLM): max_tokens must
  be >= 1 and prompt + max_tokens must fit the context (--max-context, default the model's), else 400
  naming the sizes; without max_tokens the reply may use min(--default-max-tokens, what is left of the
  context).
- A request body past `max_request_bytes` (default: 16 bytes per position of the context, at least
  1 MiB) is refused with 413 as it arrives, by its Content-Length or once it passes the limit, before it
  is parsed or tokenized.
- Errors are OpenAI-shaped: {"error": {"message", "type", "param", "code"}}; 400 bad request (`param`
  names the field), 404 unknown model or path, 405 wrong method, 413 body too large (all
  `invalid_request_error`), 503 busy; the server keeps serving.
- Responses carry `usage` and our per-request speculative stats under "specdec" (acceptance_length_mean
  includes the bonus token, as in vLLM): n_steps, drafted, accepted, tokens_per_s, ttft_s, reused_tokens.
Binds 127.0.0.1 by default. starlette and uvicorn are imported only when a server is built.

    protocol.py   the OpenAI wire format: request parsing, response / chunk / error bodies
    worker.py     the engine's thread and its queue of jobs
    metrics.py    server-wide counters (JSON, Prometheus text)
    app.py        the Starlette app
    cli.py        `specdec serve`: options, socket, loading
"""

from __future__ import annotations

from specdec.serve.app import build_app
from specdec.serve.cli import add_serve_args, cmd_serve
from specdec.serve.metrics import Metrics
from specdec.serve.protocol import RequestError, parse_request
from specdec.serve.worker import Job, Worker

__all__ = [
    "Job",
    "Metrics",
    "RequestError",
    "Worker",
    "add_serve_args",
    "build_app",
    "cmd_serve",
    "parse_request",
]
