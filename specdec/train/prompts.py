"""Offline training prompts for drafters, disjoint from the eval sets (HumanEval, MT-Bench).

Provenance (the stages of `specdec.train.corpus.build_default`):
- code: signatures and the first docstring paragraph of documented public functions and methods of the
  running Python's standard library and of 46 installed packages (`LIBRARIES`, found with `inspect`), asked
  in one of four wordings (`CODE_INSTRUCTIONS`; one is the wording `specdec.evals` wraps HumanEval in).
- chat: instructions from templates in this file (MT-Bench's kinds of task: writing, role play, reasoning,
  maths, coding, extraction, STEM, humanities) crossed with topics in this file, drawn with a seeded RNG;
  instructions the verifier writes itself when asked by persona x topic (self-instruct, "questions"); and
  follow-up turns (`FOLLOW_UPS`) to its own answers. No text comes from any benchmark: any prompt sharing a
  word 8-gram with a HumanEval problem or an MT-Bench turn is left out (`eval_ngrams`).
The verifier writes the responses itself, so a drafter learns its own target. Prompt lists depend on the
installed package versions, so a corpus fixes each stage's list once and commits it.
"""

from __future__ import annotations

import gzip
import importlib
import inspect
import json
import random
import re
import warnings
from collections.abc import Callable, Iterable, Sequence
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
            except (Exception, SystemExit):  # optional dependencies missing, platform-only modules
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


# ---- the corpus at scale (issue: 20k sequences): libraries, more chat, self-instruct, two turns -----------

#: installed packages whose public functions and methods become code prompts (beside the standard library);
#: sub-packages with these prefixes are left out (tests, vendored copies, heavy or side-effect imports)
LIBRARIES = (
    "numpy", "networkx", "sympy", "mpmath", "matplotlib", "PIL", "torch", "transformers", "huggingface_hub",
    "pygments", "rich", "markdown_it", "jinja2", "requests", "urllib3", "dateutil", "pyparsing", "fontTools",
    "pydantic", "pip", "setuptools", "_pytest", "click", "typer", "anyio", "httpx", "jsonschema", "attr",
    "fsspec", "filelock", "packaging", "yaml", "psutil", "tqdm", "starlette", "uvicorn", "mlx_lm", "gguf",
    "accelerate", "openai", "referencing", "tokenizers", "safetensors", "idna", "certifi", "pluggy",
)  # fmt: skip
_SKIP_PARTS = (
    "test", "tests", "testing", "_vendor", "vendor", "conftest", "benchmarks", "examples", "backends",
    "__main__", "cli", "commands", "scripts",
)  # fmt: skip
_TORCH_MODULES = (
    "torch.nn.functional", "torch.nn.modules", "torch.optim", "torch.utils.data", "torch.distributions",
    "torch.nn.utils", "torch.autograd", "torch.nn.init", "torch.utils.checkpoint", "torch.functional",
)  # fmt: skip
_TRANSFORMERS_MODULES = (
    "transformers.generation", "transformers.tokenization_utils_base", "transformers.modeling_utils",
    "transformers.utils.generic", "transformers.image_utils", "transformers.data",
    "transformers.optimization", "transformers.pipelines.base", "transformers.configuration_utils",
    "transformers.trainer_pt_utils",
    "transformers.masking_utils", "transformers.cache_utils", "transformers.audio_utils",
)  # fmt: skip

#: how a code prompt asks; the second is the wording `specdec.evals` wraps HumanEval problems in (our own
#: text, not benchmark data: the overlap check compares against the problems themselves)
CODE_INSTRUCTIONS = (
    "Complete the following Python function:\n```python\n{code}```",
    "Complete the following Python function. Reply with the complete function in a single Python code "
    "block.\n\n```python\n{code}```",
    "Implement this Python function. Keep the signature and the docstring.\n\n```python\n{code}```",
    "Write the body of the following function, then explain in two sentences how it works.\n\n```python\n"
    "{code}```",
)


def _library_modules(package: str) -> list[str]:
    """Importable public modules of `package`, sorted; nothing under _SKIP_PARTS or a private name."""
    import pkgutil

    roots = {"torch": _TORCH_MODULES, "transformers": _TRANSFORMERS_MODULES}.get(package, (package,))
    names: set[str] = set()
    for root in roots:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mod = importlib.import_module(root)
        except Exception:  # a broken optional import of some package: skip it
            continue
        names.add(root)
        for info in pkgutil.walk_packages(
            getattr(mod, "__path__", []), prefix=root + ".", onerror=lambda _: None
        ):
            parts = info.name.split(".")[1:]
            if any(p.startswith("_") or p in _SKIP_PARTS for p in parts):
                continue
            names.add(info.name)
    return sorted(names)


def _module_codes(mods: Sequence[Any], seen: set[tuple[str, str]], max_sig: int | None = None) -> list[str]:
    """Code blocks (signature + first docstring paragraph) of the documented public functions and methods
    that `mods` define, in a stable order; signatures already in `seen` (or longer than `max_sig`) skipped."""
    codes = []
    fits = lambda code, pad: max_sig is None or len(code.split("\n", 1)[0]) <= max_sig + pad  # noqa: E731
    for mod in mods:
        for attr, fn in _own_public(mod, inspect.isfunction):
            code = _function_prompt(attr, fn, seen)
            if code and fits(code, 0):
                codes.append(code)
        for cname, cls in _own_public(mod, inspect.isclass):
            for attr, fn in sorted(vars(cls).items()):
                if not attr.startswith("_") and inspect.isfunction(fn):
                    code = _function_prompt(attr, fn, seen, indent="    ")
                    if code and fits(code, 4):
                        codes.append(f"class {cname}:\n{code}")
    return codes


def library_code_prompts(
    packages: Sequence[str] = LIBRARIES, *, per_package: int = 600, seed: int = 0, exclude: Iterable[str] = ()
) -> list[tuple[str, str]]:
    """(source, prompt) for documented public functions and methods that `packages` define (at most
    `per_package` each, drawn with a seeded RNG from the package's sorted list), none of the code blocks in
    `exclude` (the standard library's), each asked in one of CODE_INSTRUCTIONS."""
    skip = set(exclude)
    rng = random.Random(seed)
    out: list[tuple[str, str]] = []
    for package in packages:
        codes = _module_codes(_modules(_library_modules(package)), set(), max_sig=160)
        found = [c for c in codes if c not in skip]
        for code in rng.sample(found, min(per_package, len(found))):
            out.append((package, rng.choice(CODE_INSTRUCTIONS).format(code=code)))
    return out


#: instructions by the kinds of task MT-Bench scores (writing, roleplay, reasoning, math, coding, extraction,
#: STEM, humanities), written for this project; {t}, {u}: topics, {n}, {m}: small numbers
CHAT_TEMPLATES_V2 = (
    "Write a blog post of about 300 words on {t}, with a catchy title and three sections.",
    "Write a cover letter for a job at a company that works on {t}.",
    "Write a poem of four stanzas about {t}. Then explain the imagery you used.",
    "Draft a short speech for the opening of a conference on {t}.",
    "Write a formal complaint letter about a problem with a service related to {t}.",
    "Write a children's story about {t} with a moral at the end.",
    "Compose a tweet thread of five tweets that explains {t}.",
    "Write a product review of an imaginary book about {t}: what was good and what was missing?",
    "Pretend you are a famous scientist who studies {t}. Answer a journalist who asks why it matters.",
    "Act as a travel agent and plan a three-day trip for someone fascinated by {t}.",
    "You are a detective in a mystery novel. Describe a clue connected to {t} and what it reveals.",
    "Imagine you are a coach. Give a pep talk to a team that is about to compete in {t}.",
    "Play the role of a museum curator presenting a new exhibition about {t}.",
    "You are a customer support agent. A user is confused about {t}. Help them politely.",
    "A farmer has {n} cows and buys {m} more, then sells half of them. How many cows are left? Explain.",
    "If a train travels {n}0 kilometres in {m} hours, what is its average speed? Show your reasoning.",
    "Solve for x: {n}x + {m} = {n}{m}. Explain every step.",
    "What is the sum of the first {n}{m} positive integers? Explain the formula you use.",
    "A rectangle has a perimeter of {n}{m} cm and one side of {n} cm. What is its area?",
    "I roll two dice. What is the probability that the sum is {n}? Explain.",
    "A recipe for {n} people needs {m}00 grams of flour. How much flour for {m} people?",
    "Three friends share {n}{m} dollars in the ratio 1:2:3. How much does each get?",
    "Alice is older than Bob, and Bob is older than Carol. Who is the youngest? Explain the reasoning, "
    "then relate it to {t}.",
    "Is the following argument valid? 'All things related to {t} are interesting. {u} is interesting. "
    "So {u} is related to {t}.' Explain.",
    "Give a step-by-step argument for and against the claim that {t} will change everyday life within "
    "ten years.",
    "Write a Python function that checks whether a string is a palindrome, and use it on three examples "
    "about {t}.",
    "Write a Python class that stores a list of notes about {t} and can search them by keyword.",
    "Explain the difference between a list and a dictionary in Python, using data about {t} as an example.",
    "Write a SQL query that counts the number of articles per author in a table of articles about {t}.",
    "Write a JavaScript function that formats a date, and explain it to someone who studies {t}.",
    "Find the bug in this Python code and fix it: `def mean(xs): return sum(xs) / len(xs) + 1`",
    "Write a shell command that finds every file containing the word '{t}' in a folder.",
    "Write a recursive Python function that computes the {n}th Fibonacci number, then an iterative one.",
    "Extract the names, dates and places from this text and return them as JSON: 'On {n} May, Maria met "
    "Tom in Lisbon to talk about {t}; they met again in Oslo on {m} June.'",
    "Read this review and return the product, the rating out of 5 and the main complaint as JSON: 'The "
    "{t} guide was fine, maybe three stars, but the pictures were blurry.'",
    "List every number in this sentence and their sum: 'We saw {n} birds, {m} boats and 12 people near "
    "the lake while reading about {t}.'",
    "Classify the tone of this message as positive, negative or neutral and explain why: 'I finally "
    "understand {t}, although it took ages.'",
    "Explain how {t} works at the level of a first-year university course, with one equation if it helps.",
    "What are the key scientific principles behind {t}? Give an example for each.",
    "Describe an experiment a student could do at home to learn about {t}.",
    "How does {t} relate to {u}? Describe two connections.",
    "What role did {t} play in history? Mention two turning points.",
    "Discuss the ethical questions raised by {t}.",
    "How have artists and writers portrayed {t}? Give examples.",
    "Compare how two different cultures think about {t}.",
    "Write a short essay on how {t} has influenced modern society.",
)  # fmt: skip

TOPICS_V2 = (
    *_TOPICS,
    "artificial intelligence", "the Renaissance", "antibiotics", "DNA", "the Great Wall of China",
    "hurricanes", "wind turbines", "the printing of money", "inflation", "the theory of evolution",
    "dinosaurs", "the periodic table", "magnetism", "electricity", "gravity", "the speed of light",
    "the Industrial Revolution", "the Cold War", "ancient Greece", "the Aztecs", "the Vikings",
    "the Ottoman Empire", "the Ming dynasty", "the Mongol Empire", "the Maya", "the Byzantine Empire",
    "impressionism", "classical music", "hip hop", "opera", "film noir", "poetry", "theatre",
    "photography", "architecture", "graphic design", "fashion", "knitting", "woodworking", "pottery",
    "gardening", "beekeeping", "fishing", "camping", "cycling", "swimming", "yoga", "football", "tennis",
    "basketball", "cricket", "skiing", "surfing", "rock climbing", "running shoes", "healthy breakfasts",
    "vegetarian cooking", "bread making", "tea", "chocolate", "spices", "fermentation", "food safety",
    "microbes", "viruses", "the heart", "the lungs", "the skeleton", "allergies", "diabetes", "exercise",
    "mental health", "stress", "habits", "motivation", "procrastination", "memory", "learning styles",
    "online courses", "exams", "homework", "teaching", "parenting", "pets", "dogs", "cats", "horses",
    "whales", "sharks", "octopuses", "ants", "butterflies", "owls", "penguins", "elephants", "wolves",
    "forests", "deserts", "oceans", "rivers", "lakes", "caves", "islands", "the Arctic", "Antarctica",
    "the Amazon", "the Sahara", "the Alps", "the Himalayas", "weather forecasts", "air pollution",
    "water scarcity", "plastic waste", "composting", "electric bikes", "trains", "airplanes", "ships",
    "rockets", "satellites", "Mars", "Jupiter", "comets", "the Big Bang", "telescopes", "microscopes",
    "batteries", "semiconductors", "the transistor", "databases", "spreadsheets", "operating systems",
    "computer networks", "cybersecurity", "passwords", "encryption", "cloud computing", "web browsers",
    "search engines", "social media", "email etiquette", "online privacy", "blockchain", "virtual reality",
    "self-driving cars", "drones", "smart homes", "wearable devices", "programming languages", "Python",
    "algorithms", "sorting", "recursion", "data structures", "statistics", "probability", "geometry",
    "prime numbers", "fractions", "calculus", "game theory", "logic puzzles", "economics", "taxes",
    "banking", "insurance", "entrepreneurship", "marketing", "negotiation", "leadership", "teamwork",
    "customer service", "job interviews", "resumes", "career changes", "retirement", "saving money",
    "investing", "real estate", "city planning", "bridges", "skyscrapers", "roads", "public parks",
    "elections", "human rights", "the United Nations", "law and courts", "journalism", "advertising",
    "philosophy", "ethics", "mythology", "folk tales", "world religions", "languages of the world",
    "translation", "dictionaries", "handwriting", "calligraphy", "board games", "card games", "puzzles",
    "magic tricks", "circuses", "festivals", "weddings", "birthdays", "holidays", "time zones", "calendars",
    "clocks", "maps", "navigation", "exploration", "lighthouses", "castles", "pyramids", "bridges of Paris",
    "volunteering abroad", "first aid", "firefighting", "emergency planning", "noise", "light", "colour",
    "sound waves", "music theory", "guitars", "pianos", "drums", "choirs", "dance", "animation", "comics",
)  # fmt: skip

#: who asks, for instructions the verifier writes itself (self-instruct)
PERSONAS = (
    "a high-school student", "a retired teacher", "a software engineer", "a nurse", "a farmer",
    "a small-business owner", "a curious ten-year-old", "a university professor", "a journalist",
    "a tourist", "a new parent", "a chef", "a musician", "a scientist", "a lawyer", "a data analyst",
    "a librarian", "a football coach", "a gardener", "a novelist", "a first-time home buyer",
    "a bus driver", "a museum guide", "a game designer", "a doctor", "an engineering student",
    "a history buff", "a photographer", "a pilot", "a shop assistant",
)  # fmt: skip
SELF_INSTRUCT = (
    "Write one question that {p} might ask an AI assistant about {t}. Write only the question.",
    "Write one task that {p} might give an AI assistant, related to {t}. Write only the task, in one "
    "sentence.",
)

#: follow-up user turns for two-turn conversations (written here; MT-Bench's second turns are not used)
FOLLOW_UPS = (
    "Can you make your answer shorter, in at most three sentences?",
    "Rewrite your answer for a ten-year-old.",
    "Give three concrete examples of what you described.",
    "Now summarize everything in a single sentence.",
    "Turn your answer into a bulleted list.",
    "What is the weakest point of your answer? Improve it.",
    "Add a title and a short conclusion to your answer.",
    "Rewrite your answer in a more formal tone.",
    "Explain the most important part of your answer in more detail.",
    "Write a short quiz of three questions based on your answer.",
    "Now write the opposite point of view.",
    "Can you give the same answer as a table?",
    "Which part of your answer would an expert disagree with, and why?",
    "Continue from where you stopped, adding one more paragraph.",
    "Rewrite your answer so that every paragraph starts with a question.",
    "Give me a step-by-step version of your answer.",
    "How would your answer change for someone living in a big city?",
    "Write a short email that shares your answer with a friend.",
    "Now write Python code that illustrates your answer.",
    "Check your answer for mistakes and correct any you find.",
)  # fmt: skip


def chat_prompts_v2(n: int, *, seed: int = 0) -> list[str]:
    """`n` distinct instructions from CHAT_TEMPLATES_V2 x TOPICS_V2 (and small numbers), seeded order."""
    rng = random.Random(seed)
    out: set[str] = set()
    limit = len(CHAT_TEMPLATES_V2) * len(TOPICS_V2)
    while len(out) < min(n, limit):
        t, u = rng.sample(TOPICS_V2, 2)
        out.add(rng.choice(CHAT_TEMPLATES_V2).format(t=t, u=u, n=rng.randint(2, 9), m=rng.randint(2, 9)))
    items = sorted(out)
    rng.shuffle(items)
    return items


def self_instruct_seeds(n: int, *, seed: int = 0) -> list[str]:
    """`n` distinct requests asking the verifier to write an instruction (persona x topic x wording)."""
    rng = random.Random(seed)
    out: set[str] = set()
    while len(out) < min(n, len(SELF_INSTRUCT) * len(PERSONAS) * len(TOPICS_V2)):
        out.add(rng.choice(SELF_INSTRUCT).format(p=rng.choice(PERSONAS), t=rng.choice(TOPICS_V2)))
    items = sorted(out)
    rng.shuffle(items)
    return items


ECHO_N = 6  # an instruction sharing this many consecutive words with its request repeats the request


def parse_instruction(text: str, request: str | None = None) -> str | None:
    """The instruction in a self-instruct answer, or None when it does not look like one (too short or
    long, code, a list, or a repeat of `request`, the prompt that asked for it: what a base model such as
    Gemma-3-270M answers). A quoted instruction ('A nurse might ask: "..."') is taken from its quotes;
    otherwise the first non-empty line, labels ("Question:") stripped."""
    quoted = [q.strip() for q in re.findall(r'"([^"]{12,})"', text)]
    if quoted:
        line = max(quoted, key=len)
    else:
        lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
        if not lines:
            return None
        line = re.sub(r"^(question|task|q)\s*[:.-]\s*", "", lines[0], flags=re.I).strip().strip('"').strip()
    words = line.split()
    if not 5 <= len(words) <= 60 or line.startswith(("```", "-", "*", "1.")) or "{" in line:
        return None
    if request is not None and word_ngrams(line, ECHO_N) & word_ngrams(request, ECHO_N):
        return None
    return line


# ---- disjointness from the eval sets -------------------------------------------------------------------

OVERLAP_N = 8  # word n-grams shared with an eval prompt disqualify a training prompt


def word_ngrams(text: str, n: int = OVERLAP_N) -> set[tuple[str, ...]]:
    """Lower-cased alphanumeric word n-grams of `text`."""
    words = re.findall(r"[a-z0-9]+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def eval_ngrams(n: int = OVERLAP_N) -> set[tuple[str, ...]]:
    """Word n-grams of every HumanEval problem prompt and every MT-Bench turn (the data, not the
    instruction `specdec.evals` wraps HumanEval problems in)."""
    from specdec.evals.datasets import fetch_dataset, load_mtbench

    grams: set[tuple[str, ...]] = set()
    with gzip.open(fetch_dataset("humaneval"), "rt") as f:
        for line in f:
            grams |= word_ngrams(json.loads(line)["prompt"], n)
    for r in load_mtbench():
        for turn in r.turns:
            grams |= word_ngrams(turn, n)
    return grams


# ---- the corpus stages -----------------------------------------------------------------------------------

CHAT_SOURCES = ("chat", "chat1", "self")  # stage_turn1 sources that are conversations, not code


def code_prompts_v2(*, packages: Sequence[str] = LIBRARIES, seed: int = 0) -> list[tuple[str, str]]:
    """(source, prompt): every documented public function and method of both standard-library module
    lists, then `library_code_prompts` of `packages`, each asked in one of CODE_INSTRUCTIONS (seeded)."""
    rng = random.Random(seed)
    seen: set[tuple[str, str]] = set()
    std = [c for mod in _modules(STDLIB_MODULES + STDLIB_MODULES_MORE) for c in _module_codes([mod], seen)]
    out = [("stdlib", rng.choice(CODE_INSTRUCTIONS).format(code=c)) for c in std]
    return out + library_code_prompts(packages, seed=seed, exclude=std)


def stage_questions(n: int = 3000, *, seed: int = 0) -> list[tuple[str, list[dict[str, str]]]]:
    """Stage 1: requests that make the verifier write instructions itself (self-instruct)."""
    return [
        (f"q-{i}", [{"role": "user", "content": t}]) for i, t in enumerate(self_instruct_seeds(n, seed=seed))
    ]


def stage_turn1(
    questions: Sequence[str], *, n_chat: int = 5000, n_chat_v1: int = 1000, seed: int = 0
) -> list[tuple[str, list[dict[str, str]]]]:
    """Stage 2: code prompts, chat instructions (templated, and `questions`, the verifier's own) in a seeded
    order, any whose word n-grams meet an eval prompt's left out."""
    rows = [(src, t) for src, t in code_prompts_v2(seed=seed)]
    rows += [("chat", t) for t in chat_prompts_v2(n_chat, seed=seed)]
    rows += [("chat1", t) for t in chat_prompts(n_chat_v1, seed=seed + 3, templates=_ALL_TEMPLATES)]
    rows += [("self", t) for t in dict.fromkeys(questions)]
    banned = eval_ngrams()
    rows = [(s, t) for s, t in rows if not word_ngrams(t) & banned]
    keyed = [(f"{src}-{i}", t) for i, (src, t) in enumerate(rows)]
    random.Random(seed).shuffle(keyed)
    return [(k, [{"role": "user", "content": t}]) for k, t in keyed]


def stage_turn2(
    turn1: Sequence[tuple[str, list[dict[str, str]], str]], *, n: int = 3000, seed: int = 0
) -> list[tuple[str, list[dict[str, str]]]]:
    """Stage 3: two-turn conversations: `n` of the (key, messages, answer) first turns (chat ones, seeded
    draw) followed by one of FOLLOW_UPS."""
    rng = random.Random(seed)
    chat = [t for t in turn1 if t[0].split("-")[0] in CHAT_SOURCES]
    out = []
    for key, messages, answer in rng.sample(chat, min(n, len(chat))):
        follow = rng.choice(FOLLOW_UPS)
        out.append(
            (
                f"{key}/2",
                [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": follow}],
            )
        )
    return out
