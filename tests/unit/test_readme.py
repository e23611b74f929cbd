"""The README and docs/ must not drift from CI, the code or each other."""

from __future__ import annotations

import re
from pathlib import Path

from support import REPO

DOCS = REPO / "docs"
METRICS_PAGE = DOCS / "metrics.md"
REFERENCE_PAGE = DOCS / "reference.md"


def pages() -> list[Path]:
    """README.md and every page under docs/."""
    return [REPO / "README.md", *sorted(DOCS.glob("*.md"))]


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
    from elastic._worker.observe.metrics import METRICS, PREFIX

    page = METRICS_PAGE.read_text()
    section = page.split("\n## Prometheus metrics\n", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `(\w+)` \| (\w+) \|", section, flags=re.M))
    assert listed == {(f"{PREFIX}_{name}", kind) for name, (kind, _) in METRICS.items()}
    assert images(METRICS_PAGE), "the metrics page shows the picture of a real run"
    for path in pages():
        for image in images(path):
            assert (path.parent / image).read_bytes().startswith(b"\x89PNG"), f"{path.name}: {image}"


# --- links between README.md and docs/ ------------------------------------------------

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", flags=re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", flags=re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def prose(text: str) -> str:
    """The text without fenced code blocks and code spans, where brackets are not links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def links(path: Path) -> list[str]:
    return LINK.findall(prose(path.read_text()))


def images(path: Path) -> list[str]:
    return IMAGE.findall(prose(path.read_text()))


def is_relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target, flags=re.I) and not target.startswith("//")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: rendered text, lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in FENCE.sub("", path.read_text()).splitlines():
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            base = slug(heading.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def test_slugs_follow_github() -> None:
    assert slug("Checkpoints, resume and preemption") == "checkpoints-resume-and-preemption"
    assert slug("Rendezvous on etcd (`--rdzv-backend=etcd-v3`)") == "rendezvous-on-etcd---rdzv-backendetcd-v3"
    assert slug("The CIFAR-10 recipe (`recipes/cifar.py`)") == "the-cifar-10-recipe-recipescifarpy"
    assert slug("Modules of `elastic/`") == "modules-of-elastic"


def test_the_link_finder_sees_links_and_skips_code() -> None:
    text = "[a](x.md) ![p](f.png) `[no](y.md)`\n```sh\n[no](z.md)\n```\n[b](w.md#h \"title\")\n"
    assert LINK.findall(prose(text)) == ["x.md", "f.png", "w.md#h"]
    assert IMAGE.findall(prose(text)) == ["f.png"]


def test_every_relative_link_resolves() -> None:
    broken = []
    checked = 0
    for path in pages():
        for target in links(path):
            if not is_relative(target):
                continue
            checked += 1
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                broken.append(f"{path.relative_to(REPO)}: {target} (no such file)")
            elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
                broken.append(f"{path.relative_to(REPO)}: {target} (no heading #{anchor})")
    assert checked > 0
    assert not broken, "\n".join(broken)


def test_readme_links_every_docs_page_and_each_page_links_back() -> None:
    docs = sorted(DOCS.glob("*.md"))
    assert docs
    readme_targets = {target.partition("#")[0] for target in links(REPO / "README.md")}
    for page in docs:
        assert f"docs/{page.name}" in readme_targets, f"README.md does not link docs/{page.name}"
        title, summary = page.read_text().split("\n\n", 2)[:2]
        assert title.startswith("# ") and "\n" not in title, f"{page.name} starts with its title"
        assert "](../README.md)" in summary, f"{page.name}'s opening summary links back to the README"


def test_the_flag_table_is_runconfigs() -> None:
    """docs/reference.md's table of the runtime flags is the one `RunConfig` makes, and the
    parser's flags are exactly `RunConfig`'s fields with its defaults."""
    import argparse
    from dataclasses import fields

    from elastic._worker.config import RunConfig, add_runtime_arguments, flag_table

    page = REFERENCE_PAGE.read_text()
    assert flag_table() in page, "regenerate the table: python -c 'import elastic._worker.config as c; print(c.flag_table())'"
    parser = argparse.ArgumentParser()
    add_runtime_arguments(parser)
    defaults = vars(parser.parse_args([]))
    assert defaults == {f.name: f.default for f in fields(RunConfig)}
    assert RunConfig.from_args(parser.parse_args([])) == RunConfig()
    import elastic

    assert vars(elastic.ArgumentParser().parse_args([])) == defaults


def test_the_launcher_tables_are_its_settings() -> None:
    """docs/reference.md's tables of torchrevive-run's settings and of its internal variables are the ones
    `elastic._agent.launcher.settings` makes."""
    from elastic._agent.launcher import settings

    page = REFERENCE_PAGE.read_text()
    regenerate = "regenerate the table: python -c 'import elastic._agent.launcher.settings as s; print(s.{}())'"
    assert settings.flag_table() in page, regenerate.format("flag_table")
    assert settings.internal_table() in page, regenerate.format("internal_table")


def test_the_event_table_is_every_event_kind() -> None:
    """docs/reference.md's table of events lists exactly the kinds the event log accepts, each once."""
    from elastic._worker.observe.events import EVENT_KINDS

    section = REFERENCE_PAGE.read_text().split("\n## Events\n", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `(\w+)` \|", section, flags=re.M)
    assert len(listed) == len(set(listed)), "an event listed twice"
    assert set(listed) == set(EVENT_KINDS)
