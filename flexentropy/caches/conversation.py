"""`ConversationIds`: the token ids of the conversation a `PolicyCache` holds, where they are known, so that a new
prompt on a used cache is told from a later turn of its conversation (`PolicyCache.observe_generate`).

``generate`` hands a model with a cache only the tokens past the cache's length, so the model's forward cannot tell
the two apart; ``generate`` itself holds the whole conversation's ids, and the hook that `flexentropy.enable` installs
on ``model.prepare_inputs_for_generation`` hands them over before every forward
(`flexentropy.integrations.hf.hooks`).

What is kept: references to the ids tensors ``generate`` builds (a new one for every step, never written in place), so
a decode step records its token with neither a copy nor a host sync; the ids of a forward of several tokens outside
``generate`` (a prompt fed in chunks), copied. Unknown, and so not compared: the tokens of a forward given
``inputs_embeds`` (they have no ids), of one-token forwards outside ``generate`` (a hand loop, `flexentropy.greedy_
generate`) and of the steps a step driver replays as CUDA graphs. The ids are compared on the host, once per forward
that ``generate`` begins (its prefill), never in its decode steps.
"""

from __future__ import annotations

import torch

Part = tuple[int, torch.Tensor]
"""``(start, ids [B, l])``: the conversation's tokens at positions ``start .. start + l - 1``."""


class ConversationIds:
    """The known token ids of a cache's conversation (module docstring).

    Attributes:
        parts: the recorded `Part` s, ascending and disjoint; positions outside them are unknown.
        staged: the ids ``generate`` handed over for the forward it is about to run (a `Part` ending where that
            forward's tokens end), recorded once the cache has checked the forward (`PolicyCache.check_request`), so
            that a refused forward records nothing.
    """

    def __init__(self) -> None:
        self.parts: list[Part] = []
        self.staged: Part | None = None

    def clear(self) -> None:
        """Nothing known (a new request)."""
        self.parts = []
        self.staged = None

    def put(self, start: int, ids: torch.Tensor) -> None:
        """Record ``ids [B, l]`` as the tokens from position ``start`` on; what was recorded from there on goes."""
        self.parts = [(first, part[:, :start - first]) for first, part in self.parts if first < start]
        self.parts.append((start, ids))

    def take_staged(self) -> Part | None:
        """The staged ids, which are staged no more."""
        staged, self.staged = self.staged, None
        return staged

    def first_difference(self, start: int, ids: torch.Tensor, held: int) -> int | None:
        """The first position before ``held`` at which ``ids [B, T]`` (the tokens from position ``start`` on) differ in
        some batch row from the recorded ids; None where they agree or nothing recorded overlaps them (a batch of
        another size: `PolicyCache.check_request` refuses it). One host read."""
        spans = []
        for first, part in self.parts:
            low, high = max(first, start), min(first + part.shape[1], held, start + ids.shape[1])
            if low < high and part.shape[0] == ids.shape[0]:
                theirs = ids[:, low - start:high - start].to(part.device)
                spans.append((low, (part[:, low - first:high - first] != theirs).any(dim=0)))
        if not spans:
            return None
        differs = torch.cat([differ for _, differ in spans])
        positions = torch.cat([torch.arange(low, low + differ.shape[0], device=differ.device) for low, differ in spans])
        found = positions[differs][:1].tolist()
        return found[0] if found else None

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep batch rows ``rows`` (int64 indices, repeats allowed) of every recorded part."""
        self.parts = [(first, part.index_select(0, rows.to(part.device))) for first, part in self.parts]
        self.staged = None
