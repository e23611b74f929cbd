"""benchmarks/common.py, the helpers the benchmarks share: their figures on small inputs, and no copy of
a function in two benchmarks (issue 53: a helper a second benchmark needs moves to common.py).

The scan reads benchmarks/*.py with `ast` (nothing is imported or run): two functions in different
modules with the same body (the docstring left out) are a copy when they have the same name, and when
the body is more than one statement whatever their names (a renamed copy). Not a copy: a one-statement
special method (`def __enter__(self): return self` is the protocol, not a helper).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import signal
import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import common  # noqa: E402

# -- the helpers' figures -----------------------------------------------------------------------------------


def test_median_of_odd_and_even_counts_and_of_none() -> None:
    assert common.median([3.0, 1.0, 2.0]) == 2.0
    assert common.median([4, 1, 3, 2]) == 2.5  # the mean of the middle two
    assert common.median(x for x in (0.5, 0.25)) == 0.375  # any iterable, a generator too
    assert common.median([]) is None
    assert math.isnan(common.median([], math.nan))
    assert common.median([7.0], math.nan) == 7.0


def test_comma_list_strips_names_and_leaves_out_empty_ones() -> None:
    assert common.comma_list("a, b,,c ,") == ["a", "b", "c"]
    assert common.comma_list("") == [] and common.comma_list(" , ") == []


def test_world_sizes_takes_two_or_more_ranks_and_refuses_the_rest_in_one_line(capsys) -> None:
    parser = argparse.ArgumentParser(prog="bench.py")
    assert common.world_sizes(parser, "2,4,8", "why") == [2, 4, 8]
    for text, said in (("2,x", "--ranks takes world sizes, comma-separated, not '2,x'"),
                       ("1,2", "--ranks: every world size must be at least 2 (a slow rank needs a peer)")):
        with pytest.raises(SystemExit) as exited:
            common.world_sizes(parser, text, "a slow rank needs a peer")
        assert exited.value.code == 2
        assert capsys.readouterr().err.endswith(f"bench.py: error: {said}\n")


def test_fail_says_one_line_on_stderr_and_exits_2(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        common.fail("bench.py", "--sizes: too small")
    assert exited.value.code == 2
    assert capsys.readouterr() == ("", "bench.py: error: --sizes: too small\n")


def test_read_jsonl_passes_over_torn_and_blank_lines_and_a_missing_file(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    assert common.read_jsonl(log) == []
    log.write_text('{"step": 1}\n\n{"step": 2}\n{"step": 3, "ti')  # a torn last line
    assert common.read_jsonl(log) == [{"step": 1}, {"step": 2}]


def test_write_atomically_replaces_the_file_and_leaves_nothing_beside_it(tmp_path: Path, monkeypatch) -> None:
    target = tmp_path / "r.json"
    target.write_text("old")
    common.write_atomically(target, json.dumps({"a": 1}))
    assert json.loads(target.read_text()) == {"a": 1} and list(tmp_path.iterdir()) == [target]

    def broken(src: Any, dst: Any) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(common.os, "replace", broken)
    with pytest.raises(OSError, match="disk gone"):
        common.write_atomically(target, "new")
    assert target.read_text() == '{"a": 1}' and list(tmp_path.iterdir()) == [target]  # the old file, no temporary


def test_memory_dir_is_dev_shm_where_writable_else_tempfiles_default(monkeypatch) -> None:
    monkeypatch.setattr(common.os, "access", lambda path, mode: path == "/dev/shm" and mode == os.W_OK)
    assert common.memory_dir() == "/dev/shm"
    monkeypatch.setattr(common.os, "access", lambda path, mode: False)
    assert common.memory_dir() is None


def test_wait_until_returns_the_first_true_value_or_none_after_the_timeout() -> None:
    answers = iter([0, [], "ready", "later"])
    assert common.wait_until(lambda: next(answers), 10, interval=0.001) == "ready"
    assert common.wait_until(lambda: None, 0.01, interval=0.001) is None


def test_kill_tree_kills_the_process_and_all_below_it_passing_over_the_gone(monkeypatch) -> None:
    from elastic._agent.launcher import proctree

    monkeypatch.setattr(proctree, "descendants", lambda pid: [pid + 1, pid + 2])
    killed = []

    def kill(pid: int, signum: int) -> None:
        if pid == 11:
            raise ProcessLookupError  # ended meanwhile
        killed.append((pid, signum))

    monkeypatch.setattr(common.os, "kill", kill)
    common.kill_tree(10)
    assert killed == [(10, signal.SIGKILL), (12, signal.SIGKILL)]


def test_memory_copies_time_each_round() -> None:
    seconds = common.memory_copies(4096, 3)
    assert len(seconds) == 3 and all(s >= 0 for s in seconds)


class _Optimizer:
    """Just the pre-hooks of a torch optimizer: registered in order, each with its removable handle."""

    def __init__(self) -> None:
        self.hooks: list[Any] = []

    def register_step_pre_hook(self, hook: Any) -> Any:
        self.hooks.append(hook)
        return SimpleNamespace(remove=lambda: self.hooks.remove(hook))

    def step(self) -> None:
        for hook in list(self.hooks):
            hook(self, (), {})


def test_hook_wait_counts_the_managers_wait_to_the_newest_save(monkeypatch) -> None:
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(common, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    optimizer = _Optimizer()
    wait = common.HookWait(optimizer)

    def manager_hook(*_: Any) -> None:  # the manager's pre-hook: it waits for the deferred copy
        clock.now += manager_wait

    optimizer.register_step_pre_hook(manager_hook)
    calls: dict[int, Any] = {}
    wait.after_manager(calls)
    manager_wait = 0.5
    optimizer.step()  # no save yet: nothing counts
    assert wait.seconds == {}
    calls[10] = 0.1
    optimizer.step()
    manager_wait = 0.25
    optimizer.step()
    calls[20] = 0.1
    optimizer.step()
    assert wait.seconds == {10: 0.75, 20: 0.25}
    wait.remove()
    assert optimizer.hooks == [manager_hook]


# -- no copy of a function in two benchmarks ---------------------------------------------------------------


def _body(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.stmt]:
    body = function.body
    first = body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        body = body[1:]  # the docstring: a copy may say it in other words
    return body


def copies(folder: Path) -> list[str]:
    """Functions (at any depth: methods, nested ones too) of different modules in `folder` with the same
    body, when they have the same name or a body of more than one statement, as `a.py:12 f = b.py:40 g`;
    a one-statement special method is passed over."""
    by_body: dict[str, list[tuple[str, str, int]]] = defaultdict(list)
    statements: dict[str, int] = {}
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _body(node):
                key = ast.dump(ast.Module(body=_body(node), type_ignores=[]))
                by_body[key].append((path.name, node.name, node.lineno))
                statements[key] = len(_body(node))
    found = []
    for key, places in by_body.items():
        for i, (module, name, line) in enumerate(places):
            for other, other_name, other_line in places[i + 1:]:
                dunder = name.startswith("__") and name.endswith("__")
                if other != module and (statements[key] > 1 or name == other_name and not dunder):
                    found.append(f"{module}:{line} {name} = {other}:{other_line} {other_name}")
    return found


def test_no_two_benchmarks_define_the_same_function() -> None:
    found = copies(BENCHMARKS)
    assert not found, ("the same function in two benchmarks; keep one, in benchmarks/common.py, and import it: "
                       + "; ".join(found))


def test_every_helper_in_common_serves_two_benchmarks_or_more() -> None:
    """A helper of one benchmark stays in that benchmark (common.py's rule)."""
    helpers = {node.name for node in ast.parse((BENCHMARKS / "common.py").read_text()).body
               if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_")}
    users: dict[str, set[str]] = defaultdict(set)
    for path in BENCHMARKS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "common":
                for alias in node.names:
                    users[alias.name].add(path.name)
    assert helpers and {name: sorted(users[name]) for name in helpers if len(users[name]) < 2} == {}


COPIED = '''
import json


def read_jsonl(path):
    """Another docstring does not make it another function."""
    records = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return records


def own_name(path):
    records = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return records


class Job:
    def __enter__(self):
        return self
'''


def test_the_scan_finds_a_copy_of_a_common_helper_under_its_name_or_another(tmp_path: Path) -> None:
    (tmp_path / "common.py").write_text((BENCHMARKS / "common.py").read_text())
    (tmp_path / "bench.py").write_text(COPIED)
    (tmp_path / "other.py").write_text("class Other:\n    def __enter__(self):\n        return self\n")
    pairs = sorted((a.split()[0].split(":")[0], a.split()[1], b.split()[0].split(":")[0], b.split()[1])
                   for a, b in (place.split(" = ") for place in copies(tmp_path)))
    # under its own name and renamed; not the two one-statement `__enter__` (an idiom, no copy)
    assert pairs == [("bench.py", "own_name", "common.py", "read_jsonl"), ("bench.py", "read_jsonl", "common.py", "read_jsonl")]
