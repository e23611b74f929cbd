"""Both checkpoint stores implement `CheckpointStorage`, method by method and parameter by parameter:
the interface the savers, the restore, the keeper and the tools hold is declared once and kept."""

from __future__ import annotations

import inspect

import pytest

from elastic._shared.storage.checkpoint_storage import CheckpointStorage
from elastic._shared.storage.directory import CheckpointStore
from elastic._shared.storage.object_store.bucket import BucketStore

INTERFACE = {name: member for name, member in vars(CheckpointStorage).items()
             if callable(member) and not name.startswith("_")}


def shape(function: object) -> list[tuple[str, inspect._ParameterKind, bool]]:
    """Each parameter's name, kind and whether it has a default (what a caller relies on)."""
    return [(p.name, p.kind, p.default is not inspect.Parameter.empty)
            for p in inspect.signature(function).parameters.values()]  # type: ignore[arg-type]


def test_the_interface_names_what_both_stores_share() -> None:
    assert len(INTERFACE) == 22
    shared = {name for name in vars(CheckpointStore) if callable(getattr(CheckpointStore, name)) and not name.startswith("_")}
    shared &= {name for name in vars(BucketStore) if callable(getattr(BucketStore, name)) and not name.startswith("_")}
    assert set(INTERFACE) == shared - {"chunk_source", "part_sink"}  # the sharded writer's, not a store's verbs


@pytest.mark.parametrize("store", [CheckpointStore, BucketStore])
@pytest.mark.parametrize("name", sorted(INTERFACE))
def test_each_store_takes_each_method_as_the_interface_declares_it(store: type, name: str) -> None:
    declared, implemented = shape(INTERFACE[name]), shape(getattr(store, name))
    # The stage's parameter is `tmp` (a directory) or `stage` (a bucket): the same place, named for what it is.
    renamed = [("stage" if p == "tmp" else p, kind, default) for p, kind, default in implemented]
    assert renamed == declared, f"{store.__name__}.{name}"
