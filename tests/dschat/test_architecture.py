"""docs/architecture.md names every package and module under ``dschat/``, and nothing that is not there.

The page's map is a code block of entries, one per line: a name column (``name/`` for a package, ``a.py`` or
``a.py, b.py`` for modules) and, after two or more spaces, what it holds. An entry's parent is the nearest entry
above it that is less indented, so ``  rlhf/`` under ``dschat/`` is ``dschat/rlhf/`` and ``    ppo.py`` under it is
``dschat/rlhf/ppo.py``. Lines whose first column is not such a name (descriptions carried over, arrows) are
skipped.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"
NAME = r"[\w./]+(?:\.py|/)"
ENTRY = re.compile(rf"^(?P<indent> *)(?P<names>{NAME}(?:, {NAME})*)(?: {{2,}}|$)")


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
