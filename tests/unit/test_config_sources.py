"""The runtime's settings from what a script has: argparse's namespace, a mapping (a dict, a config file's
section, a hydra/OmegaConf DictConfig), a dataclass; the same rules and one-line errors as the flags, and
`--ckpt-every` in steps or epochs. hydra and OmegaConf are not dependencies: a DictConfig is a Mapping,
which a Mapping of the test's own stands in for."""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

import elastic
from elastic._shared.common.errors import UsageError
from elastic._worker.config import ArgumentParser, RunConfig


class DictConfigLike(Mapping):
    """What a DictConfig offers a reader: a Mapping whose values are resolved when read."""

    def __init__(self, **values: Any) -> None:
        self._values = values

    def __getitem__(self, key: str) -> Any:
        value = self._values[key]
        return value() if callable(value) else value  # an interpolation resolved on access

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


TOML = """
[model]
hidden = 128

[train]
lr = 3e-4
epochs = 10
seed = 7
ckpt_dir = "runs/ckpt"
ckpt-every = "2 epochs"
snapshot_every = "auto"
collective_timeout = 120
device = "cpu"
"""


def test_a_toml_section_a_dataclass_a_mapping_and_a_namespace_give_the_same_settings() -> None:
    section = tomllib.loads(TOML)["train"]
    from_toml = RunConfig.from_args(section)
    assert (from_toml.seed, from_toml.ckpt_dir, from_toml.ckpt_every, from_toml.collective_timeout) == (7, "runs/ckpt", "2e", 120)
    assert from_toml.ckpt_every_epochs == 2 and from_toml.ckpt_every_steps == 0

    @dataclasses.dataclass
    class Train:  # a script's own settings dataclass, the runtime's names among them
        lr: float = 3e-4
        seed: int = 7
        ckpt_dir: str = "runs/ckpt"
        ckpt_every: str = "2e"
        collective_timeout: float = 120
        device: str = "cpu"

    assert RunConfig.from_args(Train()) == from_toml
    assert RunConfig.from_args(DictConfigLike(seed=lambda: 7, ckpt_dir="runs/ckpt", ckpt_every="2e", lr=0.1,
                                              collective_timeout=120, device="cpu", model=DictConfigLike(hidden=3))) == from_toml
    namespace = ArgumentParser().parse_args(["--seed", "7", "--ckpt-dir", "runs/ckpt", "--ckpt-every", "2e",
                                             "--collective-timeout", "120", "--device", "cpu"])
    assert RunConfig.from_args(namespace) == from_toml
    with elastic.Run.from_args(section) as run:  # the front door takes the same
        assert run.config == from_toml


@pytest.mark.parametrize(("given", "message"), [
    ({"seed": "seven"}, "seed='seven' must be 0 or more"),
    ({"ckpt_every": "0e"}, "ckpt_every='0e' must be a number of steps, 0 or more, or of epochs"),
    ({"ckpt_every": -3}, "ckpt_every=-3 must be a number of steps"),
    ({"device": "tpu"}, "device='tpu' is not one of auto, cpu, cuda"),
    ({"collective_timeout": "soon"}, "collective_timeout must be above 0"),
])
def test_a_bad_value_in_a_config_is_the_flags_one_line(given: dict, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        RunConfig.from_args(given)


def test_keywords_are_checked_and_an_unknown_one_is_one_line() -> None:
    with pytest.raises(UsageError, match="no runtime setting named ckpt_dri; they are: seed, ckpt_dir"):
        elastic.Run(ckpt_dri="x")
    assert elastic.Run(ckpt_every="3 epochs").config.ckpt_every == "3e"
    with pytest.raises(UsageError, match="not a list"):
        RunConfig.from_args(["--seed", "1"])


def test_the_ckpt_every_flag_takes_steps_or_epochs_and_refuses_the_rest_in_one_line(capsys) -> None:
    parser = ArgumentParser(prog="train.py")
    assert [parser.parse_args(["--ckpt-every", v]).ckpt_every for v in ("50", "0", "2e", "1epoch", "3epochs")] == [
        50, 0, "2e", "1e", "3e"]
    for bad in ("0e", "2.5e", "-1", "e"):
        with pytest.raises(SystemExit) as exited:
            parser.parse_args(["--ckpt-every", bad])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "is not a number of steps (0 or more) or of epochs (2e)" in err, err
    assert isinstance(parser, argparse.ArgumentParser)


def test_every_setting_declares_its_rule_and_section_beside_it_and_help_groups_them() -> None:
    """One source per setting: its field holds its default, its rule and its section (issue 53); `--help`
    shows the runtime flags in those sections."""
    from dataclasses import fields

    from elastic._worker.config import SECTIONS, ArgumentParser, RunConfig, sections

    for spec in fields(RunConfig):
        assert spec.metadata["section"] in SECTIONS and spec.metadata["rule"].holds(spec.default), spec.name
    assert list(sections()) == list(SECTIONS)
    text = ArgumentParser(prog="train.py").format_help()
    places = [text.index(f"runtime: {section}:") for section in SECTIONS]
    assert places == sorted(places)
    assert places[1] < text.index("\n  --ckpt-every") < places[2] and text.index("\n  --slow-factor") > places[-1]
