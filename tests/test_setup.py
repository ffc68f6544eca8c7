"""The README's two set-up commands and CI's script agree: the same packages installed, the same test command."""

import re
import shlex

from tests.conftest import ROOT


def _pip_installs(commands: list[str]) -> list[tuple[str, ...]]:
    """Each ``pip install`` among shell commands, as its arguments without ``-q`` (``python3 -m pip`` = ``pip``)."""
    out = []
    for command in commands:
        words = shlex.split(command)
        if words[:3] == ["python3", "-m", "pip"]:
            words = words[2:]
        if words[:2] == ["pip", "install"]:
            out.append(tuple(w for w in words[2:] if w != "-q"))
    return out


def _readme_setup() -> list[str]:
    """The commands of the README's set-up block, one per line (comments dropped)."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Set-up.*?```bash\n(.*?)```", text, re.S)
    assert block, "README.md has no set-up block"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def _ci_commands() -> list[str]:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    return [line for line in lines if line.strip() and not line.lstrip().startswith("#")]


def test_the_readme_and_ci_install_the_same_set():
    install, _test = _readme_setup()
    readme = _pip_installs(install.split("&&"))
    ci = _pip_installs(_ci_commands())
    assert readme == ci and readme, (readme, ci)
    # every extra's requirements (the tests of the server, the trackers and vLLM run on them) are in that set
    installed = (ROOT / "requirements-test.txt").read_text().split()
    extras = sorted(p.name for p in ROOT.glob("requirements-*.txt") if p.name != "requirements-test.txt")
    assert all(name in installed for name in ["requirements.txt", *extras]), installed


def test_ci_runs_the_readmes_test_command():
    _install, test = _readme_setup()
    assert _ci_commands()[-1] == test == "python3 -m pytest -q"
