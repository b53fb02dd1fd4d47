"""`BatchRows`: the batch rows of a static phase, each counted by a `Progress`, and the device's copy of their counts.

The host counts each group of batch rows that progress together with one `Progress` (one request, or a left-padded
batch taken together: one group; rows served one by one, `StaticPhase.insert`: a group per request, idle rows
sharing one). The device holds what a step reads and moves on inside its own graph, per batch row: the ``slot`` its
token is written to, the entries it reads (``lengths``) and the token's ``position``. `mirror` writes a group's host
count to its rows on the device; the static phase moves them one token on inside the step (`StaticPhase.advance`, so
that a recorded step replays it) and its groups' counts after the step (`StaticPhase.count`).
"""

from __future__ import annotations

import torch

from flexentropy.caches.progress import Progress
from flexentropy.caches.static_buffers import static_buffer

Rows = slice | torch.Tensor
"""Batch rows: ``slice(None)`` (all), a slice, or int64 indices."""

DEVICE_COUNTERS = (("slot", torch.long), ("lengths", torch.int32), ("position", torch.long))
"""The device counters per batch row, with their dtypes."""


class BatchRows:
    """The batch rows of a static phase: the `Progress` of each, and the device's copy of their counts (module
    docstring).

    Attributes:
        device: ``{"slot", "lengths", "position"}`` -> ``[B]`` tensors at addresses a recorded step keeps.
        row_index: int64 ``[B]`` ``0 .. B - 1`` (the rows of a group as indices).
        rows: each batch row's `Progress` (rows of one group share the object).
        groups: the distinct `Progress` of the rows, each with the rows it counts (a slice where they are consecutive).
    """

    def __init__(self) -> None:
        self.device: dict[str, torch.Tensor] = {}
        self.row_index = torch.zeros(0, dtype=torch.long)
        self.clear()

    def clear(self) -> None:
        """No rows counted (the device tensors stay, their addresses with them)."""
        self.rows: list[Progress] = []
        self.groups: list[tuple[Progress, Rows]] = []

    def allocate(self, rows: int, device: torch.device) -> None:
        """Device counters for ``rows`` batch rows; the existing ones are kept when they fit."""
        kept = self.device.get("slot")
        if kept is not None and kept.shape[0] == rows and kept.device == device:
            return
        self.device = {name: static_buffer((rows,), dtype, device) for name, dtype in DEVICE_COUNTERS}
        self.row_index = torch.arange(rows, device=device)

    @property
    def progress(self) -> Progress:
        """The one count of every row (one request, or a batch taken together); raises for rows served one by one."""
        if len(self.groups) != 1 or not isinstance(self.groups[0][1], slice):
            raise ValueError("the rows of this static cache progress one by one (insert): no one count holds for all "
                             "of them")
        return self.groups[0][0]

    def share(self, progress: Progress) -> None:
        """Every row counted by ``progress``, on the host and the device."""
        self.rows = [progress] * self.row_index.shape[0]
        self.groups = [(progress, slice(None))]
        self.mirror(progress, slice(None))

    def put(self, row: int, progress: Progress) -> None:
        """Batch row ``row`` counted by ``progress`` from its next step."""
        self.rows[row] = progress
        self._regroup()
        self.mirror(progress, self.row_index[row:row + 1])

    def idle(self) -> Progress:
        """The count of the idle rows (a new one when there is none)."""
        return next((progress for progress in self.rows if progress.prompt_length is None), Progress())

    def mirror(self, progress: Progress, rows: Rows) -> None:
        """The device counters of batch rows ``rows`` at ``progress``'s count."""
        values = {"slot": progress.stored, "lengths": progress.stored + 1, "position": progress.seen}
        for name, value in values.items():
            counter = self.device[name]
            if isinstance(rows, slice):
                counter[rows].fill_(value)
            else:
                counter.index_fill_(0, rows, value)

    def stored(self) -> int:
        """Entries held per KV head by the fullest row."""
        return max(progress.stored for progress, _ in self.groups)

    def seen(self) -> int:
        """The logical length of the longest row."""
        return max(progress.seen for progress, _ in self.groups)

    def _regroup(self) -> None:
        rows: dict[int, list[int]] = {}
        for index, progress in enumerate(self.rows):
            rows.setdefault(id(progress), []).append(index)
        by_id = {id(progress): progress for progress in self.rows}

        def index(members: list[int]) -> Rows:   # a view where the rows are consecutive
            if len(members) == len(self.rows):
                return slice(None)
            if members[-1] - members[0] == len(members) - 1:
                return self.row_index[members[0]:members[-1] + 1]
            return self.row_index[members]

        self.groups = [(by_id[key], index(members)) for key, members in rows.items()]
