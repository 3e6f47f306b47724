"""The bounded step (``kl_clip``, :mod:`chainerkfac.step_bound`) against a
by-hand float64 computation of the step's length in the damped Kronecker
Fisher metric of a 2-layer net.

The oracle builds each layer's damped Fisher ``(G + γ_G I) ⊗ (A + γ_A I)``
explicitly from per-sample inputs and output gradients (one backward per
sample), solves it against ``∇E = ∇L + γ w`` with ``numpy.linalg.solve``
and sums ``η² ∇Eᵀ F̂⁻¹ ∇E`` over the layers: no factor, inverse or
direction of the library enters it. Tolerances: the factors are sums of
~10 products of O(1) numbers and the solves are of matrices with condition
number below 1e4, so agreement is ~1e-12 relative; 1e-9 leaves room.
"""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import logging
import math

import numpy
import pytest

import chainer
import chainer.functions as F

from chainerkfac import step_bound
from tests.chainerkfac import helpers

DAMPING = 1e-2
N = 8


def _batch(seed=0):
    rng = numpy.random.RandomState(seed)
    return rng.randn(N, 5), rng.randint(0, 3, N).astype(numpy.int32)


def _damped_kronecker(a_rows, g_rows, damping):
    """``(G + γ_G I) ⊗ (A + γ_A I)`` from per-sample augmented inputs
    ``a_rows`` (N, d_in + 1) and per-sample output gradients ``g_rows``
    (N, d_out), with the trace-norm split of the damping."""
    a = a_rows.T.dot(a_rows) / len(a_rows)
    g = g_rows.T.dot(g_rows) / len(g_rows)
    pi = math.sqrt((numpy.trace(a) / len(a)) / (numpy.trace(g) / len(g)))
    root = math.sqrt(damping)
    return numpy.kron(g + root / pi * numpy.eye(len(g)),
                      a + pi * root * numpy.eye(len(a)))


def _oracle(model, x, t, lr):
    """Per layer: (∇E as the (d_out, d_in + 1) matrix flattened, F̂ damped)
    and the total ``η² Σ ∇Eᵀ F̂⁻¹ ∇E``."""
    h = F.tanh(model.l1(x))
    inputs = {'l1': x, 'l2': h.array}
    outputs = {}
    for n in range(N):
        y1 = model.l1(x[n:n + 1])
        y2 = model.l2(F.tanh(y1))
        loss = F.softmax_cross_entropy(y2, t[n:n + 1])
        gy1, gy2 = chainer.grad([loss], [y1, y2])
        outputs.setdefault('l1', []).append(gy1.array[0])
        outputs.setdefault('l2', []).append(gy2.array[0])
    model.cleargrads()
    F.softmax_cross_entropy(model(x), t).backward()
    layers, metric = {}, 0.0
    for name in ('l1', 'l2'):
        link = getattr(model, name)
        ones = numpy.ones((N, 1))
        a_rows = numpy.concatenate([inputs[name], ones], axis=1)
        fisher = _damped_kronecker(a_rows, numpy.array(outputs[name]),
                                   DAMPING)
        grad = numpy.concatenate(
            [link.W.grad + DAMPING * link.W.array,
             (link.b.grad + DAMPING * link.b.array)[:, None]], axis=1)
        vector = grad.reshape(-1)
        direction = numpy.linalg.solve(fisher, vector)
        layers[name] = (vector, fisher, direction.reshape(grad.shape))
        metric += lr * lr * vector.dot(direction)
    return layers, metric


def _one_step(lr, kl_clip, seed=0):
    model = helpers.MLP()
    x, t = _batch(seed)
    reference = helpers.MLP()
    reference.copyparams(model)
    layers, metric = _oracle(reference, x, t, lr)
    optimizer = helpers.kfac(lr=lr, momentum=0.0, damping=DAMPING,
                             kl_clip=kl_clip).setup(model)
    before = {n: getattr(model, n) for n in ('l1', 'l2')}
    before = {n: numpy.concatenate([l.W.array, l.b.array[:, None]], axis=1)
              for n, l in before.items()}
    reporter = chainer.Reporter()
    observation = {}
    with reporter.scope(observation):
        optimizer.update(helpers.loss_of(model), x, t)
    after = {n: numpy.concatenate([getattr(model, n).W.array,
                                   getattr(model, n).b.array[:, None]],
                                  axis=1) for n in ('l1', 'l2')}
    return layers, metric, before, after, observation


@pytest.mark.parametrize('lr,kl_clip', [(0.5, 1e-3), (0.05, 10.0)],
                         ids=['clipped', 'within'])
def test_step_metric_and_scale_equal_the_by_hand_computation(lr, kl_clip):
    layers, metric, before, after, observation = _one_step(lr, kl_clip)
    assert metric > 0
    numpy.testing.assert_allclose(observation['kfac/step_metric'], metric,
                                  rtol=1e-9)
    scale = min(1.0, math.sqrt(kl_clip / metric))
    numpy.testing.assert_allclose(observation['kfac/step_scale'], scale,
                                  rtol=1e-9)
    # The setting clips or not as its name says.
    assert (scale < 1.0) == (kl_clip == 1e-3)
    length = 0.0
    for name, (_, fisher, direction) in layers.items():
        # momentum 0: w ← w − η ν d.
        numpy.testing.assert_allclose(after[name],
                                      before[name] - lr * scale * direction,
                                      rtol=1e-9, atol=1e-12)
        step = (after[name] - before[name]).reshape(-1)
        length += step.dot(fisher.dot(step))
    # The step taken has squared length min(m, kl_clip) in the metric.
    numpy.testing.assert_allclose(length, min(metric, kl_clip), rtol=1e-9)


@pytest.mark.parametrize('own', [{'l2': 0.5}, {'l1': 0.0},
                                 {'l1': 0.02, 'l2': 0.3}],
                         ids=['l2-10x', 'l1-held', 'both'])
@pytest.mark.parametrize('device', [False, True], ids=['host', 'device'])
def test_a_parameter_with_its_own_lr_counts_with_it(own, device):
    """A layer whose update rules have an lr of their own steps by it, so
    the bound measures it with it: m = Σ_l η_l² ⟨d_l, ∇E_l⟩ (η_l the
    layer's lr), and the step taken has squared length min(m, kl_clip).
    With the optimizer's η for every layer, a layer at 10× lr took a step
    100× the bound, and one held at lr 0 used up the bound's budget (ν the
    same in all three cases). Host floats and the device path's 0-d η, γ
    (a CUDA graph's, on NumPy) alike."""
    lr, kl_clip = 0.05, 1e-4
    model = helpers.MLP()
    x, t = _batch(0)
    reference = helpers.MLP()
    reference.copyparams(model)
    layers, _ = _oracle(reference, x, t, lr)
    rates = {name: own.get(name, lr) for name in layers}
    metric = sum(rates[n] ** 2 * vector.dot(direction.reshape(-1))
                 for n, (vector, _, direction) in layers.items())
    optimizer = helpers.kfac(lr=lr, momentum=0.0, damping=DAMPING,
                             kl_clip=kl_clip).setup(model)
    if device:
        optimizer.device_lr = numpy.array(lr)
        optimizer.device_damping = numpy.array(DAMPING)
    for name, rate in own.items():
        for param in getattr(model, name).params():
            param.update_rule.hyperparam.lr = rate
    before = {n: numpy.concatenate([l.W.array, l.b.array[:, None]], axis=1)
              for n, l in ((n, getattr(model, n)) for n in layers)}
    optimizer.update(helpers.loss_of(model), x, t)
    scale = min(1.0, math.sqrt(kl_clip / metric))
    assert scale < 1
    numpy.testing.assert_allclose(float(optimizer.step_bound.metric),
                                  metric, rtol=1e-9)
    length = 0.0
    for name, (_, fisher, direction) in layers.items():
        link = getattr(model, name)
        after = numpy.concatenate([link.W.array, link.b.array[:, None]],
                                  axis=1)
        numpy.testing.assert_allclose(
            after, before[name] - rates[name] * scale * direction,
            rtol=1e-9, atol=1e-12)
        step = (after - before[name]).reshape(-1)
        length += step.dot(fisher.dot(step))
    numpy.testing.assert_allclose(length, kl_clip, rtol=1e-9)


def test_own_lr_reads_numbers_and_arrays_not_a_graphs_device_lr():
    """A parameter's own lr set as a 0-d array is one (it was read as the
    optimizer's: a step 25x the bound); the optimizer's lr that a CUDA
    graph binds to the rules as a device view is not."""
    import chainer.backend
    from chainerkfac.graphs import hyper
    model = helpers.MLP()
    helpers.kfac().setup(model)
    w1, w2 = model.l1.W, model.l2.W
    assert step_bound.own_lr(w1) is None
    for value in (0.5, numpy.float32(0.5), numpy.array(0.5)):
        w2.update_rule.hyperparam.lr = value
        assert step_bound.own_lr(w2) == 0.5
    scalars = hyper.DeviceScalars(('lr', 'momentum'),
                                  chainer.backend.CpuDevice())
    scalars.write({'lr': 0.05, 'momentum': 0.9})
    hyper.bind_rule_hyperparameters([w1], scalars, ('lr', 'momentum'))
    assert float(w1.update_rule.hyperparam.lr) == 0.05
    assert step_bound.own_lr(w1) is None


def test_no_bound_takes_the_whole_step_and_reports_nothing():
    layers, metric, before, after, observation = _one_step(0.5, None)
    assert 'kfac/step_scale' not in observation
    for name, (_, _, direction) in layers.items():
        numpy.testing.assert_allclose(after[name],
                                      before[name] - 0.5 * direction,
                                      rtol=1e-9, atol=1e-12)


def test_bn_blocks_count_and_plain_parameters_do_not():
    """BatchNormalization's Fisher block is counted and scaled; a link on
    the plain gradient (``skip_layers``) takes SGD's step, unscaled."""
    model = helpers.ConvNet(bn=True)
    x, t = helpers.data(n=6)
    reference = helpers.ConvNet(bn=True)
    reference.copyparams(model)
    optimizer = helpers.kfac(lr=0.5, momentum=0.0, damping=DAMPING,
                             kl_clip=1e-4, skip_layers=['/fc'])
    optimizer.setup(model)
    observation = {}
    with chainer.Reporter().scope(observation):
        optimizer.update(helpers.loss_of(model), x, t)
    scale = observation['kfac/step_scale']
    assert 0 < scale < 1
    # The plain link: w − η ∇L exactly (no γ term, no ν).
    reference.cleargrads()
    helpers.loss_of(reference)(x, t).backward()
    numpy.testing.assert_allclose(
        model.fc.W.array, reference.fc.W.array - 0.5 * reference.fc.W.grad,
        rtol=1e-12, atol=1e-15)
    # The curved blocks: ν times the unbounded step d (momentum 0:
    # Δw = −η d), and the metric is η² Σ ⟨d, ∇L + γ(w − μ)⟩ over them.
    unbounded = helpers.ConvNet(bn=True)
    unbounded.copyparams(reference)
    helpers.kfac(lr=0.5, momentum=0.0, damping=DAMPING,
                 skip_layers=['/fc']).setup(unbounded).update(
        helpers.loss_of(unbounded), x, t)
    start = dict(reference.namedparams())
    mine = dict(model.namedparams())
    metric = 0.0
    for name, param in unbounded.namedparams():
        if name.startswith('/fc'):
            continue
        direction = (start[name].array - param.array) / 0.5
        mean = 1.0 if name == '/bn/gamma' else 0.0
        regularized = start[name].grad + DAMPING * (start[name].array - mean)
        metric += float((direction * regularized).sum())
        numpy.testing.assert_allclose(mine[name].array - start[name].array,
                                      scale * (param.array -
                                               start[name].array),
                                      rtol=1e-9, atol=1e-13)
    numpy.testing.assert_allclose(observation['kfac/step_metric'],
                                  0.25 * metric, rtol=1e-9)
    numpy.testing.assert_allclose(scale, math.sqrt(1e-4 / (0.25 * metric)),
                                  rtol=1e-9)


@pytest.mark.parametrize('metric,expected', [
    (0.0, 1.0), (4e-3, 0.5), (1e-4, 1.0), (float('inf'), float('nan'))])
def test_scale_of(metric, expected):
    value = step_bound.scale_of(metric, 1e-3)
    if math.isnan(expected):
        assert math.isnan(value)
    else:
        assert value == pytest.approx(expected, rel=1e-15)


# The NaN goes through the backward pass on purpose.
@pytest.mark.filterwarnings('ignore:invalid value encountered:RuntimeWarning')
def test_a_non_finite_metric_skips_the_step():
    """A direction that is not finite makes ν NaN: the step guard skips
    the step and no NaN reaches the weights."""
    model = helpers.MLP()
    x, t = _batch()
    optimizer = helpers.kfac(lr=0.1, damping=DAMPING, kl_clip=1e-3)
    optimizer.setup(model)
    x = x.copy()
    x[0, 0] = numpy.inf
    start = {n: p.array.copy() for n, p in model.namedparams()}
    optimizer.update(helpers.loss_of(model), x, t)
    assert optimizer.last_step_skipped
    for name, param in model.namedparams():
        numpy.testing.assert_array_equal(param.array, start[name])


def test_kl_clip_is_checked():
    with pytest.raises(ValueError, match='kl_clip'):
        helpers.kfac(kl_clip=0.0)
    with pytest.raises(ValueError, match='kl_clip'):
        helpers.kfac(kl_clip=float('inf'))


class _Block:
    """What metric_term reads of a block: params and the means μ."""

    def __init__(self, params, means):
        self.params, self._means = params, means

    def regularization_means(self):
        return self._means


@pytest.mark.filterwarnings('ignore::RuntimeWarning')   # inf - inf
@pytest.mark.parametrize('case', ['acts', 'whole', 'zero', 'nan', 'inf'])
def test_device_path_is_the_host_path_op_for_op(case):
    """apply_on_device (a CUDA graph's: η and γ as float64 0-d arrays, ν
    left on the device) against apply (the host's floats), on NumPy: the
    same ν, metric and scaled directions to the bit, in float32 and
    float64 directions; ν = 1 at m = 0, NaN for a non-finite m."""
    rng = numpy.random.RandomState(1)
    terms, host_dirs, device_dirs = [], [], []
    for dtype, mean in ((numpy.float32, 0.0), (numpy.float64, 1.0)):
        params = [chainer.Parameter(rng.randn(4, 3).astype(dtype)),
                  chainer.Parameter(rng.randn(4).astype(dtype))]
        grads = [p.array * 0.5 + rng.randn(*p.shape).astype(dtype)
                 for p in params]
        directions = [g * 2 for g in grads]
        if case == 'zero':
            grads = [g * 0 for g in grads]
            directions = [d * 0 for d in directions]
            params = [chainer.Parameter(p.array * 0) for p in params]
        if case in ('nan', 'inf'):
            directions[0][0, 0] = numpy.nan if case == 'nan' else numpy.inf
        block = _Block(params, [0.0, mean])
        terms.append((block, grads, directions))
        host_dirs.append([d.copy() for d in directions])
        device_dirs.append([d.copy() for d in directions])
    lr, damping = 0.3, 1e-2 * 1.7
    kl_clip = 1e9 if case == 'whole' else 1e-3
    host = step_bound.StepBound(kl_clip)
    host.apply([(b, g, d, damping) for (b, g, _), d in zip(terms, host_dirs)],
               host_dirs, lr, lambda v: v)
    device = step_bound.StepBound(kl_clip)
    device.apply_on_device(
        [(b, g, d, numpy.array(1e-2) * 1.7)
         for (b, g, _), d in zip(terms, device_dirs)],
        device_dirs, numpy.array(lr))
    assert isinstance(device.scale, numpy.ndarray) and device.scale.ndim == 0
    numpy.testing.assert_equal(float(device.scale), host.scale)
    numpy.testing.assert_equal(float(device.metric), host.metric)
    for a, b in zip(host_dirs, device_dirs):
        for x, y in zip(a, b):
            assert x.dtype == y.dtype
            numpy.testing.assert_array_equal(x, y)
    expected = {'acts': lambda s: s < 1, 'whole': lambda s: s == 1,
                'zero': lambda s: s == 1, 'nan': math.isnan,
                'inf': math.isnan}[case]
    assert expected(host.scale), host.scale


def test_device_terms_take_no_cupy_dot(monkeypatch):
    """On device arrays the partial sums are a product and a sum (kernels
    a CUDA graph captures), never the array module's ``dot`` / ``vdot`` /
    ``matmul`` / ``tensordot`` (CuPy's cuBLAS refuses a capturing stream:
    a graphed bounded step fell back to eager on the H200). A stand-in
    array module that refuses those stands for CuPy; the value is NumPy's
    dot product of ∇E with the direction."""
    import types

    def refused(*args, **kwds):
        raise AssertionError('cuBLAS-backed call on device arrays')

    device_xp = types.SimpleNamespace(
        dot=refused, vdot=refused, matmul=refused, tensordot=refused,
        inner=refused, einsum=refused)
    monkeypatch.setattr(step_bound, 'get_array_module',
                        lambda *arrays: device_xp)
    rng = numpy.random.RandomState(4)
    params = [chainer.Parameter(rng.randn(5, 3)), chainer.Parameter(
        rng.randn(5))]
    grads = [rng.randn(5, 3), rng.randn(5)]
    directions = [rng.randn(5, 3), rng.randn(5)]
    block = _Block(params, [0.0, 0.25])
    damping = numpy.float64(0.05)
    got = step_bound._device_term(block, grads, directions, damping)
    expected = sum(
        float(numpy.dot(d.ravel(), (g + damping * (p.array - mean)).ravel()))
        for p, g, d, mean in zip(params, grads, directions, [0.0, 0.25]))
    assert abs(float(got) - expected) <= 1e-13 * abs(expected)


# -- the GPU's multi-tensor path, through stand-in kernels ---------------------
class DeviceLike(numpy.ndarray):
    """A NumPy array the bound takes for a device array."""


def _stand_in_kernels(op, dtype):
    """The multi-tensor kernels of the bound as their CUDA sources read
    their arguments (multi_tensor.source('dots' | 'terms' | 'scale'))."""
    from chainerkfac import multi_tensor
    threads, chunk = multi_tensor.THREADS, multi_tensor.CHUNK

    def dots(grid, block, args):
        partials = args[0]
        blocks, count = grid
        for slot in range(count):
            d, g, w, n = (a.ravel() if hasattr(a, 'ravel') and a.ndim
                          else a for a in args[1 + 4 * slot:5 + 4 * slot])
            owner = (numpy.arange(n) // threads) % blocks
            for b in range(blocks):
                mine = owner == b
                dd = d[mine].astype(numpy.float64)
                partials[slot, b] = [(dd * g[mine]).sum(),
                                     (dd * w[mine]).sum(), dd.sum()]

    def terms(grid, block, args):
        partials, blocks, out = args[:3]
        assert grid[0] == 1 and partials.shape[1] == blocks
        for slot in range(grid[1]):
            damping, mean, index, _ = args[3 + 4 * slot:7 + 4 * slot]
            sums = partials[slot].sum(axis=0)
            term = sums[0] + damping[()] * sums[1]
            if mean != 0:
                term = term - damping[()] * mean * sums[2]
            out[index] = term

    def scale(grid, block, args):
        factor = args[0]
        for slot in range(grid[1]):
            x, n = args[1 + 2 * slot:3 + 2 * slot]
            x *= factor.astype(x.dtype)
        assert len(args) == 1 + 2 * chunk
    return {'dots': dots, 'terms': terms, 'scale': scale}[op]


def _bound_inputs(kind, seed=8):
    import types
    rng = numpy.random.RandomState(seed)
    scaled = []
    lr = numpy.asarray(0.3).view(kind)
    terms = []
    for k, shapes in enumerate([[(4, 3), (4,)], [(5,), (5,)],
                                [(70, 300)], [(2, 2, 3)]]):
        params = [chainer.Parameter(rng.randn(*s).view(kind))
                  for s in shapes]
        grads = [rng.randn(*s).view(kind) for s in shapes]
        directions = [rng.randn(*s).view(kind) for s in shapes]
        means = [1.0, 0.0] if k == 1 else [0.0] * len(shapes)
        block = types.SimpleNamespace(params=params,
                                      regularization_means=lambda m=means: m)
        damping = numpy.asarray(0.01 * (k + 1)).view(kind)
        terms.append((block, grads, directions, damping))
        scaled.append(directions)
    return terms, scaled, lr


@pytest.mark.parametrize('kl_clip', [1e-3, 1e6])
def test_multi_tensor_bound_equals_the_per_parameter_one(monkeypatch,
                                                         kl_clip):
    """apply_on_device's GPU path (multi-tensor terms and scaling, here
    through stand-in kernels over device-like arrays) against its NumPy
    path on the same float64 values: ν and every scaled direction to
    float64 rounding (the sums run in another order)."""
    from chainerkfac import multi_tensor

    class FakeXp:
        abs, minimum, maximum = numpy.abs, numpy.minimum, numpy.maximum
        sqrt, where, isfinite = numpy.sqrt, numpy.where, numpy.isfinite

        @staticmethod
        def empty(shape, dtype):
            return numpy.full(shape, numpy.nan, dtype)
    reference = step_bound.StepBound(kl_clip)
    terms, scaled, lr = _bound_inputs(numpy.ndarray)
    reference.apply_on_device(terms, scaled, lr)
    monkeypatch.setattr(step_bound, 'get_array_module', lambda a: FakeXp)
    monkeypatch.setattr(multi_tensor, 'get_array_module', lambda a: FakeXp)
    monkeypatch.setattr(multi_tensor, '_kernel', _stand_in_kernels)
    bound = step_bound.StepBound(kl_clip)
    fused_terms, fused_scaled, fused_lr = _bound_inputs(DeviceLike)
    bound.apply_on_device(fused_terms, fused_scaled, fused_lr)
    assert_bounds_agree(bound, fused_scaled, reference, scaled, kl_clip)


def assert_bounds_agree(bound, scaled, reference, reference_scaled,
                        kl_clip):
    """ν, the scale and every scaled direction of a device path against
    the NumPy path's, to float64 rounding (the sums run in another
    order)."""
    assert float(bound.metric) == pytest.approx(float(reference.metric),
                                                rel=1e-13)
    assert float(bound.scale) == pytest.approx(float(reference.scale),
                                               rel=1e-13)
    assert (float(bound.scale) < 1) == (kl_clip < 1)
    for got, want in zip(scaled, reference_scaled):
        for a, b in zip(got, want):
            numpy.testing.assert_allclose(a, b, rtol=1e-13)


@pytest.mark.gpu
@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
def test_gpu_multi_tensor_bound_against_numpy(dtype):
    """The bound's multi-tensor kernels on the GPU against its NumPy path
    on the same values (float64 sums on both sides from float32 data:
    ν to 1e-12 relative; the scaled directions to one rounding of their
    dtype beside the two scales' difference)."""
    from tests.gpu import support
    cupy = support.cupy_or_skip()
    terms, scaled, lr = _bound_inputs(numpy.ndarray)
    for block, grads, directions, _ in terms:
        for p in block.params:
            p.array = p.array.astype(dtype)
        grads[:] = [g.astype(dtype) for g in grads]
        directions[:] = [d.astype(dtype) for d in directions]
    import types
    gpu_terms, gpu_scaled = [], []
    for block, grads, directions, damping in terms:
        params = [chainer.Parameter(cupy.asarray(p.array))
                  for p in block.params]
        gpu_block = types.SimpleNamespace(
            params=params, regularization_means=block.regularization_means)
        moved = [cupy.asarray(d) for d in directions]
        gpu_terms.append((gpu_block, [cupy.asarray(g) for g in grads],
                          moved, cupy.asarray(damping)))
        gpu_scaled.append(moved)
    reference = step_bound.StepBound(1e-3)
    reference.apply_on_device(
        [(b, [g.astype(numpy.float64) for g in gs],
          [d.astype(numpy.float64) for d in ds], damping)
         for b, gs, ds, damping in terms],
        scaled, lr)
    bound = step_bound.StepBound(1e-3)
    bound.apply_on_device(gpu_terms, gpu_scaled, cupy.asarray(lr))
    assert float(bound.scale) == pytest.approx(float(reference.scale),
                                               rel=1e-12)
    # Each scaled direction is ``d · scale``: one rounding of its dtype on
    # each side, and the two scales' own difference (their sums run in
    # another order: up to 1e-12 above).
    unit = numpy.finfo(dtype).eps
    scales = abs(float(bound.scale) / float(reference.scale) - 1)
    for got, want in zip(gpu_scaled, scaled):
        for a, b in zip(got, want):
            numpy.testing.assert_allclose(cupy.asnumpy(a), b,
                                          rtol=2 * unit + scales)


class _OnDevice:
    """ν as a device scalar (float() of it is a synchronisation)."""

    def __init__(self, value):
        self.value = value
        self.reads = 0

    def __float__(self):
        self.reads += 1
        return self.value


def test_a_bound_that_holds_every_step_back_is_told_once():
    """ν under 5 % at every reading over 50 steps: one message naming
    kl_clip; a reading above starts the count again. ν on the host is read
    every 10th step, on a device every 50th."""
    bound = step_bound.StepBound(1e-4)
    told = []
    for step in range(1, 201):
        bound.scale = numpy.float64(0.3 if step == 40 else 0.01)
        told.append(bound.held_back(step))
    messages = [(s + 1, m) for s, m in enumerate(told) if m]
    assert [s for s, _ in messages] == [100]       # 50..100, after 40's
    assert 'kl_clip=0.0001' in messages[0][1] and '0.01' in messages[0][1]
    device = step_bound.StepBound(1e-4)
    scale = device.scale = _OnDevice(0.02)
    told = [device.held_back(step) for step in range(1, 101)]
    assert scale.reads == 2 and told[99] and not any(told[:99])


def test_the_bound_is_not_read_inside_a_cuda_graphs_capture(monkeypatch):
    """A read of ν on the device inside a capture (the step's report is
    part of a captured stale step) would make the capture fail, and the
    steps of that shape eager for good: it is skipped there."""
    capturing = []

    class Stream:
        def is_capturing(self):
            return bool(capturing)

    class FakeCupy:
        class cuda:
            @staticmethod
            def get_current_stream():
                return Stream()
    monkeypatch.setattr(step_bound, 'get_array_module',
                        lambda value: FakeCupy)
    bound = step_bound.StepBound(1e-4)
    scale = bound.scale = _OnDevice(0.02)
    capturing.append(True)
    assert bound.held_back(50) is None and scale.reads == 0
    capturing.clear()
    assert bound.held_back(100) is None and scale.reads == 1
    assert bound.held_back(150) and scale.reads == 2


def test_kfac_warns_when_its_bound_holds_every_step_back(caplog):
    x, t = _batch()
    model = helpers.MLP()
    optimizer = helpers.kfac(lr=0.1, kl_clip=1e-14).setup(model)
    with caplog.at_level(logging.WARNING, logger='chainerkfac'):
        for _ in range(60):
            optimizer.update(helpers.loss_of(model), x, t)
    held = [r.getMessage() for r in caplog.records
            if 'held every step' in r.getMessage()]
    assert len(held) == 1 and held[0].startswith('K-FAC step 59:')
    caplog.clear()
    free = helpers.kfac(lr=0.1, kl_clip=1e2).setup(helpers.MLP())
    with caplog.at_level(logging.WARNING, logger='chainerkfac'):
        for _ in range(60):
            free.update(helpers.loss_of(free.target), x, t)
    assert 'held every step' not in caplog.text


def _trained(kl_clip, set_to=None, steps=6):
    """A few K-FAC steps of an MLP from kl_clip; from step 3 on,
    ``optimizer.kl_clip = set_to`` (where not the string 'keep')."""
    numpy.random.seed(0)
    model = helpers.MLP()
    optimizer = helpers.kfac(lr=0.5, momentum=0.9, damping=DAMPING,
                             kl_clip=kl_clip).setup(model)
    for step in range(steps):
        if step == 3 and set_to != 'keep':
            optimizer.kl_clip = set_to
        optimizer.update(helpers.loss_of(model), *_batch(step))
    return {n: p.array.copy() for n, p in model.namedparams()}, optimizer


@pytest.mark.parametrize('start,later', [(1e-4, 1e-1), (1e-4, None),
                                         (None, 1e-4)])
def test_kl_clip_set_mid_run_acts_from_the_next_step(start, later):
    """``optimizer.kl_clip = c`` (a user, a trainer extension shifting
    it) went unread: the bound kept the constructor's value (a shift from
    1e-4 to 0.1 changed nothing). It acts from the next step, as a run
    that took ``c`` from there."""
    shifted, optimizer = _trained(start, later)
    assert optimizer.kl_clip == later
    assert (optimizer.step_bound is None) == (later is None)
    kept, _ = _trained(start, 'keep')
    assert any(not numpy.array_equal(shifted[n], kept[n]) for n in kept)
    # the same steps as a run that changed its bound the old way (a new
    # StepBound object), which the optimizer reads at every step
    numpy.random.seed(0)
    model = helpers.MLP()
    optimizer = helpers.kfac(lr=0.5, momentum=0.9, damping=DAMPING,
                             kl_clip=start).setup(model)
    for step in range(6):
        if step == 3:
            optimizer.step_bound = (None if later is None else
                                    step_bound.StepBound(later))
        optimizer.update(helpers.loss_of(model), *_batch(step))
    for name, param in model.namedparams():
        numpy.testing.assert_array_equal(shifted[name], param.array)


def test_kl_clip_set_mid_run_is_checked():
    optimizer = helpers.kfac(kl_clip=1e-4)
    with pytest.raises(ValueError, match='kl_clip'):
        optimizer.kl_clip = -1.0
    assert optimizer.kl_clip == 1e-4


def test_options_the_estimator_holds_are_one_value():
    """``fisher``, ``mc_samples`` and ``loss_reduction`` set on the
    optimizer are the estimator's (a second copy there kept the
    constructor's: the gradients scaled one way, the factors another)."""
    optimizer = helpers.kfac(fisher='emp', loss_reduction='mean')
    optimizer.loss_reduction = 'sum'
    optimizer.fisher = 'mc'
    optimizer.mc_samples = 3
    assert optimizer.estimator.loss_reduction == 'sum'
    assert optimizer.estimator.fisher == 'mc'
    assert optimizer.estimator.mc_samples == 3
    with pytest.raises(ValueError, match='loss_reduction'):
        optimizer.loss_reduction = 'max'


def test_every_reported_key_is_in_the_docs():
    """docs/kfac.md, "What it reports", names every key a step reports
    (with the bound and eq. 21's Diff on)."""
    import os
    import re
    model = helpers.MLP()
    optimizer = helpers.kfac(kl_clip=1e-3, fisher_diff=True).setup(model)
    observation = {}
    with chainer.Reporter().scope(observation):
        for step in range(2):
            optimizer.update(helpers.loss_of(model), *_batch(step))
    keys = {re.sub(r'^kfac/diff/.*', 'kfac/diff/<factor><layer>', k)
            for k in observation}
    root = os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    with open(os.path.join(root, 'docs', 'kfac.md')) as f:
        text = f.read()
    section = text.split('## What it reports')[1].split('\n## ')[0]
    documented = set(re.findall(r'`(kfac/[^`]+)`', section))
    assert 'kfac/diff/<factor><layer>' in keys
    assert keys <= documented, sorted(keys - documented)


def test_a_bound_set_later_sums_across_the_layer_groups():
    """Layer-parallel K-FAC gives every bound the sum over the layer
    groups (``bound_sum_across``): a bound switched on after the set-up
    (``kl_clip`` None, then a value) took each group's own layers
    only."""
    optimizer = helpers.kfac(kl_clip=None)

    def across(value):
        return value
    optimizer.bound_sum_across = across
    optimizer.kl_clip = 1e-3
    assert optimizer.step_bound.sum_across is across
    optimizer.kl_clip = 1e-2
    assert optimizer.step_bound.sum_across is across
    assert optimizer.step_bound.kl_clip == 1e-2


def test_damping_and_acc_iters_set_later_are_checked():
    """Set between steps (a trainer extension's shift, a batch-size
    schedule), ``damping`` and ``acc_iters`` are checked as the
    constructor checks them (``acc_iters = 0`` and a NaN damping were
    taken); a new ``acc_iters`` acts from the coming step. A float of
    integer value is taken as that integer: Chainer's ``StepShift`` sets
    NumPy floats (``StepShift('acc_iters', 2, 6, init=1)`` was refused at
    its first call)."""
    optimizer = helpers.kfac(acc_iters=1)
    for name, value in [('damping', float('nan')), ('damping', -1.0),
                        ('acc_iters', 0), ('acc_iters', 2.5),
                        ('acc_iters', float('inf')), ('acc_iters', 0.0)]:
        with pytest.raises(ValueError, match=name):
            setattr(optimizer, name, value)
    for value in (2.0, numpy.float64(3.0)):
        optimizer.acc_iters = value
        assert optimizer.acc_iters == int(value) and \
            type(optimizer.acc_iters) is int
    optimizer.acc_iters = 1
    model = helpers.MLP()
    optimizer.setup(model)
    for step in range(4):
        if step == 2:
            optimizer.acc_iters = 2
        optimizer.update(helpers.loss_of(model), *_batch(step))
    assert optimizer.t == 3 and optimizer.pending_micro_batches == 0
