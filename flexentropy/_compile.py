"""Compilation helpers shared by flexentropy's compiled regions: the recompile guard, `eager`, and `compiled`, the
regions' ``torch.compile`` whose graphs a folder keeps for the next process (`keep_compiled`)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import os
import platform
import time
import uuid
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

RECOMPILE_LIMIT = 64
"""Graphs each flexentropy compiled region may hold. Lengths share a graph (``dynamic=True``); each model shape
(dtype, head counts, head dim, softmax scale, block size, backend) needs its own, and dynamo's default of 8 is
reached by one process that serves a few models."""


class RecompileLimitError(RuntimeError):
    """Raised instead of silently falling back to eager flex attention (which would materialise N x N scores)."""


@contextlib.contextmanager
def no_silent_fallback() -> Iterator[None]:
    """Turn dynamo's silent eager fallback at ``recompile_limit`` into `RecompileLimitError`.

    Inside an outer ``torch.compile`` (e.g. of a whole model) the config patch would break the graph; there the
    outer compile's own settings apply.
    """
    if torch.compiler.is_compiling():
        yield
        return
    try:
        limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=limit):
            yield
    except torch._dynamo.exc.FailOnRecompileLimitHit as err:
        raise RecompileLimitError(
            f"a flexentropy compiled region hit its recompile limit "
            f"({max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)} graphs); refusing the eager fallback, "
            "which materialises N x N attention scores. Raise flexentropy._compile.RECOMPILE_LIMIT (or "
            "torch._dynamo.config.recompile_limit), or keep dtypes/devices/head counts fixed across calls."
        ) from err


def keep_dynamic(*tensors: torch.Tensor, dims: tuple[int, ...]) -> None:
    """Keep the sizes of ``dims`` of ``tensors`` (lengths, block counts) symbolic in the next compiled call.

    Dynamo gives equal sizes one symbol, and flex keeps head counts and the head dim static: a first call whose block
    count equals one of them would compile that count as a constant, and the next length would recompile. Inside an
    outer compile the outer graph decides, so this marks nothing there.
    """
    if torch.compiler.is_compiling():
        return
    for tensor in tensors:
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(tensor, dim % tensor.dim())


@torch.compiler.disable
def eager(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` outside any compiled region (dynamo breaks the graph here instead of tracing it)."""
    return fn(*args)


COMPILED_DIR_VARIABLE = "FLEXENTROPY_COMPILED_DIR"
"""Environment variable naming the folder where flexentropy keeps its compiled work (`keep_compiled`) in every process
that starts with it set (a vLLM server and its workers, a restarted service); `flexentropy.warm_up`'s
``compiled_dir`` sets it for one process."""

DIMENSION_MARKS = ("_has_dynamo_dim_marking", "_dynamo_dynamic_indices", "_dynamo_weak_dynamic_indices",
                   "_dynamo_unbacked_indices", "_dynamo_strict_unbacked_indices", "_dynamo_static_indices",
                   "_dynamo_shape_ids", "_dynamo_unbacked_bounds")
"""The attributes dynamo's ``mark_dynamic``, ``maybe_mark_dynamic`` and ``mark_static`` set on a tensor. A graph loaded
from disk guards on their absence (torch 2.13 saves the guards without them), and a graph compiled ahead of time has
its dynamic sizes already: a kept graph's guards are checked with them taken off (`KeptGraphs`)."""

KEPT = Counter()
"""What this process's kept compiled work did so far: graphs ``"loaded"`` from the folder (in ``"load_seconds"``),
``"compiled"`` ahead of time (in ``"compile_seconds"``) and written there, calls ``"served"`` by a kept graph (one
loaded or compiled here)."""

_CHOSEN: list[Path] = []
"""The folder `keep_compiled` set for this process (before `COMPILED_DIR_VARIABLE`), if any."""


def keep_compiled(path: str | os.PathLike[str]) -> Path:
    """From now on, this process keeps the graphs of flexentropy's compiled regions in the folder ``path`` (made if
    missing), and loads from there what an earlier process kept, instead of tracing and compiling it again
    (`KeptGraphs`); the folder. Takes the place of `COMPILED_DIR_VARIABLE` for this process.

    Raises:
        ValueError: ``path`` is a file, or the folder cannot be made.
    """
    folder = Path(path).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"compiled_dir names a folder to keep compiled work in, got the file {folder}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"compiled_dir: cannot make the folder {folder} ({err}); name a folder this process can "
                         "write") from err
    _CHOSEN[:] = [folder]
    return folder


def kept_folder() -> Path | None:
    """The folder of this environment's kept compiled work (`environment_folder` of the folder `keep_compiled` or
    `COMPILED_DIR_VARIABLE` names), or None: nothing is kept."""
    base = str(_CHOSEN[0]) if _CHOSEN else os.environ.get(COMPILED_DIR_VARIABLE)
    return environment_folder(base) if base else None


def environment() -> dict[str, str]:
    """What a kept graph is valid for: the Python, torch and flexentropy (its version and a digest of its source),
    the device (the GPU's name and compute capability, or the CPU's vector instructions) and the versions of the
    packages whose code the graphs run (transformers, Triton, flash-attn-4) where installed."""
    import importlib.metadata

    import flexentropy

    source = hashlib.sha256()
    root = Path(flexentropy.__file__).parent
    for file in sorted(root.rglob("*.py")):
        source.update(file.relative_to(root).as_posix().encode() + b"\0" + file.read_bytes())
    if torch.cuda.is_available():
        device = f"{torch.cuda.get_device_name()} (sm {'.'.join(map(str, torch.cuda.get_device_capability()))})"
    else:
        device = f"cpu ({torch.backends.cpu.get_cpu_capability()})"
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": str(torch.version.cuda),
            "device": device, "flexentropy": f"{flexentropy.__version__} ({source.hexdigest()[:12]})"}
    for package in ("transformers", "triton", "flash-attn-4"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            info[package] = importlib.metadata.version(package)
    return info


@functools.cache
def environment_folder(base: str) -> Path | None:
    """``base``'s subfolder of this process's `environment` (named by its digest, holding it as
    ``environment.json``), made if missing; warns once where ``base`` holds only other environments' work (that work
    is left as it is), and where the folder cannot be made (None: nothing is kept)."""
    info = environment()
    root = Path(base).expanduser()
    folder = root / hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()[:16]
    try:
        if not folder.is_dir():
            others = [other for path in sorted(root.glob("*/environment.json")) if (other := read_json(path))]
            if others:
                changed = sorted({key for other in others for key in info if other.get(key) != info[key]})
                differences = "; ".join(f"{key}: kept {sorted({str(other.get(key)) for other in others})}, here "
                                        f"{info[key]!r}" for key in changed)
                warnings.warn(f"flexentropy: the compiled work kept in {root} was compiled elsewhere ({differences}); "
                              "compiling here, and keeping it beside", RuntimeWarning, stacklevel=4)
            folder.mkdir(parents=True, exist_ok=True)
            partial = folder / f"environment.{uuid.uuid4().hex}.partial"
            partial.write_text(json.dumps(info, indent=1, sort_keys=True))
            partial.replace(folder / "environment.json")     # whole, or not there: another process may read it
    except OSError as err:
        warnings.warn(f"flexentropy: cannot keep compiled work in {root} ({err}); compiling as usual",
                      RuntimeWarning, stacklevel=4)
        return None
    return folder


def read_json(path: Path) -> Any:
    """The JSON in the file ``path``, or None where it cannot be read."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def dimension_marks_off(args: Any) -> Iterator[None]:
    """Inside, the tensors of ``args`` carry none of dynamo's `DIMENSION_MARKS`; on exit they carry them again."""
    taken = []
    for leaf in torch.utils._pytree.tree_leaves(args):
        if isinstance(leaf, torch.Tensor):
            marks = {name: leaf.__dict__.pop(name) for name in DIMENSION_MARKS if name in leaf.__dict__}
            if marks:
                taken.append((leaf, marks))
    try:
        yield
    finally:
        for leaf, marks in taken:
            leaf.__dict__.update(marks)


class KeptGraphs:
    """``torch.compile(fn, **options)`` whose graphs are kept in the folder of `kept_folder`, where one is named.

    Without a folder (and inside an enclosing compile) a call is the compiled function's. With one, the graphs kept
    there for ``fn`` are loaded at its first call, and a call runs the first whose guards its arguments pass; where
    none does, ``fn`` is compiled ahead of time for these arguments (``torch.compile(...).aot_compile``: one graph, as
    dynamo would trace, with its guards) and the graph written there (``.bin``, `AOTCompiledFunction`) for the next
    process. A later process loads it without tracing (``torch.compiler.load_compiled_function``). Where an earlier
    process kept graphs but none matches (another config, model, batch or dtype) a warning names the guards that
    failed, once per function and process. A function that cannot be compiled ahead of time (a graph break,
    something torch cannot save) is said so, once, and compiled as usual from then on. Past `RECOMPILE_LIMIT` kept
    graphs a call is the compiled function's (whose own limit then holds).

    torch's guards drop what it cannot save (object identities, globals): a kept graph is valid for the code that
    compiled it, which `environment` keys (flexentropy's source, the packages' versions).
    """

    def __init__(self, fn: Callable[..., Any], options: dict[str, Any]) -> None:
        self.fn = fn
        self.options = options
        self.compiled = torch.compile(fn, **options)
        digest = hashlib.sha256(repr(sorted(options.items())).encode()).hexdigest()[:8]
        self.name = f"{fn.__module__}.{fn.__qualname__}.{digest}"
        self.graphs: dict[Path, list[Any]] = {}
        self.loaded: dict[Path, int] = {}
        self.unkept = False
        self.warned: set[str] = set()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return self.compiled(*args, **kwargs)
        folder = kept_folder()
        if folder is None or self.unkept:
            return self.compiled(*args, **kwargs)
        if folder not in self.graphs:
            self.graphs[folder] = self.load(folder / self.name)
            self.loaded[folder] = len(self.graphs[folder])
        graphs = self.graphs[folder]
        with dimension_marks_off((args, kwargs)):
            graph = next((graph for graph in graphs if graph.guard_check(*args, **kwargs)), None)
            if graph is None and self.loaded[folder] and len(graphs) < RECOMPILE_LIMIT:
                self.warn("mismatch", f"the {len(graphs)} graphs kept in {folder / self.name} do not match this "
                          f"call ({'; '.join(self.failed_guards(graph, args, kwargs) for graph in graphs)}); "
                          "compiling it, and keeping it there too")
        if graph is None:
            graph = self.compile(folder / self.name, args, kwargs) if len(graphs) < RECOMPILE_LIMIT else None
            if graph is None:
                return self.compiled(*args, **kwargs)
            graphs.append(graph)
        KEPT["served"] += 1
        return graph.fn(*args, **kwargs)

    def load(self, folder: Path) -> list[Any]:
        """The graphs kept in ``folder`` (each ``*.bin``), loaded; one that does not load is said so and skipped."""
        graphs, start = [], time.perf_counter()
        for path in sorted(folder.glob("*.bin")):
            try:
                with torch._guards.tracing(torch._guards.TracingContext(None)):   # a saved import guard needs one
                    graphs.append(torch.compiler.load_compiled_function(io.BytesIO(path.read_bytes()),
                                                                        f_globals=self.fn.__globals__))
            except Exception as err:  # noqa: BLE001 - torch raises several kinds for a graph it cannot load here
                self.warn("unloadable", f"cannot load the compiled graph {path} ({type(err).__name__}: {err}); "
                          "compiling instead")
            else:
                KEPT["loaded"] += 1
        KEPT["load_seconds"] += time.perf_counter() - start
        return graphs

    def compile(self, folder: Path, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``fn`` compiled ahead of time for ``args`` and ``kwargs``, written to ``folder``; None (said once) where
        it cannot be compiled ahead of time."""
        aot, start = torch.compile(self.fn, **{**self.options, "fullgraph": True}), time.perf_counter()
        try:   # a float argument (a softmax scale) is a constant of the graph, as dynamo makes it after a restart
            with torch._dynamo.config.patch(specialize_float=True):
                graph = aot.aot_compile((args, kwargs))
        except Exception as err:  # noqa: BLE001 - a graph break, or anything torch cannot compile ahead of time
            self.unkept = True
            self.warn("unkept", f"{self.name} cannot be compiled ahead of time ({type(err).__name__}: "
                      f"{str(err).splitlines()[0] if str(err) else ''}); compiling it as usual, not kept")
            return None
        KEPT["compiled"] += 1
        KEPT["compile_seconds"] += time.perf_counter() - start
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{uuid.uuid4().hex}.bin"
            partial = path.with_suffix(".partial")
            graph.save_compiled_function(str(partial))
            partial.replace(path)                            # whole, or not there: another process may be reading
        except Exception as err:  # noqa: BLE001 - a full disk, or a graph torch cannot save
            self.warn("unsaved", f"cannot keep the compiled graph of {self.name} in {folder} ({type(err).__name__}: "
                      f"{err}); using it in this process only")
        return graph

    @staticmethod
    def failed_guards(graph: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """The guards of ``graph`` that ``args`` and ``kwargs`` fail, as torch words them."""
        verbose = graph._artifacts.guard_manager.check_verbose(graph.prepare_f_locals(*args, **kwargs))
        return ", ".join(verbose.verbose_code_parts)

    def warn(self, kind: str, message: str) -> None:
        """Warn ``message``, once per ``kind`` for this function in this process."""
        if kind not in self.warned:
            self.warned.add(kind)
            warnings.warn(f"flexentropy: {message}", RuntimeWarning, stacklevel=3)


def compiled(fn: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """``torch.compile(fn, **options)``, its graphs kept on disk where a folder is named (`KeptGraphs`)."""
    return KeptGraphs(fn, options)
