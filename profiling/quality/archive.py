"""The committed raw runs of a study: ``docs/results/<study>/runs.tar.xz``, unpacked once into the ignored ``runs/``."""

from __future__ import annotations

import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
UNPACKED = ROOT / "runs" / "unpacked"


def runs_folder(study: str, archive: str = "runs.tar.xz") -> Path:
    """The ``runs/`` folder of ``docs/results/<study>`` (its ``archive`` holds ``runs/...``): the study's own folder
    when it is unpacked there (a fresh run), else the archive unpacked under ``runs/unpacked/<study>``."""
    packed = RESULTS / study / archive
    here = packed.parent / "runs"
    if here.is_dir():
        return here
    target = UNPACKED / study / Path(archive).name.removesuffix(".tar.xz")
    if not (target / "runs").is_dir():
        target.mkdir(parents=True, exist_ok=True)
        with tarfile.open(packed) as tar:
            tar.extractall(target, filter="data")
    return target / "runs"
