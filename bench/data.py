"""The lab's prompts: the library's needle prompts over Paul Graham's essays (`flexentropy.cli.prompts`, re-exported
here), a vault needle whose answer outlives the first eviction, later turns of a conversation, and the Python
standard library's own source files (`python_sources`: every machine has them).
Nothing here imports transformers.
"""

from __future__ import annotations

import functools
import random
import sysconfig
from pathlib import Path
from typing import Any

from flexentropy.cli.prompts import (
    Needle,
    chat_ids,
    essays_dir,
    load_essays,
    number_needle,
    plant,
    prompt_ids,
    truncate_tokens,
)

__all__ = ["REPLY_MARK", "VAULT_COLOURS", "Needle", "chat_ids", "essays_dir", "load_essays", "next_turn_ids",
           "number_needle", "plant", "prompt_ids", "python_sources", "truncate_tokens", "vault_needle"]


@functools.cache
def python_sources() -> tuple[tuple[str, str], ...]:
    """``(file name, text)`` of every top-level ``*.py`` module of the running Python's standard library, by name
    (the files differ between Python versions)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    if not files:
        raise FileNotFoundError(f"no Python sources in {sysconfig.get_paths()['stdlib']}")
    return tuple((f.name, f.read_text(encoding="utf-8")) for f in files)


VAULT_COLOURS = ("crimson", "amber", "teal", "violet", "olive", "silver")


def vault_needle(seed: int = 0) -> Needle:
    """A 5-digit "access code for the {colour} vault" needle, drawn from ``seed``: its answer is a sentence that
    repeats the question's words before the code, so that a cache deciding a few tokens into the answer decides
    before the code is read."""
    rng = random.Random(seed)
    code, colour = str(rng.randrange(10_000, 100_000)), VAULT_COLOURS[seed % len(VAULT_COLOURS)]
    return Needle(fact=f"The access code for the {colour} vault is {code}.",
                  question=f"What is the access code for the {colour} vault? Answer in one sentence.", answer=code)


REPLY_MARK = "\u00a7reply\u00a7"
"""A stand-in reply that `next_turn_ids` renders through the chat template to find where a reply ends."""


def next_turn_ids(tokenizer: Any, question: str) -> list[int]:
    """Token ids that close the assistant's reply and ask ``question`` as the next user turn, generation prompt
    included: what follows a reply in a conversation (the chat template's text after the reply; without a template,
    two newlines and ``question``). They start with the template's end-of-turn token, so a reply that generated its
    own is continued without it."""
    if not getattr(tokenizer, "chat_template", None):
        return list(tokenizer(f"\n\n{question}", add_special_tokens=False)["input_ids"])
    turns = [{"role": "user", "content": "?"}, {"role": "assistant", "content": REPLY_MARK},
             {"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text[text.index(REPLY_MARK) + len(REPLY_MARK):], add_special_tokens=False)["input_ids"])
