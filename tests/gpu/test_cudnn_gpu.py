"""chainerkfac.cudnn on a GPU: each Chainer function with cuDNN
(``use_cudnn='always'``) against Chainer's own path (``'never'``) on
ResNet-50's shapes, float64 and float32 in exact FMA math
(``use_cudnn_tensor_core='never'``), each output to a bound from its
reduction length (:func:`bound`); gradient checks; one ResNet-50 SGD step
(float64: a whole network is compared where float64 can give it) and
K-FAC's factors either way; dropout; what is not served.

Needs the backend installed (the default; not with ``CHAINERKFAC_CUDNN=0``
in the environment of the pytest process: ``tests/gpu/run.sh`` then runs
this module apart with ``CHAINERKFAC_CUDNN=1``); skipped with the reason
otherwise, and on a machine without CuPy or a GPU.
"""
import contextlib
import math

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import gradient_check

import chainerkfac
import models
from chainerkfac.cudnn import not_served
from chainerkfac.cudnn import runtime
from tests.chainerkfac import helpers
from tests.gpu import support

INSTALLED = chainerkfac.cudnn.describe().startswith('cuDNN 9')
pytestmark = support.MARKS + [pytest.mark.skipif(
    support.SKIP_REASON is None and not INSTALLED,
    reason='chainerkfac.cudnn is not installed: {} (run without '
    'CHAINERKFAC_CUDNN=0)'.format(chainerkfac.cudnn.describe()))]

DTYPES = [numpy.float32, numpy.float64]


def bound(dtype, length):
    """How far two correct computations of a sum of ``length`` products
    may be apart, relative to the largest result: each rounds with an
    error of about λ·√length·u relative to the result (the probabilistic
    bound of Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019; the sums of
    cuDNN's algorithms and of Chainer's GEMMs are ordered differently), two
    of them 2λ√length·u; λ = 8. For a 3x3 convolution's weight gradient at
    56², batch 2 (6,272 terms) in float32 that is 7.5e-5; measured on an
    H100 (2026-11-24): 1.13e-5."""
    unit = numpy.finfo(dtype).eps / 2
    return 16 * math.sqrt(max(length, 1)) * unit


def conv_lengths(x_shape, w_shape, y_shape, groups=1):
    """Terms summed per element of a convolution's y, gx, gW and gb."""
    kernel = int(numpy.prod(w_shape[2:]))
    positions = int(numpy.prod(y_shape[2:]))
    return {'y': w_shape[1] * kernel,
            'gx': w_shape[0] // groups * kernel,
            'gW': x_shape[0] * positions,
            'gb': x_shape[0] * positions}


@contextlib.contextmanager
def recorded_calls(monkeypatch):
    """The names of the cuDNN functions called inside the block."""
    lib = runtime.current().lib
    names = []
    call = lib.call

    def recording(name, *args):
        names.append(name)
        return call(name, *args)
    monkeypatch.setattr(lib, 'call', recording)
    yield names
    monkeypatch.undo()


def _random(shape, dtype, seed):
    rng = numpy.random.RandomState(seed)
    return rng.standard_normal(shape).astype(dtype)


def both_ways(monkeypatch, function, inputs, dtype, expect):
    """Outputs and input gradients of ``function`` with cuDNN and with
    Chainer's own path, on GPU copies of ``inputs``; asserts that cuDNN
    call ``expect`` was made (and not on Chainer's path)."""
    results = {}
    for mode in ('always', 'never'):
        with chainer.using_config('use_cudnn', mode), \
                chainer.using_config('use_cudnn_tensor_core', 'never'), \
                recorded_calls(monkeypatch) as names:
            variables = [chainer.Variable(support.to_gpu(a))
                         for a in inputs]
            y = function(*variables)
            y.grad = support.to_gpu(_random(y.shape, dtype, 99))
            y.backward()
            results[mode] = [y.array] + [v.grad for v in variables]
        assert (expect in names) == (mode == 'always'), (mode, names)
    return results['always'], results['never']


def assert_close(actual, expected, tol, what=''):
    a = numpy.asarray(support.to_cpu(actual), numpy.float64)
    e = numpy.asarray(support.to_cpu(expected), numpy.float64)
    assert a.shape == e.shape, what
    scale = max(float(numpy.max(numpy.abs(e))), 1e-300)
    error = float(numpy.max(numpy.abs(a - e))) / scale
    assert error <= tol, '{}: error {:.3g} of the largest value > {:g}'.format(
        what, error, tol)


def assert_all_close(cudnn, chainer_path, dtype, names, lengths):
    """Each output within :func:`bound` of its reduction length
    (``lengths[name]``, or ``lengths[None]`` for every name)."""
    for name, a, e in zip(names, cudnn, chainer_path):
        length = lengths.get(name, lengths.get(None))
        assert_close(a, e, bound(dtype, length), name)


# ResNet-50's convolutions, batch 2: x shape, W shape, stride, pad, groups
CONVS = {
    '7x7/2': ((2, 3, 224, 224), (64, 3, 7, 7), 2, 3, 1),
    '1x1': ((2, 256, 56, 56), (64, 256, 1, 1), 1, 0, 1),
    '3x3': ((2, 64, 56, 56), (64, 64, 3, 3), 1, 1, 1),
    '1x1/2': ((2, 256, 56, 56), (512, 256, 1, 1), 2, 0, 1),
    '3x3 grouped': ((2, 128, 28, 28), (128, 4, 3, 3), 1, 1, 32),
}


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('bias', [False, True])
@pytest.mark.parametrize('name', sorted(CONVS))
def test_convolution(monkeypatch, name, bias, dtype):
    x_shape, w_shape, stride, pad, groups = CONVS[name]
    inputs = [_random(x_shape, dtype, 0), _random(w_shape, dtype, 1) * 0.1]
    if bias:
        inputs.append(_random(w_shape[:1], dtype, 2))

    def conv(*args):
        return F.convolution_2d(*args, stride=stride, pad=pad, groups=groups)
    cudnn, own = both_ways(monkeypatch, conv, inputs, dtype,
                           'cudnnConvolutionForward')
    assert_all_close(cudnn, own, dtype, ['y', 'gx', 'gW', 'gb'],
                     conv_lengths(x_shape, w_shape, own[0].shape, groups))


@pytest.mark.parametrize('dtype', DTYPES)
def test_deconvolution_with_bias_and_dilation(monkeypatch, dtype):
    inputs = [_random((2, 64, 28, 28), dtype, 0),
              _random((64, 32, 3, 3), dtype, 1) * 0.1,
              _random((32,), dtype, 2)]

    def deconv(x, W, b):
        return F.deconvolution_2d(x, W, b, stride=2, pad=1, dilate=2)
    cudnn, own = both_ways(monkeypatch, deconv, inputs, dtype,
                           'cudnnConvolutionBackwardData')
    # The transposed convolution: y is a convolution's gx, gx its y.
    y_shape = own[0].shape
    assert_all_close(cudnn, own, dtype, ['y', 'gx', 'gW', 'gb'], {
        'y': 32 * 9, 'gx': 32 * 9, 'gW': 2 * 28 * 28,
        'gb': 2 * y_shape[2] * y_shape[3]})


@pytest.mark.parametrize('dtype', DTYPES)
def test_convolution_3d(monkeypatch, dtype):
    inputs = [_random((2, 4, 6, 7, 8), dtype, 0),
              _random((5, 4, 3, 3, 3), dtype, 1)]

    def conv(x, W):
        return F.convolution_nd(x, W, stride=(1, 2, 1), pad=1)
    cudnn, own = both_ways(monkeypatch, conv, inputs, dtype,
                           'cudnnConvolutionForward')
    assert_all_close(cudnn, own, dtype, ['y', 'gx', 'gW'],
                     conv_lengths(inputs[0].shape, inputs[1].shape,
                                  own[0].shape))


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('shape', [(2, 64, 56, 56), (32, 1000)])
@pytest.mark.parametrize('fast', [False, True])
def test_batch_normalization(monkeypatch, shape, dtype, fast):
    """Training forward and backward, the running statistics, then
    inference with them (``cudnn_fast_batch_normalization``: the
    persistent kernel, as the paper's script)."""
    channels = shape[1]
    x = _random(shape, dtype, 0) * 3 + 1
    gy = _random(shape, dtype, 9)
    x2 = _random(shape, dtype, 5)
    trained, inferred = {}, {}
    for mode in ('always', 'never'):
        bn = L.BatchNormalization(channels, dtype=dtype)
        bn.gamma.array[...] = _random((channels,), dtype, 3)
        bn.beta.array[...] = _random((channels,), dtype, 4)
        bn.to_device(support.device())
        # Chainer fills a parameter's gradient with NaN until a backward
        # pass writes it: clear first, or γ's and β's gradients are NaN on
        # both paths and the comparison cannot pass.
        bn.cleargrads()
        x_var = chainer.Variable(support.to_gpu(x))
        with chainer.using_config('use_cudnn', mode), \
                chainer.using_config('cudnn_fast_batch_normalization', fast), \
                recorded_calls(monkeypatch) as names:
            y = bn(x_var)
            y.grad = support.to_gpu(gy)
            y.backward()
            with chainer.using_config('train', False):
                y2 = bn(support.to_gpu(x2))
        assert ('cudnnBatchNormalizationForwardTrainingEx' in names) == \
            (mode == 'always')
        assert ('cudnnBatchNormalizationForwardInference' in names) == \
            (mode == 'always')
        trained[mode] = [y.array, x_var.grad, bn.gamma.grad, bn.beta.grad,
                         bn.avg_mean, bn.avg_var]
        assert all(bool(numpy.isfinite(support.to_cpu(a)).all())
                   for a in trained[mode]), mode
        inferred[mode] = y2.array
    # Every statistic and parameter gradient sums over a channel's values.
    per_channel = int(numpy.prod(shape)) // channels
    assert_all_close(trained['always'], trained['never'], dtype,
                     ['y', 'gx', 'ggamma', 'gbeta', 'avg_mean', 'avg_var'],
                     {None: per_channel})
    assert_close(inferred['always'], inferred['never'],
                 bound(dtype, per_channel), 'inference')


@pytest.mark.parametrize('dtype', DTYPES)
def test_pooling(monkeypatch, dtype):
    x = [_random((2, 64, 112, 112), dtype, 0)]
    cudnn, own = both_ways(
        monkeypatch, lambda v: F.max_pooling_2d(v, 3, 2, 1, cover_all=False),
        x, dtype, 'cudnnPoolingForward')
    assert_all_close(cudnn, own, dtype, ['max y', 'max gx'], {None: 9})
    cudnn, own = both_ways(monkeypatch,
                           lambda v: F.average_pooling_2d(v, 2, 2), x, dtype,
                           'cudnnPoolingBackward')
    assert_all_close(cudnn, own, dtype, ['avg y', 'avg gx'], {None: 4})
    x3 = [_random((2, 4, 6, 6, 6), dtype, 1)]
    cudnn, own = both_ways(
        monkeypatch,
        lambda v: F.average_pooling_nd(v, 2, pad=1, pad_value=None),
        x3, dtype, 'cudnnPoolingForward')
    assert_all_close(cudnn, own, dtype, ['avg nd y', 'avg nd gx'],
                     {None: 8})


@pytest.mark.parametrize('dtype', DTYPES)
def test_softmax_cross_entropy_and_activations(monkeypatch, dtype):
    logits = [_random((32, 1000), dtype, 0) * 4]
    t = support.to_gpu(numpy.random.RandomState(1).randint(
        0, 1000, 32).astype(numpy.int32))
    cudnn, own = both_ways(
        monkeypatch, lambda y: F.softmax_cross_entropy(y, t), logits, dtype,
        'cudnnSoftmaxForward')
    # sums over the 1000 classes (and the loss over the 32 samples)
    assert_all_close(cudnn, own, dtype, ['loss', 'gy'], {None: 32 * 1000})
    for function in (F.softmax, F.log_softmax):
        cudnn, own = both_ways(monkeypatch, function, logits, dtype,
                               'cudnnSoftmaxBackward')
        assert_all_close(cudnn, own, dtype, [function.__name__] * 2,
                         {None: 1000})
    x = [_random((2, 64, 56, 56), dtype, 2)]
    for function in (F.relu, F.sigmoid, F.tanh,
                     lambda v: F.clipped_relu(v, 1.5)):
        cudnn, own = both_ways(monkeypatch, function, x, dtype,
                               'cudnnActivationForward')
        # elementwise: a few units in the last place
        assert_all_close(cudnn, own, dtype,
                         ['activation y', 'activation gx'], {None: 1})


def test_group_normalization(monkeypatch):
    dtype = numpy.float64
    inputs = [_random((2, 8, 5, 5), dtype, 0), _random((8,), dtype, 1),
              _random((8,), dtype, 2)]
    cudnn, own = both_ways(
        monkeypatch, lambda x, g, b: F.group_normalization(x, 4, g, b),
        inputs, dtype, 'cudnnBatchNormalizationForwardTrainingEx')
    assert_all_close(cudnn, own, dtype, ['y', 'gx', 'ggamma', 'gbeta'],
                     {None: 2 * 2 * 5 * 5})     # a group's values


GRADIENT_CHECKS = {
    'convolution 3x3/2 with bias': (
        lambda x, W, b: F.convolution_2d(x, W, b, stride=2, pad=1),
        [(2, 3, 7, 7), (4, 3, 3, 3), (4,)]),
    'grouped convolution': (
        lambda x, W: F.convolution_2d(x, W, pad=1, groups=2),
        [(2, 4, 5, 5), (6, 2, 3, 3)]),
    'deconvolution': (lambda x, W: F.deconvolution_2d(x, W, stride=2),
                      [(2, 3, 4, 4), (3, 2, 3, 3)]),
    'batch normalization': (
        lambda x, g, b: F.batch_normalization(x, g, b),
        [(5, 3, 4, 4), (3,), (3,)]),
    'max pooling': (lambda x: F.max_pooling_2d(x, 3, 2, 1, cover_all=False),
                    [(2, 3, 7, 7)]),
    'average pooling': (lambda x: F.average_pooling_2d(x, 2, 2),
                        [(2, 3, 6, 6)]),
    'log softmax': (F.log_softmax, [(4, 7)]),
    'relu': (F.relu, [(3, 5)]),
}
#: Inputs whose values must stay apart (max) or away from 0 (relu) for
#: finite differences: a shuffled grid with steps of 0.1.
SEPARATED = ('max pooling', 'relu')


def _separated(shape, seed):
    size = int(numpy.prod(shape))
    grid = (numpy.arange(size) - (size - 1) / 2) * 0.1 + 0.05
    return numpy.random.RandomState(seed).permutation(grid).reshape(shape)


@pytest.mark.parametrize('name', sorted(GRADIENT_CHECKS))
def test_check_backward(name):
    function, shapes = GRADIENT_CHECKS[name]
    make = _separated if name in SEPARATED else (
        lambda shape, seed: _random(shape, numpy.float64, seed))
    inputs = tuple(support.to_gpu(make(s, i)) for i, s in enumerate(shapes))
    with chainer.using_config('use_cudnn', 'always'):
        y_shape = function(*inputs).shape
        gy = support.to_gpu(_random(y_shape, numpy.float64, 50))
        gradient_check.check_backward(function, inputs, gy, eps=1e-3,
                                      dtype=numpy.float64, atol=1e-6,
                                      rtol=1e-5)


def test_dropout(monkeypatch):
    x = support.to_gpu(numpy.ones((256, 512), numpy.float32))
    with chainer.using_config('use_cudnn', 'always'), \
            recorded_calls(monkeypatch) as names:
        v = chainer.Variable(x)
        y = F.dropout(v, 0.25)
        y.grad = support.to_gpu(numpy.full(y.shape, 2, numpy.float32))
        y.backward()
    assert 'cudnnDropoutForward' in names
    kept = support.to_cpu(y.array) != 0
    assert abs(kept.mean() - 0.75) < 0.01
    numpy.testing.assert_allclose(support.to_cpu(y.array)[kept], 1 / 0.75,
                                  rtol=1e-6)
    numpy.testing.assert_allclose(
        support.to_cpu(v.grad), numpy.where(kept, 2 / 0.75, 0), rtol=1e-6)


def test_not_served_functions_name_the_way_out():
    xs = [support.to_gpu(_random((3, 4), numpy.float32, i))
          for i in range(2)]
    link = L.NStepLSTM(1, 4, 5, 0.0)
    link.to_device(support.device())
    with chainer.using_config('use_cudnn', 'always'):
        with pytest.raises(not_served.NotServedError, match="'never'"):
            link(None, None, xs)
    with chainer.using_config('use_cudnn', 'never'):
        hy, cy, ys = link(None, None, xs)
    assert ys[0].shape == (3, 5)
    theta = support.to_gpu(numpy.tile(numpy.eye(2, 3, dtype=numpy.float32),
                                      (2, 1, 1)))
    with chainer.using_config('use_cudnn', 'always'):
        with pytest.raises(not_served.NotServedError,
                           match='spatial_transformer'):
            F.spatial_transformer_grid(theta, (5, 5))
    with chainer.using_config('use_cudnn', 'never'):
        assert F.spatial_transformer_grid(theta, (5, 5)).shape == (2, 2, 5, 5)


# -- whole steps --------------------------------------------------------------
def _resnet50(seed=0, dtype=numpy.float32):
    numpy.random.seed(seed)
    with chainer.using_config('dtype', dtype):
        model = models.SoftLabelClassifier(models.build_model('resnet50'))
    model.to_device(support.device())
    return model


def test_resnet50_sgd_step_either_way(monkeypatch):
    """One momentum-SGD step of ResNet-50 (batch 4, float64) with cuDNN
    and on Chainer's own path: the same loss, gradients and weights.

    Float64, because a whole network is compared: in float32 each path's
    gradients of this random-initialised ResNet-50 are ~2 % (median) and up
    to 19 % off their float64 values (measured on an H100, 2026-11-24), so
    a float32 comparison says nothing. The bound, 1e-11 of each gradient's
    largest entry: float64 sums over up to 200,704 terms per layer through
    53 layers (`bound` gives 1e-12 for one such sum; the errors add over
    the depth); measured 2.6e-13 (median 7e-14 over the 161 gradients)."""
    rng = numpy.random.RandomState(1)
    x = support.to_gpu(rng.standard_normal((4, 3, 224, 224)))
    t = support.to_gpu(rng.randint(0, 1000, 4).astype(numpy.int32))
    weights, losses, grads = {}, {}, {}
    for mode in ('always', 'never'):
        model = _resnet50(dtype=numpy.float64)
        optimizer = chainer.optimizers.MomentumSGD(lr=0.1, momentum=0.9)
        optimizer.setup(model)
        with chainer.using_config('use_cudnn', mode), \
                recorded_calls(monkeypatch) as names:
            loss = model(x, t)
            model.cleargrads()
            loss.backward()
            grads[mode] = {name: support.to_cpu(param.grad)
                           for name, param in model.namedparams()}
            optimizer.update()
        assert ('cudnnConvolutionBackwardFilter' in names) == \
            (mode == 'always')
        losses[mode] = float(loss.array)
        weights[mode] = support.weights(model)
    assert abs(losses['always'] - losses['never']) <= 1e-12 * abs(
        losses['never'])
    assert len(grads['never']) == 161
    for name, expected in grads['never'].items():
        assert numpy.isfinite(expected).all(), name
        assert_close(grads['always'][name], expected, 1e-11, name)
    diff = support.max_relative_diff(weights['always'], weights['never'])
    assert diff <= 1e-11, diff


def test_kfac_factors_either_way():
    """K-FAC's captured factors after one update of the small ResNet in
    float64 (public attributes only: ``optimizer.blocks``, each block's
    ``name`` and ``factors``)."""
    rng = numpy.random.RandomState(2)
    x = support.to_gpu(rng.standard_normal((16, 3, 32, 32)))
    t = support.to_gpu(rng.randint(0, 10, 16).astype(numpy.int32))
    factors = {}
    for mode in ('always', 'never'):
        numpy.random.seed(0)
        with chainer.using_config('dtype', numpy.float64):
            model = models.SoftLabelClassifier(models.build_model(
                'small', n_class=10, depth=8, width=16))
        model.to_device(support.device())
        optimizer = chainerkfac.optimizers.KFAC(lr=0.01, verbose=False)
        optimizer.setup(model)
        with chainer.using_config('use_cudnn', mode):
            optimizer.update(model, x, t)
        factors[mode] = {(block.name, name): support.to_cpu(
                             helpers.dense(value))
                         for block in optimizer.blocks
                         for name, value in block.factors.items()}
    assert factors['always'] and factors['always'].keys() == \
        factors['never'].keys()
    for key, value in factors['never'].items():
        assert_close(factors['always'][key], value, 1e-10, str(key))
