"""``python -m bench``: the library's ``flexentropy`` command (`flexentropy.cli`) with the lab's model aliases
(`bench.models`: Qwen2.5-Coder assembled from registry part wheels) accepted by ``--model`` as well as paths."""

from __future__ import annotations

import argparse

from bench.loading import resolve_model
from bench.models import MODEL_HELP
from flexentropy.cli import needle_demo


def build_parser() -> argparse.ArgumentParser:
    """The command's parser, its ``--model`` help naming the aliases."""
    return needle_demo.build_parser(model_help=MODEL_HELP)


def main(argv: list[str] | None = None) -> int:
    """The command, ``--model`` resolved through `bench.loading.resolve_model` (aliases, then paths)."""
    return needle_demo.main(argv, parser=build_parser(), resolve=resolve_model)
