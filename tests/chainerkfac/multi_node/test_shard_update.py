"""Weight-update sharding (:mod:`chainerkfac.sharding`) under mpiexec:
sharded steps equal unsharded ones, the optimizer state lives on the
owners only, and per-rank snapshots resume on the same or another number
of processes.

Sharded against unsharded on the same processes: float64 models on a
float64 wire, so the same arithmetic up to the order of the gradient sums
(K-FAC: the same reduce-scatter; the baselines: ChainerMN's all-reduce
against a reduce-scatter) — 1e-12 relative after a few steps. Against
one process accumulating the N chunks: 1e-9 as in test_equivalence.
"""
import os
import re

import numpy
import pytest

import chainer
import chainer.functions as F

from chainerkfac import sharding
from chainerkfac.optimizers import FusedMomentumSGD, GuardedOptimizer, LARS
from tests.chainerkfac import helpers
from tests.chainerkfac.multi_node import common

pytestmark = pytest.mark.mpi

STALE = dict(refresh_interval_a=2, refresh_interval_g=1,
             refresh_interval_f=3)
SHARDED_TOLERANCE = 1e-12
STEPS = 4


def _state_of(model):
    """``{name: velocity}`` of the parameters whose rule holds one."""
    return {name: p.update_rule.state['v'].copy()
            for name, p in sorted(model.namedparams())
            if p.update_rule.state}


def _check_close(mine, ref, tolerance, what):
    # (A rank may hold none: a redundant owner updates nothing.)
    diff = common.max_relative_diff(mine, ref) if mine else 0.0
    diffs = common.gathered(diff)
    assert max(diffs) < tolerance, '{}: rank-wise max relative diff {}' \
        .format(what, diffs)


def _train_and_compare(comm, acc_iters, sharded, plain, single, moved):
    """Train the sharded, the unsharded and the one-process run
    (``(model, optimizer)`` each) for STEPS steps on the same global
    batches; the sharded weights equal the unsharded ones to
    SHARDED_TOLERANCE and the one-process ones to 1e-9, and the weights
    moved by more than ``moved``."""
    initial = common.params(single[0])
    common.train_distributed(*sharded, comm, STEPS)
    common.train_distributed(*plain, comm, STEPS)
    common.train_single(*single, comm.size * acc_iters, STEPS)
    _check_close(common.params(sharded[0]), common.params(plain[0]),
                 SHARDED_TOLERANCE, 'sharded vs unsharded')
    _check_close(common.params(sharded[0]), common.params(single[0]), 1e-9,
                 'sharded vs one process')
    common.assert_everywhere(
        common.max_relative_diff(common.params(single[0]), initial) > moved,
        'weights moved')


# -- K-FAC -------------------------------------------------------------------
@pytest.mark.parametrize('net, acc_iters', [
    (common.ConvBNNet, 1), (common.ConvBNNet, 2), (common.SmallMLP, 1)],
    ids=['convbn', 'convbn-acc2', 'mlp-redundant'])
def test_kfac_sharded_equals_unsharded(net, acc_iters):
    comm = common.naive('float64')
    sharded, optimizer = common.distributed(
        comm, net=net, acc_iters=acc_iters, shard_update=True, **STALE)
    plain, plain_optimizer = common.distributed(
        comm, net=net, acc_iters=acc_iters, **STALE)
    single, single_optimizer = common.single(
        net=net, acc_iters=acc_iters * comm.size, **STALE)
    _train_and_compare(comm, acc_iters, (sharded, optimizer),
                       (plain, plain_optimizer), (single, single_optimizer),
                       moved=1e-2)
    # Velocities: only where this rank updates the block, equal there.
    transport = optimizer.transport
    names = {id(p): n for n, p in sharded.namedparams()}
    updated = {names[id(p)] for b in optimizer.blocks
               if transport.updates(b) for p in b.params}
    held = _state_of(sharded)
    common.assert_everywhere(set(held) == updated, 'velocities of owners')
    ref = _state_of(plain)
    _check_close(held, {n: ref[n] for n in held}, SHARDED_TOLERANCE,
                 'velocities')
    counts = common.gathered(sorted(held))
    common.assert_everywhere(
        sorted(n for c in counts for n in c) == sorted(ref),
        'every velocity held once')


def _bounded_run(comm, net, shard_update, clip):
    """A K-FAC run with the bounded step (and, with ``clip``, Chainer's
    GradientHardClipping); ν of every step."""
    model, optimizer = common.distributed(
        comm, net=net, lr=0.5, kl_clip=1e-3, shard_update=shard_update,
        **STALE)
    if clip:
        optimizer.add_hook(chainer.optimizer_hooks.GradientHardClipping(
            -0.02, 0.02))
    scales = []
    for step in range(STEPS):
        common.train_distributed(model, optimizer, comm, 1, first_step=step)
        scales.append(optimizer.step_bound.scale)
    return common.params(model), scales


@pytest.mark.parametrize('net', [common.ConvBNNet, common.SmallMLP],
                         ids=['convbn', 'mlp-redundant'])
def test_kfac_sharded_bounded_step_equals_unsharded(net):
    """kl_clip on: ν is summed from every block's term (the first owners'
    partial sums over processes) before any owner updates, so the sharded
    run scales as the unsharded one; GradientHardClipping clips the
    updated blocks' directions element by element as it clips the gathered
    ones. The same arithmetic up to the gradient sums' order: 1e-12."""
    comm = common.naive('float64')
    sharded, scales = _bounded_run(comm, net, True, True)
    plain, plain_scales = _bounded_run(comm, net, False, True)
    unclipped, _ = _bounded_run(comm, net, False, False)
    common.assert_everywhere(min(plain_scales) < 0.5, 'the bound acted')
    common.assert_everywhere(
        all(abs(a - b) <= 1e-12 * b for a, b in zip(scales, plain_scales)),
        'ν: {} vs {}'.format(scales, plain_scales))
    common.assert_everywhere(
        common.max_relative_diff(plain, unclipped) > 1e-6,
        'the clipping acted')
    _check_close(sharded, plain, SHARDED_TOLERANCE, 'sharded vs unsharded')


def test_kfac_sharded_refuses_a_whole_model_clipping_hook():
    """GradientClipping needs the norm of every direction, which no
    process holds with a sharded update: every rank refuses it, naming
    it, before any weight changes."""
    comm = common.naive('float64')
    model, optimizer = common.distributed(comm, shard_update=True, **STALE)
    optimizer.add_hook(chainer.optimizer_hooks.GradientClipping(1.0))
    # Every rank starts from rank 0's weights (the transport's setup).
    before = common.gathered(common.params(model))[0]
    with pytest.raises(ValueError, match='GradientClipping.*shard_update'):
        common.train_distributed(model, optimizer, comm, 1)
    _check_close(common.params(model), before, 1e-300, 'weights unchanged')


def test_kfac_sharded_ranks_hold_identical_weights_on_a_float16_wire():
    """The weights travel at their own dtype: on a float16 wire (which
    rounds the gradients and factors) every rank still ends with the
    owners' weights bit for bit."""
    comm = common.naive('float16')
    model, optimizer = common.distributed(comm, shard_update=True, **STALE)
    common.train_distributed(model, optimizer, comm, 2)
    flat = numpy.concatenate([a.ravel() for a in
                              common.params(model).values()])
    everyone = common.gathered(flat)
    common.assert_everywhere(all(numpy.array_equal(everyone[0], f)
                                 for f in everyone), 'identical weights')


# -- the baselines -----------------------------------------------------------
def _sgd():
    optimizer = chainer.optimizers.MomentumSGD(lr=0.05, momentum=0.9)
    return optimizer


def _lars(form):
    return lambda: LARS(lr=0.5, momentum=0.9, weight_decay=1e-3, eta=0.02,
                        momentum_form=form)


BASELINES = {'momentum_sgd': _sgd, 'lars_scaled': _lars('scaled'),
             'lars_unscaled': _lars('unscaled'),
             # its update is GradientMethod.update's, fused: sharded, the
             # owners update parameter by parameter
             'fused_momentum_sgd': lambda: FusedMomentumSGD(lr=0.05,
                                                            momentum=0.9)}


def _guarded(comm, make, acc_iters, shard_update, seed=0):
    model = common.ConvBNNet(seed=seed)
    optimizer = GuardedOptimizer(make(), acc_iters, comm,
                                 shard_update=shard_update).setup(model)
    if isinstance(optimizer.actual_optimizer,
                  chainer.optimizers.MomentumSGD):
        optimizer.add_hook(chainer.optimizer_hooks.WeightDecay(1e-3))
    return model, optimizer


@pytest.mark.parametrize('name', sorted(BASELINES))
@pytest.mark.parametrize('acc_iters', [1, 2])
def test_baseline_sharded_equals_unsharded(name, acc_iters):
    comm = common.naive('float64')
    make = BASELINES[name]
    sharded, optimizer = _guarded(comm, make, acc_iters, True)
    plain, plain_optimizer = _guarded(comm, make, acc_iters, False)
    single, single_optimizer = _guarded(None, make, acc_iters * comm.size,
                                        False)
    _train_and_compare(comm, acc_iters, (sharded, optimizer),
                       (plain, plain_optimizer), (single, single_optimizer),
                       moved=1e-3)
    held = _state_of(sharded)
    everyone = common.gathered(sorted(held))
    common.assert_everywhere(
        sorted(n for names in everyone for n in names) ==
        sorted(_state_of(plain)), 'every velocity held once')
    params = [p for _, p in sorted(sharded.namedparams())]
    nbytes = common.gathered(sharding.state_nbytes(params))
    total = sharding.state_nbytes(plain.params())
    common.assert_everywhere(
        sum(nbytes) == total and
        (comm.size == 1 or max(nbytes) < total), 'state bytes divided')
    # Every rule counted every step (Adam's bias correction would need it).
    common.assert_everywhere(
        all(p.update_rule.t == STEPS for p in params), 'rule step counts')


@pytest.mark.parametrize('acc_iters', [1, 2])
def test_a_bad_lars_form_is_refused_before_the_sharded_update_moves(
        acc_iters):
    """``momentum_form`` set to a bad value after a step: the sharded path
    runs the rules itself, and LARS's check (in ``LARS.update``) did not
    run: the rules raised after ``optimizer.t`` and the owned rules' ``t``
    had advanced, differently on each rank."""
    comm = common.naive('float64')
    model, optimizer = _guarded(comm, _lars('scaled'), acc_iters, True)
    common.train_distributed(model, optimizer, comm, 1)
    lars = optimizer.actual_optimizer
    lars.momentum_form = 'bogus'
    weights = common.params(model)
    counts = {n: p.update_rule.t for n, p in model.namedparams()}
    with pytest.raises(ValueError, match="momentum_form='bogus'"):
        common.train_distributed(model, optimizer, comm, 1, first_step=1)
    assert lars.t == 1
    assert {n: p.update_rule.t for n, p in model.namedparams()} == counts
    for name, array in common.params(model).items():
        numpy.testing.assert_array_equal(array, weights[name], name)
    lars.momentum_form = 'scaled'
    optimizer.accumulator.reset()
    optimizer.pending_micro_batches = 0
    common.train_distributed(model, optimizer, comm, 1, first_step=1)
    common.assert_everywhere(lars.t == 2, 'the next step is taken')


def test_a_whole_model_hook_is_refused_with_sharding():
    comm = common.naive('float64')
    model, optimizer = _guarded(comm, _sgd, 1, True)
    optimizer.add_hook(chainer.optimizer_hooks.GradientClipping(1.0))
    x, t = common.chunks(0, comm.size)[comm.rank]
    if comm.size == 1:
        optimizer.update(helpers.loss_of(model), x, t)   # not sharded
        return
    with pytest.raises(ValueError, match='GradientClipping'):
        optimizer.update(helpers.loss_of(model), x, t)


class _Branched(chainer.Chain):
    def __init__(self):
        super().__init__()
        with helpers.float64_links(), self.init_scope():
            self.trunk = chainer.links.Linear(3, 2, initialW=0.5)
            self.branch = chainer.links.Linear(3, 2, initialW=0.5)

    def forward(self, x, use_branch):
        y = self.trunk(x)
        return F.sum(y * y) + (F.sum(self.branch(x)) if use_branch else 0)


@pytest.mark.parametrize('shard_update', [False, True])
def test_a_branch_some_processes_do_not_take_is_averaged(shard_update):
    """A parameter no loss reached on some processes: a zero there, in the
    mean. Without sharding the processes all-reduced different lists of
    gradients (ChainerMN leaves out missing ones): a hang."""
    comm = common.naive('float64')
    model = _Branched()
    optimizer = GuardedOptimizer(chainer.optimizers.SGD(lr=0.5), 1, comm,
                                 shard_update=shard_update).setup(model)
    x = numpy.ones((1, 3))
    optimizer.update(model, x, comm.rank == 0)
    # the branch's gradient is ones on rank 0 only: its mean 1 / size
    numpy.testing.assert_allclose(
        model.branch.W.array, 0.5 - 0.5 / comm.size, rtol=1e-14)
    flat = numpy.concatenate([p.array.ravel() for _, p in
                              sorted(model.namedparams())])
    everyone = common.gathered(flat)
    common.assert_everywhere(all(numpy.array_equal(everyone[0], f)
                                 for f in everyone), 'identical weights')


class _Transposable(chainer.Chain):
    """A 4×6 weight on rank 0, 6×4 elsewhere: the same element count."""

    def __init__(self, rank):
        super().__init__()
        shape = (4, 6) if rank == 0 else (6, 4)
        with helpers.float64_links(), self.init_scope():
            self.w = chainer.Parameter(numpy.ones(shape))

    def forward(self, x):
        return chainer.functions.sum(self.w * self.w) * x


@pytest.mark.parametrize('disagree', ['shard_update', 'shapes', 'acc_iters',
                                      'hooks', 'loss_scaling'])
def test_processes_that_disagree_are_refused_at_the_first_step(disagree):
    """A rank without shard_update waited in ChainerMN's all-reduce while
    the others gathered (a hang); weights of transposed shapes were
    averaged as the same array (silently); so were a scaled and an
    unscaled loss's gradients; one rank's acc_iters or its hook that the
    sharded step refuses hung the others. All are refused on every rank,
    naming what differs, before any collective of the step."""
    comm = common.naive('float64')
    if comm.size == 1:
        return
    if disagree in ('shard_update', 'acc_iters', 'hooks', 'loss_scaling'):
        odd = comm.rank == comm.size - 1
        model, optimizer = _guarded(
            comm, _sgd, 2 if disagree == 'acc_iters' and odd else 1,
            comm.rank == 0 if disagree == 'shard_update' else True)
        if disagree == 'hooks' and odd:
            optimizer.add_hook(chainer.optimizer_hooks.GradientClipping(1.0))
        if disagree == 'loss_scaling' and odd:
            optimizer.actual_optimizer.loss_scaling(scale=4.0)
        x, t = common.chunks(0, comm.size)[comm.rank]
        args = helpers.loss_of(model), x, t
        named = {'shard_update': r"shard_update: True on rank 0; False on "
                                 r"rank",
                 'acc_iters': r"acc_iters: 1 on rank",
                 'hooks': r"hooks: .*GradientClipping",
                 'loss_scaling': r"loss scaling: none on rank"}[disagree]
    else:
        model = _Transposable(comm.rank)
        optimizer = GuardedOptimizer(_sgd(), 1, comm,
                                     shard_update=True).setup(model)
        args = model, numpy.ones(())
        named = r"param /w: \(4, 6\) float64 on rank 0; \(6, 4\) float64"
    before = {n: p.array.copy() for n, p in model.namedparams()}
    with pytest.raises(ValueError, match='GuardedOptimizer: the processes '
                       'disagree on the model or the optimizer') as raised:
        for _ in range(optimizer.acc_iters):
            optimizer.update(*args)
    assert re.search(named, str(raised.value)), str(raised.value)
    for name, param in model.namedparams():
        numpy.testing.assert_array_equal(param.array, before[name])


# -- snapshots ---------------------------------------------------------------
def _file(directory, what, rank):
    return os.path.join(directory, '{}_rank{}.npz'.format(what, rank))


def _build(kind, comm, seed=0, acc_iters=1):
    """A sharded optimizer of ``kind`` over ``comm`` (None: one process)."""
    if kind == 'kfac':
        if comm is None:
            return common.single(seed=seed, acc_iters=acc_iters,
                                 shard_update=True, **STALE)
        return common.distributed(comm, seed=seed, acc_iters=acc_iters,
                                  shard_update=True, **STALE)
    return _guarded(comm, _lars('scaled'), acc_iters, True, seed=seed)


N, M = 3, 2


@pytest.mark.parametrize('kind', ['kfac', 'lars'])
def test_sharded_snapshots_resume_on_the_same_and_other_sizes(kind,
                                                             shared_dir):
    """P ranks, N steps, save per rank; then M more steps three ways: on
    (a) the same ranks from their own files, (b) one process loading every
    rank's file, (c) for the 1 -> P direction, P ranks from one process's
    file. Each equals the uninterrupted run."""
    comm = common.naive('float64')
    model, optimizer = _build(kind, comm)
    common.train_distributed(model, optimizer, comm, N)
    chainer.serializers.save_npz(_file(shared_dir, 'model', comm.rank),
                                 model)
    chainer.serializers.save_npz(_file(shared_dir, 'optimizer', comm.rank),
                                 optimizer)
    comm.mpi_comm.Barrier()
    common.train_distributed(model, optimizer, comm, M, first_step=N)
    uninterrupted = common.params(model)

    # (a) The same processes, each loading its own file as Chainer's
    # snapshot(autoload=True) does: strictly (a file lacks the velocities
    # of the parameters its process did not own; they raised KeyError).
    again, again_optimizer = _build(kind, comm, seed=42)
    chainer.serializers.load_npz(_file(shared_dir, 'model', comm.rank),
                                 again)
    chainer.serializers.load_npz(_file(shared_dir, 'optimizer', comm.rank),
                                 again_optimizer)
    common.train_distributed(again, again_optimizer, comm, M, first_step=N)
    _check_close(common.params(again), uninterrupted, SHARDED_TOLERANCE,
                 'resumed on the same ranks')

    # (b) One process, every rank's file merged.
    alone, alone_optimizer = _build(kind, None, seed=7,
                                    acc_iters=comm.size)
    chainer.serializers.load_npz(_file(shared_dir, 'model', 0), alone)
    for rank in range(comm.size):
        chainer.serializers.load_npz(_file(shared_dir, 'optimizer', rank),
                                     alone_optimizer, strict=False)
    common.assert_everywhere(
        all(p.update_rule.state for p in alone.params()),
        'every velocity merged')
    common.train_single(alone, alone_optimizer, comm.size, M, first_step=N)
    _check_close(common.params(alone), uninterrupted, 1e-9,
                 'elastic P -> 1')

    # (c) One process's snapshot (rank 0's file of (b)'s run) on P ranks:
    # each keeps the velocities it owns.
    comm.mpi_comm.Barrier()
    if comm.rank == 0:
        chainer.serializers.save_npz(_file(shared_dir, 'alone', 0),
                                     alone_optimizer)
        chainer.serializers.save_npz(_file(shared_dir, 'alone_model', 0),
                                     alone)
    comm.mpi_comm.Barrier()
    common.train_single(alone, alone_optimizer, comm.size, M,
                        first_step=N + M)
    wide, wide_optimizer = _build(kind, comm, seed=3)
    chainer.serializers.load_npz(_file(shared_dir, 'alone_model', 0), wide)
    chainer.serializers.load_npz(_file(shared_dir, 'alone', 0),
                                 wide_optimizer)
    common.train_distributed(wide, wide_optimizer, comm, M,
                             first_step=N + M)
    _check_close(common.params(wide), common.params(alone), 1e-9,
                 'elastic 1 -> P')
    held = common.gathered(sorted(_state_of(wide)))
    common.assert_everywhere(
        sorted(n for names in held for n in names) ==
        sorted(_state_of(alone)), 'velocities re-sharded, each held once')


@pytest.mark.parametrize('shard_update', [False, True])
@pytest.mark.parametrize('manual', [False, True],
                         ids=['update-lossfun', 'own-backward'])
def test_processes_seeded_apart_train_rank_0s_model(shard_update, manual):
    """Each process built its model from its own seed (a script seeded per
    rank): GuardedOptimizer with a communicator never broadcast rank 0's
    weights, and the processes trained different models (1.76 apart
    after 4 steps in an auditor's MLP); sharded, each parameter started
    from its owner's. Now every process trains rank 0's model: the steps
    of one process from rank 0's weights. With the loop's own backward,
    the first micro-batch (computed with each process's weights) is
    dropped on every process, as ChainerMN's multi-node optimizer drops
    its first update."""
    comm = common.naive('float64')
    model, optimizer = _guarded(comm, _sgd, 1, shard_update,
                                seed=comm.rank)
    single, single_optimizer = _guarded(None, _sgd, comm.size, False)
    steps = 3
    for step in range(steps):
        x, t = common.chunks(step, comm.size)[comm.rank]
        if manual:
            model.cleargrads()
            helpers.loss_of(model)(x, t).backward()
            optimizer.update()
        else:
            optimizer.update(helpers.loss_of(model), x, t)
    dropped = manual and comm.size > 1
    for step in range(1 if dropped else 0, steps):
        for x, t in common.chunks(step, comm.size):
            single_optimizer.update(helpers.loss_of(single), x, t)
    everyone = common.gathered(common.params(model))
    common.assert_everywhere(
        all(all(numpy.array_equal(everyone[0][n], w[n]) for n in w)
            for w in everyone), 'identical weights')
    diff = common.max_relative_diff(common.params(model),
                                    common.params(single))
    common.assert_everywhere(diff < 1e-9, 'rank 0 model: {}'.format(diff))


def test_setup_again_starts_the_wrappers_state_again():
    """``setup(new_model)`` after a sharded step kept the owners and the
    shards of the old model: the old model went on being reduced, updated
    and gathered (0.163 moved), the new one 0.099 off a fresh optimizer's;
    and a held micro-batch was counted into the new model's step."""
    comm = common.naive('float64')
    old, optimizer = _guarded(comm, _sgd, 2, True)
    x, t = common.chunks(0, comm.size)[comm.rank]
    for _ in range(3):                  # a step and a held micro-batch
        optimizer.update(helpers.loss_of(old), x, t)
    kept = common.params(old)
    new = common.ConvBNNet(seed=1)
    optimizer.setup(new)
    fresh_model = common.ConvBNNet(seed=1)
    # (Chainer's setup drops the optimizer's hooks: the fresh one has none)
    fresh = GuardedOptimizer(_sgd(), 2, comm, shard_update=True).setup(
        fresh_model)
    for step in range(2):
        for j in range(2):
            x, t = common.chunks(step, 2 * comm.size)[2 * comm.rank + j]
            optimizer.update(helpers.loss_of(new), x, t)
            fresh.update(helpers.loss_of(fresh_model), x, t)
    for name, array in common.params(old).items():
        numpy.testing.assert_array_equal(array, kept[name], name)
    diff = common.max_relative_diff(common.params(new),
                                    common.params(fresh_model))
    common.assert_everywhere(diff == 0.0, 'as a fresh optimizer: {}'.format(
        diff))


def test_a_whole_model_hook_added_after_the_first_sharded_step_is_refused():
    comm = common.naive('float64')
    if comm.size == 1:
        pytest.skip('sharding needs two processes')
    model, optimizer = _guarded(comm, _sgd, 1, True)
    common.train_distributed(model, optimizer, comm, 1)
    optimizer.add_hook(chainer.optimizer_hooks.GradientClipping(1.0))
    weights = common.params(model)
    x, t = common.chunks(1, comm.size)[comm.rank]
    with pytest.raises(ValueError, match='GradientClipping'):
        optimizer.update(helpers.loss_of(model), x, t)
    for name, array in common.params(model).items():
        numpy.testing.assert_array_equal(array, weights[name], name)


def test_a_dropped_first_micro_batch_leaves_no_running_statistics():
    """The loop's own backward ran with each process's weights: dropped,
    its forward's trace in BatchNormalization's running statistics goes
    too (the guard's copy from before it)."""
    comm = common.naive('float64')
    if comm.size == 1:
        pytest.skip('one process has nothing to broadcast')
    model, optimizer = _guarded(comm, _sgd, 1, False, seed=comm.rank)
    before = model.bn1.avg_mean.copy()
    x, t = common.chunks(0, comm.size)[comm.rank]
    model.cleargrads()
    helpers.loss_of(model)(x, t).backward()
    assert not numpy.array_equal(model.bn1.avg_mean, before)
    optimizer.update()
    assert optimizer.t == 0
    numpy.testing.assert_array_equal(model.bn1.avg_mean, before)


class _Lazy(chainer.Chain):
    def __init__(self):
        super().__init__()
        with helpers.float64_links(), self.init_scope():
            self.l1 = chainer.links.Linear(None, 4)

    def forward(self, x):
        return F.sum(self.l1(x) ** 2)


def test_lazy_links_of_other_shapes_are_named_not_broadcast():
    """Lazily initialised links whose inputs differ between processes:
    agreed before the broadcast, a ValueError naming the parameter on
    every process (it aborted MPI in the broadcast: MPI_ERR_TRUNCATE)."""
    comm = common.naive('float64')
    if comm.size == 1:
        pytest.skip('one process has nothing to agree with')
    model = _Lazy()
    optimizer = GuardedOptimizer(_sgd(), 1, comm).setup(model)
    x = numpy.ones((2, 5 + comm.rank))
    with pytest.raises(ValueError, match='/l1/W'):
        optimizer.update(model, x)


def test_a_resumed_sharded_run_saves_the_states_it_owns(shared_dir):
    """Loaded, then saved before its first step: each file holds the
    velocities its process owns, as the first one did (saving gave every
    never-updated rule a state: every file held every velocity, and
    merging them, to resume on another count, loaded zeros)."""
    comm = common.naive('float64')
    if comm.size == 1:
        pytest.skip('sharding needs two processes')
    model, optimizer = _guarded(comm, _lars('scaled'), 1, True)
    common.train_distributed(model, optimizer, comm, 2)
    first = _file(shared_dir, 'first', comm.rank)
    chainer.serializers.save_npz(first, optimizer)
    resumed, again = _guarded(comm, _lars('scaled'), 1, True)
    chainer.serializers.load_npz(first, again)
    second = _file(shared_dir, 'second', comm.rank)
    chainer.serializers.save_npz(second, again)
    with numpy.load(first) as a, numpy.load(second) as b:
        keys = sorted(a.files), sorted(b.files)
    common.assert_everywhere(keys[0] == keys[1], 'the same keys')
