"""The tree's dependency direction (design.md §5), read off the source with `ast`:

- no import cycle in the library (imports inside functions count);
- the library (`flexentropy/`) never imports the lab (`bench/`) or the test oracle (`reference/`);
- transformers is imported only at the library's edge, and models are patched (hooks, replaced attributes) only
  by the modules of `PATCHERS`;
- vLLM is imported only by the vLLM plugin (`flexentropy/integrations/vllm/`), which imports neither transformers
  nor the transformers integration (`flexentropy/integrations/hf/`), and which nothing else imports; importing it, in a
  fresh interpreter, loads none of them;
- no module writes another object's private attributes;
- the lab's needle demo and its evaluation never import each other;
- the lab (`bench/`, `profiling/`) and the oracle (`reference/`) import only the library's public names.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "flexentropy"
LAB = ROOT / "bench"
OUTSIDE = ("bench", "reference", "tests", "profiling")
"""Top-level packages beside the library that it must never import."""

USERS = ("bench", "profiling", "reference")
"""The lab and the oracle: users of the library, through its public names only."""

TRANSFORMERS_ALLOWED = ("flexentropy.caches", "flexentropy.engine", "flexentropy.integrations.hf", "flexentropy.cli")
"""Library modules (and packages) that may import transformers: cache storage, the decode engine, the transformers
integration, the command line (the library's transformers side)."""

VLLM_PLUGIN = "flexentropy.integrations.vllm"
"""The only library package that may import vLLM (and the only one vLLM loads)."""

PATCHERS = ("flexentropy.integrations", "flexentropy.surgery", "flexentropy.engine.compiled_layer",
            "flexentropy.cli.gguf", "flexentropy.cli.rope", "flexentropy.cli.progress")
"""The only library modules that may install hooks on a model or set attributes of objects they were handed: the
model backends, model surgery (its job is to rewrite a model's modules), the static step's compiled layer (each decoder
layer's ``forward`` swapped for the step's length, then given back) and the command line's tokenizer repair, YaRN
config and progress hooks."""

LAYERS = ("flexentropy._checks", "flexentropy.config", "flexentropy._compile", "flexentropy.sparse",
          "flexentropy.kv", "flexentropy.policies", "flexentropy.settings",
          "flexentropy.surgery", "flexentropy.caches", "flexentropy.engine", "flexentropy.integrations",
          "flexentropy.cli")
"""Lower layers first: a module may import its own layer and the ones before it, never a later one. (The deprecated
``flexentropy.prefill`` holds no code: its modules hand out the moved names through `flexentropy._deprecated`.)"""


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of its syntax tree (functions included)."""
    found: set[str] = set()
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def sources(folder: Path) -> dict[str, Path]:
    return {module_name(p): p for p in folder.rglob("*.py")}


def graph(folder: Path = LIBRARY) -> dict[str, set[str]]:
    """Module -> the modules of ``folder`` it imports (``from pkg import name`` counts as importing ``pkg``, and
    ``pkg.name`` when that is a module)."""
    modules = sources(folder)
    return {name: {m for m in imports(path) if m in modules and m != name} for name, path in modules.items()}


def is_within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def attribute_writes(path: Path) -> Iterator[tuple[int, str, str, ast.AST]]:
    """``(line, target object, attribute name or "?", the function's node or the module)`` of every attribute
    written in ``path``: assignments (``obj.name = ...``, augmented, annotated), ``setattr``/``delattr`` calls (the
    name when it is a string literal or a module-level string constant)."""
    module = tree(path)
    constants = {t.id: node.value.value for node in module.body if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                 for t in node.targets if isinstance(t, ast.Name)}

    def visit(node: ast.AST, scope: ast.AST) -> Iterator[tuple[int, str, str, ast.AST]]:
        for child in ast.iter_child_nodes(node):
            inner = child if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) else scope
            targets: list[ast.expr] = []
            if isinstance(child, ast.Assign):
                targets = child.targets
            elif isinstance(child, ast.AugAssign | ast.AnnAssign):
                targets = [child.target]
            for target in targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
                        yield child.lineno, ast.unparse(sub.value), sub.attr, scope
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Name)
                    and child.func.id in ("setattr", "delattr") and len(child.args) >= 2):
                name = child.args[1]
                attr = (name.value if isinstance(name, ast.Constant) and isinstance(name.value, str)
                        else constants.get(name.id, "?") if isinstance(name, ast.Name) else "?")
                yield child.lineno, ast.unparse(child.args[0]), attr, scope
            yield from visit(child, inner)

    yield from visit(module, module)


def parameters(scope: ast.AST) -> set[str]:
    if not isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
        return set()
    args = scope.args
    return {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg) if a}


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


def test_library_never_imports_the_lab() -> None:
    offenders = sorted((name, m) for name, path in sources(LIBRARY).items() for m in imports(path)
                       if any(is_within(m, outside) for outside in OUTSIDE))
    assert not offenders, f"the library imports the lab, the tests or the oracle: {offenders}"


def test_transformers_only_at_the_edge() -> None:
    offenders = sorted(name for name, path in sources(LIBRARY).items()
                       if any(is_within(m, "transformers") for m in imports(path))
                       and not any(is_within(name, allowed) for allowed in TRANSFORMERS_ALLOWED))
    assert not offenders, f"transformers imported outside {TRANSFORMERS_ALLOWED}: {offenders}"


def test_vllm_only_in_its_plugin() -> None:
    """vLLM is imported only inside the plugin; the plugin imports no transformers and none of the library's
    transformers side (the transformers integration, the caches, the decoding loops, the command); nothing imports
    it."""
    offenders = []
    for name, path in sources(LIBRARY).items():
        inside = is_within(name, VLLM_PLUGIN)
        for m in imports(path):
            if is_within(m, "vllm") and not inside:
                offenders.append(f"{name} imports {m}")
            if inside and (is_within(m, "transformers") or any(is_within(m, t) for t in TRANSFORMERS_ALLOWED)):
                offenders.append(f"{name} (the vLLM plugin) imports {m}")
            if not inside and is_within(m, VLLM_PLUGIN):
                offenders.append(f"{name} imports the vLLM plugin ({m})")
    assert not offenders, offenders


def test_importing_the_vllm_plugin_loads_no_transformers() -> None:
    """The module of the plugin's entry point (pyproject's ``vllm.general_plugins``), imported in a fresh interpreter,
    loads neither transformers nor any module of the library's transformers side: every package above it (the
    library's, ``flexentropy.integrations``) imports neither engine, which the import lines alone do not show."""
    entry = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["entry-points"]
    module = entry["vllm.general_plugins"]["flexentropy"].partition(":")[0]
    assert is_within(module, VLLM_PLUGIN), module
    code = f"import sys, {module}; print(' '.join(sys.modules))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                            env=env).stdout.split()
    assert module in loaded
    offenders = sorted(m for m in loaded if is_within(m, "transformers")
                       or any(is_within(m, side) for side in TRANSFORMERS_ALLOWED))
    assert not offenders, f"importing {module} loaded {offenders[:8]} ({len(offenders)} modules)"


def test_only_integrations_patch_models() -> None:
    """Outside `PATCHERS`, the library registers no hook and sets no attribute of an object it was handed (a
    function's parameter other than ``self``/``cls``), nor any attribute through ``setattr`` on another object."""
    offenders = []
    for name, path in sources(LIBRARY).items():
        if any(is_within(name, allowed) for allowed in PATCHERS):
            continue
        for node in ast.walk(tree(path)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr.startswith("register_") and node.func.attr.endswith("hook")):
                offenders.append(f"{name}:{node.lineno} {node.func.attr}")
        for line, target, attr, scope in attribute_writes(path):
            if target not in ("self", "cls") and (target in parameters(scope) - {"self", "cls"} or attr == "?"):
                offenders.append(f"{name}:{line} {target}.{attr}")
    assert not offenders, f"models patched outside {PATCHERS}: {offenders}"


def test_no_module_writes_private_attributes_of_others() -> None:
    offenders = [f"{name}:{line} {target}.{attr}"
                 for folder in (LIBRARY, LAB) for name, path in sources(folder).items()
                 for line, target, attr, _ in attribute_writes(path)
                 if attr.startswith("_") and not attr.startswith("__") and target not in ("self", "cls")]
    assert not offenders, f"private attributes of other objects written: {offenders}"


def test_layers_point_one_way() -> None:
    def layer(module: str) -> int | None:
        return next((i for i, prefix in enumerate(LAYERS) if is_within(module, prefix)), None)

    wrong = [(m, d) for m, deps in graph().items() for d in deps
             if layer(m) is not None and layer(d) is not None and layer(d) > layer(m)]
    assert not wrong, f"imports against the layer order {LAYERS}: {wrong}"


def private_imports(path: Path) -> list[str]:
    """``module`` or ``module.name`` of every import of ``path`` from the library whose module or name is private
    (a part beginning with ``_``, dunder names aside)."""
    def private(dotted: str) -> bool:
        return any(part.startswith("_") and not part.startswith("__") for part in dotted.split("."))

    found = []
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names
                      if is_within(alias.name, "flexentropy") and private(alias.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and is_within(node.module, "flexentropy"):
            found += [f"{node.module}.{alias.name}" for alias in node.names
                      if private(f"{node.module}.{alias.name}")]
    return found


def test_the_lab_imports_only_public_names() -> None:
    offenders = [f"{path.relative_to(ROOT)}: {name}" for folder in USERS
                 for path in sorted((ROOT / folder).rglob("*.py")) for name in private_imports(path)]
    assert not offenders, f"private library names imported by the lab or the oracle: {offenders}"


def test_demo_and_eval_never_import_each_other() -> None:
    edges = graph(LAB)
    crossing = [(m, d) for m, deps in edges.items() for d in deps
                if (is_within(m, "bench.needle_demo") and is_within(d, "bench.eval"))
                or (is_within(m, "bench.eval") and is_within(d, "bench.needle_demo"))]
    assert not crossing, f"the needle demo and the evaluation import each other: {crossing}"


def test_the_checks_find_what_they_look_for(tmp_path: Path) -> None:
    """The checks on planted offenders: a handed-over model patched, a private attribute written, private names
    imported by the lab."""
    planted = tmp_path / "planted.py"
    planted.write_text("_NAME = '_private'\n\n"
                       "def patch(model, layer):\n"
                       "    model.forward = None\n"
                       "    setattr(layer, _NAME, 1)\n"
                       "    local = object()\n"
                       "    local.public = 2\n", encoding="utf-8")
    found = [(target, attr) for _, target, attr, scope in attribute_writes(planted)
             if target in parameters(scope)]
    assert found == [("model", "forward"), ("layer", "_private")]
    lab = tmp_path / "lab.py"
    lab.write_text("import flexentropy._compile\nfrom flexentropy import enable, _checks\n"
                   "from flexentropy.prefill.observation import observe, _helper\n", encoding="utf-8")
    assert private_imports(lab) == ["flexentropy._compile", "flexentropy._checks",
                                    "flexentropy.prefill.observation._helper"]
