"""The lab beside the flexentropy library: the quality evaluation (``python -m bench.eval``), model aliases and their
loading, data, diagnostics, and ``python -m bench``: the ``flexentropy`` command (`flexentropy.cli`) with the aliases.
It stays in the repository; the wheel ships the library alone.

It imports the library; the library never imports it (``tests/test_architecture.py``).
"""
