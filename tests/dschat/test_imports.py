"""The import graph of ``dschat/`` (SPEC 1: no import cycles; the library never imports the CLI layer or the demo).

Every ``import`` statement of every module is read with ``ast``: top-level ones, function-local ones and those
under ``if TYPE_CHECKING:`` alike, so a cycle cannot hide inside a function. Importing ``a.b.c`` also runs the
``__init__`` of each package on the way (``a.b``), so that counts as an import of the package too, except of the
importer's own packages (they are initialised before the importer runs). The commands that ``dschat.cli`` loads
by name (its ``COMMANDS`` table, read from the source) count as imports of ``dschat.cli``.

Three layers:

- the **CLI layer** (``CLI_LAYER``): ``dschat.cli`` and the modules that define its click commands. They may
  import anything in ``dschat``.
- the **demo** (the ``dschat.demo`` package): the generated corpus and the tools that build the tiny tokenizer.
  It may import the library, never the CLI layer.
- the **library**: every other module, ``dschat.rlhf.*`` included. It never imports the CLI layer or the demo.

Who may import the demo (``DEMO_COMMANDS``): the demo package itself, and the commands whose documented default
*is* the embedded demo: ``dschat.pipeline`` (``dschat pipeline`` with no arguments runs the demo, on demo files
it picks per stage), ``dschat.commands`` (``dschat data inspect`` without ``--data`` shows the demo corpus) and
``dschat.eval_cmd`` (``dschat eval --step 1|3`` without ``--data`` evaluates on the demo corpus, the stages' own
default data, so the demo's held-out figures can be reproduced).
The stage mains live outside ``dschat/`` and pass ``dschat.demo.demo_data`` to the library as their default
data, so the library itself never names the demo.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "dschat"

CLI_LAYER = frozenset({
    "dschat.cli",  # the `dschat` group and `dschat train`
    "dschat.chat",  # dschat chat
    "dschat.commands",  # dschat data inspect|balance
    "dschat.eval_cmd",  # dschat eval
    "dschat.export",  # dschat export
    "dschat.generate_cmd",  # dschat generate
    "dschat.options",  # click options from flag declarations (dschat train's, and dschat eval's shared flags)
    "dschat.judge_cmd",  # dschat judge (and the judge evaluation of dschat eval --judge)
    "dschat.pipeline",  # dschat pipeline
})
DEMO = "dschat.demo"
DEMO_COMMANDS = frozenset({"dschat.pipeline", "dschat.commands", "dschat.eval_cmd"})

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
    """The modules named in ``COMMANDS = {"name": "module:attribute", ...}`` (``dschat.cli``'s lazy commands)."""
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
        if module == f"{package_dir.name}.cli":
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


def _in_demo(module: str) -> bool:
    return module == DEMO or module.startswith(DEMO + ".")


# ------------------------------------------------------------------------------------------------------ tests
GRAPH = import_graph(PACKAGE_DIR)


def test_no_import_cycles() -> None:
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle in dschat/:\n" + describe_cycle(cycle, GRAPH)


def test_the_library_and_the_demo_never_import_the_cli_layer() -> None:
    bad = [f"{m} imports {dep} ({where})" for m, deps in sorted(GRAPH.items()) if m not in CLI_LAYER
           for dep, where in sorted(deps.items()) if dep in CLI_LAYER]
    assert not bad, "library or demo module importing the CLI layer:\n" + "\n".join(bad)


def test_only_the_demo_commands_import_the_demo() -> None:
    bad = [f"{m} imports {dep} ({where})" for m, deps in sorted(GRAPH.items())
           if not _in_demo(m) and m not in DEMO_COMMANDS for dep, where in sorted(deps.items()) if _in_demo(dep)]
    assert not bad, "module importing dschat.demo (only " + ", ".join(sorted(DEMO_COMMANDS)) + \
        " and the demo itself may):\n" + "\n".join(bad)


def test_the_cli_layer_lists_every_command_module() -> None:
    """A command registered in ``dschat.cli.COMMANDS`` belongs to the CLI layer above; the layer names no module
    that does not exist."""
    assert CLI_LAYER <= set(GRAPH), sorted(CLI_LAYER - set(GRAPH))
    cli_tree = ast.parse((PACKAGE_DIR / "cli.py").read_text(encoding="utf-8"))
    commands = {name for name, _ in _lazy_commands(cli_tree)}
    assert commands and commands <= CLI_LAYER, sorted(commands - CLI_LAYER)


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
