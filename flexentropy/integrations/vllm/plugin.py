"""The plugin's entry point (``vllm.general_plugins``): vLLM calls `register` in each of its processes at start-up."""

from __future__ import annotations

BACKENDS_MODULE = "flexentropy.integrations.vllm.backends"

EXTENDED_BACKENDS = ("FLASH_ATTN", "CPU_ATTN")
"""The vLLM attention backends the plugin extends: the one vLLM picks on CUDA for most models, and the CPU build's."""


def register() -> None:
    """Make vLLM's ``FLASH_ATTN`` and ``CPU_ATTN`` attention backends resolve to flexentropy's subclasses of them
    (`flexentropy.integrations.vllm.backends`), so that the backend vLLM picks on CUDA (``FLASH_ATTN``) or on the CPU
    build (always ``CPU_ATTN``) runs long prompt chunks sparse. Calling it again changes nothing.

    A model served by another backend (picked by vLLM, e.g. MLA models, or named with ``--attention-backend``) runs
    without flexentropy; flexentropy's start-up log line (``flexentropy: sparse prefill on ...``) says where it runs.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    for name in EXTENDED_BACKENDS:
        register_backend(AttentionBackendEnum[name], f"{BACKENDS_MODULE}.{name}")
