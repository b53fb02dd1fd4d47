"""Prefill policies (design.md §1 and 3): each file one rule from ``q``/``k`` (a whole prompt, or a chunk: the last
positions of ``k``) to a `SparsePlan`, on the shared kernel; ``entropy/`` the entropy rule and its stages. What the
rules share, named for what it holds: ``fixed.py`` (the blocks every rule keeps, the per-segment top-k table, the
dense plan), ``ranking.py`` (top-k and mass covers), ``estimates.py`` (attention estimates from a few queries and
block statistics)."""
