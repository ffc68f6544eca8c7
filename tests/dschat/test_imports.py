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

Inside the library the packages have an order (``PACKAGE_ORDER``, the one docs/architecture.md states): a module
imports packages below its own, or siblings on its own line, never one above, except the edges of
``ALLOWED_UPWARD``, each there on purpose with its reason. A new upward import fails here until it goes down
instead, or is added to that list and to the page with its reason.
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

# The library's packages, top to bottom (docs/architecture.md, Import rules); the packages of one entry are
# siblings, neither above the other. The core, the modules at the root of dschat/, is below them all (CORE); the
# CLI layer and the demo are outside the order (the layer rules above).
PACKAGE_ORDER: tuple[tuple[str, ...], ...] = (
    ("apps", "doctor", "serving"),  # a command's whole job, or the library of one command
    ("rlhf",),  # stage 3 by role, its held-out evaluation with it
    ("evaluation",),  # the held-out evaluations of stages 1 and 2 and of a judge
    ("rewards",),  # reward sources
    ("generation",),  # the one decode path
    ("training",),  # runs: the loop skeleton, states, tracking
    ("planning",),  # memory and time from the flags alone, no torch
    ("data", "models"),  # rows to batches; models
    ("agents",),  # tools and environments, which the decode loop drives and the data renders
)
CORE = "<core>"

# Every import that goes up PACKAGE_ORDER, on purpose: (importing package, imported package, importing module).
# docs/architecture.md names each one with the same reason; an edge that is gone must leave both lists.
ALLOWED_UPWARD: frozenset[tuple[str, str, str]] = frozenset({
    # The planner plans stage 3 from its flags alone: it builds stage 3's config (rlhf.config, whose algorithm
    # answers come from rlhf.specs), which imports no torch, so `dschat plan` stays light. The planner sits below
    # training so that a run can ask it for the flags that would fit (a downward import).
    ("planning", "rlhf", "dschat.planning.plan"),
    # ... and it names the model-scored reward sources (rewards.names: the names without the scorers, no torch)
    # to count the reward model and the judge among stage 3's models.
    ("planning", "rewards", "dschat.planning.plan"),
})

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


def library_package(module: str) -> str | None:
    """The package of ``PACKAGE_ORDER`` a module belongs to (``CORE`` for ``dschat`` itself and the modules at its
    root), or None for the CLI layer and the demo."""
    if "." not in module or is_core(module):
        return CORE
    if in_cli_layer(module) or _in_demo(module):
        return None
    return module.split(".")[1]


def _rank(package: str) -> int | None:
    if package == CORE:
        return len(PACKAGE_ORDER)
    return next((i for i, line in enumerate(PACKAGE_ORDER) if package in line), None)


def upward_edges(graph: Graph) -> dict[tuple[str, str, str], str]:
    """Every import of a library module that goes up ``PACKAGE_ORDER``, as ``(importing package, imported package,
    importing module) -> "imported module (file:line)"`` of its first such import. A package missing from the
    order counts as above everything (test_every_library_package_has_a_place_in_the_order names it)."""
    out: dict[tuple[str, str, str], str] = {}
    for m, deps in sorted(graph.items()):
        src = library_package(m)
        if src is None:
            continue
        for dep, where in sorted(deps.items(), key=lambda d: (d[0].count(".") < 2, d[0])):  # modules before packages
            dst = library_package(dep)
            if dst is None or dst == src:
                continue
            a, b = _rank(src), _rank(dst)
            if b is None or (a is not None and b < a):
                out.setdefault((src, dst, m), f"{dep} ({where})")
    return out


def unexpected_upward(graph: Graph) -> list[str]:
    """Each upward import not in ``ALLOWED_UPWARD``, as one line that says what to do about it."""
    return [f"{m} imports {what}: {src} is below {dst} in the package order (docs/architecture.md); "
            "import downward or move the code, or add the edge to ALLOWED_UPWARD and the page with its reason"
            for (src, dst, m), what in sorted(upward_edges(graph).items()) if (src, dst, m) not in ALLOWED_UPWARD]


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


def test_every_library_package_has_a_place_in_the_order() -> None:
    """Each package under ``dschat/`` but the CLI layer and the demo is in ``PACKAGE_ORDER`` once, and the order
    names no package that is not there: a new package is placed before its imports can be checked."""
    on_disk = {m.split(".")[1] for m in FILES if m.count(".") == 1 and _is_package(m, FILES)} - {"cli", "demo"}
    named = [p for line in PACKAGE_ORDER for p in line]
    assert len(named) == len(set(named)), f"a package twice in PACKAGE_ORDER: {named}"
    assert sorted(on_disk - set(named)) == [], "packages missing from PACKAGE_ORDER (and docs/architecture.md)"
    assert sorted(set(named) - on_disk) == [], "PACKAGE_ORDER names packages that do not exist"


def test_imports_go_down_the_package_order() -> None:
    """No library module imports a package above its own (function-local imports too), but the edges of
    ``ALLOWED_UPWARD``; and each allowed edge still exists, so the list (and the page) says what the code does."""
    bad = unexpected_upward(GRAPH)
    assert not bad, "imports up the package order of dschat/:\n" + "\n".join(bad)
    gone = sorted(ALLOWED_UPWARD - set(upward_edges(GRAPH)))
    assert not gone, f"ALLOWED_UPWARD names edges the code no longer has (remove them here and in the page): {gone}"


def test_the_order_check_fails_on_a_planted_upward_import() -> None:
    """The rule itself: a planted upward import (data importing stage 3's scoring; the core importing a package)
    is reported with its package pair and module, while a downward one and one between siblings are not."""
    planted = {**GRAPH, "dschat.data.formats": {**GRAPH["dschat.data.formats"],
                                                "dschat.rlhf.scoring": "dschat/data/formats.py:1"},
               "dschat.rlhf.ppo": {**GRAPH["dschat.rlhf.ppo"], "dschat.agents.tools": "dschat/rlhf/ppo.py:1"},
               "dschat.models.lora": {**GRAPH["dschat.models.lora"], "dschat.data.usertext": "dschat/models/lora.py:1"},
               "dschat.units": {**GRAPH["dschat.units"], "dschat.training.lock": "dschat/units.py:1"}}
    edges = upward_edges(planted)
    assert ("data", "rlhf", "dschat.data.formats") in edges and ("<core>", "training", "dschat.units") in edges
    assert not any(m in ("dschat.rlhf.ppo", "dschat.models.lora") for _, _, m in edges), edges
    bad = unexpected_upward(planted)
    assert any(b.startswith("dschat.data.formats imports dschat.rlhf.scoring (dschat/data/formats.py:1)")
               for b in bad), bad


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
