"""The cuDNN calls of a training step, replayed on a CPU against the
recording fake (tests/chainerkfac/cudnn_fake.py).

Chainer takes its cuDNN path only for CuPy arrays, so on a CPU the step
itself cannot call the backend. :func:`record` runs one forward and
backward pass of a model on NumPy arrays and records, with a
:class:`chainer.FunctionHook`, every function node that Chainer 7.8.1's GPU
path would hand to cuDNN (``use_cudnn='auto'``), with its inputs' shapes
and parameters; :func:`replay` then makes, for each, the backend call that
Chainer's ``forward_gpu`` makes (``chainer/functions/...``: convolution
forward, its gradients ``deconvolution_2d`` and ``Convolution2DGradW``,
batch normalization and its gradient, ReLU and its gradient, max pooling
and its gradient, the log-softmax of ``softmax_cross_entropy``), on zeros
of those shapes. Functions Chainer computes without cuDNN (``F.mean``,
``F.linear``, additions, the cross-entropy's gradient) are not recorded.
"""
from typing import List, NamedTuple, Tuple

import numpy

import chainer

from chainerkfac.cudnn import constants as C
from chainerkfac.cudnn import highlevel

#: Chainer 7.8.1's defaults on the GPU path.
EPS, DECAY = 2e-5, 0.9


class Event(NamedTuple):
    """One backend call of the step: its name and what it is made of."""

    call: str
    shapes: Tuple[Tuple[int, ...], ...]
    params: tuple


def _pairs(node, names):
    return tuple(tuple(getattr(node, n) for n in pair) for pair in names)


class Recorder(chainer.FunctionHook):
    """Records the cuDNN calls of the function nodes applied while active
    (module docstring)."""

    name = 'cudnn_calls'

    def __init__(self):
        self.events: List[Event] = []

    def forward_preprocess(self, function, in_data):
        kind = type(function).__name__
        shapes = tuple(tuple(a.shape) for a in in_data)
        if kind == 'Convolution2DFunction':
            x, w = shapes[:2]
            pad, stride, dilation = _pairs(
                function, (('ph', 'pw'), ('sy', 'sx'), ('dy', 'dx')))
            out = tuple(
                chainer.utils.conv.get_conv_outsize(
                    size, k, s, p, cover_all=function.cover_all, d=d)
                for size, k, s, p, d in zip(x[2:], w[2:], stride, pad,
                                            dilation))
            y = (x[0], w[0]) + out
            self._add('convolution_forward', (x, w, y),
                      (pad, stride, dilation, function.groups))
        elif kind == 'Deconvolution2DFunction':   # a convolution's gx
            gy, w = shapes[:2]
            gx = (gy[0], w[1] * function.groups, function.outh,
                  function.outw)
            self._add('convolution_backward_data', (w, gy, gx), _pairs(
                function, (('ph', 'pw'), ('sy', 'sx'), ('dy', 'dx'))) +
                (function.groups,))
        elif kind == 'Convolution2DGradW':
            x, gy = shapes
            self._add('convolution_backward_filter',
                      (x, gy, tuple(function.W_shape)), _pairs(
                          function, (('ph', 'pw'), ('sy', 'sx'),
                                     ('dy', 'dx'))) + (function.groups,))
        elif kind == 'BatchNormalization':
            self._add('batch_normalization_forward_training_ex', shapes[:2],
                      ())
        elif kind == 'BatchNormalizationGrad':
            self._add('batch_normalization_backward', shapes, ())
        elif kind == 'ReLU':
            self._add('activation_forward', shapes, ())
        elif kind in ('ReLUGrad2', 'ReLUGradCudnn'):
            self._add('activation_backward', shapes, ())
        elif kind == 'MaxPoolingND':
            x, = shapes
            out = tuple(
                chainer.utils.conv.get_conv_outsize(
                    size, k, s, p, cover_all=function.cover_all)
                for size, k, s, p in zip(x[2:], function.ksize,
                                         function.stride, function.pad))
            self._add('pooling_forward', (x, x[:2] + out), (
                function.ksize, function.stride, function.pad))
        elif kind == 'MaxPoolingNDGrad':
            forward = function.func
            gy, = shapes
            self._add('pooling_backward', (tuple(forward._in_shape), gy),
                      (forward.ksize, forward.stride, forward.pad))
        elif kind == 'SoftmaxCrossEntropy':
            self._add('softmax_forward', shapes[:1], ())

    def _add(self, call, shapes, params):
        self.events.append(Event(call, shapes, params))


def record(model, x, t) -> List[Event]:
    """The cuDNN calls of one forward and backward pass of ``model(x, t)``
    (a loss), in order."""
    recorder = Recorder()
    model.cleargrads()
    with recorder:
        loss = model(x, t)
        loss.backward()
    return recorder.events


def replay(events, dtype=numpy.float32) -> None:
    """Make the backend calls of ``events`` on zeros of their shapes, as
    Chainer's GPU path makes them."""
    options = dict(auto_tune=False, tensor_core='auto')
    backward = dict(options, deterministic=False)
    reserve = None   # the last forward's (the fake reads none)

    def z(shape):
        return numpy.zeros(shape, dtype)

    for event in events:
        s, p = event.shapes, event.params
        if event.call == 'convolution_forward':
            highlevel.convolution_forward(
                z(s[0]), z(s[1]), None, numpy.empty(s[2], dtype), *p,
                **options)
        elif event.call == 'convolution_backward_data':
            highlevel.convolution_backward_data(
                z(s[0]), z(s[1]), None, numpy.empty(s[2], dtype), *p,
                **backward)
        elif event.call == 'convolution_backward_filter':
            highlevel.convolution_backward_filter(
                z(s[0]), z(s[1]), numpy.empty(s[2], dtype), *p, **backward)
        elif event.call == 'batch_normalization_forward_training_ex':
            channels = s[1][0]
            reserve, *_ = highlevel.batch_normalization_forward_training_ex(
                z(s[0]), z(channels), z(channels), z(channels),
                z(channels), None, None, EPS, DECAY, True,
                C.CUDNN_BATCHNORM_SPATIAL, False)
        elif event.call == 'batch_normalization_backward':
            channels = s[1][0]
            highlevel.batch_normalization_backward(
                z(s[0]), z(channels), z(s[2]), z(channels), z(channels), EPS,
                True, C.CUDNN_BATCHNORM_SPATIAL, False,
                reserve_space=reserve)
        elif event.call == 'activation_forward':
            highlevel.activation_forward(z(s[0]), C.CUDNN_ACTIVATION_RELU)
        elif event.call == 'activation_backward':
            y = z(s[0])   # Chainer passes y as x too
            highlevel.activation_backward(y, y, z(s[0]),
                                          C.CUDNN_ACTIVATION_RELU)
        elif event.call == 'pooling_forward':
            highlevel.pooling_forward(z(s[0]), numpy.empty(s[1], dtype), *p,
                                      C.CUDNN_POOLING_MAX)
        elif event.call == 'pooling_backward':
            x = z(s[0])
            highlevel.pooling_backward(x, z(s[1]), z(s[1]), *p,
                                       C.CUDNN_POOLING_MAX)
        elif event.call == 'softmax_forward':
            highlevel.softmax_forward(z(s[0]), 1, C.CUDNN_SOFTMAX_LOG)
        else:
            raise ValueError(event.call)
