"""Result files: JSON written atomically."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def new_file_mode() -> int:
    """The permissions ``open(path, "w")`` gives a new file: ``0o666`` less the process's umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_json_atomic(path: Path, report: dict[str, Any]) -> None:
    """Write ``report`` to ``path`` through a temporary file in the same folder, so it is never half-written; the
    file gets the permissions of a file ``open`` makes (`new_file_mode`; the temporary file's own are owner-only).
    Missing folders above ``path`` are made."""
    path = path.expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, new_file_mode())
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
