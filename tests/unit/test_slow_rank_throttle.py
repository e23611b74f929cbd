"""benchmarks/slow_rank.py's throttle from outside the process: which one it takes (a cgroup CPU quota,
v2 or v1, where this process may make one; else the SIGSTOP/SIGCONT duty cycle) and what it writes, on
cgroup trees faked in a directory (no process is started or moved here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_slow_rank_table import slow_rank


def tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_v2_is_taken_when_its_root_hands_the_cpu_controller_down(tmp_path: Path) -> None:
    bench = slow_rank()
    root = tree(tmp_path, {"cgroup.controllers": "cpuset cpu io memory", "cgroup.subtree_control": "cpu memory"})
    layout = bench.cgroup_layout(root)
    assert layout == bench.CgroupLayout(2, root)
    assert bench.quota_files(layout, 0.5) == {"cpu.max": "5000 10000"}


def test_v1_is_taken_when_v2_has_no_cpu_controller_and_none_is_nothing(tmp_path: Path) -> None:
    bench = slow_rank()
    root = tree(tmp_path, {"cgroup.controllers": "cpu", "cgroup.subtree_control": "memory",  # not delegated
                           "cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"})
    layout = bench.cgroup_layout(root)
    assert layout == bench.CgroupLayout(1, root / "cpu")
    assert bench.quota_files(layout, 0.25) == {"cpu.cfs_period_us": "10000", "cpu.cfs_quota_us": "2500"}
    assert bench.quota_files(layout, 0.05)["cpu.cfs_quota_us"] == "1000"  # the kernel's least quota
    with pytest.raises(ValueError):
        bench.quota_files(layout, 1.5)
    assert bench.cgroup_layout(tmp_path / "empty") is None


def test_the_flag_picks_the_throttle_and_says_in_one_line_when_a_cgroup_cannot_be_had(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    bench = slow_rank()
    monkeypatch.setattr(bench, "CGROUP_ROOT", tmp_path / "none")
    assert isinstance(bench.make_throttle(4321, bench.parse_args([])), bench.DutyCycle)  # auto: the fallback
    with pytest.raises(SystemExit) as exited:
        bench.parse_args(["--throttle", "cgroup"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--throttle cgroup: no writable cgroup CPU controller" in err[-1]
    v1 = tree(tmp_path / "v1", {"cpu/cpu.cfs_quota_us": "-1", "cpu/cgroup.procs": ""})
    monkeypatch.setattr(bench, "CGROUP_ROOT", v1)
    assert isinstance(bench.make_throttle(4321, bench.parse_args(["--throttle", "stop"])), bench.DutyCycle)
    quota = bench.make_throttle(4321, bench.parse_args(["--stopped", "0.5"]))
    assert isinstance(quota, bench.CgroupQuota) and quota.started_at is None
    quota.start()  # on the fake tree: the files a real cgroup would get
    assert (quota.path / "cpu.cfs_quota_us").read_text() == "5000" and (quota.path / "cgroup.procs").read_text() == "4321"
    assert quota.path.parent == v1 / "cpu" and quota.started_at is not None


def test_a_cgroup_that_cannot_be_made_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    bench = slow_rank()
    layout = bench.CgroupLayout(1, tmp_path / "gone")  # its parent does not exist: mkdir fails
    with pytest.raises(SystemExit, match="cannot throttle by a cgroup CPU quota .*--throttle stop"):
        bench.CgroupQuota(4321, 0.5, layout).start()
