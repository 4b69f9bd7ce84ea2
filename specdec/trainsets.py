"""Offline training prompt sets for drafters, disjoint from the eval sets (HumanEval, MT-Bench).

Provenance:
- `code`: signatures and docstrings of public functions in the running Python's standard library
  (found with `inspect`), asked for as "complete this function" in the style of code benchmarks.
- `chat`: instructions written from templates in this file crossed with topics in this file, drawn with
  a seeded RNG. No text comes from any benchmark.
The verifier writes the responses itself (see `specdec.train`), so a drafter learns its own target.
"""

from __future__ import annotations

import importlib
import inspect
import json
import random
import warnings
from pathlib import Path

STDLIB_MODULES = (
    "string", "textwrap", "re", "difflib", "math", "statistics", "fractions", "decimal", "random",
    "itertools", "functools", "operator", "collections", "heapq", "bisect", "copy", "json", "csv",
    "base64", "binascii", "hashlib", "hmac", "secrets", "os.path", "posixpath", "ntpath", "fnmatch",
    "glob", "shutil", "tempfile", "pathlib", "datetime", "calendar", "time", "zlib", "gzip", "bz2",
    "urllib.parse", "html", "html.parser", "http.cookies", "email.utils", "ipaddress", "uuid",
    "colorsys", "keyword", "tokenize", "ast", "dis", "inspect", "shlex", "argparse", "logging",
    "pprint", "reprlib", "enum", "numbers", "cmath", "array", "struct", "codecs", "unicodedata",
    "locale", "gettext", "wave", "quopri", "uu", "mimetypes", "filecmp", "linecache", "traceback",
    "warnings", "contextlib", "abc", "dataclasses", "typing", "graphlib", "zipfile", "tarfile",
    "configparser", "plistlib", "sched", "queue", "threading", "socket", "selectors", "platform",
)  # fmt: skip

_CHAT_TEMPLATES = (
    "Explain {t} to a curious high-school student.",
    "Write a short story of about 150 words that involves {t}.",
    "Give me five practical tips about {t}.",
    "What are the main advantages and disadvantages of {t}?",
    "Write a friendly email to a colleague about {t}.",
    "Summarize the history of {t} in a few paragraphs.",
    "Compare {t} with {u}. Which would you recommend to a beginner, and why?",
    "Write a haiku and then a limerick about {t}.",
    "Draft a step-by-step plan for someone who wants to learn about {t} in one month.",
    "What common misconceptions do people have about {t}? Correct them.",
    "Create a short quiz with three questions and answers about {t}.",
    "Describe {t} using an analogy a child would understand.",
    "Write a persuasive paragraph arguing that everyone should care about {t}.",
    "List the key terms someone must know to talk about {t}, with one-line definitions.",
    "Role-play: you are a tour guide. Introduce visitors to {t}.",
    "Write a product description for an imaginary gadget related to {t}.",
    "How would you explain {t} in a job interview?",
    "Rewrite this sentence in a more formal tone: 'honestly {t} is kind of a big deal these days'.",
    "What questions should I ask an expert on {t}?",
    "Write a dialogue between two friends who disagree about {t}.",
)  # fmt: skip

_TOPICS = (
    "photosynthesis", "compound interest", "the water cycle", "machine learning", "black holes",
    "the French Revolution", "volcanoes", "public transport", "sourdough baking", "chess openings",
    "renewable energy", "the immune system", "supply and demand", "jazz music", "the Roman Empire",
    "climate change", "plate tectonics", "remote work", "urban gardening", "the printing press",
    "quantum computing", "marathon training", "coral reefs", "electric cars", "the stock market",
    "meditation", "honeybees", "cryptography", "the Silk Road", "time management", "recycling",
    "the human brain", "origami", "solar eclipses", "vaccines", "the Internet", "mountain climbing",
    "coffee", "rainforests", "budgeting", "ancient Egypt", "robotics", "sleep", "languages",
    "video games", "the Moon landing", "friendship", "volunteering", "open-source software",
    "birdwatching", "tides", "earthquakes", "nutrition", "public speaking", "democracy", "museums",
    "smartphones", "the Olympic Games", "glaciers", "3D printing", "libraries", "pollination",
)  # fmt: skip


def stdlib_code_prompts(limit: int | None = None) -> list[str]:
    """One prompt per documented public stdlib function, in a stable order."""
    seen, prompts = set(), []
    for name in STDLIB_MODULES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                mod = importlib.import_module(name)
            except ImportError:
                continue
        for attr, fn in sorted(vars(mod).items()):
            if attr.startswith("_") or not inspect.isfunction(fn) or fn.__module__ != mod.__name__:
                continue
            doc = inspect.getdoc(fn)
            try:
                sig = str(inspect.signature(fn))
            except (TypeError, ValueError):
                continue
            if not doc or len(doc) < 20 or (attr, sig) in seen:
                continue
            seen.add((attr, sig))
            body = "\n".join("    " + line if line else "" for line in doc.split("\n\n")[0].splitlines())
            code = f'def {attr}{sig}:\n    """\n{body}\n    """\n'
            prompts.append(f"Complete the following Python function:\n```python\n{code}```")
    return prompts[:limit]


def chat_prompts(n: int, *, seed: int = 0) -> list[str]:
    """`n` distinct instructions from the templates and topics above."""
    rng = random.Random(seed)
    out: set[str] = set()
    limit = len(_CHAT_TEMPLATES) * len(_TOPICS)
    while len(out) < min(n, limit):
        t, u = rng.sample(_TOPICS, 2)
        out.add(rng.choice(_CHAT_TEMPLATES).format(t=t, u=u))
    return sorted(out, key=lambda s: rng.random())


def write_prompts(path: str | Path, *, n_code: int | None = None, n_chat: int = 600, seed: int = 0) -> Path:
    """A JSONL of {"id", "source", "messages"} records, code first then chat."""
    path = Path(path)
    rows = [("code", p) for p in stdlib_code_prompts(n_code)]
    rows += [("chat", p) for p in chat_prompts(n_chat, seed=seed)]
    with open(path, "w") as f:
        for i, (source, text) in enumerate(rows):
            messages = [{"role": "user", "content": text}]
            f.write(json.dumps({"id": f"{source}-{i}", "source": source, "messages": messages}) + "\n")
    return path
