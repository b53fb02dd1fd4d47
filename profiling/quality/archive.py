"""The raw runs of a study, packed as ``docs/results/<study>/runs.tar.xz``: unpacked once into the ignored ``runs/``.

The packed runs left the tree (docs/results/gpu_sessions.md); they are read from the repository's history at
`ARCHIVE_REV` when the study's folder has no unpacked ``runs/`` of a fresh run.
"""

from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
UNPACKED = ROOT / "runs" / "unpacked"
ARCHIVE_REV = "0c4d8ed"
"""The last commit whose tree holds the studies' packed runs."""


def runs_folder(study: str, archive: str = "runs.tar.xz") -> Path:
    """The ``runs/`` folder of ``docs/results/<study>`` (its ``archive`` holds ``runs/...``): the study's own folder
    when it is unpacked there (a fresh run), else the archive of `ARCHIVE_REV` unpacked under
    ``runs/unpacked/<study>``."""
    here = RESULTS / study / "runs"
    if here.is_dir():
        return here
    target = UNPACKED / study / Path(archive).name.removesuffix(".tar.xz")
    if not (target / "runs").is_dir():
        path = f"docs/results/{study}/{archive}"
        packed = subprocess.run(["git", "show", f"{ARCHIVE_REV}:{path}"], cwd=ROOT, capture_output=True, check=True)
        target.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(packed.stdout)) as tar:
            tar.extractall(target, filter="data")
    return target / "runs"
