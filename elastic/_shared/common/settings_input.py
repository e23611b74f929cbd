"""Settings given as data, read as one flat mapping of names to values.

A training script may hold its settings in an argparse namespace, in a mapping (a dict, a section of
a TOML or YAML file, hydra's or OmegaConf's `DictConfig`) or in a dataclass instance. `as_settings`
reads any of them the same way, so the runtime takes its settings from whatever the script has:

    elastic.Run.from_args(cfg.runtime)          # a hydra/OmegaConf section, a dict, a dataclass, a namespace

Invariants:
- Nothing is imported to recognise a source: a `DictConfig` is a `collections.abc.Mapping`, duck-typed.
- A key reads with dashes as underscores (`ckpt-dir` in a YAML file is `ckpt_dir`); a key that is
  not text is no setting and is skipped.
- A source of any other kind is a `UsageError`, one line naming its type.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from elastic._shared.common.errors import UsageError


def as_settings(source: Any) -> dict[str, Any]:
    """`source`'s names and values (see the module docstring)."""
    if isinstance(source, argparse.Namespace):
        items: Any = vars(source).items()
    elif isinstance(source, Mapping):
        items = source.items()
    elif dataclasses.is_dataclass(source) and not isinstance(source, type):
        items = ((field.name, getattr(source, field.name)) for field in dataclasses.fields(source))
    else:
        raise UsageError(f"settings come as an argparse namespace, a mapping (a dict, a config file's section, a "
                         f"hydra DictConfig) or a dataclass instance, not a {type(source).__name__}")
    return {key.replace("-", "_"): value for key, value in items if isinstance(key, str)}


def read_value(parse: Callable[[str], Any], value: Any, problem: str | None) -> Any:
    """`value` as a flag's `parse` reads it when it is text (a config file's "50", "auto"); other values as they
    are. Text `parse` refuses is `UsageError(problem)`, one line, or, with `problem` None, left as it is (for the
    setting's own check to refuse)."""
    if not isinstance(value, str):
        return value
    try:
        return parse(value)
    except (argparse.ArgumentTypeError, ValueError):
        if problem is None:
            return value
        raise UsageError(problem) from None
