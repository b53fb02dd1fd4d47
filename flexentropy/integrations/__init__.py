"""flexentropy inside model engines, one sibling package per engine, each importing its engine alone:

- `flexentropy.integrations.hf`: transformers (``enable``/``disable``, the ``"flexentropy"`` attention and mask
  functions, the hooks on the model, tensor parallelism). Importing it imports transformers and registers
  ``"flexentropy"`` in its attention interfaces.
- `flexentropy.integrations.vllm`: the vLLM plugin (its entry point, attention backends, settings and counters);
  importing it imports neither transformers nor the transformers side of the library.

This package imports neither: ``from flexentropy.integrations.hf import enable, prefill_density``.
"""
