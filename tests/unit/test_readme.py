"""The README's quick start and CI must not drift apart."""

from __future__ import annotations

import re

from support import REPO


def quick_start_commands() -> list[str]:
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sh\n(.*?)\n```", section, flags=re.S)


def test_quick_start_is_exactly_two_commands() -> None:
    commands = quick_start_commands()
    assert len(commands) == 2 and all("\n" not in c for c in commands)
    run_job, run_tests = commands
    assert "--nnodes=1:4" in run_job and "--rdzv-backend=c10d" in run_job and "recipes/gpt.py" in run_job
    assert "pytest" in run_tests and "etcd-server" in run_tests


def test_ci_runs_the_readme_test_command() -> None:
    ci_lines = (REPO / ".ci" / "run").read_text().splitlines()
    assert quick_start_commands()[1] in ci_lines


def test_every_metric_is_listed_and_the_pictured_run_is_committed() -> None:
    from elastic.metrics import METRICS, PREFIX

    readme = (REPO / "README.md").read_text()
    section = readme.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `(\w+)` \| (\w+) \|", section, flags=re.M))
    assert listed == {(f"{PREFIX}_{name}", kind) for name, (kind, _) in METRICS.items()}
    for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", readme):
        assert (REPO / image).read_bytes().startswith(b"\x89PNG"), image
