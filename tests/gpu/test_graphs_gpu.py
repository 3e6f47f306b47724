"""CUDA-graph replay on a GPU (chainerkfac.graphs): the GEMMs of our own
cuBLAS handle against CuPy's, and 50 MomentumSGD steps through StepGraph
(captured once, replayed with new inputs and a learning rate that changes
twice) against the same steps taken eagerly: the same weights in float64
to 1e-12 (the same kernels in the same order; only the GEMMs' and
convolutions' summation orders may differ between the two processes'
algorithm choices, which is why it is not bit-equal). A step that draws
random numbers (dropout) draws new ones at every replay, or is not
replayed."""
import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

import models
from tests.gpu import support

pytestmark = support.MARKS


@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
@pytest.mark.parametrize('transa, transb', [(False, False), (True, False),
                                            (False, True), (True, True)])
def test_gemm_equals_cupy(dtype, transa, transb):
    import cupy
    from chainerkfac.graphs import gemm
    rng = numpy.random.RandomState(0)
    m, k, n = 40, 30, 20
    a = cupy.asarray(rng.randn(*((3, k, m) if transa else (3, m, k)))
                     .astype(dtype))
    b = cupy.asarray(rng.randn(*((3, n, k) if transb else (3, k, n)))
                     .astype(dtype))
    op_a = a.transpose(0, 2, 1) if transa else a
    op_b = b.transpose(0, 2, 1) if transb else b
    got = gemm.default().matmul(a, b, transa, transb)
    expected = cupy.matmul(op_a, op_b)
    tol = 1e-12 if dtype == numpy.float64 else 1e-5
    assert float(abs(got - expected).max() / abs(expected).max()) < tol


def test_fifty_steps_replayed_equal_eager():
    import cupy
    from chainerkfac import graphs
    rng = numpy.random.RandomState(1)
    batches = [(cupy.asarray(rng.randn(4, 3, 16, 16)),
                cupy.asarray(rng.randint(0, 10, 4).astype(numpy.int32)))
               for _ in range(50)]
    runs = []
    for use_graph in (False, True):
        numpy.random.seed(0)
        with chainer.using_config('dtype', numpy.float64):
            model = models.SoftLabelClassifier(models.build_model(
                'small', 10, 8, 4))
        model.to_device('@cupy:0')
        optimizer = chainer.optimizers.MomentumSGD(lr=0.05)
        optimizer.setup(model)

        def step(x, t):
            optimizer.update(model, x, t)
        graph = graphs.StepGraph(step, graphs.ChainerOptimizer(optimizer))
        for i, (x, t) in enumerate(batches):
            if i in (20, 35):
                optimizer.lr *= 0.5
            if use_graph:
                graph(x, t)
            else:
                with graphs.gemm.route_linear():
                    step(x, t)
        runs.append({n: p.array.get() for n, p in model.namedparams()})
        if use_graph:
            assert graph.stats['replayed'] >= 40, dict(graph.stats)
            assert graph.stats['captured'] == 3, dict(graph.stats)
    for name, eager in runs[0].items():
        numpy.testing.assert_allclose(runs[1][name], eager, rtol=0,
                                      atol=1e-12 * abs(eager).max())


class _DropoutMLP(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(64, 256)
            self.l2 = L.Linear(256, 10)

    def forward(self, x):
        return self.l2(F.dropout(F.relu(self.l1(x)), 0.5))


@pytest.mark.parametrize('use_cudnn', ['auto', 'never'])
def test_dropout_draws_a_new_mask_at_every_replay(use_cudnn):
    """lr 0 and one batch: the loss moves only with the dropout mask. With
    the cuDNN backend (its dropout's RNG states live in device memory,
    advanced by its kernels) the step is replayed and every replay's loss
    is its own; with CuPy's generator (cuRAND, which CuPy refuses inside
    a capture) the capture fails and the steps run eagerly, each with its
    own mask too. Either way no mask repeats (docs/gpu.md, "For the next
    GPU session", item 11)."""
    import cupy
    from chainer.backends import cuda
    from chainerkfac import graphs
    if use_cudnn == 'auto' and not cuda.cudnn_enabled:
        pytest.skip('cuDNN is off here')
    rng = numpy.random.RandomState(0)
    x = cupy.asarray(rng.randn(32, 64).astype(numpy.float32))
    t = cupy.asarray(rng.randint(0, 10, 32).astype(numpy.int32))
    model = L.Classifier(_DropoutMLP())
    model.to_device('@cupy:0')
    optimizer = chainer.optimizers.MomentumSGD(lr=0.0)
    optimizer.setup(model)
    stepper = graphs.graphed(optimizer)
    reporter = chainer.reporter.Reporter()
    reporter.add_observer('main', model)
    losses, modes = [], []
    with chainer.using_config('use_cudnn', use_cudnn):
        for _ in range(12):
            observation = {}
            with reporter.scope(observation):
                modes.append(stepper.update(model, x, t))
            losses.append(float(observation['main/loss'].array))
    stats = dict(stepper.stats)
    if use_cudnn == 'auto':
        assert modes.count('replayed') >= 6, (modes, stats)
    else:
        assert 'captured' not in modes and 'replayed' not in modes, modes
        assert stats.get('capture failed', 0) >= 1, stats
    assert len(set(losses)) == len(losses), losses
