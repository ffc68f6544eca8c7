"""The import graph of ``dschat/``: no import cycles, and the layers below, stated by package
(docs/architecture.md).

Every ``import`` statement of every module is read with ``ast``: top-level ones, function-local ones and those
under ``if TYPE_CHECKING:`` alike, so a cycle cannot hide inside a function. Importing ``a.b.c`` also runs the
``__init__`` of each package on the way (``a.b``), so that counts as an import of the package too, except of the
importer's own packages (they are initialised before the importer runs). The commands that ``dschat.cli.main``
loads by name (its ``COMMANDS`` table, read from the source) count as imports of their modules.

The layers:

- the **CLI layer**: the ``dschat.cli`` package, every click command one module of it, plus the option
  machinery. It may import anything in ``dschat``; it is the only place that imports click.
- the **demo** (the ``dschat.demo`` package): the generated corpus and the tools that build the tiny tokenizer.
  It may import the library, never the CLI layer.
- the **library**: every other module. It never imports the CLI layer or the demo.
- the **core**, the modules at the root of ``dschat/`` (config, engine, losses, ...): part of the library that
  imports none of its sub-packages, so any of them may use it.

Who may import the demo (``DEMO_COMMANDS``): the demo package itself, and the commands whose documented default
*is* the embedded demo: ``dschat.cli.pipeline`` (``dschat pipeline`` with no arguments runs the demo, on demo files
it picks per stage), ``dschat.cli.data`` (``dschat data inspect`` without ``--data`` shows the demo corpus) and
``dschat.cli.eval`` (``dschat eval --step 1|3`` without ``--data`` evaluates on the demo corpus, the stages' own
default data, so the demo's held-out figures can be reproduced) and ``dschat.cli.doctor`` (``dschat doctor``
without ``--data`` reads the stage's default, the demo corpus, as the stage would).
The stage mains live outside ``dschat/`` and pass ``dschat.demo.demo_data`` to the library as their default
data, so the library itself never names the demo.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "dschat"

CLI = "dschat.cli"
DEMO = "dschat.demo"
DEMO_COMMANDS = frozenset({"dschat.cli.pipeline", "dschat.cli.data", "dschat.cli.eval", "dschat.cli.doctor"})
LAYER_FILES = frozenset({"dschat.cli.main"})  # where the lazily loaded COMMANDS table lives

Graph = dict[str, dict[str, str]]  # module -> {imported module: "file:line" of the first such import}


# ------------------------------------------------------------------------------------------------ the graph
def module_files(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``package_dir`` (a package is its ``__init__``)."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_package(name: str, files: dict[str, Path]) -> bool:
    return files[name].name == "__init__.py"


def _imported_names(module: str, tree: ast.AST, files: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """Every dotted name an import statement of ``module`` brings in (``from a import b`` gives ``a.b``, which
    is a module or an attribute of ``a``), with its line."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the importer's package
                pkg = module.split(".") if _is_package(module, files) else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            for alias in node.names:
                yield f"{base}.{alias.name}", node.lineno
            yield base, node.lineno


def _lazy_commands(tree: ast.AST) -> Iterator[tuple[str, int]]:
    """The modules named in ``COMMANDS = {"name": "module:attribute", ...}`` (``dschat.cli.main``'s lazy commands)."""
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "COMMANDS" for t in node.targets)
                and isinstance(node.value, ast.Dict)):
            for value in node.value.values:
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    yield value.value.split(":")[0], value.lineno


def _resolve(name: str, files: dict[str, Path]) -> str | None:
    """The module an imported name lives in: the name itself, or its longest prefix that is a module."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in files:
            return candidate
    return None


def import_graph(package_dir: Path) -> Graph:
    files = module_files(package_dir)
    root = package_dir.parent
    graph: Graph = {m: {} for m in files}
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        names = list(_imported_names(module, tree, files))
        if module in LAYER_FILES or module == f"{package_dir.name}.cli":
            names += list(_lazy_commands(tree))
        own = {".".join(module.split(".")[:n]) for n in range(1, module.count(".") + 2)}  # itself and its packages
        for name, line in names:
            target = _resolve(name, files)
            if target is None:
                continue
            parts = target.split(".")
            for n in range(1, len(parts) + 1):  # the target and the packages initialised on the way to it
                dep = ".".join(parts[:n])
                if dep in files and dep not in own:
                    graph[module].setdefault(dep, f"{path.relative_to(root)}:{line}")
    return graph


def find_cycle(graph: Graph) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, {})):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def describe_cycle(cycle: list[str], graph: Graph) -> str:
    return " -> ".join(cycle) + "\n" + "\n".join(
        f"  {a} imports {b} at {graph[a][b]}" for a, b in zip(cycle, cycle[1:], strict=False))


def _in(package: str, module: str) -> bool:
    return module == package or module.startswith(package + ".")


def _in_demo(module: str) -> bool:
    return _in(DEMO, module)


def in_cli_layer(module: str) -> bool:
    return _in(CLI, module)


def is_core(module: str) -> bool:
    """A module at the root of ``dschat/`` (not a package, not in one)."""
    return module.count(".") == 1 and not _is_package(module, FILES)


def layer_violations(graph: Graph) -> list[str]:
    """Every import that breaks a layer rule (the module docstring), as ``"a imports b (file:line)"``."""
    bad = []
    for m, deps in sorted(graph.items()):
        for dep, where in sorted(deps.items()):
            if in_cli_layer(dep) and not in_cli_layer(m):
                bad.append(f"{m} imports {dep} ({where}): only the CLI layer imports dschat.cli")
            elif _in_demo(dep) and not _in_demo(m) and m not in DEMO_COMMANDS:
                bad.append(f"{m} imports {dep} ({where}): only the demo and " + ", ".join(sorted(DEMO_COMMANDS))
                           + " import dschat.demo")
            elif is_core(m) and not is_core(dep) and dep != "dschat":
                bad.append(f"{m} imports {dep} ({where}): the core at the root of dschat/ imports no sub-package")
    return bad


# ------------------------------------------------------------------------------------------------------ tests
FILES = module_files(PACKAGE_DIR)
GRAPH = import_graph(PACKAGE_DIR)


def test_no_import_cycles() -> None:
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle in dschat/:\n" + describe_cycle(cycle, GRAPH)


def test_every_import_keeps_to_the_layers() -> None:
    bad = layer_violations(GRAPH)
    assert not bad, "imports across the layers of dschat/:\n" + "\n".join(bad)


def test_the_layer_check_fails_on_a_library_module_importing_the_cli() -> None:
    """The rule itself: a library module that imports a command (here a planted edge) is reported, and so is a
    core module that imports a sub-package."""
    planted = {**GRAPH, "dschat.losses": {**GRAPH["dschat.losses"], "dschat.cli.train": "dschat/losses.py:1"},
               "dschat.rlhf.ppo": {**GRAPH["dschat.rlhf.ppo"], "dschat.cli.options": "dschat/rlhf/ppo.py:1"}}
    bad = layer_violations(planted)
    assert any(b.startswith("dschat.losses imports dschat.cli.train") for b in bad), bad
    assert any(b.startswith("dschat.rlhf.ppo imports dschat.cli.options") for b in bad), bad
    assert any("core at the root" in b for b in layer_violations(
        {**GRAPH, "dschat.losses": {"dschat.rlhf": "dschat/losses.py:1"}})), "core rule not checked"


def test_only_the_cli_layer_imports_click() -> None:
    """``import click`` / ``from click ...`` appears in no module outside ``dschat/cli/`` (nor in the stage mains,
    which build their commands through ``dschat.cli.options``)."""
    root = PACKAGE_DIR.parent
    files = [p for p in PACKAGE_DIR.rglob("*.py") if "cli" not in p.relative_to(PACKAGE_DIR).parts[:1]]
    files += sorted(root.glob("step*_*/main.py"))
    bad = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad += [f"{path.relative_to(root)}:{node.lineno}" for n in names if n.split(".")[0] == "click"]
    assert files and not bad, "click imported outside dschat/cli/: " + ", ".join(bad)


def test_every_registered_command_is_a_cli_module() -> None:
    """Each command in ``dschat.cli.main.COMMANDS`` names an existing module of the CLI layer."""
    tree = ast.parse((PACKAGE_DIR / "cli" / "main.py").read_text(encoding="utf-8"))
    commands = {name for name, _ in _lazy_commands(tree)}
    assert commands and all(in_cli_layer(c) and c in GRAPH for c in commands), sorted(commands)


def test_the_checker_sees_cycles_through_function_local_imports_and_package_inits(tmp_path: Path) -> None:
    """The graph builder itself: a cycle closed by an import inside a function, and one closed by a package's
    ``__init__`` (importing ``pkg.sub.x`` runs ``pkg/sub/__init__.py``), are both found."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import os\n\n\ndef f():\n    from pkg import b\n    return b\n")
    (pkg / "b.py").write_text("from pkg.a import f\n")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub.x import X\n")
    (pkg / "sub" / "x.py").write_text("X = 1\n")
    (pkg / "c.py").write_text("from pkg.sub.x import X\n")
    graph = import_graph(pkg)
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]
    assert graph["pkg.c"] == {"pkg.sub": "pkg/c.py:1", "pkg.sub.x": "pkg/c.py:1"}
    assert "pkg.sub" not in graph["pkg.sub.x"]  # a module's own package is initialised before it, not by it
    (pkg / "b.py").write_text("X = 2\n")
    (pkg / "sub" / "x.py").write_text("def g():\n    from pkg import c\n")
    assert find_cycle(import_graph(pkg)) == ["pkg.c", "pkg.sub", "pkg.sub.x", "pkg.c"]
