"""The package's dependency direction (design.md §5): no import cycle between its modules (imports inside
functions count), transformers only at the edge, and the command line and the evaluation independent of each other."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "flexentropy"

TRANSFORMERS_ALLOWED = ("flexentropy.caches", "flexentropy.integrations", "flexentropy.runtime", "flexentropy.cli",
                        "flexentropy.eval", "flexentropy.diagnostics")
"""Modules (and packages) that may import transformers: cache storage, integrations, runtime, CLI, eval, diagnostics."""

LAYERS = ("flexentropy._checks", "flexentropy.config", "flexentropy._compile", "flexentropy.prefill", "flexentropy.kv",
          "flexentropy.policies", "flexentropy.caches", "flexentropy.integrations", "flexentropy.runtime")
"""Lower layers first: a module may import its own layer and the ones before it, never a later one."""


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of its syntax tree (functions included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``from pkg import name`` counts as importing ``pkg``, and
    ``pkg.name`` when that is a module)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in imports(path) if m in modules and m != name} for name, path in modules.items()}


def is_within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_no_import_cycle() -> None:
    edges = graph()
    # A package's __init__ re-exporting its children is not a dependency of the children on their siblings.
    edges = {m: {d for d in deps if not (is_within(m, d) and m != d)} for m, deps in edges.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(edges[node]):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)


def test_transformers_only_at_the_edge() -> None:
    offenders = sorted(name for name, path in ((module_name(p), p) for p in PACKAGE.rglob("*.py"))
                       if any(is_within(m, "transformers") for m in imports(path))
                       and not any(is_within(name, allowed) for allowed in TRANSFORMERS_ALLOWED))
    assert not offenders, f"transformers imported outside {TRANSFORMERS_ALLOWED}: {offenders}"


def test_layers_point_one_way() -> None:
    def layer(module: str) -> int | None:
        return next((i for i, prefix in enumerate(LAYERS) if is_within(module, prefix)), None)

    wrong = [(m, d) for m, deps in graph().items() for d in deps
             if layer(m) is not None and layer(d) is not None and layer(d) > layer(m)]
    assert not wrong, f"imports against the layer order {LAYERS}: {wrong}"


def test_cli_and_eval_never_import_each_other() -> None:
    edges = graph()
    crossing = [(m, d) for m, deps in edges.items() for d in deps
                if (is_within(m, "flexentropy.cli") and is_within(d, "flexentropy.eval"))
                or (is_within(m, "flexentropy.eval") and is_within(d, "flexentropy.cli"))]
    assert not crossing, f"the CLI and the evaluation import each other: {crossing}"
