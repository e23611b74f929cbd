"""The torch the package declares is the torch that is tested: a range with an upper bound, holding the
installed release, the test extra's pin and the release README.md names. A torch outside it was never
run against this code (its collectives, DCP and DTensor change between releases), so nothing may
install one silently."""

from __future__ import annotations

import importlib.metadata
import re

import tomllib
from packaging.requirements import Requirement
from packaging.version import Version
from support import REPO

UPPER = {"<", "<=", "==", "~=", "==="}
"""The operators that bound a range from above."""


def torch_requirement(entries: list[str]) -> Requirement:
    (found,) = [Requirement(entry) for entry in entries if Requirement(entry).name == "torch"]
    return found


def project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_the_torch_dependency_is_a_range_with_an_upper_bound() -> None:
    specifier = torch_requirement(project()["dependencies"]).specifier
    assert any(spec.operator in UPPER for spec in specifier), f"torch{specifier} has no upper bound"
    assert any(spec.operator in {">=", ">", "==", "~=", "==="} for spec in specifier), f"torch{specifier} has no lower bound"


def test_the_installed_torch_and_the_test_pin_lie_in_the_range() -> None:
    specifier = torch_requirement(project()["dependencies"]).specifier
    installed = Version(importlib.metadata.version("torch"))
    assert specifier.contains(installed, prereleases=True), f"torch {installed} is installed, the package declares torch{specifier}"
    pinned = torch_requirement(project()["optional-dependencies"]["test"]).specifier
    (pin,) = [spec.version for spec in pinned if spec.operator == "=="]
    assert specifier.contains(pin), f"the test extra pins torch {pin}, outside torch{specifier}"


def test_the_readme_names_a_torch_in_the_range() -> None:
    specifier = torch_requirement(project()["dependencies"]).specifier
    named = re.findall(r"installs torch (\d+\.\d+(?:\.\d+)?)", (REPO / "README.md").read_text())
    assert named, "README.md's quick start names the torch it installs"
    assert all(specifier.contains(version) for version in named), f"README.md names torch {named}, outside torch{specifier}"
