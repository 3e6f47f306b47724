"""CUDA-graph replay on a GPU (chainerkfac.graphs): the GEMMs of our own
cuBLAS handle against CuPy's, and 50 MomentumSGD steps through StepGraph
(captured once, replayed with new inputs and a learning rate that changes
twice) against the same steps taken eagerly: the same weights in float64
to 1e-12 (the same kernels in the same order; only the GEMMs' and
convolutions' summation orders may differ between the two processes'
algorithm choices, which is why it is not bit-equal)."""
import numpy
import pytest

import chainer

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
