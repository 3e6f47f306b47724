"""K-FAC's stale steps and GuardedOptimizer's steps replayed as CUDA graphs
(chainerkfac.graphs.graphed) against the same steps taken eagerly, on a
GPU; the device guard's kernels; the batched inverses against float64
NumPy.

Equal to the eager run "in float64 to 1e-12" of the largest weight: the
replayed kernels are the eager ones on the same buffers (the scalars read
from device memory hold the same float64 values), so only the GEMMs'
summation orders could differ between handles; float64 rounding over 50
steps of a small network stays near 1e-15.

The networks: an MLP with BatchNormalization (Linear routed to our
cuBLAS, BN on Chainer's generic kernels: capturable without cuDNN), and
the small ResNet where Chainer's convolutions run on cuDNN (the backend,
on by default; with ``CHAINERKFAC_CUDNN=0`` they are im2col + CuPy's
cuBLAS, which CuPy refuses to capture, and those cases skip).
"""
import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

import chainerkfac
import models
from chainerkfac import graphs
from chainerkfac.graphs import gemm
from chainerkfac import linalg
from chainerkfac import linalg_cuda
from chainerkfac.device_guard import DeviceStepGuard
from chainerkfac.optimizers import GuardedOptimizer, KFAC
from tests.chainerkfac.test_linalg import _problem_factors
from tests.gpu import support

pytestmark = support.MARKS


class _MLP(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(64, 32)
            self.bn = L.BatchNormalization(32)
            self.l2 = L.Linear(32, 10)

    def forward(self, x):
        return self.l2(F.relu(self.bn(self.l1(x))))


class _MLPWithUnusedHead(_MLP):
    """_MLP with a Linear head the loss never reaches."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.aux = L.Linear(32, 3)


def _network(kind):
    numpy.random.seed(0)
    with chainer.using_config('dtype', numpy.float64):
        if kind == 'mlp':
            predictor = _MLP()
        elif kind == 'mlp_head':
            predictor = _MLPWithUnusedHead()
        else:
            if not chainer.backends.cuda.cudnn_enabled:
                pytest.skip('the small ResNet is captured with cuDNN '
                            'convolutions: cuDNN is off here ({})'.format(
                                chainerkfac.cudnn.describe()))
            predictor = models.build_model('small', 10, 8, 4)
    model = models.SoftLabelClassifier(predictor)
    model.to_device('@cupy:0')
    return model


def _batches(kind, n_steps, nan_at=None):
    import cupy
    rng = numpy.random.RandomState(1)
    shape = (16, 64) if kind == 'mlp' else (8, 3, 16, 16)
    out = []
    for step in range(n_steps):
        x = rng.randn(*shape)
        if step == nan_at:
            x[0, 0] = numpy.nan
        out.append((cupy.asarray(x),
                    cupy.asarray(rng.randint(0, 10, shape[0]).astype(
                        numpy.int32))))
    return out


def _kfac(model):
    # K-FAC's defaults otherwise: the bounded step (ν on the device in a
    # graphed run) and low-rank factors where they pay
    return KFAC(lr=0.02, momentum=0.9, damping=0.1, damping_target=0.01,
                damping_warmup_steps=20, refresh_interval_a=5,
                refresh_interval_g=5, refresh_interval_f=5,
                weight_rescale=True, verbose=False).setup(model)


def _guarded(model):
    optimizer = GuardedOptimizer(chainer.optimizers.MomentumSGD(
        lr=0.05, momentum=0.9)).setup(model)
    optimizer.add_hook(chainer.optimizer_hooks.WeightDecay(1e-4))
    return optimizer


def _steps(model, optimizer, batches, use_graph, schedule=False,
           between=None, **graphed):
    """``optimizer``'s steps on ``model`` over ``batches``, graphed (with
    the options ``graphed``) or eagerly (the eager steps route their GEMMs
    as a graph's: the same calls either way); with ``schedule``, a new
    learning rate every step; ``between(step, model)`` before each step.
    Returns what stepped (the graphed optimizer or ``optimizer``)."""
    stepper = graphs.graphed(optimizer, **graphed) if use_graph else \
        optimizer
    for step, (x, t) in enumerate(batches):
        if between is not None:
            between(step, model)
        if schedule:
            optimizer.lr = 0.02 * 0.97 ** step
        if use_graph:
            stepper.update(model, x, t)
        else:
            with gemm.route_step():
                stepper.update(model, x, t)
    return stepper


def _train(kind, make, batches, use_graph, between=None, **graphed):
    model = _network(kind)
    optimizer = make(model)
    stepper = _steps(model, optimizer, batches, use_graph, schedule=True,
                     between=between, **graphed)
    return model, optimizer, stepper


def _assert_equal_runs(eager, model):
    """Weights and BN statistics of two float64 runs to 1e-12 (module
    docstring)."""
    reference = support.weights(eager)
    got = support.weights(model)
    for name, value in reference.items():
        numpy.testing.assert_allclose(got[name], value, rtol=0,
                                      atol=1e-12 * abs(value).max(),
                                      err_msg=name)
    for link, ref in zip(model.links(), eager.links()):
        if isinstance(link, L.BatchNormalization):
            numpy.testing.assert_allclose(
                support.to_cpu(link.avg_mean), support.to_cpu(ref.avg_mean),
                rtol=0, atol=1e-12)


def _run_steps(model, extra, batches, use_graph, interval=5, **graphed):
    """K-FAC refreshed every ``interval`` steps with ``extra`` options on
    ``model`` over ``batches``, graphed (with the options ``graphed``) or
    eagerly."""
    optimizer = KFAC(lr=0.02, momentum=0.9, damping=0.1,
                     refresh_interval_a=interval,
                     refresh_interval_g=interval,
                     refresh_interval_f=interval, verbose=False,
                     **extra).setup(model)
    return optimizer, _steps(model, optimizer, batches, use_graph,
                             **graphed)


def test_recaptures_do_not_grow_device_memory(monkeypatch):
    """K-FAC refreshing every 5 steps, made to drop its graph at each
    refresh (as it did before refreshes kept it) and capture the stale
    step again: after 12 captures the device holds no more than after the
    first one plus half of that capture's own footprint (the captures
    share one pool). A new pool per capture grew the device memory by
    1.7 GB per capture on ResNet-50 at batch 32 (H200, 2026-11-26), until
    a sweep ran out of 140 GB."""
    import cupy
    from chainerkfac.graphs import kfac_step
    monkeypatch.setattr(kfac_step.KFACOptimizer, 'keeps_graph',
                        lambda self, reason: False)
    if not chainer.backends.cuda.cudnn_enabled:
        pytest.skip('the small ResNet is captured with cuDNN convolutions: '
                    'cuDNN is off here ({})'.format(
                        chainerkfac.cudnn.describe()))
    numpy.random.seed(0)
    model = models.SoftLabelClassifier(models.build_model('small', 10, 20,
                                                          16))
    model.to_device('@cupy:0')
    stepper = graphs.graphed(_kfac(model))
    rng = numpy.random.RandomState(0)
    x = cupy.asarray(rng.randn(64, 3, 32, 32).astype(numpy.float32))
    t = cupy.asarray(rng.randint(0, 10, 64).astype(numpy.int32))

    def used():
        cupy.cuda.Device().synchronize()
        free, total = cupy.cuda.runtime.memGetInfo()
        return total - free

    for _ in range(4):                  # eager: warm-up, refresh
        stepper.update(model, x, t)
    before = used()
    for _ in range(6):                  # the first capture, its replays
        stepper.update(model, x, t)
    first = used()
    for _ in range(55):                 # 11 more cycles
        stepper.update(model, x, t)
    last = used()
    assert stepper.stats['captured'] >= 10, dict(stepper.stats)
    assert last - first <= 0.5 * max(first - before, 0) + 8 * 2 ** 20, (
        before, first, last, dict(stepper.stats))


def test_closed_graphs_give_their_memory_back():
    """Three graphed K-FAC runs one after another in one process (a
    sweep, the demo's two runs), each closed: the device memory after the
    third is within 64 MiB of what it was after the first (a closed
    StepGraph lets go of its pool and of the cuDNN and cuBLAS workspaces of
    its side stream, which were cut from that pool; kept, 23 GB stayed in
    use after two ResNet-50 graphs at batch 64 on an H200)."""
    import gc
    import cupy
    if not chainer.backends.cuda.cudnn_enabled:
        pytest.skip('the small ResNet is captured with cuDNN convolutions: '
                    'cuDNN is off here ({})'.format(
                        chainerkfac.cudnn.describe()))
    rng = numpy.random.RandomState(0)
    x = cupy.asarray(rng.randn(64, 3, 32, 32).astype(numpy.float32))
    t = cupy.asarray(rng.randint(0, 10, 64).astype(numpy.int32))

    def used():
        gc.collect()
        cupy.get_default_memory_pool().free_all_blocks()
        cupy.cuda.Device().synchronize()
        free, total = cupy.cuda.runtime.memGetInfo()
        return total - free

    after = []
    for _ in range(3):
        numpy.random.seed(0)
        model = models.SoftLabelClassifier(models.build_model('small', 10,
                                                              20, 16))
        model.to_device('@cupy:0')
        stepper = graphs.graphed(_kfac(model))
        for _ in range(12):
            stepper.update(model, x, t)
        assert stepper.stats['captured'] >= 1, dict(stepper.stats)
        stepper.close()
        del model, stepper
        after.append(used())
    assert after[2] - after[0] <= 64 * 2 ** 20, after


@pytest.mark.parametrize('kind', ['mlp', 'small_resnet'])
@pytest.mark.parametrize('make', [_kfac, _guarded], ids=['kfac', 'guarded'])
def test_fifty_steps_replayed_equal_eager(kind, make):
    batches = _batches(kind, 50)
    eager, _, _ = _train(kind, make, batches, False)
    model, optimizer, stepper = _train(kind, make, batches, True)
    stats = dict(stepper.stats)
    if make is _kfac:
        # t = 0, 5, ..., 45 refresh eagerly; the first stale steps warm up
        # (3 steps), the next is captured, and the graph is kept through
        # the refreshes (their inverses go where it reads them) unless a
        # buffer moved (a low-rank factor's rank, say: then captured again)
        assert stats['eager: a refresh step (factors due)'] == 9, stats
        kept = stats.get('kept through: a refresh step (factors due)', 0)
        assert kept >= 1, stats
        assert kept + stats['captured'] >= 9, stats
        assert stats['replayed'] >= 25, stats
    else:
        assert stats['captured'] == 1, stats   # lr moved every step
        assert stats['replayed'] >= 45, stats
    assert isinstance(optimizer.guard, DeviceStepGuard)
    assert not optimizer.last_step_skipped
    _assert_equal_runs(eager, model)


@pytest.mark.parametrize('refresh_steps', [False, True],
                         ids=['stale', 'refresh-steps'])
def test_a_model_with_an_unused_head_is_replayed(refresh_steps):
    """A head no loss reaches keeps its factors due, and its rule no
    state: every step counted as a refresh (no stale step replayed), and
    the device guard decided on the host (a read a capture refuses). Now
    its stale steps and refresh ends are replayed, equal to the eager run
    to 1e-12, the head untouched."""
    batches = _batches('mlp', 30)
    graphed = {'refresh_steps': True} if refresh_steps else {}
    eager, _, _ = _train('mlp_head', _kfac, batches, False)
    model, optimizer, stepper = _train('mlp_head', _kfac, batches, True,
                                       **graphed)
    stats = dict(stepper.stats)
    assert not [k for k in stats if 'capture failed' in k], stats
    # t = 0, 5, ..., 25 refresh: 24 stale steps, the first 4 warm up
    assert stats['replayed'] >= 15, stats
    if refresh_steps:
        assert stats['refresh update: replayed'] >= 2, stats
    assert model.predictor.aux.W.update_rule.t == 0
    _assert_equal_runs(eager, model)


@pytest.mark.parametrize('make, refresh_steps', [
    (_kfac, False), (_kfac, True), (_guarded, False)],
    ids=['kfac', 'kfac-refresh-steps', 'guarded'])
def test_a_link_frozen_and_unfrozen_mid_run_is_replayed_as_eager(
        make, refresh_steps):
    """The first Linear frozen (``disable_update()``) from step 12 to 21
    and updated again from step 22 (stale by the schedule, its factors
    decided while it was frozen): the graphed run captures again each
    time and equals the eager run to 1e-12 (a graph captured with the
    link updated would go on updating it, and one captured without would
    not update it once unfrozen); K-FAC refreshes its factors at step 22
    (docs/gpu.md, "For the next GPU session", item 10)."""
    def between(step, model):
        if 12 <= step < 22:
            model.predictor.l1.disable_update()
        else:
            model.predictor.l1.enable_update()
    batches = _batches('mlp', 32)
    graphed = {'refresh_steps': True} if refresh_steps else {}
    eager, _, _ = _train('mlp', make, batches, False, between=between)
    model, optimizer, stepper = _train('mlp', make, batches, True,
                                       between=between, **graphed)
    stats = dict(stepper.stats)
    assert not [k for k in stats if 'capture failed' in k], stats
    assert stats['dropped: hyperparameters changed'] >= 1, stats
    assert stats['replayed'] >= 10, stats
    _assert_equal_runs(eager, model)


def _own_lr(step, model):
    if step == 12:
        for param in model.predictor.l2.params():
            param.update_rule.hyperparam.lr = 0.005


def _bn_decay(step, model):
    if step == 12:
        model.predictor.bn.decay = 0.5


def _test_mode(step, model):
    chainer.config.train = step < 12


def _new_velocities(step, model):
    if step == 12:
        for param in model.params():
            state = param.update_rule.state
            if state is not None:
                state['v'] = state['v'] * 0.5


@pytest.mark.parametrize('change', [_own_lr, _bn_decay, _test_mode,
                                    _new_velocities],
                         ids=['own-lr', 'bn-decay', 'test-mode',
                              'new-velocities'])
@pytest.mark.parametrize('make', [_kfac, _guarded], ids=['kfac', 'guarded'])
def test_host_values_changed_mid_run_are_replayed_as_eager(make, change):
    """A host value a captured step holds changed at step 12 (a layer's
    own lr, a BatchNormalization's decay, ``chainer.config.train``, a
    velocity replaced by a new array): the graph is dropped and captured
    again, and the run equals the eager one to 1e-12 (a replay of the old
    graph would have taken the old value, or written the old array)."""
    batches = _batches('mlp', 30)
    try:
        eager, _, _ = _train('mlp', make, batches, False, between=change)
        chainer.config.train = True
        model, optimizer, stepper = _train('mlp', make, batches, True,
                                           between=change)
    finally:
        chainer.config.train = True
    stats = dict(stepper.stats)
    assert not [k for k in stats if 'capture failed' in k], stats
    assert [k for k in stats if k.startswith('dropped')], stats
    _assert_equal_runs(eager, model)


def _kfac_every(model):
    """K-FAC refreshing every factor at every step, otherwise _kfac."""
    return KFAC(lr=0.02, momentum=0.9, damping=0.1, damping_target=0.01,
                damping_warmup_steps=20, refresh_interval_a=1,
                refresh_interval_g=1, refresh_interval_f=1,
                weight_rescale=True, verbose=False).setup(model)


@pytest.mark.parametrize('kind', ['mlp', 'small_resnet'])
@pytest.mark.parametrize('make, stale', [(_kfac_every, False),
                                         (_kfac, True)],
                         ids=['every', 'stale'])
def test_refresh_steps_replayed_equal_eager(kind, make, stale):
    """``graphed(refresh_steps=True)``: the refresh steps' forward and
    backward passes replayed from a graph of their own, their end (stage
    5, the update) from another after the eager inverses, the stale steps
    from theirs; equal to the eager run in float64 to 1e-12."""
    batches = _batches(kind, 60 if stale else 30)
    eager, _, _ = _train(kind, make, batches, False)
    model, optimizer, stepper = _train(kind, make, batches, True,
                                       refresh_steps=True)
    stats = dict(stepper.stats)
    passes, end = 'refresh passes: ', 'refresh update: '
    assert not stats.get(passes + 'capture failed'), stats
    assert not stats.get(end + 'capture failed'), stats
    # every step: 29 refreshes after the first step: the passes' graph
    # warms up on one and captures the next, the end's graph a step later;
    # stale: t = 5, ..., 55, 11 refreshes
    assert stats[passes + 'captured'] == stats[end + 'captured'] == 1, stats
    assert stats[passes + 'replayed'] == (9 if stale else 27), stats
    assert stats[end + 'replayed'] == (8 if stale else 26), stats
    if stale:
        assert stats['replayed'] >= 30, stats
    assert not optimizer.last_step_skipped
    _assert_equal_runs(eager, model)


class _DeepMLP(chainer.Chain):
    """Ten Linear + BatchNormalization layers of one width: stage 5's
    batches of ten equal Kronecker blocks and ten equal BN Fishers."""

    def __init__(self, width=32, depth=10):
        super().__init__()
        with self.init_scope():
            self.first = L.Linear(64, width)
            self.hidden = chainer.ChainList(*[chainer.Sequential(
                L.Linear(width, width), L.BatchNormalization(width))
                for _ in range(depth)])
            self.last = L.Linear(width, 10)

    def forward(self, x):
        h = self.first(x)
        for layer in self.hidden:
            h = F.relu(layer(h))
        return self.last(h)


@pytest.mark.parametrize('refresh_steps', [False, True],
                         ids=['stale', 'refresh-steps'])
def test_more_than_eight_equal_blocks_are_replayed(refresh_steps):
    """Stage 5 batches blocks of equal shapes; more than 8 of them were
    stacked by ``cupy.stack``, which copies a table of pointers from the
    host, and the capture refused it (ResNet-50 has 16 BN layers of 256
    channels): every stale step then ran eagerly. Dense factors, so that
    every block is batched; 20 steps end where the eager run's do. With
    ``refresh_steps``, every step a refresh whose passes and end (the
    batches read from stacks refreshed in place) are replayed."""
    import cupy
    from chainerkfac.fisher_blocks import batch_norm, kronecker
    rng = numpy.random.RandomState(3)
    batches = [(cupy.asarray(rng.randn(16, 64)),
                cupy.asarray(rng.randint(0, 10, 16).astype(numpy.int32)))
               for _ in range(20)]

    def run(use_graph):
        numpy.random.seed(0)
        with chainer.using_config('dtype', numpy.float64):
            model = models.SoftLabelClassifier(_DeepMLP())
        model.to_device('@cupy:0')
        if refresh_steps:
            return (model,) + _run_steps(
                model, dict(low_rank=False), batches, use_graph,
                interval=1, **({'refresh_steps': True} if use_graph else {}))
        return (model,) + _run_steps(model, dict(low_rank=False), batches,
                                     use_graph)
    eager, _, _ = run(False)
    model, optimizer, stepper = run(True)
    keys = [kronecker.batch_key(b) or batch_norm.batch_key(b)
            for b in optimizer.blocks]
    assert max(keys.count(k) for k in keys if k is not None) >= 10
    stats = dict(stepper.stats)
    if refresh_steps:
        assert stats['refresh update: replayed'] >= 15, stats
    else:
        assert stats['replayed'] >= 8, stats
    reference = support.weights(eager)
    for name, value in support.weights(model).items():
        numpy.testing.assert_allclose(
            value, reference[name], rtol=0,
            atol=1e-12 * abs(reference[name]).max(), err_msg=name)


def test_tf32_stage_5_is_replayed_as_taken_eagerly():
    """float32 K-FAC with TF32 factors and stage 5 (our cuBLAS handle in
    TF32 math, which the capture then meets on its side stream): the
    stale steps are replayed, and 20 steps end where the eager run's do
    (the same kernels on the same operands; float32's rounding of 20
    steps allowed)."""
    import cupy
    rng = numpy.random.RandomState(2)
    batches = [(cupy.asarray(rng.randn(16, 64).astype(numpy.float32)),
                cupy.asarray(rng.randint(0, 10, 16).astype(numpy.int32)))
               for _ in range(20)]

    def run(use_graph):
        numpy.random.seed(0)
        model = models.SoftLabelClassifier(_MLP())
        model.to_device('@cupy:0')
        _, stepper = _run_steps(model, dict(factor_dtype='tf32',
                                            precondition_dtype='tf32'),
                                batches, use_graph)
        return model, stepper
    eager, _ = run(False)
    model, stepper = run(True)
    assert dict(stepper.stats)['replayed'] >= 8, dict(stepper.stats)
    reference = support.weights(eager)
    for name, value in support.weights(model).items():
        assert value.dtype == numpy.float32
        numpy.testing.assert_allclose(
            value, reference[name], rtol=0,
            atol=1e-5 * abs(reference[name]).max(), err_msg=name)


@pytest.mark.parametrize('make', [_kfac, _guarded], ids=['kfac', 'guarded'])
def test_non_finite_replayed_step_is_undone_on_the_device(make):
    batches = _batches('mlp', 14, nan_at=12)
    model = _network('mlp')
    optimizer = make(model)
    stepper = graphs.graphed(optimizer)
    for x, t in batches[:12]:
        stepper.update(model, x, t)
    weights = support.weights(model)
    velocity = {n: support.to_cpu(p.update_rule.state['v'])
                for n, p in model.namedparams()}
    mean = support.to_cpu(model.predictor.bn.avg_mean)
    x, t = batches[12]
    assert stepper.update(model, x, t) == 'replayed'
    assert optimizer.last_step_skipped     # read after the step
    for name, value in support.weights(model).items():
        numpy.testing.assert_array_equal(value, weights[name])
    for name, param in model.namedparams():
        numpy.testing.assert_array_equal(
            support.to_cpu(param.update_rule.state['v']), velocity[name])
    numpy.testing.assert_array_equal(
        support.to_cpu(model.predictor.bn.avg_mean), mean)
    x, t = batches[13]
    assert stepper.update(model, x, t) == 'replayed'
    assert not optimizer.last_step_skipped
    assert optimizer.guard.skipped_steps == 1


def _spd(n, seed, dtype):
    rng = numpy.random.RandomState(seed)
    m = rng.randn(n, 2 * n)
    return (m.dot(m.T) / (2 * n)).astype(dtype)


@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
@pytest.mark.parametrize('max_dim', [0, 512, 1024],
                         ids=['per-factor', 'batched-512', 'batched-1024'])
def test_batched_inverses_against_float64_numpy(dtype, max_dim,
                                                monkeypatch):
    """Sizes repeated as in ResNet-50 (64, 128, 256, 512) and single ones.
    Bound: the damped factors' condition numbers κ are below 60 (their
    eigenvalues lie in about [0.09, 2.9], damping 1e-2 to 1e-1), so a
    backward-stable inverse is within n·κ·ε of the exact one; the bound
    taken is 10·n·κ·ε of the largest entry."""
    monkeypatch.setattr(linalg_cuda, 'BATCHED_MAX_DIM', max_dim)
    factors = [(_spd(n, k, dtype), 10.0 ** -(1 + k % 2))
               for k, n in enumerate([64] * 5 + [128] * 3 + [256] * 2 +
                                     [512] * 2 + [7, 300, 700])]
    results = linalg.damped_inverses(
        [support.to_gpu(m) for m, _ in factors], [d for _, d in factors])
    eps = numpy.finfo(dtype).eps
    for (matrix, damping), result in zip(factors, results):
        assert result.retries == 0 and result.damping == damping
        damped = matrix.astype(numpy.float64) + damping * numpy.eye(
            len(matrix))
        exact = numpy.linalg.inv(damped)
        kappa = numpy.linalg.cond(damped)
        assert kappa < 60
        got = support.to_cpu(result.inverse)
        assert got.dtype == dtype and numpy.array_equal(got, got.T)
        bound = 10 * len(matrix) * kappa * eps * abs(exact).max()
        assert abs(got - exact).max() <= bound, (matrix.shape, bound)


@pytest.mark.parametrize('max_dim', [0, 512, 1024],
                         ids=['per-factor', 'batched-512', 'batched-1024'])
def test_batched_retries_as_the_cpu(max_dim, monkeypatch):
    """The problem factors (−I, indefinite, NaN, Inf) twice over, so that
    the equal sizes go as batches: the same retries and dampings as the
    CPU's LAPACK path, and no NaN returned."""
    monkeypatch.setattr(linalg_cuda, 'BATCHED_MAX_DIM', max_dim)
    factors = _problem_factors() * 2
    cpu = linalg.damped_inverses([m for m, _ in factors],
                                 [d for _, d in factors])
    gpu = linalg.damped_inverses([support.to_gpu(m) for m, _ in factors],
                                 [d for _, d in factors])
    for c, g in zip(cpu, gpu):
        assert (g.retries, g.damping) == (c.retries, c.damping)
        assert (g.inverse is None) == (c.inverse is None)
        if g.inverse is not None:
            assert numpy.isfinite(support.to_cpu(g.inverse)).all()


@pytest.mark.slow
@pytest.mark.parametrize('flag', [['--cuda-graphs'], ['--cuda-graphs',
                                                      'auto'],
                                  ['--replay-refresh-steps', 'off']])
def test_train_imagenet_with_cuda_graphs(tmp_path, monkeypatch, flag):
    """``--demo --gpu --cuda-graphs`` (and ``--cuda-graphs auto``, which
    turns them on here) with a config of one process's batch and
    stale factors (refresh every 5 steps): both runs train, and their
    summaries count replayed steps; K-FAC's refresh steps are replayed
    too but for their inverses (``--replay-refresh-steps auto``, the
    default; about 18 refreshes in the two epochs: the passes' graph warms
    up on one and captures the next, the end's graph a refresh later),
    and eager with ``--replay-refresh-steps off``."""
    import json
    import os
    from tests import launch
    with open(os.path.join(launch.REPO, 'config', 'demo.json')) as f:
        config = json.load(f)
    config.update(global_batch_size=32, refresh_interval_a=5,
                  refresh_interval_g=5, refresh_interval_f=5)
    path = tmp_path / 'stale.json'
    path.write_text(json.dumps(config))
    out = tmp_path / 'out'
    monkeypatch.setenv('CHAINERKFAC_CACHE', str(tmp_path / 'cache'))
    # the small ResNet's convolutions are captured on cuDNN (the backend)
    monkeypatch.setenv('CHAINERKFAC_CUDNN', '1')
    proc, seconds = launch.run_mpi(
        ['train_imagenet.py', '--demo', '--gpu'] + flag +
        ['--config', path, '--epochs', '2', '--no-progress', '--out', out],
        nproc=1, timeout=480)
    assert proc.returncode == 0, 'failed after {:.0f} s:\n{}\n{}'.format(
        seconds, proc.stdout[-4000:], proc.stderr[-8000:])
    assert 'CUDA graphs: on' in proc.stdout, proc.stdout[-4000:]
    with open(out / 'summary.json') as f:
        summaries = json.load(f)
    for summary in summaries:
        stats = summary['cuda_graphs']
        assert stats.get('replayed', 0) > 0, (summary['optimizer'], stats)
        assert 0.0 < summary['final_top1'] <= 1.0, summary
        if summary['optimizer'] != 'kfac':
            continue
        if 'off' in flag:
            assert "refresh steps eager" in proc.stdout
            assert not [k for k in stats if k.startswith('refresh')], stats
        else:
            assert "refresh steps replayed too" in proc.stdout
            assert stats.get('refresh passes: replayed', 0) >= 5, stats
            assert stats.get('refresh update: replayed', 0) >= 3, stats
            assert not [k for k in stats if 'capture failed' in k], stats
