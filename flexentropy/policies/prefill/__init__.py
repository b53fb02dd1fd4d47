"""Prefill policies (design.md §1 and 3): each file one rule from ``q``/``k`` to a `SparsePlan`, on the shared
kernel."""
