"""The lab beside the flexentropy library: the ``flexentropy`` needle demo (`bench.needle_demo`), the quality
evaluation (``python -m bench.eval``), model aliases and offline loading, data, diagnostics and timed generation.

It imports the library; the library never imports it (``tests/test_architecture.py``).
"""
