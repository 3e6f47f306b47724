"""The cost guard on a Linear with 30000 inputs: its A (30001², 3.6 GB in
float32) is kept as its diagonal; the step is the diagonal-A oracle's and
never allocates anything near an n² factor."""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import tracemalloc

import numpy

import chainer
import chainer.functions as F
import chainer.links as L

from tests.chainerkfac.stock import common

N_IN = 30000
N_OUT = 10
BATCH = 16


def _model():
    numpy.random.seed(0)
    with chainer.using_config('dtype', numpy.float64):
        return L.Classifier(L.Linear(N_IN, N_OUT))


def _data():
    rng = numpy.random.RandomState(0)
    x = rng.randn(BATCH, N_IN)
    t = rng.randint(0, N_OUT, size=BATCH).astype(numpy.int32)
    return x, t


def test_linear_with_30000_inputs_gets_a_diagonal_a(caplog):
    model = _model()
    x, t = _data()
    w0 = model.predictor.W.array.copy()
    b0 = model.predictor.b.array.copy()
    damping = 1e-2
    # The whole step (no bound): the oracle below computes it.
    optimizer = chainerkfac.optimizers.KFAC(
        lr=1.0, momentum=0.0, damping=damping, max_factor_dim=4096,
        weight_rescale=False, kl_clip=None, verbose=False)
    optimizer.setup(model)
    tracemalloc.start()
    try:
        optimizer.update(model, x, t)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # A full A would be 30001² float64 = 7.2 GB; the step's peak stays
    # at a few copies of the weight (2.4 MB each) and the batch (3.8 MB).
    assert peak < 64 * 2 ** 20, peak

    [block] = optimizer.blocks
    assert block.factor_shapes() == {'A': (N_IN + 1,), 'G': (N_OUT, N_OUT)}
    row = common.rows_of(optimizer.registration_table())['/predictor']
    assert 'A 30001 (diag), G 10x10' in row
    assert 'A diagonal (30001 > max_factor_dim=4096)' in row

    # The oracle: diag A = E[a²] with the bias's 1, G = N Σ gy gyᵀ; the
    # damping split by the trace norm; direction = (G + γ_G)⁻¹ ∇E (A +
    # γ_A)⁻¹ with ∇E = ∇L + γ w.
    a = numpy.hstack([x, numpy.ones((BATCH, 1))])
    diag_a = (a ** 2).mean(axis=0)
    numpy.testing.assert_allclose(block.factors['A'], diag_a, rtol=1e-12)
    h = chainer.Variable(x.dot(w0.T) + b0)
    loss = F.softmax_cross_entropy(h, t)
    loss.backward()
    gy = h.grad
    g = BATCH * gy.T.dot(gy)
    numpy.testing.assert_allclose(block.factors['G'], g, rtol=1e-10)
    grad_w = gy.T.dot(x) + damping * w0
    grad_b = gy.sum(axis=0) + damping * b0
    pi = numpy.sqrt((diag_a.sum() / (N_IN + 1)) / (numpy.trace(g) / N_OUT))
    damping_a, damping_g = pi * numpy.sqrt(damping), numpy.sqrt(damping) / pi
    matrix = numpy.hstack([grad_w, grad_b[:, None]])
    direction = numpy.linalg.solve(g + damping_g * numpy.eye(N_OUT),
                                   matrix) / (diag_a + damping_a)
    numpy.testing.assert_allclose(model.predictor.W.array,
                                  w0 - direction[:, :-1], rtol=1e-8,
                                  atol=1e-12)
    numpy.testing.assert_allclose(model.predictor.b.array,
                                  b0 - direction[:, -1], rtol=1e-8,
                                  atol=1e-12)
