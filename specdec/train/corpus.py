"""Building a token-id training corpus (the format: `specdec.corpus`) in resumable chunks.

A stage is a list of prompts answered greedily with up to `budget` new tokens (ending at the first stop
token, included). Its prompt list is written once: a later build (another machine, other installed
package versions) reads the committed list instead of recomputing it, so chunk N always means the same
prompts. Chunks are written atomically as soon as all their prompts are answered, and the answers of
unfinished chunks go to `partial.npz`, so a build can be stopped at any moment and resumed losing at most
a minute of work: only the prompts still unanswered are generated. Readers see complete chunks only.
An HF verifier answers with continuous batching (`verifiers.hf_generate.generate_many`, rows kept full
across chunk boundaries); any other verifier through the engine's autoregressive loop, one prompt at a
time.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from specdec.chat import check_messages, encode_prompt
from specdec.corpus import Corpus, Messages, Row, TrainSequence, read_rows, write_rows
from specdec.protocols import BatchGeneration, Verifier

__all__ = ["Corpus", "TrainSequence", "build_default", "build_from_prompts", "build_stage", "load_prompts"]


def _answers(
    verifier: Verifier, items: Iterator[tuple[Any, list[int], int]], *, max_len: int, rows: int
) -> Iterator[tuple[Any, list[int]]]:
    """(key, greedy response) for (key, prompt ids, budget) items, in any order."""
    if isinstance(verifier, BatchGeneration):
        yield from verifier.generate_many(items, max_len=max_len, rows=rows)
        return
    from specdec.engine import DecodeConfig, generate

    for key, prompt, budget in items:
        res = generate(verifier, prompt, cfg=DecodeConfig(max_new_tokens=budget, block_size=1))
        yield key, list(res.output_tokens)


PARTIAL_EVERY_S = 60.0  # how often the answers of unfinished chunks are saved


def build_stage(
    corpus: Corpus,
    verifier: Verifier,
    stage: str,
    *,
    encode: Callable[[Messages], list[int]],
    rows: int = 128,
    max_chunks: int | None = None,
    progress: bool = True,
) -> int:
    """Answer the unanswered prompts of the missing chunks of `stage` (at most `max_chunks` of them);
    returns the number of chunks written. A prompt whose ids leave no room under the corpus' max_len gets
    an empty response and is recorded as such (its chunk still completes)."""
    s = corpus.meta["stages"][stage]
    size, budget, max_len = s["chunk_size"], s["budget"], corpus.meta["max_len"]
    todo = corpus.missing_chunks(stage)[:max_chunks]
    if not todo:
        return 0
    prompts = corpus.prompts(stage)
    results = _saved_partial(corpus, stage, prompts, size, todo)  # chunk -> prompt index -> row
    want = {n: len(prompts[n * size : (n + 1) * size]) for n in todo}
    encoded: dict[int, list[int]] = {}

    def items() -> Iterator[tuple[int, list[int], int]]:
        for n in todo:
            for i in range(n * size, n * size + want[n]):
                if i in results[n]:  # answered before an interruption
                    continue
                ids = encoded[i] = encode(prompts[i][1])
                room = min(budget, max_len - len(ids))
                if room < 1:  # too long for this corpus: an empty answer keeps the chunk whole
                    results[n][i] = (prompts[i][0], ids, [])
                    continue
                yield i, ids, room

    from tqdm import tqdm

    done0 = sum(map(len, results.values()))
    bar = tqdm(
        total=sum(want.values()), initial=done0, desc=stage, unit="seq", disable=not progress, file=sys.stderr
    )
    written, n_tok, t0, saved_at = 0, 0, time.perf_counter(), time.monotonic()

    def flush() -> int:
        nonlocal saved_at
        done = [m for m in results if len(results[m]) == want[m]]
        for m in done:
            rows_m = results.pop(m)
            write_rows(corpus.chunk_path(stage, m), [rows_m[j] for j in sorted(rows_m)])
        if done or time.monotonic() - saved_at > PARTIAL_EVERY_S:
            _save_partial(corpus.partial_path(stage), results)
            saved_at = time.monotonic()
        return len(done)

    try:
        written += flush()  # chunks an interruption left complete
        for i, resp in _answers(verifier, items(), max_len=max_len, rows=rows):
            results[i // size][i] = (prompts[i][0], encoded.pop(i), resp)
            n_tok += len(resp)
            written += flush()
            bar.update()
            bar.set_postfix(tok_s=f"{n_tok / (time.perf_counter() - t0):.0f}", chunks=written)
        written += flush()  # chunks whose last prompts were all too long
    finally:
        _save_partial(corpus.partial_path(stage), results)  # also when interrupted
        bar.close()
    return written


def _save_partial(path: Path, results: dict[int, dict[int, Row]]) -> None:
    """The answers of unfinished chunks into `path` (removed when there are none)."""
    flat = {i: row for r in results.values() for i, row in r.items()}
    if not flat:
        path.unlink(missing_ok=True)
        return
    index = sorted(flat)
    write_rows(path, [flat[i] for i in index], index)


def _saved_partial(
    corpus: Corpus, stage: str, prompts: list[tuple[str, Messages]], size: int, todo: list[int]
) -> dict[int, dict[int, Row]]:
    """chunk -> {prompt index: row} for the chunks in `todo`, from the partial file of an interrupted
    build (checked against the stage's prompts)."""
    results: dict[int, dict[int, Row]] = {n: {} for n in todo}
    path = corpus.partial_path(stage)
    if not path.is_file():
        return results
    rows, index = read_rows(path)
    for i, (key, prompt, response) in zip(index or [], rows):
        if not 0 <= i < len(prompts) or prompts[i][0] != key:
            raise ValueError(
                f"{str(path)!r} does not belong to this stage's prompts (index {i}, key {key!r})"
            )
        if i // size in results:
            results[i // size][i] = (key, prompt.tolist(), response.tolist())
    return results


# ---- a prompt file as a one-stage corpus (`specdec train --prompts`) -------------------------------------


def load_prompts(path: str | os.PathLike[str]) -> list[tuple[str, Messages]]:
    """(key, chat messages) from a JSONL of {"id"?, "messages"} or {"id"?, "text"} records, or from plain
    text (one prompt per non-empty line, taken as a user message). Keys default to the line number."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {str(path)!r} does not exist")
    lines = path.read_text(encoding="utf-8").splitlines()
    jsonl = path.suffix == ".jsonl" or (bool(lines) and lines[0].lstrip().startswith("{"))
    out: list[tuple[str, Messages]] = []
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        if not jsonl:
            out.append((str(n), [{"role": "user", "content": line}]))
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n + 1}: not valid JSON ({e})") from None
        if "messages" in rec:
            messages = rec["messages"]
        elif "text" in rec:
            messages = [{"role": "user", "content": str(rec["text"])}]
        else:
            raise ValueError(f"{path}:{n + 1}: a record needs 'messages' or 'text' (found {sorted(rec)})")
        out.append((str(rec.get("id", n)), check_messages(messages)))
    keys = [k for k, _ in out]
    if len(set(keys)) != len(keys):
        raise ValueError(f"{path}: prompt ids must be unique ({len(keys) - len(set(keys))} repeated)")
    return out


def build_from_prompts(
    corpus_dir: str | os.PathLike[str],
    verifier: Verifier,
    prompts: str | os.PathLike[str],
    *,
    budget: int = 512,
    max_len: int = 3072,
    chunk_size: int = 256,
    rows: int = 128,
    progress: bool = True,
) -> Corpus:
    """A corpus with one stage, "prompts": the verifier's answers to a prompt file (`load_prompts`)."""
    c = Corpus.create(corpus_dir, verifier, max_len=max_len)
    c.start_stage("prompts", lambda: load_prompts(prompts), budget=budget, chunk_size=chunk_size)
    build_stage(
        c,
        verifier,
        "prompts",
        encode=functools.partial(encode_prompt, verifier),
        rows=rows,
        progress=progress,
    )
    return c


# ---- the bundled drafters' corpus: three stages -----------------------------------------------------------


def build_default(
    corpus_dir: str | os.PathLike[str],
    verifier: Verifier,
    *,
    max_len: int = 768,
    rows: int = 128,
    max_chunks: int | None = None,
    seed: int = 0,
    progress: bool = True,
) -> Corpus:
    """The corpus the bundled drafters train on (`specdec.train.prompts`): "questions" (the verifier writes
    instructions, 64 new tokens), "turn1" (code, templated chat and those instructions, 256), "turn2"
    (follow-ups to chat answers of turn1, 256). A stage's prompts are fixed once the stage before it is
    complete; `max_chunks` bounds the chunks this call generates (over all stages)."""
    from specdec.train import prompts as ts

    c = Corpus.create(corpus_dir, verifier, max_len=max_len)
    encode = functools.partial(encode_prompt, verifier)
    tok = verifier.tokenizer
    left = [max_chunks if max_chunks is not None else 1 << 30]

    def run(stage: str) -> bool:  # True when the stage is complete
        left[0] -= build_stage(
            c, verifier, stage, encode=encode, rows=rows, max_chunks=left[0], progress=progress
        )
        return not c.missing_chunks(stage)

    def answers(stage: str) -> dict[str, str]:
        stops = verifier.eos_token_ids
        return {
            k: tok.decode([t for t in r.tolist() if t not in stops]).strip()
            for k, r in c.responses(stage).items()
        }

    c.start_stage("questions", lambda: ts.stage_questions(seed=seed), budget=64, chunk_size=512)
    if not run("questions") or left[0] <= 0:
        return c
    asked = {k: m[-1]["content"] for k, m in c.prompts("questions")}
    qs = [q for k, a in answers("questions").items() if (q := ts.parse_instruction(a, asked[k]))]
    c.start_stage("turn1", lambda: ts.stage_turn1(qs, seed=seed), budget=256, chunk_size=512)
    if not run("turn1") or left[0] <= 0:
        return c
    first = c.prompts("turn1")
    got = answers("turn1")
    c.start_stage(
        "turn2",
        lambda: ts.stage_turn2([(k, m, got[k]) for k, m in first], seed=seed),
        budget=256,
        chunk_size=512,
    )
    run("turn2")
    return c


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    from specdec.api import load_verifier

    p = argparse.ArgumentParser(prog="python -m specdec.train.corpus", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="verifier model (HF): short name or folder")
    p.add_argument("--out", required=True, help="corpus folder (resumed when it exists)")
    p.add_argument("--max-chunks", type=int, help="stop after generating this many chunks")
    p.add_argument("--rows", type=int, default=128, help="sequences decoded together")
    p.add_argument("--max-len", type=int, default=768, help="prompt + response positions at most")
    args = p.parse_args(argv)
    # `kill` (SIGTERM) unwinds like Ctrl-C, so the answers of unfinished chunks are saved on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    c = build_default(
        args.out,
        load_verifier("hf", args.model),
        max_len=args.max_len,
        rows=args.rows,
        max_chunks=args.max_chunks,
    )
    print(json.dumps(c.stats(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
