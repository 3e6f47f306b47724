"""The seed's time-derivative regularisation of the layer weights.

R(θ) = β / (2h) Σ_{n=0}^{N-2} ‖θ_{n+1} - θ_n‖², the discretised
(β/2) ∫ ‖dθ/dt‖² dt of the seed's objective (eq. 2.7: "we additionally
penalize the time-derivative of θ(t) in order to ensure weights that vary
smoothly in time"), over every parameter of the residual layers. Weights
that vary smoothly in t are what makes a coarse level — the same layers
with the weights of every c^l-th one — a good model of the fine one: MGRIT
then needs about half the iterations (experiments/.../convergence.py).
"""
import math

import chainer
import chainer.functions as F

from chainerkfac.layer_parallel.mgrit import MGRIT
from chainerkfac.layer_parallel.network import ResidualODE

# Above the tags of the cycle and of MGRIT's weight fetch (10000 + layer).
_TAG_NEIGHBOURS = 1 << 20


def time_smoothness(net: ResidualODE, weight: float) -> chainer.Variable:
    """R(θ) as a Chainer function of ``net``'s parameters (layer-serial
    training adds it to the loss): a few operations on every parameter
    stacked over the layers, not a graph per layer."""
    total = 0
    per_layer = [net.layer_params(n) for n in range(net.n_layers)]
    for params in zip(*per_layer):
        stacked = F.stack(params)
        total = total + F.sum(F.square(stacked[1:] - stacked[:-1]))
    return (weight / (2 * net.h)) * total


def accumulate_time_smoothness(mgrit: MGRIT, weight: float) -> float:
    """Add ∂R/∂θ_n = β/h (2θ_n - θ_{n-1} - θ_{n+1}) (one-sided at the
    ends) to the grads of the layers this process owns, and return R (on
    every process).

    The blocks' edge layers need their neighbours' weights: one message to
    and from each neighbouring process.
    """
    net, owners, transport = mgrit.net, mgrit.owners, mgrit.transport
    block = mgrit.owned_layers
    neighbours = {}
    if len(block):
        requests, sent = [], []
        for inside, outside in ((block.start, block.start - 1),
                                (block.stop - 1, block.stop)):
            if 0 <= outside < net.n_layers:
                neighbours[outside] = net.xp.empty_like(
                    net.pack_layer(inside))
                requests.append(transport.irecv(
                    neighbours[outside], owners[outside],
                    _TAG_NEIGHBOURS + outside))
                sent.append(net.pack_layer(inside))
                requests.append(transport.isend(
                    sent[-1], owners[outside], _TAG_NEIGHBOURS + inside))
        transport.waitall(requests)
    scale = weight / net.h
    squares = []
    for n in block:
        own = net.pack_layer(n)
        grad = 0 * own
        for m in (n - 1, n + 1):
            if 0 <= m < net.n_layers:
                other = (neighbours[m] if m in neighbours
                         else net.pack_layer(m))
                grad += own - other
                if m == n + 1:
                    difference = other - own
                    squares.append(float((difference * difference).sum()))
        _accumulate_flat(net, n, scale * grad)
    total = math.fsum(value for part in transport.allgather(squares)
                      for value in part)
    return weight / (2 * net.h) * total


def _accumulate_flat(net: ResidualODE, n: int, flat) -> None:
    offset = 0
    for param in net.layer_params(n):
        size = param.array.size
        grad = flat[offset:offset + size].reshape(param.array.shape)
        if param.grad is None:
            param.grad = grad.copy()
        else:
            param.grad += grad
        offset += size
