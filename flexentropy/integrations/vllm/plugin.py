"""The plugin's entry point (``vllm.general_plugins``): vLLM calls `register` in each of its processes at start-up,
before any engine's configuration exists, so `register` decides nothing: the backends it names decide, per engine,
when vLLM resolves them under that engine's configuration (`flexentropy.integrations.vllm.backends`)."""

from __future__ import annotations

BACKENDS_MODULE = "flexentropy.integrations.vllm.backends"

EXTENDED_BACKENDS = ("FLASH_ATTN", "CPU_ATTN")
"""The vLLM attention backends the plugin extends: the one vLLM picks on CUDA for most models, and the CPU build's."""


def register() -> None:
    """Point vLLM's ``FLASH_ATTN`` and ``CPU_ATTN`` attention backends at `BACKENDS_MODULE`, which resolves each, when
    vLLM builds a model, to vLLM's own class unless that engine's ``additional_config`` has a ``"flexentropy"`` entry
    (then to flexentropy's subclass, which runs long prompt chunks sparse). Installed but not chosen, vLLM runs
    exactly its own backend. Calling it again changes nothing.

    A model served by another backend (picked by vLLM, e.g. MLA models, or named with ``--attention-backend``) runs
    without flexentropy; flexentropy's start-up line (``flexentropy: on ...`` or ``flexentropy: off ...``) says
    whether it runs, on which backend and with what configuration.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    for name in EXTENDED_BACKENDS:
        register_backend(AttentionBackendEnum[name], f"{BACKENDS_MODULE}.{name}")
