"""The docs stay short enough to read and speak the user's words (issue 57).

Sizes: README.md at most 12,000 characters, every page of docs/ at most 15 KB, docs/ at most 150 KB
in all (1 KB = 1,000 bytes). Words: a user page (README.md and docs/, except the pages about the
package's insides) names no internal module (`elastic._...`, `elastic/_...`): flags, events,
variables and public names only.
"""

from __future__ import annotations

import re
from pathlib import Path

from support import REPO

DOCS = REPO / "docs"
README_CHARACTERS = 12_000
PAGE_BYTES = 15_000
DOCS_BYTES = 150_000
INTERNAL_PAGES = {"architecture.md", "concepts.md", "modules.md"}
"""The pages that explain the package's insides, where its module paths are the subject."""
INTERNAL_PATH = re.compile(r"\belastic[./]_\w+")


def user_pages() -> list[Path]:
    return [REPO / "README.md", *(page for page in sorted(DOCS.glob("*.md")) if page.name not in INTERNAL_PAGES)]


def generated_tables() -> list[str]:
    """Tables docs/reference.md holds as the code makes them: the default of `--preload` is a list of
    modules (the one the fork server imports), printed as `torchrevive-run --help` prints it."""
    from elastic._agent.launcher import settings

    return [settings.flag_table()]


def internal_paths(text: str) -> list[str]:
    """The lines of `text` that name an internal module."""
    for table in generated_tables():
        text = text.replace(table, "")
    return [line.strip() for line in text.splitlines() if INTERNAL_PATH.search(line)]


def test_the_readme_fits_its_budget() -> None:
    size = len((REPO / "README.md").read_text())
    assert size <= README_CHARACTERS, f"README.md is {size:,} characters, over {README_CHARACTERS:,}: cut words, link a page"


def test_every_page_and_the_docs_fit_their_budgets() -> None:
    sizes = {page.name: page.stat().st_size for page in sorted(DOCS.glob("*.md"))}
    assert sizes
    over = {name: size for name, size in sizes.items() if size > PAGE_BYTES}
    assert not over, f"pages over {PAGE_BYTES:,} bytes: {over}; split the page or say each thing once and link"
    total = sum(sizes.values())
    assert total <= DOCS_BYTES, f"docs/ holds {total:,} bytes, over {DOCS_BYTES:,}"


def test_no_user_page_names_an_internal_module() -> None:
    found = {page.name: lines for page in user_pages() if (lines := internal_paths(page.read_text()))}
    assert not found, f"user pages name internal modules (say it in the user's words, or in architecture.md): {found}"


def test_the_internal_path_finder_sees_modules_and_files_but_not_public_names() -> None:
    assert internal_paths("see elastic._worker.run.run\n`elastic/_agent/launcher/keeper.py`\n") == [
        "see elastic._worker.run.run", "`elastic/_agent/launcher/keeper.py`"]
    assert internal_paths("import elastic\nelastic.Run, elastic.hf.Trainer, python -m elastic.chaos\n") == []
