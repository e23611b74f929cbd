"""Both checkpoint stores implement `CheckpointStorage`, method by method and parameter by parameter:
the interface the savers, the restore, the keeper and the tools hold is declared once and kept. A public
method added to one store and not to the other fails here until it is declared (or named as one store's own)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from memory_objects import MemoryObjects

from elastic._shared.storage import location
from elastic._shared.storage.checkpoint_storage import CheckpointStorage
from elastic._shared.storage.directory import CheckpointStore
from elastic._shared.storage.object_store.bucket import BucketStore

INTERFACE = {name: member for name, member in vars(CheckpointStorage).items()
             if callable(member) and not name.startswith("_")}
PROPERTIES = {name for name, member in vars(CheckpointStorage).items() if isinstance(member, property)}
ONLY_DIRECTORY = {"commit"}
"""A format-1 commit from whole files (tools and tests make such checkpoints; no bucket holds one)."""
ONLY_BUCKET = {"check_may_commit", "retire_old", "mark_checked", "was_checked", "forget"}
"""What the bucket's retention (object_store/bucket_retention.py) calls back; a directory's is retention.py's."""


def shape(function: object) -> list[tuple[str, inspect._ParameterKind, bool]]:
    """Each parameter's name, kind and whether it has a default (what a caller relies on)."""
    return [(p.name, p.kind, p.default is not inspect.Parameter.empty)
            for p in inspect.signature(function).parameters.values()]  # type: ignore[arg-type]


def public_methods(store: type) -> set[str]:
    """The public methods of `store`, its own and those it inherits (a reader base class's)."""
    return {name for name in dir(store) if not name.startswith("_") and callable(getattr(store, name))}


def test_the_interface_names_what_both_stores_share() -> None:
    assert len(INTERFACE) == 24
    shared = public_methods(CheckpointStore) & public_methods(BucketStore)
    assert set(INTERFACE) == shared


@pytest.mark.parametrize(("store", "own"), [(CheckpointStore, ONLY_DIRECTORY), (BucketStore, ONLY_BUCKET)])
def test_each_store_has_no_public_method_the_interface_does_not_declare(store: type, own: set[str]) -> None:
    assert public_methods(store) - set(INTERFACE) == own, store.__name__


@pytest.mark.parametrize("store", [CheckpointStore, BucketStore])
@pytest.mark.parametrize("name", sorted(INTERFACE))
def test_each_store_takes_each_method_as_the_interface_declares_it(store: type, name: str) -> None:
    declared, implemented = shape(INTERFACE[name]), shape(getattr(store, name))
    # The stage's parameter is `tmp` (a directory) or `stage` (a bucket): the same place, named for what it is.
    renamed = [("stage" if p == "tmp" else p, kind, default) for p, kind, default in implemented]
    assert renamed == declared, f"{store.__name__}.{name}"


def test_each_store_has_the_root_callers_name_it_by(tmp_path: Path) -> None:
    assert PROPERTIES == {"root"}
    directory = CheckpointStore(tmp_path)
    bucket = BucketStore(location.parse_bucket("s3://bucket1/runs/a"), MemoryObjects())
    # What the savers and the restore do with it: a checkpoint's place in a message, the store named alike on every node.
    assert str(directory.root / "step_00000001") == str(tmp_path / "step_00000001")
    assert str(bucket.root / "step_00000001") == "s3://bucket1/runs/a/step_00000001"
    assert directory.root.resolve() == tmp_path.resolve() and bucket.root.resolve() == bucket.root
