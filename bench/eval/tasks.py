"""RULER-style synthetic tasks over Paul Graham's essays, in kvpress's data contract.

Every task draws one `Sample` from ``(task, length, index, seed)`` alone (a string-seeded `random.Random`, stable
across processes and Python versions), so sample ``i`` is the same whatever the sample count of a run. A sample's
prompt (chat template, context, question, answer prefix) is about ``length`` tokens of the given tokenizer: the
haystack (essay text starting at a drawn essay) is cut to what the template, instruction, facts and question leave.

Tasks (RULER, Hsieh et al. 2024, scaled to a 135M model's 1k-4k range):

* ``niah_single``: one "special magic number" for a key, planted at a drawn depth;
* ``niah_multikey``: four keys, each with its number; one is asked (the others are distractors);
* ``niah_multivalue``: four numbers for the same key; all are asked;
* ``niah_multiquery``: four keys; the numbers of all four are asked;
* ``niah_multiquery3``: four keys; the numbers of three are asked in one question, so one answer carries three
  values and the fourth key is a distractor;
* ``niah_multiquery3_lines``: the same, the reply asked for one line per key (``key: number``), so that a value
  written under a wrong key shows (`bench.eval.metrics.key_value_hits` scores the pairs);
* ``vt``: variable tracking, one chain ``VAR A = 12345``, ``VAR B = VAR A``, ... of five variables; all are asked;
* ``cwe``: common-word extraction over a numbered list of words drawn from the essays' vocabulary;
* ``niah_multiturn``: two keys, three numbers for the first and one for the second; the first key's are asked, then,
  on the same cache after the reply, the second's (`Sample.followups`): the second needle must outlive the decisions
  taken while the first answer was written;
* ``code_recall``: long output from real code: Python standard-library source files as the context, one of their
  functions to write out after its ``def`` line (each line of its body of at least `CODE_LINE_CHARS` characters,
  docstring aside, scored on its own);
* ``summarise``: the paper's latency prompt (sec. 5.3): summarise the essays, exactly ``max_new_tokens`` generated.

Tasks whose answer has several values (``niah_multivalue``, ``niah_multiquery``, ``niah_multiquery3``,
``niah_multiquery3_lines``, ``vt``, ``cwe``, ``code_recall``, ``niah_multiturn``) score each value on its own: the
score is the share of values found.

Question placement (`prompt_text`): ``"outside"`` puts the question after the context (kvpress' default: the context
is what gets compressed, the question is not); ``"inside"`` puts it before the context, so it is compressed or
evicted with the context, and the prompt ends with a question-agnostic reminder.
"""

from __future__ import annotations

import ast
import functools
import platform
import random
import re
import string
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from bench.data import chat_ids, load_essays, plant, python_sources, truncate_tokens

Placement = Literal["outside", "inside"]
PLACEMENTS: tuple[str, ...] = ("outside", "inside")

INSIDE_REMINDER = "Answer the question asked before the text."
"""The prompt's last line when the question precedes the context: it does not say what is asked."""

NIAH_INSTRUCTION = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
                    "I will quiz you about the numbers afterwards.")

KEYS = (
    "apple", "anchor", "badge", "barrel", "basket", "beacon", "blanket", "bottle", "bridge", "bucket", "cabin",
    "camera", "candle", "canvas", "carpet", "castle", "chimney", "compass", "cottage", "crystal", "curtain", "dagger",
    "diamond", "dolphin", "engine", "falcon", "feather", "forest", "fountain", "garden", "glacier", "hammer", "harbor",
    "helmet", "island", "jacket", "kettle", "ladder", "lantern", "lemon", "lighthouse", "magnet", "meadow", "mirror",
    "monkey", "needle", "orchard", "oyster", "paddle", "parrot", "pebble", "pencil", "pillow", "pirate", "planet",
    "pocket", "puzzle", "rabbit", "ribbon", "rocket", "saddle", "sailor", "scarf", "shovel", "spider", "statue",
    "teapot", "tiger", "tractor", "trumpet", "tunnel", "turtle", "umbrella", "valley", "violin", "wagon", "walnut",
    "whistle", "window", "wizard",
)
"""Needle keys (distinct concrete nouns, as RULER draws words for its keys)."""

Encode = Callable[[str], Sequence[int]]

MAX_CHARS_PER_TOKEN = 12
"""Essay text taken per token wanted before cutting by tokens (English BPE averages ~4-5 characters per token)."""


@dataclass(frozen=True)
class Turn:
    """A later question of a conversation, asked on the same cache once the reply before it is done.

    Attributes:
        question: the next user turn. answer_prefix: the start of its reply (part of the prompt).
        answers: the strings this reply must contain. max_new_tokens: greedy tokens to generate for it.
    """

    question: str
    answer_prefix: str
    answers: tuple[str, ...]
    max_new_tokens: int


@dataclass(frozen=True)
class Sample:
    """One evaluation example in kvpress's data contract, plus what scoring and bookkeeping need.

    Attributes:
        task, length, index: what drew it (``length`` is the target prompt length in tokens).
        context: the long part (instruction and haystack with the planted facts).
        question: asked after the context (``"outside"``) or before it (``"inside"``).
        answer_prefix: the start of the assistant's reply, part of the prompt (kvpress' ``answer_prefix``).
        answers: every string the reply must contain (kvpress' ``answer``); empty for ``summarise``.
        max_new_tokens: greedy tokens to generate. min_new_tokens: generated even past an end-of-sequence token
            (``summarise`` sets both to 100, as the paper's latency test).
        followups: later turns, each asked after the reply to the one before on the same cache (`Turn`); the
            prompt is about ``length`` tokens without them.
        meta: task details (keys, depths, values) for the record.
    """

    task: str
    length: int
    index: int
    context: str
    question: str
    answer_prefix: str
    answers: tuple[str, ...]
    max_new_tokens: int
    min_new_tokens: int = 0
    followups: tuple[Turn, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def all_answers(self) -> tuple[str, ...]:
        """The answers of every turn, first turn first (each scored on its own)."""
        return self.answers + tuple(answer for turn in self.followups for answer in turn.answers)

    def as_kvpress(self) -> dict[str, Any]:
        """The kvpress dataset row: ``context``, ``question``, ``answer_prefix``, ``answer``, ``max_new_tokens``."""
        return {"context": self.context, "question": self.question, "answer_prefix": self.answer_prefix,
                "answer": list(self.answers), "max_new_tokens": self.max_new_tokens}


# --------------------------------------------------------------------------------------------------------------
# prompt


def prompt_text(context: str, question: str, placement: Placement = "outside") -> str:
    """The user turn: context then question (``"outside"``), or question, context and `INSIDE_REMINDER`."""
    if placement == "outside":
        return f"{context}\n\n{question}"
    if placement == "inside":
        return f"{question}\n\n{context}\n\n{INSIDE_REMINDER}"
    raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")


def _encode(tokenizer: Any) -> Encode:
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


def assemble_ids(tokenizer: Any, context: str, question: str, answer_prefix: str,
                 placement: Placement = "outside") -> list[int]:
    """Token ids: the user turn (`prompt_text`, chat template with generation prompt), then ``answer_prefix``."""
    ids = chat_ids(tokenizer, prompt_text(context, question, placement))
    return ids + list(_encode(tokenizer)(answer_prefix)) if answer_prefix else ids


def sample_ids(tokenizer: Any, sample: Sample, placement: Placement = "outside") -> list[int]:
    """Prompt token ids of ``sample`` (see `assemble_ids`)."""
    return assemble_ids(tokenizer, sample.context, sample.question, sample.answer_prefix, placement)


# --------------------------------------------------------------------------------------------------------------
# drawing


@functools.cache
def _essays() -> tuple[str, tuple[int, ...]]:
    """The essays (`bench.data.load_essays`) and the character offset where each essay starts."""
    text = load_essays()
    starts = (0, *(m.end() for m in re.finditer(r"\n\n", text)))
    return text, starts


@dataclass
class Draw:
    """What a task generator draws from: a seeded ``rng``, the tokenizer and the target ``length``."""

    rng: random.Random
    tokenizer: Any
    length: int

    def number(self, digits: int = 7) -> str:
        return str(self.rng.randrange(10 ** (digits - 1), 10**digits))

    def depths(self, count: int, low: float = 0.05, high: float = 0.95) -> list[float]:
        """``count`` sorted needle depths drawn uniformly in ``[low, high]``."""
        return sorted(round(self.rng.uniform(low, high), 3) for _ in range(count))

    def haystack(self, num_tokens: int) -> str:
        """``num_tokens`` tokens of essay text, starting at a drawn essay (wrapping around at the end)."""
        text, starts = _essays()
        start = self.rng.choice(starts)
        chars = MAX_CHARS_PER_TOKEN * num_tokens
        window = text[start:start + chars]
        if len(window) < chars:
            window += "\n\n" + text[:chars - len(window)]
        return truncate_tokens(window, num_tokens, _encode(self.tokenizer), self.tokenizer.decode)

    def fit(self, render: Callable[[str], str], question: str, answer_prefix: str) -> str:
        """The context ``render(haystack)`` with the haystack cut so that the prompt is about ``length`` tokens."""
        overhead = len(assemble_ids(self.tokenizer, render(""), question, answer_prefix))
        room = self.length - overhead
        if room <= 0:
            raise ValueError(f"a prompt of {self.length} tokens leaves no room for text: template, instruction, facts "
                             f"and question take {overhead}")
        return render(self.haystack(room))


def plant_all(haystack: str, facts: Sequence[str], depths: Sequence[float]) -> str:
    """``haystack`` with each fact planted as its own sentence at its depth (deepest first, so that planting one
    does not move where the shallower ones go)."""
    for fact, depth in sorted(zip(facts, depths, strict=True), key=lambda fd: -fd[1]):
        haystack = plant(haystack, fact, depth)
    return haystack


def positions(context: str, facts: Sequence[str]) -> list[float]:
    """Where each fact ended up, as a share of the context's characters (planting moves it to a sentence end, so
    it may sit after its drawn depth)."""
    return [round(context.index(fact) / len(context), 3) for fact in facts]


def _magic(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _names(keys: Sequence[str]) -> str:
    return keys[0] if len(keys) == 1 else f"{', '.join(keys[:-1])} and {keys[-1]}"


LINES_FORMAT = "Answer with one line per key, each as `key: number`."
"""What `niah_multiquery3_lines` adds to its question."""


def _niah(draw: Draw, task: str, num_keys: int, values_per_key: int | Sequence[int], asked_keys: int,
          lines: bool = False) -> Sample:
    keys = draw.rng.sample(KEYS, num_keys)
    counts = [values_per_key] * num_keys if isinstance(values_per_key, int) else list(values_per_key)
    values = {key: [draw.number() for _ in range(count)] for key, count in zip(keys, counts, strict=True)}
    facts = [_magic(key, value) for key in keys for value in values[key]]
    draw.rng.shuffle(facts)
    depths = draw.depths(len(facts))
    asked = keys[:asked_keys]
    answers = tuple(value for key in asked for value in values[key])
    plural = len(answers) > 1
    noun = "numbers" if plural else "number"
    question = (f"What {'are all the' if plural else 'is the'} special magic {noun} for {_names(asked)} "
                "mentioned in the provided text?")
    prefix = f"The special magic {noun} for {_names(asked)} mentioned in the provided text {'are' if plural else 'is'}"
    if lines:   # one line per key: the reply binds each value to a key
        question, prefix = f"{question} {LINES_FORMAT}", f"The special magic numbers for {_names(asked)}, one per line:"
    context = draw.fit(lambda hay: f"{NIAH_INSTRUCTION}\n\n{plant_all(hay, facts, depths)}", question, prefix)
    return Sample(task, draw.length, 0, context, question, prefix, answers,
                  max_new_tokens=12 + (14 if lines else 10) * len(answers),
                  meta={"keys": keys, "asked": asked, "values": values, "facts": facts, "depths": depths,
                        "positions": positions(context, facts)})


def niah_single(draw: Draw) -> Sample:
    return _niah(draw, "niah_single", num_keys=1, values_per_key=1, asked_keys=1)


def niah_multikey(draw: Draw) -> Sample:
    return _niah(draw, "niah_multikey", num_keys=4, values_per_key=1, asked_keys=1)


def niah_multivalue(draw: Draw) -> Sample:
    return _niah(draw, "niah_multivalue", num_keys=1, values_per_key=4, asked_keys=1)


def niah_multiquery(draw: Draw) -> Sample:
    return _niah(draw, "niah_multiquery", num_keys=4, values_per_key=1, asked_keys=4)


def niah_multiquery3(draw: Draw) -> Sample:
    return _niah(draw, "niah_multiquery3", num_keys=4, values_per_key=1, asked_keys=3)


def niah_multiquery3_lines(draw: Draw) -> Sample:
    return _niah(draw, "niah_multiquery3_lines", num_keys=4, values_per_key=1, asked_keys=3, lines=True)


def niah_multiturn(draw: Draw) -> Sample:
    """Two keys, the first with three numbers, the second with one: the first key's numbers are asked (a reply of
    ~30 tokens, past a default ``decode_delay``), then the second key's number in a later turn."""
    sample = _niah(draw, "niah_multiturn", num_keys=2, values_per_key=(3, 1), asked_keys=1)
    key = sample.meta["keys"][1]
    value = sample.meta["values"][key][0]
    later = Turn(question=f"What is the special magic number for {key} mentioned in the provided text?",
                 answer_prefix=f"The special magic number for {key} mentioned in the provided text is",
                 answers=(value,), max_new_tokens=22)
    return replace(sample, followups=(later,))


def vt(draw: Draw, hops: int = 4) -> Sample:
    """Variable tracking (RULER ``vt``): one chain of ``hops + 1`` variables, statements planted in order."""
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(draw.rng.choices(string.ascii_uppercase, k=5))
        if name not in names:
            names.append(name)
    value = draw.number(5)
    facts = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, hops + 1)]
    depths = draw.depths(len(facts))
    question = f"Question: Find all variables that are assigned the value {value} in the text above."
    prefix = (f"Answer: According to the chain of variable assignments in the text above, {len(names)} variables "
              f"are assigned the value {value}, they are:")
    instruction = "Memorize and track the chain of variable assignments hidden in the following text."
    context = draw.fit(lambda hay: f"{instruction}\n\n{plant_all(hay, facts, depths)}", question, prefix)
    return Sample("vt", draw.length, 0, context, question, prefix, tuple(names), max_new_tokens=40,
                  meta={"value": value, "facts": facts, "depths": depths, "positions": positions(context, facts)})


@functools.cache
def essay_vocabulary(min_count: int = 5) -> tuple[str, ...]:
    """Lower-case alphabetic words of 5-10 letters that occur at least ``min_count`` times in the essays, sorted."""
    counts = Counter(re.findall(r"\b[a-z]{5,10}\b", _essays()[0]))
    return tuple(sorted(word for word, n in counts.items() if n >= min_count))


def cwe(draw: Draw, num_common: int = 5, common_freq: int = 12, rare_freq: int = 2) -> Sample:
    """Common-word extraction (RULER ``cwe``): ``num_common`` words ``common_freq`` times each among rare words
    ``rare_freq`` times each, shuffled into a numbered list; as many rare words as fit in ``length`` tokens."""
    vocabulary = draw.rng.sample(essay_vocabulary(), len(essay_vocabulary()))
    common, rare_pool = vocabulary[:num_common], vocabulary[num_common:]
    shuffle_seed = draw.rng.random()
    question = f"Question: What are the {num_common} most common words in the above list?"
    prefix = f"Answer: The top {num_common} words that appear most often in the list are:"
    instruction = ("Below is a numbered list of words. In these words, some appear more often than others. "
                   "Memorize the ones that appear most often.")

    def render(num_rare: int) -> str:
        words = common * common_freq + rare_pool[:num_rare] * rare_freq
        random.Random(shuffle_seed).shuffle(words)
        return instruction + "\n" + " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))

    def size(num_rare: int) -> int:
        return len(assemble_ids(draw.tokenizer, render(num_rare), question, prefix))

    if size(0) > draw.length:
        raise ValueError(f"cwe: {num_common} common words x {common_freq} do not fit in {draw.length} tokens")
    low, high = 0, len(rare_pool)
    while low < high:  # the most rare words that still fit
        mid = (low + high + 1) // 2
        low, high = (mid, high) if size(mid) <= draw.length else (low, mid - 1)
    return Sample("cwe", draw.length, 0, render(low), question, prefix, tuple(common), max_new_tokens=40,
                  meta={"rare_words": low, "common_freq": common_freq, "rare_freq": rare_freq})


CODE_LINE_CHARS = 8
"""Shortest stripped line of a function that `code_recall` scores (shorter ones, ``else:`` or ``return``, are not
evidence of a copy)."""

CODE_FUNCTION_CHARS = 800
"""Longest function source `code_recall` asks for (about 200-250 tokens of code for a BPE tokenizer)."""

CODE_INSTRUCTION = ("Below are Python source files. Read them carefully: you will be asked to write out one of their "
                    "functions exactly.")


def code_lines(source: str) -> tuple[str, ...]:
    """The lines of ``source`` that `code_recall` scores: stripped, at least `CODE_LINE_CHARS` characters, not
    comments, each once, in order."""
    lines = (line.strip() for line in source.splitlines())
    return tuple(dict.fromkeys(line for line in lines if len(line) >= CODE_LINE_CHARS and not line.startswith("#")))


_PARSE = threading.Lock()
"""Held around ``ast.parse``: CPython 3.11's parser is not thread-safe, and `PromptBuilder` draws prompts on threads."""


@functools.cache
def _module(text: str) -> tuple[int | None, tuple[tuple[str, str, tuple[str, ...]], ...]]:
    """A module's ``text``: the line of its first top-level ``def`` or ``class`` (None without one), and
    ``(name, source, scored lines)`` of every function and method (no dunders) of at most `CODE_FUNCTION_CHARS`: its
    source from the ``def`` line to its last, and the `code_lines` of its body without the docstring, 6 to 20 of
    them."""
    with _PARSE:
        tree = ast.parse(text)
    lines = text.splitlines()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.name.startswith("__"):
            body = node.body[1:] if ast.get_docstring(node) is not None else node.body
            scored = code_lines("\n".join(lines[body[0].lineno - 1 : node.end_lineno])) if body else ()
            source = "\n".join(lines[node.lineno - 1 : node.end_lineno])
            if 6 <= len(scored) <= 20 and len(source) <= CODE_FUNCTION_CHARS:
                found.append((node.name, source, scored))
    tops = [node.lineno for node in tree.body
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)]
    return (tops[0] if tops else None), tuple(found)


def _code_context(files: Sequence[tuple[str, str]], room: int, tokenizer: Any
                  ) -> tuple[str, list[tuple[str, str]]]:
    """`CODE_INSTRUCTION` and ``room`` tokens of ``files`` (each from its first top-level ``def`` or ``class``, under
    a ``# file:`` line), and the files it reaches."""
    parts: list[str] = []
    chars = 0
    for name, text in files:
        first = _module(text)[0]
        body = "\n".join(text.splitlines()[first - 1:]) if first else text
        parts.append(f"# file: {name}\n{body}")
        chars += len(parts[-1])
        if chars >= MAX_CHARS_PER_TOKEN * room:
            break
    code = truncate_tokens("\n\n".join(parts), room, _encode(tokenizer), tokenizer.decode)
    return f"{CODE_INSTRUCTION}\n\n{code}", list(files[:len(parts)])


def code_recall(draw: Draw) -> Sample:
    """Long output from real code (module docstring): standard-library files in a drawn order (`_code_context`), cut
    to ``length``; the function asked is the one nearest a drawn depth whose whole source is in the context and whose
    name is defined once there. The reply starts with its ``def`` line (the answer prefix, so that the model copies
    rather than recalls); the scored lines of its body (`code_lines`, docstring left out: a model may summarise it)
    are the answers; ``max_new_tokens`` covers its tokens."""
    files = draw.rng.sample(python_sources(), len(python_sources()))
    depth = draw.rng.uniform(0.05, 0.95)
    prefix = "```python\n"

    def question(name: str, file: str) -> str:
        return f"Write out the function `{name}` of {file} in the code above, exactly as it appears there."

    overhead = len(assemble_ids(draw.tokenizer, CODE_INSTRUCTION, question("x" * 16, "y" * 12), prefix + "x" * 40))
    room = draw.length - overhead
    if room <= 0:
        raise ValueError(f"a prompt of {draw.length} tokens leaves no room for code: template, instruction and "
                         f"question take {overhead}")
    for first in range(len(files)):   # the next drawn file first when no function fits whole (tiny lengths)
        context, included = _code_context(files[first:], room, draw.tokenizer)
        candidates = [(abs(context.index(source) / len(context) - depth), name, file, source, scored)
                      for file, text in included for name, source, scored in _module(text)[1]
                      if source in context and context.count(f"def {name}(") == 1]
        if candidates:
            break
    else:
        raise ValueError(f"code_recall: no function of 6-20 lines fits whole in {draw.length} tokens")
    _, name, file, source, scored = min(candidates)
    return Sample("code_recall", draw.length, 0, context, question(name, file), prefix + source.split("\n")[0].strip(),
                  scored, max_new_tokens=len(_encode(draw.tokenizer)(source)) + 16,
                  meta={"function": name, "file": file, "depth": round(depth, 3),
                        "position": round(context.index(source) / len(context), 3),
                        "python": platform.python_version()})


def summarise(draw: Draw, new_tokens: int = 100) -> Sample:
    """The paper's latency prompt (sec. 5.3): summarise essays, generate exactly ``new_tokens`` tokens."""
    question = "Summarize the text above in one paragraph."
    context = draw.fit(lambda hay: hay, question, "")
    return Sample("summarise", draw.length, 0, context, question, "", (), max_new_tokens=new_tokens,
                  min_new_tokens=new_tokens)


TASKS: dict[str, Callable[[Draw], Sample]] = {
    "niah_single": niah_single,
    "niah_multikey": niah_multikey,
    "niah_multivalue": niah_multivalue,
    "niah_multiquery": niah_multiquery,
    "niah_multiquery3": niah_multiquery3,
    "niah_multiquery3_lines": niah_multiquery3_lines,
    "niah_multiturn": niah_multiturn,
    "vt": vt,
    "cwe": cwe,
    "code_recall": code_recall,
    "summarise": summarise,
}
"""Task name -> generator."""
SOURCE_TASKS = frozenset({"code_recall"})
"""Tasks drawn from the Python standard library's sources; every other task draws from the essays."""


def sample_seed(task: str, length: int, index: int, seed: int = 0) -> str:
    """The string seeding sample ``index`` of ``task`` at ``length`` (independent of the run's sample count)."""
    return f"{task}/{length}/{index}/{seed}"


def make_sample(task: str, length: int, index: int, tokenizer: Any, seed: int = 0) -> Sample:
    """Sample ``index`` of ``task`` with a prompt of about ``length`` tokens; the same for the same arguments."""
    if task not in TASKS:
        raise KeyError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")
    draw = Draw(random.Random(sample_seed(task, length, index, seed)), tokenizer, length)
    return replace(TASKS[task](draw), index=index)
