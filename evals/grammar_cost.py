"""What structured output costs and gains: a grammar's mask beside a verify, and JSON-schema answers decoded
with and without speculation, with and without the forced tokens drafted, against unconstrained decoding of
the same prompts.

    python -m specdec.evals.grammar_cost [--model smollm2-135m] [--drafter bundled:smollm2-135m+lookup]
        [--rounds 2] [--max-new-tokens 96] [--reps 20] [--out FIGURES.json]

Part 1 (`mask`): the mask of 1, 8 and 16 chain rows inside a JSON document, as medians of `--reps` calls,
against the verify of as many rows. Part 2 (`runs`): six chat prompts asking for JSON, each under its schema;
per round and prompt, in turn: autoregressive and speculative decoding unconstrained, then under the schema
autoregressive, speculative, and speculative with the forced tokens not drafted (`Constraint.forced` made to
return nothing: an ablation, here only). Then the same six as tool calls (`tools_*`): each schema the
parameters of one function offered through a Hermes-style chat template (ours; SmolLM2's own renders no
tools) under `tool_choice` "required", autoregressive, speculative, and speculative with the forced tokens
not drafted. Speculation is checked exact (its tokens equal AR's) in every run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from specdec.evals.report import emit_figures, figures_header, median_ms
from specdec.grammar import Constraint, GrammarSpec
from specdec.processors import LogitsParams, Processor

S = {"type": "string", "maxLength": 40}
TASKS = [  # (what the user asks, the schema)
    ("Describe a fictional person: name, age and city.",
     {"type": "object", "properties": {"name": S, "age": {"type": "integer"}, "city": S},
      "required": ["name", "age", "city"], "additionalProperties": False}),
    ("Describe a product for sale: title, price in dollars and up to three tags.",
     {"type": "object", "properties": {"title": S, "price": {"type": "number"},
      "tags": {"type": "array", "items": S, "maxItems": 3}}, "required": ["title", "price", "tags"],
      "additionalProperties": False}),
    ("Report the weather in Paris: city, temperature in Celsius and conditions.",
     {"type": "object", "properties": {"city": S, "temperature_c": {"type": "number"},
      "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]}},
      "required": ["city", "temperature_c", "conditions"], "additionalProperties": False}),
    ("Name a classic novel: its title, author and year of publication.",
     {"type": "object", "properties": {"title": S, "author": S, "year": {"type": "integer"}},
      "required": ["title", "author", "year"], "additionalProperties": False}),
    ("Write a to-do list of three tasks for a weekend, each with whether it is done.",
     {"type": "object", "properties": {"todos": {"type": "array", "maxItems": 3, "items": {
      "type": "object", "properties": {"task": S, "done": {"type": "boolean"}}, "required": ["task", "done"],
      "additionalProperties": False}}}, "required": ["todos"], "additionalProperties": False}),
    ("What is the capital of Japan? Answer with your confidence between 0 and 1.",
     {"type": "object", "properties": {"answer": S, "confidence": {"type": "number", "minimum": 0,
      "maximum": 1}}, "required": ["answer", "confidence"], "additionalProperties": False}),
]  # fmt: skip


def mask_cost(v, reps: int) -> list[dict]:
    """The mask of n chain rows inside a JSON document against the verify of n rows."""
    tok = v.tokenizer
    spec = GrammarSpec.json_schema(TASKS[4][1])
    doc = json.dumps({"todos": [{"task": "Buy groceries for the week", "done": False},
                                {"task": "Clean the garage", "done": True}]})  # fmt: skip
    ids = tok.encode(doc, add_special_tokens=False)
    out = []
    for n in (1, 8, 16):
        cut = len(ids) - n
        c = Constraint(spec, tok, v.vocab_size, v.eos_token_ids)
        proc = Processor(LogitsParams(grammar=spec), [], constraint=c)
        proc.commit(ids[:cut])
        paths = [ids[cut : cut + i] for i in range(n)]
        v.reset()
        v.prefill(tok.encode("Here is the list: " + doc[:20], add_special_tokens=False))
        rows = [ids[cut - 1], *ids[cut : cut + n - 1]]

        def verify(rows=rows, n=n) -> list[int]:
            got = v.verify(rows)
            v.rollback(n)
            return got

        verify_ms = median_ms(verify, reps)
        logits = v.forward(rows)  # [n, V]
        v.rollback(n)
        ms = median_ms(lambda proc=proc, x=logits, ps=paths: proc(x, ps).sum().item(), reps)
        out.append({"rows": n, "verify_ms": verify_ms, "mask_ms": ms, "share": round(ms / verify_ms, 4)})
        print(out[-1], file=sys.stderr)
    return out


#: ChatML with tools offered and calls written in the Hermes syntax (the syntax is a fact; the template ours)
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call one of these functions:{% for t in tools %}\n"
    '{{ t.function | tojson }}{% endfor %}\nCall it as <tool_call>\n{"name": ..., "arguments": {...}}'
    "\n</tool_call><|im_end|>\n{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "<|im_end|>\n{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _prompts(v) -> list[tuple[list[int], list[int], dict]]:
    """Per task: (the JSON prompt's ids with the model's template, the tool prompt's ids with
    TOOL_TEMPLATE, its tool)."""
    from specdec.api import encode_prompt
    from specdec.chat import chat_template, set_chat_template

    own = chat_template(v.tokenizer)
    plain = [encode_prompt(v, [{"role": "user", "content": ask + " Reply in JSON."}]) for ask, _ in TASKS]
    set_chat_template(v.tokenizer, TOOL_TEMPLATE)
    tools = [{"type": "function", "function": {"name": "record", "description": ask, "parameters": schema}}
             for ask, schema in TASKS]  # fmt: skip
    calls = [
        encode_prompt(v, [{"role": "user", "content": ask}], tools=[t]) for (ask, _), t in zip(TASKS, tools)
    ]
    set_chat_template(v.tokenizer, own)
    return list(zip(plain, calls, tools))


def runs(v, d, rounds: int, max_new: int) -> dict:
    """Every configuration of part 2 on every task, interleaved per round."""
    from specdec.engine import DecodeConfig, generate
    from specdec.tools import SYNTAXES, ToolChoice, tool_grammar

    real_forced = Constraint.forced
    configs = ["ar", "spec", "grammar_ar", "grammar_spec", "grammar_spec_unforced", "tools_ar", "tools_spec",
               "tools_spec_unforced"]  # fmt: skip
    rec: dict[str, list[dict]] = {c: [] for c in configs}
    prompts = _prompts(v)
    for r in range(rounds):
        for i, (_, schema) in enumerate(TASKS):
            plain, call, tool = prompts[i]
            required = tool_grammar(SYNTAXES["hermes"], [tool], ToolChoice("required"), False)
            logits = {"grammar": LogitsParams(grammar=GrammarSpec.json_schema(schema)),
                      "tools": LogitsParams(grammar=required)}  # fmt: skip
            ref = {}
            for c in configs:
                key = c.split("_")[0] if c.startswith(("grammar", "tools")) else "plain"
                ids = call if key == "tools" else plain
                cfg = DecodeConfig(max_new_tokens=max_new, block_size=1 if c.endswith("ar") else d.block_size,
                                   logits=logits.get(key))  # fmt: skip
                Constraint.forced = (lambda self: []) if c.endswith("unforced") else real_forced
                try:
                    t0 = time.perf_counter()
                    res = generate(v, ids, drafter=None if c.endswith("ar") else d, cfg=cfg)
                    secs = time.perf_counter() - t0
                finally:
                    Constraint.forced = real_forced
                ref.setdefault(key, res.output_tokens)
                assert res.output_tokens == ref[key], f"{c} on task {i} is not its AR's output"
                steps = res.decode_steps
                tau = len(res.output_tokens[1:]) / max(1, len(steps))
                rec[c].append({"round": r, "task": i, "tokens": len(res.output_tokens), "seconds": secs,
                               "tok_s": len(res.output_tokens) / secs, "tau": round(tau, 3),
                               "finish": res.finish_reason})  # fmt: skip
                print(c, rec[c][-1], file=sys.stderr)
    summary = {}
    for c in configs:
        rows = rec[c]
        per_round = [sum(x["tokens"] for x in rows if x["round"] == r) / sum(x["seconds"] for x in rows
                     if x["round"] == r) for r in range(rounds)]  # fmt: skip
        summary[c] = {"tok_s": round(statistics.median(per_round), 2),
                      "tok_s_rounds": [round(x, 2) for x in per_round],
                      "tau": round(statistics.mean(x["tau"] for x in rows), 3),
                      "tokens": sum(x["tokens"] for x in rows) // rounds}  # fmt: skip
    return {"summary": summary, "runs": rec}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m specdec.evals.grammar_cost", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--drafter", default="bundled:smollm2-135m+lookup")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out")
    args = p.parse_args(argv)
    from specdec.api import bundled_corpus, load_drafter, load_verifier

    v = load_verifier("hf", args.model, dtype=args.dtype)
    corpus = bundled_corpus(args.model) if args.drafter.startswith("bundled:") else None
    d = load_drafter(args.drafter, verifier=v, corpus=corpus)
    result = {
        **figures_header("specdec.evals.grammar_cost"),
        "model": args.model,
        "dtype": args.dtype,
        "drafter": args.drafter,
        "threads": torch.get_num_threads(),
        "max_new_tokens": args.max_new_tokens,
    }
    result["mask"] = mask_cost(v, args.reps)
    result.update(runs(v, d, args.rounds, args.max_new_tokens))
    emit_figures(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
