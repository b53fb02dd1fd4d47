"""The runtime layer under the command line and the evaluation (design.md §5): model resolution (paths and the
aliases of :mod:`.models`), device and dtype, offline loading (:mod:`.loading`), warm-up and timed generation with
cache sizes (:mod:`.generation`), atomic JSON (:mod:`.files`).

`flexentropy.cli` and `flexentropy.eval` both build on it and never import each other.
"""
