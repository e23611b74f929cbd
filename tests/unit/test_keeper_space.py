"""Room for replicas in flight (launcher/keeper_space.py): each upload reserves its length first."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from elastic._agent.launcher.keeper_space import UploadSpace

TOTAL = 1000


class Disk:
    """A file system of 1000 bytes the test fills."""

    def __init__(self, used: int) -> None:
        self.used = used

    def __call__(self, path: Path) -> shutil._ntuple_diskusage:
        return shutil._ntuple_diskusage(TOTAL, self.used, TOTAL - self.used)


def test_uploads_in_flight_together_cannot_fill_the_reserve(tmp_path: Path) -> None:
    disk = Disk(used=500)
    space = UploadSpace(tmp_path, 0.10, usage=disk)
    # 500 free, 100 must stay free: one upload of 300 fits, two at once do not.
    with space.reserve(300) as first:
        with pytest.raises(OSError, match="promised to uploads in flight"), space.reserve(300):
            pass
        disk.used += 200  # it wrote 200 of its bytes: they show in the free space, no longer in the reservation
        first.wrote(200)
        assert space.reserved == 100
        with pytest.raises(OSError):
            space.reserve(300).__enter__()
        with space.reserve(100):  # 300 free - 100 still promised - 100 >= the reserve
            assert space.reserved == 200
    assert space.reserved == 0


def test_a_failed_upload_releases_what_it_reserved(tmp_path: Path) -> None:
    space = UploadSpace(tmp_path, 0.10, usage=Disk(used=500))
    with pytest.raises(ValueError), space.reserve(300):
        raise ValueError("the part ended early")
    assert space.reserved == 0
    with space.reserve(300):
        pass
