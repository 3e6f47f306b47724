"""Small float64 residual networks and their layer-serial reference
gradients (Chainer's own backprop through ``net(x)``)."""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import numpy

import chainer
import chainer.functions as F

from chainerkfac import layer_parallel as lp


def dense_net(n_layers=24, width=4, n_in=2, n_out=3, seed=0, **kwargs):
    """A dense ResidualODE with weights drawn from ``seed``."""
    numpy.random.seed(seed)
    with chainer.using_config('dtype', numpy.float64):
        return lp.ResidualODE(n_in=n_in, width=width, n_layers=n_layers,
                              n_out=n_out, **kwargs)


def conv_net(n_layers=9, width=2, size=4, n_out=3, seed=0, **kwargs):
    """A convolutional ResidualODE on ``size``² single-channel images."""
    numpy.random.seed(seed)
    kwargs.setdefault('activation', 'tanh')
    with chainer.using_config('dtype', numpy.float64):
        return lp.ResidualODE(n_in=1, width=width, n_layers=n_layers,
                              n_out=n_out, layer='conv', image_size=size,
                              **kwargs)


def batch(net, size=6, seed=1):
    """Inputs and labels that fit ``net``."""
    rng = numpy.random.RandomState(seed)
    n_in = net.opening.W.shape[1]
    if net.layer == 'dense':
        x = rng.uniform(-3, 3, (size, n_in))
    else:
        side = int(round((net.classifier.W.shape[1]
                          / net.opening.out_channels) ** 0.5))
        x = rng.uniform(0, 1, (size, n_in, side, side))
    t = rng.randint(0, net.classifier.out_size, size).astype(numpy.int32)
    return x, t


def serial_gradients(net, x, t):
    """Logits, loss and every parameter's gradient by Chainer's backprop
    through the layer-serial network (grads of ``net`` are left cleared)."""
    net.cleargrads()
    logits = net(x)
    loss = F.softmax_cross_entropy(logits, t)
    loss.backward()
    grads = {name: param.grad.copy() for name, param in net.namedparams()}
    net.cleargrads()
    return logits.array, float(loss.array), grads


def mgrit_gradients(mgrit, x, t, **kwargs):
    """Logits, loss, histories and the grads ``mgrit`` computes."""
    mgrit.net.cleargrads()
    logits, history = mgrit.forward(x, **kwargs)
    loss, adjoint_history = mgrit.backward(t, **kwargs)
    grads = {name: param.grad.copy() for name, param in mgrit.owned_params()}
    return logits, loss, history, adjoint_history, grads


def max_relative_error(grads, reference):
    """max over parameters of ‖g - g_ref‖_max / ‖g_ref‖_max."""
    return max(float(abs(grads[name] - reference[name]).max()
                     / abs(reference[name]).max()) for name in grads)
