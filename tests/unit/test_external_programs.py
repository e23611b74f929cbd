"""Every program the tests run is installed by the README's test command, or optional.

The README's test command starts with an install guard: a list of tools it checks
with `command -v`, and the Debian packages it installs when any one is missing.
A program that the tests (or `elastic/chaos`, which they drive) start must be:

- in that list, so a fresh machine gets it before the suite runs; or
- optional: the code asks `shutil.which(name)` first and skips (with a reason)
  or falls back when it is absent; or
- part of every POSIX system (`sh`).

The programs are found by reading the source: the first literal word of an argv
list handed to `subprocess` (or to a helper method of the same name, such as
`SlurmCluster.run`), and every name given to `shutil.which`.
"""

from __future__ import annotations

import ast
import re

from support import REPO
from test_readme import quick_start_commands

BASE_SYSTEM = {"sh"}
"""Programs every POSIX system has."""
SUBPROCESS_CALLS = {"run", "Popen", "call", "check_call", "check_output"}
SCANNED = [*sorted((REPO / "tests").rglob("*.py")), *sorted((REPO / "elastic" / "chaos").glob("*.py"))]


def guard() -> tuple[list[str], list[str]]:
    """(tools checked, packages installed) of the README test command's install guard."""
    command = quick_start_commands()[1]
    tools = re.search(r"for tool in ([\w. -]+); do command -v \"?\$tool\"? >/dev/null \|\| exit 1; done", command)
    packages = re.search(r"apt-get install -y -qq ([\w. -]+)\)", command)
    assert tools and packages, f"the README's test command has no install guard of the expected shape: {command}"
    return tools.group(1).split(), packages.group(1).split()


def _first_word(node: ast.AST) -> str | None:
    """The first string of an argv list literal (after any `*prefix`), if it is a program name."""
    if not isinstance(node, (ast.List, ast.Tuple)):
        return None
    for element in node.elts:
        if isinstance(element, ast.Starred):
            continue
        if isinstance(element, ast.Constant) and isinstance(element.value, str) and not element.value.startswith("-"):
            return element.value
        return None  # sys.executable, a path, a call: not a program looked up on PATH
    return None


def _is_call_to(node: ast.Call, module: str, names: set[str]) -> bool:
    func = node.func
    return (
        isinstance(func, ast.Attribute) and func.attr in names
        and isinstance(func.value, ast.Name) and func.value.id == module
    )


def programs(source: str, where: str) -> tuple[dict[str, list[str]], set[str]]:
    """(program -> places it is started, programs looked up with shutil.which) in `source`."""
    started: dict[str, list[str]] = {}
    checked: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        # subprocess's calls, and helpers' methods of the same names that take the argv first
        # (tests/slurm_cluster.py's `SlurmCluster.run`)
        if isinstance(node.func, ast.Attribute) and node.func.attr in SUBPROCESS_CALLS:
            argv = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "args"), None)
            name = _first_word(argv) if argv is not None else None
            if name is not None:
                started.setdefault(name, []).append(f"{where}:{node.lineno}")
        elif _is_call_to(node, "shutil", {"which"}) and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                checked.add(arg.value)
    return started, checked


def uncovered(sources: dict[str, str], tools: list[str]) -> dict[str, list[str]]:
    """Programs started in `sources` that are neither in `tools`, optional, nor the base system."""
    started: dict[str, list[str]] = {}
    checked: set[str] = set()
    for where, source in sources.items():
        found, looked_up = programs(source, where)
        for name, places in found.items():
            started.setdefault(name, []).extend(places)
        checked |= looked_up
    return {
        name: places for name, places in started.items()
        if name not in tools and name not in checked and name not in BASE_SYSTEM
    }


def test_every_program_the_tests_start_is_installed_or_optional() -> None:
    tools, packages = guard()
    sources = {str(path.relative_to(REPO)): path.read_text() for path in SCANNED}
    missing = uncovered(sources, tools)
    assert not missing, (
        f"add these to the README test command's install guard (tools and Debian packages), or look them up "
        f"with shutil.which and skip with a reason: {missing}"
    )
    # Each tool the guard checks is one the tests need (looked up, or started).
    needed = set().union(*(set(programs(s, w)[0]) | programs(s, w)[1] for w, s in sources.items()))
    assert set(tools) <= needed, f"the guard checks tools nothing runs: {sorted(set(tools) - needed)}"
    assert packages


def test_the_guard_test_finds_a_new_program_without_an_install_step() -> None:
    source = (
        "import shutil, subprocess, sys\n"
        "subprocess.run(['slurmctld', '-D'])\n"                  # new: neither installed nor optional
        "subprocess.Popen([sys.executable, '-c', 'pass'])\n"     # python itself: not a program on PATH
        "subprocess.run(args=['etcd', '--version'])\n"           # installed by the guard
        "if shutil.which('kubectl'):\n"
        "    subprocess.run(['kubectl', 'version'])\n"           # optional: looked up first
        "subprocess.run([*prefix, 'sh', 'x.sh'])\n"              # the base system
    )
    assert uncovered({"new_test.py": source}, ["etcd"]) == {"slurmctld": ["new_test.py:2"]}


def test_the_guard_installs_when_any_one_tool_is_missing() -> None:
    """A machine with etcd but not openssl (or the reverse) still gets the install."""
    command = quick_start_commands()[1]
    assert "command -v etcd >/dev/null ||" not in command, "one tool must not stand for all"
    tools, _ = guard()
    assert {"etcd", "openssl"} <= set(tools)
