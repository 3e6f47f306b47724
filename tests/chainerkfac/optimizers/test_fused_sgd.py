"""FusedMomentumSGD against Chainer's MomentumSGD: on the CPU the same
weights, velocities and step counts bit for bit (the same expression in
the same order; a model with an unused head, whose cleared gradients
Chainer reallocates as zeros, moved by weight decay alike), with the
parameters its kernel does not take (a hooked or disabled rule) going
Chainer's own way;
snapshots of either load into the other; a CUDA graph's adapter replays
it. On the GPU (marked ``gpu``) the multi-tensor kernel against Chainer's
per-parameter one, within float rounding of the same expression."""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import io

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import serializers

from chainerkfac import multi_tensor
from chainerkfac.optimizers import FusedMomentumSGD, GuardedOptimizer
from tests.chainerkfac import helpers
from tests.gpu import support


class Net(chainer.Chain):
    """An MLP with a head the loss never uses and more parameters than one
    kernel launch takes."""

    def __init__(self, dtype=numpy.float32, width=6, depth=20):
        super().__init__()
        with chainer.using_config('dtype', dtype), self.init_scope():
            self.first = L.Linear(5, width)
            self.hidden = chainer.ChainList(*[
                L.Linear(width, width) for _ in range(depth)])
            self.out = L.Linear(width, 3)
            self.unused = L.Linear(width, 2)

    def forward(self, x):
        h = F.tanh(self.first(x))
        for link in self.hidden:
            h = F.tanh(link(h))
        return self.out(h)


def _data(dtype, steps, seed=0):
    rng = numpy.random.RandomState(seed)
    return [(rng.randn(8, 5).astype(dtype),
             rng.randint(0, 3, 8).astype(numpy.int32)) for _ in range(steps)]


def _train(make, dtype=numpy.float32, steps=6, manual=False, prepare=None,
           xp=numpy):
    numpy.random.seed(0)
    model = Net(dtype)
    if xp is not numpy:
        model.to_device(support.device())
    optimizer = make().setup(model)
    optimizer.add_hook(chainer.optimizer_hooks.WeightDecay(1e-3))
    if prepare is not None:
        prepare(model)
    for x, t in _data(dtype, steps):
        x, t = xp.asarray(x), xp.asarray(t)
        helpers.update(optimizer, model, helpers.loss_of(model), x, t,
                       manual)
    return model, optimizer


def _state(model, optimizer):
    out = {}
    for name, param in sorted(model.namedparams()):
        rule = param.update_rule
        out[name] = (support.to_cpu(param.array),
                     None if rule.state is None
                     else support.to_cpu(rule.state['v']), rule.t)
    return out, optimizer.t


def _sgd():
    return chainer.optimizers.MomentumSGD(lr=0.1, momentum=0.9)


def _fused():
    return FusedMomentumSGD(lr=0.1, momentum=0.9)


@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64,
                                   numpy.float16])
@pytest.mark.parametrize('manual', [False, True])
def test_equals_chainer_bit_for_bit_on_the_cpu(dtype, manual):
    expected, t = _state(*_train(_sgd, dtype, manual=manual))
    got, fused_t = _state(*_train(_fused, dtype, manual=manual))
    assert fused_t == t == 6
    assert set(got) == set(expected)
    for name, (weight, velocity, rule_t) in expected.items():
        numpy.testing.assert_array_equal(got[name][0], weight, err_msg=name)
        assert got[name][2] == rule_t == 6, name
        if velocity is None:
            assert got[name][1] is None, name
        else:
            numpy.testing.assert_array_equal(got[name][1], velocity, name)
    # the unused head moved (weight decay on its zero gradients) as
    # Chainer moves it
    assert expected['/unused/W'][1].any()


def _grads_after(make, hooks, steps=3):
    """Weights, velocities and gradients after ``steps`` updates with the
    optimizer-level ``hooks`` (made fresh)."""
    numpy.random.seed(0)
    model = Net()
    optimizer = make().setup(model)
    for hook in hooks():
        optimizer.add_hook(hook)
    for x, t in _data(numpy.float32, steps):
        optimizer.update(helpers.loss_of(model), x, t)
    return {name: (p.array.copy(), p.grad.copy(),
                   p.update_rule.state['v'].copy())
            for name, p in model.namedparams()}


@pytest.mark.parametrize('hooks', [
    lambda: [chainer.optimizer_hooks.WeightDecay(1e-2)],
    lambda: [chainer.optimizer_hooks.WeightDecay(1e-2),
             chainer.optimizer_hooks.GradientClipping(0.5)],
    lambda: [chainer.optimizer_hooks.GradientClipping(0.5),
             chainer.optimizer_hooks.WeightDecay(1e-2)],
    lambda: [chainer.optimizer_hooks.Lasso(1e-3)],
], ids=['weight decay', 'decay then clipping', 'clipping then decay',
        'lasso'])
def test_optimizer_hooks_as_chainer_calls_them(monkeypatch, hooks):
    """A lone WeightDecay hook is folded into the kernel's pass (the
    gradients left with λ·w added, as the hook leaves them); with other
    hooks Chainer calls them all in their order first. Weights,
    velocities and gradients are Chainer's bit for bit either way."""
    seen = []
    original = multi_tensor.momentum_sgd

    def spy(*args):
        seen.append(args[5] if len(args) > 5 else None)
        return original(*args)
    monkeypatch.setattr(multi_tensor, 'momentum_sgd', spy)
    expected = _grads_after(_sgd, hooks)
    got = _grads_after(_fused, hooks)
    lone = len(hooks()) == 1 and isinstance(
        hooks()[0], chainer.optimizer_hooks.WeightDecay)
    assert seen == [1e-2 if lone else None] * 3
    for name, arrays in expected.items():
        for a, b in zip(got[name], arrays):
            numpy.testing.assert_array_equal(a, b, err_msg=name)


def test_folded_weight_decay_reaches_the_parameters_chainer_updates():
    """Parameters that go Chainer's way (a hooked rule, float16) still get
    the folded WeightDecay hook, once, before their update."""
    def prepare(model):
        model.hidden[3].W.update_rule.add_hook(lambda rule, param: None,
                                               name='noop')
    expected, _ = _state(*_train(_sgd, prepare=prepare))
    got, _ = _state(*_train(_fused, prepare=prepare))
    for name, (weight, velocity, _) in expected.items():
        numpy.testing.assert_array_equal(got[name][0], weight, err_msg=name)
        numpy.testing.assert_array_equal(got[name][1], velocity, name)


def _hooked_and_disabled(model):
    calls = []
    model.hidden[3].W.update_rule.add_hook(
        lambda rule, param: calls.append(param.name), name='counter')
    model.hidden[4].b.update_rule.enabled = False
    model.calls = calls


def test_hooked_and_disabled_rules_go_chainers_way():
    expected, _ = _state(*_train(_sgd, prepare=_hooked_and_disabled))
    model, optimizer = _train(_fused, prepare=_hooked_and_disabled)
    got, _ = _state(model, optimizer)
    assert model.calls == ['W'] * 6
    assert got['/hidden/4/b'][2] == 0      # disabled: never counted
    for name, (weight, velocity, rule_t) in expected.items():
        numpy.testing.assert_array_equal(got[name][0], weight, err_msg=name)
        assert got[name][2] == rule_t, name


def _spy(monkeypatch, name):
    """The lengths of the tensor lists that multi_tensor.<name> is called
    with, the calls going through."""
    calls = []
    original = getattr(multi_tensor, name)

    def spy(tensors, *args):
        calls.append(len(tensors))
        return original(tensors, *args)
    monkeypatch.setattr(multi_tensor, name, spy)
    return calls


def test_the_fused_path_is_taken(monkeypatch):
    """Every parameter with a plain rule goes to one call per group (the
    unused head's too: Chainer gives it zero gradients)."""
    calls = _spy(monkeypatch, 'momentum_sgd')
    model, _ = _train(_fused, steps=2)
    assert calls == [46, 46] == [len(list(model.params()))] * 2


def test_snapshots_load_either_way():
    for save, load in ((_sgd, _fused), (_fused, _sgd)):
        model, optimizer = _train(save, steps=3)
        buffer = io.BytesIO()
        serializers.save_npz(buffer, optimizer)
        numpy.random.seed(0)
        other = load().setup(Net())
        buffer.seek(0)
        serializers.load_npz(buffer, other)
        assert other.t == 3
        for (name, a), (_, b) in zip(sorted(model.namedparams()),
                                     sorted(other.target.namedparams())):
            if a.update_rule.state is not None:
                numpy.testing.assert_array_equal(
                    a.update_rule.state['v'], b.update_rule.state['v'])


def test_guarded_and_graph_adapter_take_it():
    """GuardedOptimizer drives it as it drives MomentumSGD; the CUDA-graph
    adapter finds it replayable, and with the hyperparameters in device
    memory (NumPy twins here) the steps are Chainer's."""
    from chainerkfac import graphs
    runs = []
    for make in (_sgd, _fused):
        numpy.random.seed(0)
        model = Net()
        optimizer = GuardedOptimizer(make()).setup(model)
        adapter = graphs.ChainerOptimizer(optimizer.actual_optimizer,
                                          hyperparameters_on_device=True)
        assert adapter.refusal() is None
        for step, (x, t) in enumerate(_data(numpy.float32, 4)):
            optimizer.lr = 0.1 * 0.9 ** step
            adapter.before_step()
            optimizer.update(helpers.loss_of(model), x, t)
        runs.append(_state(model, optimizer)[0])
    for name, (weight, velocity, _) in runs[0].items():
        numpy.testing.assert_array_equal(runs[1][name][0], weight, name)


def test_numpy_twin_is_chainers_expression():
    rng = numpy.random.RandomState(1)
    w, g, v = (rng.randn(7).astype(numpy.float32) for _ in range(3))
    expected_v = v * numpy.float32(0.9) - numpy.float32(0.1) * g
    w2, v2 = w.copy(), v.copy()
    multi_tensor.momentum_sgd([w2], [g], [v2], 0.1, 0.9)
    numpy.testing.assert_array_equal(v2, expected_v)
    numpy.testing.assert_array_equal(w2, w + expected_v)
    multi_tensor.momentum_sgd([], [], [], 0.1, 0.9)      # nothing to do


# -- GPU ------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
def test_gpu_kernel_against_chainers(dtype):
    """46 parameters (two launches of 32), the WeightDecay hook folded into
    them: the weights and velocities of 6 steps within a few roundings of
    Chainer's (the same expression; the compiler may contract it
    differently)."""
    cupy = support.cupy_or_skip()
    expected, _ = _state(*_train(_sgd, dtype, xp=cupy))
    got, _ = _state(*_train(_fused, dtype, xp=cupy))
    unit = numpy.finfo(dtype).eps
    for name, (weight, velocity, rule_t) in expected.items():
        scale = abs(weight).max() + 1e-30
        numpy.testing.assert_allclose(got[name][0], weight, rtol=0,
                                      atol=64 * unit * scale, err_msg=name)
        assert got[name][2] == rule_t


@pytest.mark.gpu
def test_gpu_kernel_reads_device_hyperparameters():
    cupy = support.cupy_or_skip()
    rng = numpy.random.RandomState(2)
    sizes = [1, 7, 1000, 70000] * 9          # 36 tensors: two launches
    host = [[rng.randn(n).astype(numpy.float32) for n in sizes]
            for _ in range(3)]
    expected = [[a.copy() for a in group] for group in host]
    multi_tensor.momentum_sgd(*expected, 0.05, 0.8)
    on_device = (cupy.asarray(0.05, numpy.float32),
                 cupy.asarray(0.8, numpy.float64))     # cast to float32
    for lr, momentum in ((0.05, 0.8), on_device, (on_device[0], 0.8),
                         (0.05, on_device[1])):
        device = [[cupy.asarray(a) for a in group] for group in host]
        multi_tensor.momentum_sgd(*device, lr, momentum)
        # The GPU may fuse ``m·v − η·g`` into one rounding (FMA) where
        # NumPy rounds twice, and ``w + v`` cancels: each element agrees
        # to two roundings of the terms it sums, not of its own size.
        eps = numpy.finfo(numpy.float32).eps
        for (w, g, v), got_w, got_v, want_w, want_v in zip(
                zip(*host), device[0], device[2], expected[0], expected[2]):
            v_terms = 0.8 * abs(v) + 0.05 * abs(g)
            for got, want, terms in ((got_v, want_v, v_terms),
                                     (got_w, want_w, abs(w) + v_terms)):
                error = abs(cupy.asnumpy(got) - want)
                assert (error <= 2 * eps * terms).all(), (
                    error.max(), (error / (terms + 1e-30)).max())


@pytest.mark.parametrize('scalars', ['host', 'device', 'mixed'])
def test_gpu_launches_marshalled_as_the_kernel_reads_them(monkeypatch,
                                                          scalars):
    """The GPU path's launches against a stand-in kernel that reads its
    arguments as the CUDA source does (NumPy arrays for device memory):
    70 tensors in launches of at most 32, largest first, padded with
    empty slots, sizes as int64, η and m by value or by pointer as the
    flag bits say; the result is the NumPy twin's."""
    launches = []

    def kernel(grid, block, args):
        assert len(args) == 5 + 4 * multi_tensor.CHUNK
        lr_ptr, m_ptr, lr_value, m_value, flags = args[:5]
        assert isinstance(flags, numpy.int32) and block == (
            multi_tensor.THREADS,)
        assert type(lr_value) is numpy.float32
        lr = lr_ptr[()] if flags & 1 else lr_value
        momentum = m_ptr[()] if flags & 2 else m_value
        blocks, count = grid
        assert 1 <= blocks <= multi_tensor.MAX_BLOCKS
        sizes = []
        for slot in range(multi_tensor.CHUNK):
            p, g, v, n = args[5 + 4 * slot:9 + 4 * slot]
            assert isinstance(n, numpy.int64)
            if slot >= count:
                assert n == 0
                continue
            assert n == p.size == g.size == v.size
            v[...] = momentum * v - lr * g
            p += v
            sizes.append(int(n))
        assert blocks * multi_tensor.THREADS * 4 >= min(
            sizes[0], multi_tensor.MAX_BLOCKS * multi_tensor.THREADS * 4)
        launches.append(sizes)

    class FakeCupy:   # any module other than NumPy takes the GPU path
        pass
    monkeypatch.setattr(multi_tensor, 'get_array_module',
                        lambda a: FakeCupy)
    monkeypatch.setattr(multi_tensor, '_kernel', lambda op, dtype: kernel)
    rng = numpy.random.RandomState(3)
    sizes = [int(n) for n in rng.randint(1, 3000, 70)] + [300000]
    groups = [[rng.randn(n).astype(numpy.float32) for n in sizes]
              for _ in range(3)]
    expected = [[a.copy() for a in group] for group in groups]
    lr, momentum = {
        'host': (0.05, 0.8),
        'device': (numpy.asarray(0.05, numpy.float32),
                   numpy.asarray(0.8, numpy.float64)),
        'mixed': (numpy.asarray(0.05, numpy.float32), 0.8)}[scalars]
    multi_tensor.momentum_sgd(*groups, lr, momentum)
    assert [len(s) for s in launches] == [32, 32, 7]
    flat = [n for s in launches for n in s]
    assert flat == sorted(sizes, reverse=True)
    for k in range(len(sizes)):      # the kernel's expression, in float32
        w, g, v = (group[k] for group in expected)
        v[...] = numpy.float32(0.8) * v - numpy.float32(0.05) * g
        w += v
        numpy.testing.assert_array_equal(groups[0][k], w)
        numpy.testing.assert_array_equal(groups[2][k], v)


# -- K-FAC's update and the device guard's check in multi-tensor kernels -----
class DeviceLike(numpy.ndarray):
    """A NumPy array that K-FAC's update takes for a device array (its
    fused path), computed by the NumPy twins."""


def _kfac_params(seed):
    from chainerkfac.optimizers.update_rule import KFACRule
    rng = numpy.random.RandomState(seed)
    params, directions = [], []
    for k, shape in enumerate([(3, 4), (5,), (2, 2), (7,), (4, 3), (6,)]):
        param = chainer.Parameter(
            rng.randn(*shape).astype(numpy.float32).view(DeviceLike))
        param.update_rule = KFACRule(lr=0.1, momentum=0.9)
        params.append(param)
        directions.append(rng.randn(*shape).astype(numpy.float32).view(
            DeviceLike))
    params[0].update_rule.rescale_norm = 2.0           # eq. (20)
    params[1].update_rule.add_hook(lambda rule, p: None, name='hook')
    params[2].update_rule.enabled = False
    return params, directions


def test_kfac_update_fuses_the_plain_rules(monkeypatch):
    """apply_all: the plain rules go to one multi-tensor call per group
    (here its NumPy twin), those with eq. (20) to one of their own; the
    hooked and the disabled rule by rule; two steps equal the rules' own
    updates bit for bit."""
    from chainerkfac.optimizers import update_rule
    seen = _spy(monkeypatch, 'momentum_step')
    fused, directions = _kfac_params(4)
    plain, _ = _kfac_params(4)
    for step in range(2):
        update_rule.apply_all(list(zip(fused, directions)))
        for param, direction in zip(plain, directions):
            param.update_rule.direction = direction
            param.update()
    assert seen == [1, 3] * 2   # the rescaled one (eq. 20), the plain ones
    for a, b in zip(fused, plain):
        numpy.testing.assert_array_equal(a.array, b.array)
        assert a.update_rule.t == b.update_rule.t
        # consumed by an update (a disabled rule keeps it, as before)
        assert (a.update_rule.direction is None) == (
            b.update_rule.direction is None)
        if b.update_rule.state is not None:
            numpy.testing.assert_array_equal(a.update_rule.state['v'],
                                             b.update_rule.state['v'])
    assert [p.update_rule.t for p in fused] == [2, 2, 0, 2, 2, 2]


@pytest.mark.parametrize('op', ['momentum_step', 'nonfinite'])
def test_other_kernels_marshalled_as_they_read_them(monkeypatch, op):
    """K-FAC's step and the finite check through a stand-in kernel, as in
    the SGD test: the slots' tensors in the source's order."""
    seen = []

    def kernel(grid, block, args):
        head = 5 if op == 'momentum_step' else 1
        width = 4 if op == 'momentum_step' else 2
        assert len(args) == head + width * multi_tensor.CHUNK
        for slot in range(grid[1]):
            tensors = args[head + width * slot:head + width * (slot + 1)]
            assert all(t.size == tensors[-1] for t in tensors[:-1])
            if op == 'nonfinite':
                if not numpy.isfinite(tensors[0]).all():
                    args[0][0] = 1
                continue
            lr, momentum = numpy.float32(0.1), numpy.float32(0.9)
            w, d, v = tensors[:3]
            step = momentum * v - lr * d
            new = w + step
            v[...] = new - w
            w[...] = new
        seen.append(grid[1])

    class FakeCupy:
        pass
    monkeypatch.setattr(multi_tensor, 'get_array_module',
                        lambda a: FakeCupy)
    monkeypatch.setattr(multi_tensor, '_kernel', lambda o, dtype: kernel)
    rng = numpy.random.RandomState(5)
    arrays = [rng.randn(n).astype(numpy.float32) for n in range(1, 40)]
    if op == 'nonfinite':
        flag = numpy.zeros(1, numpy.int32)
        multi_tensor.flag_nonfinite(arrays, flag)
        assert flag[0] == 0 and seen == [32, 7]
        arrays[17][3] = numpy.inf
        multi_tensor.flag_nonfinite(arrays, flag)
        assert flag[0] == 1
        return
    weights = [a.copy() for a in arrays]
    velocities = [numpy.zeros_like(a) for a in arrays]
    multi_tensor.momentum_step(weights, velocities, arrays, 0.1, 0.9)
    from chainerkfac import fused
    for w0, w, v, d in zip([a.copy() for a in arrays], weights, velocities,
                           arrays):
        expected_w, expected_v = w0.copy(), numpy.zeros_like(w0)
        fused.momentum_step(expected_w, expected_v, d, 0.1, 0.9)
        numpy.testing.assert_array_equal(w, expected_w)
        numpy.testing.assert_array_equal(v, expected_v)


def test_rescaled_step_marshalled_as_the_kernels_read_it(monkeypatch):
    """Eq. (20) in two launches per chunk through stand-in kernels that
    read the arguments as the CUDA sources do: the first writes each
    block's sum of squares of the unscaled weights (the elements a block's
    grid-stride loop visits), the second adds a tensor's sums in order and
    rescales; the result is fused.momentum_step's within float32
    rounding (its norm sums in another order)."""
    from chainerkfac import fused
    launches = []

    def kernels(op, dtype):
        def unscaled(grid, block, args):
            lr, momentum = args[2], args[3]
            partials = args[5]
            blocks, count = grid
            assert partials.shape == (count, blocks)
            for slot in range(count):
                w, d, v, n = args[6 + 4 * slot:10 + 4 * slot]
                v[...] = w + (momentum * v - lr * d)
                owner = (numpy.arange(n) // multi_tensor.THREADS) % blocks
                for b in range(blocks):
                    chosen = v[owner == b].astype(numpy.float64)
                    partials[slot, b] = (chosen * chosen).sum()
            launches.append(('unscaled', grid))

        def rescaled(grid, block, args):
            partials, eps = args[:2]
            assert launches[-1] == ('unscaled', grid)   # the same grid
            for slot in range(grid[1]):
                w, v, target, n = args[2 + 4 * slot:6 + 4 * slot]
                assert isinstance(target, numpy.float32)
                norm = numpy.float32(numpy.sqrt(partials[slot].sum()))
                factor = target / (norm + eps)
                scaled = v * factor
                v[...] = scaled - w
                w[...] = scaled
            launches.append(('rescaled', grid))
        return {'unscaled': unscaled, 'rescaled': rescaled}[op]

    class FakeCupy:
        @staticmethod
        def empty(shape, dtype):
            return numpy.full(shape, numpy.nan, dtype)
    monkeypatch.setattr(multi_tensor, 'get_array_module',
                        lambda a: FakeCupy)
    monkeypatch.setattr(multi_tensor, '_kernel', kernels)
    rng = numpy.random.RandomState(6)
    sizes = [1, 5, 700, 3000, 300000] * 8            # 40: two chunks
    directions = [rng.randn(n).astype(numpy.float32) for n in sizes]
    weights = [rng.randn(n).astype(numpy.float32) for n in sizes]
    velocities = [rng.randn(n).astype(numpy.float32) * 0.1 for n in sizes]
    targets = [float(k + 1) for k in range(len(sizes))]
    expected = [(w.copy(), v.copy()) for w, v in zip(weights, velocities)]
    multi_tensor.momentum_step(weights, velocities, directions, 0.1, 0.9,
                               targets)
    assert [op for op, _ in launches] == ['unscaled', 'rescaled'] * 2
    assert max(grid[0] for _, grid in launches) > 1    # several blocks
    for k, ((w, v), d) in enumerate(zip(expected, directions)):
        fused.momentum_step(w, v, d, 0.1, 0.9, targets[k])
        numpy.testing.assert_allclose(weights[k], w, rtol=2e-6,
                                      atol=2e-6 * abs(w).max())
        assert abs(numpy.linalg.norm(weights[k]) - targets[k]) < \
            1e-5 * targets[k]


@pytest.mark.gpu
@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
@pytest.mark.parametrize('rescaled', [False, True])
def test_gpu_kfac_step_kernels_against_per_parameter(dtype, rescaled):
    """K-FAC's eq. (19) (and 20) for 40 weights in multi-tensor kernels
    against fused.momentum_step weight by weight on the GPU: the same
    expressions, the norms summed in another order."""
    cupy = support.cupy_or_skip()
    from chainerkfac import fused
    rng = numpy.random.RandomState(7)
    sizes = [1, 5, 700, 3000, 300000] * 8
    host = [[rng.randn(n).astype(dtype) for n in sizes] for _ in range(3)]
    targets = [float(k + 1) for k in range(len(sizes))] if rescaled \
        else None
    weights, velocities, directions = ([cupy.asarray(a) for a in group]
                                       for group in host)
    multi_tensor.momentum_step(weights, velocities, directions, 0.1, 0.9,
                               targets)
    unit = numpy.finfo(dtype).eps
    for k in range(len(sizes)):
        w, v, d = (cupy.asarray(group[k]) for group in host)
        fused.momentum_step(w, v, d, 0.1, 0.9,
                            None if targets is None else targets[k])
        scale = float(abs(w).max())
        numpy.testing.assert_allclose(cupy.asnumpy(weights[k]),
                                      cupy.asnumpy(w), rtol=0,
                                      atol=16 * unit * scale)
