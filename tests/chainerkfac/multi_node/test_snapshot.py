"""Per-rank snapshots: n steps, save, rebuild, load, m steps == n + m steps.

Each rank saves its own model and optimizer (the factors and inverses of
the blocks it owns) to its own npz file.
"""
import os
import shutil
import tempfile

import pytest

import chainer

from tests.chainerkfac.multi_node import common

pytestmark = pytest.mark.mpi

# A refreshed every 2 steps, G every 3: the resumed steps reuse the
# restored inverses before refreshing them.
OPTIONS = dict(refresh_interval_a=2, refresh_interval_g=3,
               refresh_interval_f=2, bn_fisher='full')
N, M = 3, 3


@pytest.fixture
def shared_dir():
    """One temporary directory, the same path on every rank."""
    path = common.world.bcast(tempfile.mkdtemp() if common.world.rank == 0
                              else None)
    yield path
    common.world.Barrier()
    if common.world.rank == 0:
        shutil.rmtree(path)


def _files(directory, rank):
    return (os.path.join(directory, 'model_rank{}.npz'.format(rank)),
            os.path.join(directory, 'optimizer_rank{}.npz'.format(rank)))


def test_resume_equals_uninterrupted_run(shared_dir):
    comm = common.naive('float64')
    model, optimizer = common.distributed(comm, **OPTIONS)
    common.train_distributed(model, optimizer, comm, N)
    model_file, optimizer_file = _files(shared_dir, comm.rank)
    chainer.serializers.save_npz(model_file, model)
    chainer.serializers.save_npz(optimizer_file, optimizer)
    common.train_distributed(model, optimizer, comm, M, first_step=N)
    uninterrupted = common.params(model)

    # A new process would build everything afresh (other initial values).
    resumed_model, resumed = common.distributed(comm, seed=42, **OPTIONS)
    chainer.serializers.load_npz(model_file, resumed_model)
    chainer.serializers.load_npz(optimizer_file, resumed)
    common.train_distributed(resumed_model, resumed, comm, M, first_step=N)
    diff = common.max_relative_diff(common.params(resumed_model),
                                    uninterrupted)
    common.assert_everywhere(resumed.t == N + M and diff < 1e-12,
                             'resumed run matches (diff {})'.format(diff))


@pytest.mark.skipif(common.world.size < 2,
                    reason='needs a snapshot of several ranks')
def test_resume_on_fewer_ranks_refreshes_every_factor(shared_dir):
    comm = common.naive('float64')
    model, optimizer = common.distributed(comm, **OPTIONS)
    common.train_distributed(model, optimizer, comm, N)
    model_file, optimizer_file = _files(shared_dir, comm.rank)
    chainer.serializers.save_npz(model_file, model)
    chainer.serializers.save_npz(optimizer_file, optimizer)

    # Each rank resumes alone from its shard, which lacks some factors.
    alone = comm.split(comm.rank, 0)
    resumed_model, resumed = common.distributed(alone, **OPTIONS)
    chainer.serializers.load_npz(model_file, resumed_model)
    chainer.serializers.load_npz(optimizer_file, resumed)
    common.train_distributed(resumed_model, resumed, alone, 1, first_step=N)
    common.assert_everywhere(
        all(b.has_inverses() for b in resumed.blocks) and
        resumed.last_refresh == {'A': N, 'G': N, 'F': N},
        'every factor refreshed after resuming')
