"""`warm_up`: what a server will run, compiled (and on CUDA recorded) before its first request, through the same
step driver as the requests (`flexentropy.engine.driver`); `load_artifacts`, inductor's compiled artifacts from a
file; `keep_flash_kernels`, flash-attn-4's compiled kernels kept on disk for the next process; `compiled_work`, what
the compiled work kept in ``compiled_dir`` did. transformers is imported inside the functions."""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from flexentropy._checks import check_bool, check_int, is_int
from flexentropy._compile import COMPILED_DIR_VARIABLE as COMPILED_DIR_VARIABLE  # the folder's variable, public here
from flexentropy._compile import KEPT, keep_compiled
from flexentropy.config import check_config
from flexentropy.engine.loops import greedy_generate, served_config

FLASH_KERNEL_CACHE = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"
"""flash-attn-4's switch of its persistent kernel cache: with ``1`` its compiled CuTe kernels (the prefill's FLASH
backend, the decode kernel) are written to disk (``FLASH_ATTENTION_CUTE_DSL_CACHE_DIR``, by default a folder of the
user's under the system's temporary directory) and a new process loads them instead of compiling them again; off by
default in flash-attn-4."""


def keep_flash_kernels() -> bool:
    """Turn flash-attn-4's persistent kernel cache on (`FLASH_KERNEL_CACHE` set to ``1``) where the user has not set
    the variable and ``flash_attn.cute`` is not imported yet (flash-attn-4 reads it once, at that import); whether the
    variable says on now. A user's ``0`` is kept."""
    if FLASH_KERNEL_CACHE not in os.environ and "flash_attn.cute" not in sys.modules:
        os.environ[FLASH_KERNEL_CACHE] = "1"
    return os.environ.get(FLASH_KERNEL_CACHE) == "1"


def load_artifacts(path: Path) -> None:
    """Load the compiled artifacts at ``path`` into torch's caches when the file exists (`warm_up`); raise before
    any work where ``path`` cannot be written after it, warn where the file is not torch's."""
    if path.is_dir():
        raise ValueError(f"warm_up(artifacts=...) names a file to read and write, got the folder {path}")
    if not path.parent.is_dir():
        raise ValueError(f"warm_up(artifacts=...): the folder {path.parent} does not exist (the file is written "
                         f"there after the warm-up)")
    if not path.is_file():
        return
    try:
        loaded = torch.compiler.load_cache_artifacts(path.read_bytes())
    except Exception as err:  # noqa: BLE001 - torch raises several kinds for a file that is not its own
        loaded, reason = None, f" ({type(err).__name__}: {err})"
    else:
        reason = ""
    if loaded is None:
        warnings.warn(f"warm_up: could not load the compiled artifacts in {path}{reason}; compiling, and writing "
                      f"the file anew", stacklevel=3)


def compiled_work() -> dict[str, float]:
    """What this process did so far with the compiled work kept in a folder (`warm_up`'s ``compiled_dir``, or the
    folder of `COMPILED_DIR_VARIABLE`): graphs ``"loaded"`` from it (in ``"load_seconds"``), ``"compiled"`` ahead
    of time (in ``"compile_seconds"``) and written to it, and calls ``"served"`` by those graphs (an empty dict: none
    kept)."""
    return dict(KEPT)


def shown(lengths: list[int], desc: str) -> Iterable[int]:
    """``lengths``, through a progress bar on stderr where tqdm is installed and stderr is a terminal (none in logs
    or under pytest's capture: tqdm's ``disable=None``)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return lengths
    return tqdm(lengths, desc=desc, unit="prompt", leave=False, disable=None, file=sys.stderr)


def warm_up(model: Any, lengths: int | Iterable[int] | None = None, *, config: Any = None, batch_size: int = 1,
            new_tokens: int | None = None, compile_config: Any = None, loop: bool = False,
            cache: Any = None, artifacts: str | os.PathLike[str] | None = None,
            compiled_dir: str | os.PathLike[str] | None = None) -> dict[int, float]:
    """Compile what a server will run, before its first request: the sparse prefill graphs for prompts of
    ``lengths`` tokens and the static decode steps of a `StaticLatentKVCache` (the static phase's, and with a
    ``max_prompt_length`` the captured phase 1's), compiled and, on CUDA, recorded on the serving cache's buffers,
    through ``model.generate`` or, with ``loop=True``, through `greedy_generate` (both run the model's `StepDriver`
    for the same ``compile_config``: either warms both).

    Run it once after ``fe.enable(model, config)`` with lengths covering the served range (two distinct lengths
    above ``config.dense_prefix`` make the prefill graphs length-generic; the decode graphs do not depend on the
    length); later prompts of any length in that range and any number of decode steps compile nothing new. Pass the
    ``cache`` that will serve (reset after each warm-up prompt, and left empty): its buffers are then the ones the
    decode step was recorded with (CUDA graphs), so serving with it and ``cache.reset()`` between requests records
    nothing new.

    Where tqdm is installed (the ``hf`` extra) and stderr is a terminal, a progress bar names the lengths and counts
    the prompts done.

    flash-attn-4 compiles its CuTe kernels again in every process unless its persistent kernel cache is on: `warm_up`
    turns it on (``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1``, `keep_flash_kernels`) where the variable is unset and
    flash-attn-4 is not imported yet; set the variable to ``0`` to keep it off.

    Args:
        model: an HF causal LM switched by `flexentropy.enable`.
        lengths: prompt lengths to run, a list of ints or one int (default: two lengths just above
            ``dense_prefix``, one not a multiple of the block size).
        config: the `EntropyConfig` of the served caches (default: the model's, as `enable` stored it).
        batch_size: rows of the served batches (the decode graphs are per batch size).
        new_tokens: tokens generated per warm-up prompt (default: enough to reach the static phase and one
            recompression, ``decode_delay + recompress_every + 2``).
        compile_config: transformers' ``CompileConfig`` for ``generate`` (default: the model's; off CUDA, transformers
            compiles only with one whose ``_compile_all_devices`` is set).
        loop: run `greedy_generate` instead of ``generate``.
        cache: the `StaticLatentKVCache` that will serve (default: a new one for all lengths, dropped after the
            warm-up).
        artifacts: a file of compiled artifacts (``torch.compiler.save_cache_artifacts``): loaded before the warm-up
            if it exists, written after it, so that a new process, on this machine or another with the same torch and
            device, takes inductor's compiled kernels from it instead of compiling them again (dynamo still traces in
            every process: ``compiled_dir`` saves that too). None: only torch's own caches
            (``TORCHINDUCTOR_CACHE_DIR``). A file torch cannot read is reported (a warning) and written anew; a
            folder, or a path in a missing folder, is an error raised before any work.
        compiled_dir: a folder (made if missing) where this process keeps, from now on, the graphs of flexentropy's
            compiled regions (the sparse kernel, the block selection, the probe kernel, the static decode step's
            decoder layer), each compiled ahead of time and saved, and from where it loads the graphs an earlier
            process kept there, instead of tracing and compiling them again: a restarted server's warm-up. Work
            kept for another torch, device or flexentropy is left beside (a warning); a graph whose guards a call
            fails (another model, config, batch size or dtype) is compiled and kept too (a warning). None: the folder
            of the environment variable ``FLEXENTROPY_COMPILED_DIR`` where set, else nothing is kept
            (docs/usage.md, "Keep the compiled work"). A file, or a folder that cannot be made, is an error raised
            before any work.

    Returns:
        seconds each length took, ``{length: seconds}``.
    """
    from flexentropy.caches.keywords import cache_keyword
    from flexentropy.caches.static_latent import StaticLatentKVCache

    if cache is not None and not isinstance(cache, StaticLatentKVCache):
        raise TypeError(f"warm_up warms a StaticLatentKVCache, got {type(cache).__name__}")
    config = served_config(model, cache) if config is None else check_config(config, "warm_up")
    if lengths is None:
        start = config.dense_prefix + config.segment_size
        lengths = (start + config.block_size, 2 * start + config.block_size // 2 + 1)
    elif is_int(lengths):
        lengths = (lengths,)
    elif isinstance(lengths, str | bytes) or not isinstance(lengths, Iterable):
        raise TypeError(f"warm_up takes lengths as prompt lengths in tokens: a list of ints (e.g. [8192, 12345]) or "
                        f"one int, got {type(lengths).__name__} {lengths!r}")
    batch_size = check_int("warm_up", "batch_size", batch_size, 1)
    check_bool("warm_up", "loop", loop)
    lengths = [check_int("warm_up", "length", length, 1) for length in lengths]
    if new_tokens is None:
        new_tokens = config.decode_delay + (config.recompress_every or 0) + 2
    new_tokens = check_int("warm_up", "new_tokens", new_tokens, 1)
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    generator = torch.Generator(device="cpu").manual_seed(0)
    extra = {} if compile_config is None else {"compile_config": compile_config}
    if compiled_dir is not None:
        keep_compiled(compiled_dir)
    if artifacts is not None:
        load_artifacts(Path(artifacts))
    keep_flash_kernels()
    serving = StaticLatentKVCache(config, model=model) if cache is None else cache
    seconds = {}
    for length in shown(lengths, f"warm_up ({', '.join(map(str, lengths))} tokens)"):
        ids = torch.randint(min(3, text.vocab_size - 1), text.vocab_size, (batch_size, length), generator=generator)
        serving.reset()
        start_time = time.perf_counter()
        if loop:
            greedy_generate(model, ids.to(model.device), serving, new_tokens, compile_config=compile_config)
        else:  # no inference_mode: its tensors would not pass the guards of the compiled graphs for generate's calls
            model.generate(ids.to(model.device), attention_mask=torch.ones_like(ids, device=model.device),
                           max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           pad_token_id=0, **{cache_keyword(model): serving}, **extra)
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        seconds[length] = time.perf_counter() - start_time
    serving.reset()
    saved = torch.compiler.save_cache_artifacts() if artifacts is not None else None
    if saved is not None:
        Path(artifacts).write_bytes(saved[0])
    return seconds
