"""Fixtures of the distributed tests."""
import shutil
import tempfile

import pytest

from tests.chainerkfac.multi_node import common


@pytest.fixture
def shared_dir():
    """One temporary directory, the same path on every rank."""
    path = common.world.bcast(tempfile.mkdtemp() if common.world.rank == 0
                              else None)
    yield path
    common.world.Barrier()
    if common.world.rank == 0:
        shutil.rmtree(path)
