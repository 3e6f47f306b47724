"""Per-rank snapshots: n steps, save, rebuild, load, m steps == n + m steps.

Each rank saves its own model and optimizer (the factors and inverses of
the blocks it owns) to its own npz file.
"""
import os

import pytest

import chainer

from tests.chainerkfac import helpers
from tests.chainerkfac.multi_node import common

pytestmark = pytest.mark.mpi

# A refreshed every 2 steps, G every 3: the resumed steps reuse the
# restored inverses before refreshing them.
OPTIONS = dict(refresh_interval_a=2, refresh_interval_g=3,
               refresh_interval_f=2, bn_fisher='full')
N, M = 3, 3


def _train_and_save(shared_dir):
    """N distributed steps, then every rank saves its model and optimizer
    (its own files)."""
    comm = common.naive('float64')
    model, optimizer = common.distributed(comm, **OPTIONS)
    common.train_distributed(model, optimizer, comm, N)
    model_file, optimizer_file = _files(shared_dir, comm.rank)
    chainer.serializers.save_npz(model_file, model)
    chainer.serializers.save_npz(optimizer_file, optimizer)
    return comm, model, optimizer, model_file, optimizer_file


def _files(directory, rank):
    return (os.path.join(directory, 'model_rank{}.npz'.format(rank)),
            os.path.join(directory, 'optimizer_rank{}.npz'.format(rank)))


def test_resume_equals_uninterrupted_run(shared_dir):
    comm, model, optimizer, model_file, optimizer_file = \
        _train_and_save(shared_dir)
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
def test_resume_from_one_shard_refreshes_the_missing_factors(shared_dir):
    comm, model, optimizer, model_file, optimizer_file = \
        _train_and_save(shared_dir)
    held = {b.name: set(b.factors) for b in optimizer.blocks}

    # Each rank resumes alone from its own shard only: it lacks the
    # factors of the blocks other ranks owned.
    alone = comm.split(comm.rank, 0)
    resumed_model, resumed = common.distributed(alone, **OPTIONS)
    chainer.serializers.load_npz(model_file, resumed_model)
    chainer.serializers.load_npz(optimizer_file, resumed)
    common.train_distributed(resumed_model, resumed, alone, 1, first_step=N)
    lacking_refreshed = all(
        b.last_refresh[n] == N for b in resumed.blocks
        for n in b.factor_names if n not in held[b.name])
    common.assert_everywhere(
        all(b.has_inverses() for b in resumed.blocks) and lacking_refreshed
        and any(n not in held[b.name] for b in resumed.blocks
                for n in b.factor_names),
        'missing factors refreshed after resuming')


@pytest.mark.skipif(common.world.size < 2,
                    reason='needs a snapshot of several ranks')
def test_rank_0s_file_loaded_everywhere_is_named_with_the_fix(shared_dir,
                                                                caplog):
    """ChainerMN's ``multi_node_snapshot`` with ``replica_sets=[]`` loads
    rank 0's file on every process: the others lack their blocks'
    factors. The warning asked about "another number of processes"; it now
    names this case and ``replica_sets=[[r] for r in range(comm.size)]``
    (the factors are still refreshed, as before)."""
    import logging
    comm, model, optimizer, _, _ = _train_and_save(shared_dir)
    comm.mpi_comm.Barrier()         # rank 0's files written: all read them
    resumed_model, resumed = common.distributed(comm, **OPTIONS)
    model_file, optimizer_file = _files(shared_dir, 0)
    chainer.serializers.load_npz(model_file, resumed_model)
    chainer.serializers.load_npz(optimizer_file, resumed)
    with caplog.at_level(logging.WARNING, logger='chainerkfac'):
        common.train_distributed(resumed_model, resumed, comm, 1,
                                 first_step=N)
    said = [r.getMessage() for r in caplog.records
            if 'restored state lacks' in r.getMessage()]
    ok = len(said) == 1 and "another process's file loaded" in \
        said[0] and 'replica_sets=[[r] for r in range(comm.size)]' in said[0]
    common.assert_everywhere(ok if comm.rank == 0 else not said,
                             'the warning {}'.format(said))


@pytest.mark.skipif(common.world.size < 2,
                    reason='elastic resume needs several ranks')
def test_elastic_resume_on_one_process_equals_uninterrupted(shared_dir):
    """P ranks for N steps, then one process (acc_iters=P) loading every
    rank's file continues as the P-rank run does."""
    comm, model, optimizer, model_file, optimizer_file = \
        _train_and_save(shared_dir)
    comm.mpi_comm.Barrier()
    common.train_distributed(model, optimizer, comm, M, first_step=N)
    uninterrupted = common.params(model)

    resumed_model, resumed = common.single(seed=7, acc_iters=comm.size,
                                           **OPTIONS)
    chainer.serializers.load_npz(model_file, resumed_model)
    for rank in range(comm.size):
        chainer.serializers.load_npz(_files(shared_dir, rank)[1], resumed,
                                     strict=False)
    assert all(set(b.factors) == set(b.factor_names)
               for b in resumed.blocks if b.factor_names)
    common.train_single(resumed_model, resumed, comm.size, M, first_step=N)
    diff = common.max_relative_diff(common.params(resumed_model),
                                    uninterrupted)
    common.assert_everywhere(resumed.t == N + M and diff < 1e-9,
                             'elastic P -> 1 (diff {})'.format(diff))


@pytest.mark.skipif(common.world.size < 2,
                    reason='elastic resume needs several ranks')
def test_elastic_resume_on_more_processes_equals_uninterrupted(shared_dir):
    """One process (acc_iters=P) for N steps, then P ranks loading its
    file continue as the one process does; each rank keeps only the
    factors of the blocks it owns."""
    comm = common.naive('float64')
    single_model, single_opt = common.single(acc_iters=comm.size, **OPTIONS)
    common.train_single(single_model, single_opt, comm.size, N)
    model_file, optimizer_file = _files(shared_dir, 0)
    if comm.rank == 0:
        chainer.serializers.save_npz(model_file, single_model)
        chainer.serializers.save_npz(optimizer_file, single_opt)
    comm.mpi_comm.Barrier()
    common.train_single(single_model, single_opt, comm.size, M, first_step=N)

    model, optimizer = common.distributed(comm, seed=3, **OPTIONS)
    chainer.serializers.load_npz(model_file, model)
    chainer.serializers.load_npz(optimizer_file, optimizer)
    common.train_distributed(model, optimizer, comm, M, first_step=N)
    diff = common.max_relative_diff(common.params(model),
                                    common.params(single_model))
    owned_only = all(not b.factors for b in optimizer.blocks
                     if not optimizer.transport.owns(b))
    common.assert_everywhere(optimizer.t == N + M and diff < 1e-9 and
                             owned_only,
                             'elastic 1 -> P (diff {})'.format(diff))


@pytest.mark.parametrize('kind', ['kfac', 'kfac-sharded', 'guarded',
                                  'guarded-sharded'])
def test_resume_inside_a_step_equals_uninterrupted_run(shared_dir, kind):
    """Per-rank files saved after 1 of 2 micro-batches (a Trainer's
    snapshot at an iteration that ends no step) hold each process's step
    so far: the resumed processes finish it, and the run equals the
    uninterrupted one bit for bit (float64; it dropped the micro-batch)."""
    from chainerkfac.optimizers import GuardedOptimizer
    comm = common.naive('float64')
    shard = kind.endswith('sharded')
    options = dict(OPTIONS, acc_iters=2, shard_update=shard)
    micro = [(step, j) for step in range(3) for j in range(2)]

    def make(seed=0):
        if kind.startswith('kfac'):
            return common.distributed(comm, seed=seed, **options)
        model = common.ConvBNNet(seed=seed + comm.rank)
        optimizer = GuardedOptimizer(chainer.optimizers.MomentumSGD(0.05),
                                     2, comm, shard_update=shard)
        optimizer.setup(model)
        return model, optimizer

    def train(model, optimizer, part):
        for step, j in part:
            batch = common.chunks(step, comm.size * 2, 0, model.in_shape)
            optimizer.update(helpers.loss_of(model),
                             *batch[comm.rank * 2 + j])
    model, optimizer = make()
    train(model, optimizer, micro[:3])
    model_file, optimizer_file = _files(shared_dir, comm.rank)
    chainer.serializers.save_npz(model_file, model)
    chainer.serializers.save_npz(optimizer_file, optimizer)
    train(model, optimizer, micro[3:])
    uninterrupted = common.params(model)

    resumed_model, resumed = make(seed=42)
    chainer.serializers.load_npz(optimizer_file, resumed)
    chainer.serializers.load_npz(model_file, resumed_model)
    pending = resumed.pending_micro_batches
    train(resumed_model, resumed, micro[3:])
    diff = common.max_relative_diff(common.params(resumed_model),
                                    uninterrupted)
    common.assert_everywhere(pending == 1 and resumed.t == 3 and diff == 0,
                             'resumed inside a step: pending {}, t {}, '
                             'diff {}'.format(pending, resumed.t, diff))
