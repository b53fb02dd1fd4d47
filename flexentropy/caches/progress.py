"""`Progress`: the host's counters of a static phase, one set for every layer (all layers see every forward), under
the names of `LayerView` (what `CachePolicy.before_append` reads)."""

from __future__ import annotations

from dataclasses import dataclass

from flexentropy.policies.layer_view import LayerView


@dataclass
class Progress:
    """Counters of tokens seen, queries handed over and entries stored per KV head, of the prompt, of the tokens
    generated before the previous step and of the decisions that evicted (`LayerView`'s meanings)."""

    seen: int = 0
    observed: int = 0
    stored: int = 0
    prompt_length: int | None = None
    previous_generated: int | None = None
    evictions: int = 0

    @classmethod
    def of(cls, layer: LayerView) -> Progress:
        """The counters of a dynamic layer (a `PolicyLayer`), as a static phase counts on from them."""
        return cls(seen=layer.seen, observed=layer.observed, stored=layer.stored, prompt_length=layer.prompt_length,
                   previous_generated=layer.previous_generated, evictions=layer.evictions)

    @property
    def generated(self) -> int:
        return 0 if self.prompt_length is None else self.seen - self.prompt_length

    def advance(self, tokens: int) -> None:
        """Account for a step of ``tokens`` tokens appended and handed over."""
        self.previous_generated = self.generated
        self.seen += tokens
        self.observed += tokens
        self.stored += tokens

    def keep(self, target: int | None) -> None:
        """Account for a decision: ``target`` entries per KV head kept (None: all of them, nothing evicted)."""
        if target is not None:
            self.stored = min(target, self.stored)
            self.evictions += 1

    def start_over(self) -> None:
        """An idle row's slots start over from the first (nothing it holds is read)."""
        self.stored = 0
