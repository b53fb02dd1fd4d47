"""`Progress`: the caches' one counter class: a layer's counts (`PolicyLayer`), or, in a static phase, those of a group
of batch rows that progress together (all layers see every forward), under the names of `LayerView` (what a
`CachePolicy` reads); and `Counted`, those names read from an object's `Progress`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Progress:
    """Counters of tokens seen, queries handed over and entries stored per KV head, of the prompt, of the tokens
    generated before the previous append and of the decisions that evicted (`LayerView`'s meanings)."""

    seen: int = 0
    observed: int = 0
    stored: int = 0
    prompt_length: int | None = None
    previous_generated: int | None = None
    evictions: int = 0

    @property
    def generated(self) -> int:
        return 0 if self.prompt_length is None else self.seen - self.prompt_length

    def observe(self, tokens: int) -> None:
        """Account for the queries of ``tokens`` tokens handed over."""
        self.observed += tokens

    def append(self, tokens: int) -> None:
        """Account for ``tokens`` tokens appended: ``previous_generated`` takes ``generated`` (None while no prompt is
        counted), and ``seen`` and ``stored`` move on."""
        self.previous_generated = None if self.prompt_length is None else self.generated
        self.seen += tokens
        self.stored += tokens

    def keep(self, target: int | None) -> None:
        """Account for a decision: ``target`` entries per KV head kept (None: all of them, nothing evicted)."""
        if target is not None:
            self.stored = min(target, self.stored)
            self.evictions += 1

    def start_over(self) -> None:
        """An idle row's slots start over from the first (nothing it holds is read)."""
        self.stored = 0


class Counted:
    """`LayerView`'s counters, read from the object's `Progress` (``progress``)."""

    progress: Progress

    @property
    def seen(self) -> int:
        return self.progress.seen

    @property
    def observed(self) -> int:
        return self.progress.observed

    @property
    def stored(self) -> int:
        return self.progress.stored

    @property
    def prompt_length(self) -> int | None:
        return self.progress.prompt_length

    @property
    def previous_generated(self) -> int | None:
        return self.progress.previous_generated

    @property
    def evictions(self) -> int:
        return self.progress.evictions

    @property
    def generated(self) -> int:
        return self.progress.generated
