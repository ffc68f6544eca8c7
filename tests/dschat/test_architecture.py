"""docs/architecture.md names every package and module under ``dschat/``, and nothing that is not there; its
"Import rules" state the package order and the allowed upward imports that ``tests/dschat/test_imports.py`` checks
the code against, the same ones.

The page's map is a code block of entries, one per line: a name column (``name/`` for a package, ``a.py`` or
``a.py, b.py`` for modules) and, after two or more spaces, what it holds. An entry's parent is the nearest entry
above it that is less indented, so ``  rlhf/`` under ``dschat/`` is ``dschat/rlhf/`` and ``    ppo.py`` under it is
``dschat/rlhf/ppo.py``. Lines whose first column is not such a name (descriptions carried over, arrows) are
skipped.

In "Import rules" the order is a numbered list whose items begin with their packages (``1. `apps`, `doctor`,
`serving`: ...``), and each allowed upward import a bullet that begins with its package pair and importing module
(``- `planning` → `rlhf` (`planning.plan`): ...``).
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.dschat.test_imports import ALLOWED_UPWARD, PACKAGE_ORDER

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"
NAME = r"[\w./]+(?:\.py|/)"
ENTRY = re.compile(rf"^(?P<indent> *)(?P<names>{NAME}(?:, {NAME})*)(?: {{2,}}|$)")
ORDER_ITEM = re.compile(r"^\d+\. (?P<names>`\w+`(?:, `\w+`)*):")
UPWARD_ITEM = re.compile(r"^- `(?P<src>\w+)` → `(?P<dst>\w+)` \(`(?P<module>[\w.]+)`\):")


def map_block(text: str) -> list[str]:
    """The lines of the page's first code block (its map)."""
    start = text.index("```\n") + 4
    return text[start:text.index("```", start)].splitlines()


def documented(lines: list[str]) -> tuple[set[str], set[str]]:
    """``(packages, modules)`` the map names under ``dschat/``, as paths from the repository root
    (``dschat/rlhf/``, ``dschat/rlhf/ppo.py``)."""
    stack: list[tuple[int, str]] = []  # (indent, path) of the enclosing packages
    packages: set[str] = set()
    modules: set[str] = set()
    for line in lines:
        m = ENTRY.match(line)
        if not m:
            continue
        indent = len(m["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1] if stack else ""
        for name in m["names"].split(", "):
            path = parent + name
            if name.endswith("/"):
                packages.add(path)
                stack.append((indent, path))
            else:
                modules.add(path)
    inside = lambda p: p.startswith("dschat/")  # noqa: E731 - the stage mains above the library are not checked
    return {p for p in packages if inside(p)}, {p for p in modules if inside(p)}


def on_disk() -> tuple[set[str], set[str]]:
    """``(packages, modules)`` of ``dschat/``: folders with an ``__init__.py``, and every other ``.py`` file."""
    files = [p.relative_to(ROOT).as_posix() for p in (ROOT / "dschat").rglob("*.py")]
    packages = {f.removesuffix("__init__.py") for f in files if f.endswith("/__init__.py")}
    return packages, {f for f in files if not f.endswith("/__init__.py")}


def test_the_page_names_every_package_and_module_and_nothing_else():
    pages_packages, page_modules = documented(map_block(PAGE.read_text(encoding="utf-8")))
    packages, modules = on_disk()
    assert sorted(packages - pages_packages) == [], "packages missing from docs/architecture.md"
    assert sorted(modules - page_modules) == [], "modules missing from docs/architecture.md"
    assert sorted(pages_packages - packages) == [], "docs/architecture.md names packages that do not exist"
    assert sorted(page_modules - modules) == [], "docs/architecture.md names modules that do not exist"


def test_the_map_reader_follows_indentation_and_lists():
    lines = ["step1_sft/main.py      stage 1",
             "dschat/cli/            the CLI layer",
             "  main.py              the group",
             "dschat/                the library",
             "  rlhf/                stage 3",
             "    ppo.py             PPO",
             "    rloo.py, remax.py   critic-free",
             "                       carried over: not.py an entry",
             "  config.py            flags",
             "        │ imports"]
    assert documented(lines) == ({"dschat/cli/", "dschat/", "dschat/rlhf/"},
                                 {"dschat/cli/main.py", "dschat/rlhf/ppo.py", "dschat/rlhf/rloo.py",
                                  "dschat/rlhf/remax.py", "dschat/config.py"})


def import_rules(text: str) -> tuple[tuple[tuple[str, ...], ...], set[tuple[str, str, str]]]:
    """The package order (one tuple of packages per numbered item) and the allowed upward imports (``(importing
    package, imported package, dschat.importing.module)``) that the page's "Import rules" section states."""
    start = text.index("## Import rules")
    end = text.find("\n## ", start + 1)
    lines = text[start:end if end != -1 else len(text)].splitlines()
    order = tuple(tuple(n.strip("`") for n in m["names"].split(", ")) for m in map(ORDER_ITEM.match, lines) if m)
    upward = {(m["src"], m["dst"], "dschat." + m["module"]) for m in map(UPWARD_ITEM.match, lines) if m}
    return order, upward


def test_the_import_rules_state_the_order_and_the_upward_imports_the_test_checks():
    order, upward = import_rules(PAGE.read_text(encoding="utf-8"))
    assert order == PACKAGE_ORDER, "docs/architecture.md's package order differs from test_imports.PACKAGE_ORDER"
    assert upward == ALLOWED_UPWARD, "docs/architecture.md's upward imports differ from test_imports.ALLOWED_UPWARD"


def test_the_import_rules_reader_takes_numbered_packages_and_upward_bullets():
    text = "\n".join(["# Page", "## Import rules", "1. `apps`, `doctor`: jobs", "   carried over: `rlhf`",
                      "2. `rlhf`: stage 3", "3. the core", "- `planning` → `rlhf` (`planning.plan`): why",
                      "- no import cycle", "## Flags", "1. `flags`: not the order"])
    assert import_rules(text) == ((("apps", "doctor"), ("rlhf",)), {("planning", "rlhf", "dschat.planning.plan")})
