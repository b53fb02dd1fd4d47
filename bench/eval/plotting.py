"""The plotting boilerplate of the evaluation's figures: a file-only pyplot and one way to save a figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

DPI = 130


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend (figures go to files; imported on first use)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path) -> Path:
    """Lay ``fig`` out (unless it has a layout engine of its own), write it to ``path`` and close it; ``path``."""
    if fig.get_layout_engine() is None:
        fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    pyplot().close(fig)
    return path
