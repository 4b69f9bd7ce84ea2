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
import re
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

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

# The third set's code comes from these: more of the standard library, none of it in STDLIB_MODULES.
STDLIB_MODULES_MORE = (
    "email.message", "email.header", "email.headerregistry", "email.parser", "email.generator",
    "email.policy", "email.charset", "email.feedparser", "email.iterators", "email.quoprimime",
    "email.base64mime", "http.client", "http.server", "http.cookiejar", "urllib.request",
    "urllib.robotparser", "urllib.error", "xml.etree.ElementTree", "xml.dom.minidom", "xml.dom.pulldom",
    "xml.sax.saxutils", "xml.sax.handler", "sqlite3", "asyncio.tasks", "asyncio.queues", "asyncio.locks",
    "asyncio.streams", "asyncio.events", "concurrent.futures._base", "concurrent.futures.thread",
    "subprocess", "importlib.util", "importlib.metadata", "importlib.resources", "pkgutil", "pydoc",
    "doctest", "unittest.case", "unittest.loader", "unittest.result", "unittest.mock", "optparse",
    "getopt", "os", "trace", "timeit", "cProfile", "pstats", "pickletools", "pickle", "shelve", "dbm",
    "smtplib", "poplib", "imaplib", "ftplib", "mailbox", "netrc", "chunk", "aifc", "sunau",
    "rlcompleter", "code", "codeop", "compileall", "py_compile", "zipapp", "runpy", "modulefinder",
    "symtable", "token", "tabnanny", "pyclbr", "weakref", "types", "copyreg", "socketserver",
    "xmlrpc.client", "xmlrpc.server", "wsgiref.util", "wsgiref.headers", "wsgiref.handlers", "getpass",
    "stringprep", "ssl", "lzma", "stat", "tomllib", "sysconfig", "bdb", "pdb", "tracemalloc", "opcode",
    "collections.abc", "logging.handlers", "logging.config", "json.decoder", "json.encoder", "ctypes",
    "ctypes.util", "pty", "tty", "html.entities", "multiprocessing.pool", "multiprocessing.managers",
    "multiprocessing.shared_memory", "multiprocessing.queues", "multiprocessing.connection", "cmd",
    "sre_parse", "signal", "_pyio", "_strptime", "_collections_abc", "_pydecimal", "zoneinfo._zoneinfo",
    "zoneinfo._tzpath", "encodings.idna",
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

_CHAT_TEMPLATES_MORE = (
    "A shop sells {t} kits for 12 dollars each and gives 15% off orders of 10 or more. How much do 14 "
    "kits cost? Explain each step.",
    "Extract every noun phrase from this sentence and return them as a JSON list: 'Experts on {t} met "
    "in the old library to discuss {u} and the future of research.'",
    "Reason step by step: if every expert on {t} also studies {u}, and Sam studies {u}, must Sam be an "
    "expert on {t}?",
    "Write a Python function that returns the number of words in a text about {t}, with a docstring and "
    "two doctests.",
    "Write a table in Markdown with three facts about {t} and three facts about {u}.",
    "Give a one-paragraph answer, then a one-sentence answer: why does {t} matter?",
    "Translate into simple English for a language learner: a short explanation of {t}.",
    "You are a teacher. Grade this student answer from 1 to 10 and explain: '{t} is the same as {u}.'",
)  # fmt: skip

_ALL_TEMPLATES = _CHAT_TEMPLATES + _CHAT_TEMPLATES_MORE

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


def _modules(names: Sequence[str] = STDLIB_MODULES) -> list[Any]:
    mods = []
    for name in names:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                mods.append(importlib.import_module(name))
            except ImportError:
                continue
    return mods


def _own_public(mod: Any, kind: Callable[[Any], bool]) -> list[tuple[str, Any]]:
    """(name, object) of `mod`'s public members of `kind` that `mod` itself defines, by name."""
    return [
        (name, obj)
        for name, obj in sorted(vars(mod).items())
        if not name.startswith("_") and kind(obj) and obj.__module__ == mod.__name__
    ]


def _function_prompt(name: str, fn: Any, seen: set[tuple[str, str]], indent: str = "") -> str | None:
    doc = inspect.getdoc(fn)
    try:
        sig = re.sub(r" at 0x[0-9a-fA-F]+", "", str(inspect.signature(fn)))  # no per-process addresses
    except (TypeError, ValueError):
        return None
    if not doc or len(doc) < 20 or (name, sig) in seen:
        return None
    seen.add((name, sig))
    pad = indent + "    "
    body = "\n".join(pad + line if line else "" for line in doc.split("\n\n")[0].splitlines())
    return f'{indent}def {name}{sig}:\n{pad}"""\n{body}\n{pad}"""\n'


def stdlib_code_prompts(limit: int | None = None, *, modules: Sequence[str] = STDLIB_MODULES) -> list[str]:
    """One prompt per documented public stdlib function, in a stable order."""
    seen: set[tuple[str, str]] = set()
    prompts = []
    for mod in _modules(modules):
        for attr, fn in _own_public(mod, inspect.isfunction):
            code = _function_prompt(attr, fn, seen)
            if code:
                prompts.append(f"Complete the following Python function:\n```python\n{code}```")
    return prompts[:limit]


def stdlib_method_prompts(limit: int | None = None, *, modules: Sequence[str] = STDLIB_MODULES) -> list[str]:
    """One prompt per documented public method of a public stdlib class, in a stable order."""
    seen: set[tuple[str, str]] = set()
    prompts = []
    for mod in _modules(modules):
        for cname, cls in _own_public(mod, inspect.isclass):
            for attr, fn in sorted(vars(cls).items()):
                if attr.startswith("_") or not inspect.isfunction(fn):
                    continue
                code = _function_prompt(attr, fn, seen, indent="    ")
                if code:
                    prompts.append(
                        f"Complete the method of class `{cname}` (module `{mod.__name__}`):\n"
                        f"```python\nclass {cname}:\n{code}```"
                    )
    return prompts[:limit]


def chat_prompts(
    n: int, *, seed: int = 0, templates: Sequence[str] = _CHAT_TEMPLATES, exclude: Iterable[str] = ()
) -> list[str]:
    """`n` distinct instructions from `templates` and the topics above, none of them in `exclude`."""
    rng = random.Random(seed)
    skip = set(exclude)
    out: set[str] = set()
    limit = len(templates) * len(_TOPICS) - len(skip)
    while len(out) < min(n, limit):
        t, u = rng.sample(_TOPICS, 2)
        text = rng.choice(templates).format(t=t, u=u)
        if text not in skip:
            out.add(text)
    items = sorted(out)  # a set's order follows the per-process string hash: sort before shuffling
    rng.shuffle(items)
    return items


def _write_rows(path: Path, rows: list[tuple[str, str, str]]) -> Path:
    with open(path, "w") as f:
        for rid, source, text in rows:
            messages = [{"role": "user", "content": text}]
            f.write(json.dumps({"id": rid, "source": source, "messages": messages}) + "\n")
    return path


def write_prompts(path: str | Path, *, n_code: int | None = None, n_chat: int = 600, seed: int = 0) -> Path:
    """A JSONL of {"id", "source", "messages"} records, code first then chat."""
    rows = [("code", p) for p in stdlib_code_prompts(n_code)]
    rows += [("chat", p) for p in chat_prompts(n_chat, seed=seed)]
    return _write_rows(Path(path), [(f"{src}-{i}", src, text) for i, (src, text) in enumerate(rows)])


def write_more_prompts(
    path: str | Path, *, after_code: int, after_chat: int, n_method: int, n_chat: int, seed: int = 0
) -> Path:
    """A second, disjoint set after `write_prompts(n_code=after_code, n_chat=after_chat, seed=seed)`:
    the remaining stdlib functions, `n_method` stdlib methods, and `n_chat` instructions from all
    templates (including the reasoning / math / extraction ones) that the first set does not hold,
    interleaved in a seeded order so any prefix of the file mixes code and chat. Ids are
    "more-<source>-<index within the source>", so both sets can share one dataset directory."""
    sources = {
        "code": stdlib_code_prompts()[after_code:],
        "method": stdlib_method_prompts(n_method),
        "chat": _second_chat(after_chat, n_chat, seed),
    }
    return _write_mixed(Path(path), "more", sources, seed)


def write_third_prompts(
    path: str | Path, *, first_chat: int, second_chat: int, n_code: int, n_chat: int, seed: int = 0
) -> Path:
    """A third set, disjoint from the first two (`write_prompts(n_chat=first_chat, seed=seed)` and
    `write_more_prompts(after_chat=first_chat, n_chat=second_chat, seed=seed)`): `n_code` functions and
    methods of STDLIB_MODULES_MORE (functions first, then methods, skipping any text the first two sets'
    modules give) and `n_chat` instructions from all templates that neither chat set holds. Seeded
    interleaving as in `write_more_prompts`; ids are "third-<source>-<index>"."""
    earlier = set(chat_prompts(first_chat, seed=seed)) | set(_second_chat(first_chat, second_chat, seed))
    known = set(stdlib_code_prompts()) | set(stdlib_method_prompts())
    code = stdlib_code_prompts(modules=STDLIB_MODULES_MORE) + stdlib_method_prompts(
        modules=STDLIB_MODULES_MORE
    )
    sources = {
        "code": [p for p in code if p not in known][:n_code],
        "chat": chat_prompts(n_chat, seed=seed + 2, templates=_ALL_TEMPLATES, exclude=earlier),
    }
    return _write_mixed(Path(path), "third", sources, seed)


def _second_chat(first_chat: int, n_chat: int, seed: int) -> list[str]:
    """The second set's instructions: all templates, none of the first set's `first_chat`."""
    first = set(chat_prompts(first_chat, seed=seed))
    return chat_prompts(n_chat, seed=seed + 1, templates=_ALL_TEMPLATES, exclude=first)


def _write_mixed(path: Path, tag: str, sources: dict[str, list[str]], seed: int) -> Path:
    rows = [(f"{tag}-{src}-{i}", src, text) for src, texts in sources.items() for i, text in enumerate(texts)]
    random.Random(seed).shuffle(rows)  # any prefix of the file mixes the sources
    return _write_rows(path, rows)
