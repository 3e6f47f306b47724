"""Which weights eq. (20) may rescale: scale invariance from the graph.

Eq. (20) rescales a weight ``W`` to the norm ``√(2·d_out)`` after every
step. That leaves the network's function unchanged only where the layer is
*scale invariant*: its output ``y = W x + b`` reaches a BatchNormalization,
which removes any positive factor on ``W`` and any per-channel constant
``b`` (``BN(c W x + b) = BN(W x)`` for ``c > 0``, up to BN's ε). Elsewhere
— a BN-free MLP, the classifier of a ResNet — rescaling changes the
function even at learning rate 0.

:func:`scale_invariant_weights` walks the computational graph of one loss
and returns the weights whose *every* use reaches a BatchNormalization
input, directly or through operations that commute with a positive factor
and keep a per-channel constant per channel:

* reshape, transpose, copy, identity;
* max pooling;
* average pooling without padding (zero padding would weight the bias
  differently at the borders).

Anything else in between (an activation, an addition of a skip
connection, a concatenation) makes the layer not scale invariant.
"""
from typing import Dict, List, Set

from chainer.functions.array import copy as copy_module
from chainer.functions.array import reshape as reshape_module
from chainer.functions.array import transpose as transpose_module
from chainer.functions.connection import convolution_2d as conv2d_module
from chainer.functions.connection import linear as linear_module
from chainer.functions.math import identity as identity_module
from chainer.functions.normalization import batch_normalization as bn_module
from chainer.functions.pooling import average_pooling_2d as avg2d_module
from chainer.functions.pooling import average_pooling_nd as avgnd_module
from chainer.functions.pooling import max_pooling_nd as maxnd_module

#: Functions whose output is linear in their weight input (index 1).
WEIGHTED_FUNCTIONS = (linear_module.LinearFunction,
                      conv2d_module.Convolution2DFunction)
#: Functions that normalise their first input per channel.
NORMALIZING_FUNCTIONS = (bn_module.BatchNormalization,
                         bn_module.FixedBatchNormalization)
_PASS_THROUGH = (reshape_module.Reshape, transpose_module.Transpose,
                 copy_module.Copy, identity_module.Identity,
                 maxnd_module.MaxPoolingND)
_AVERAGE_POOLING = (avg2d_module.AveragePooling2D,
                    avgnd_module.AveragePoolingND)


def scale_invariant_weights(loss) -> Set[int]:
    """``id`` of every weight parameter whose layer is scale invariant in
    the graph of ``loss`` (see the module docstring).

    Parameters
    ----------
    loss : chainer.Variable
        Output of a forward pass with the graph kept.

    Returns
    -------
    set of int
        ``id(param)`` of the ``W`` of every call of a Linear or
        Convolution2D function whose output reaches only BatchNormalization
        inputs; a weight used in several calls counts only if every call
        does.
    """
    functions = _functions_of(loss)
    consumers: Dict[int, List] = {}
    for function in functions:
        for index, node in enumerate(function.inputs):
            consumers.setdefault(id(node), []).append((function, index))
    verdict: Dict[int, bool] = {}
    invariant: Dict[int, bool] = {}
    for function in functions:
        if not isinstance(function, WEIGHTED_FUNCTIONS):
            continue
        param = function.inputs[1].get_variable_or_none()
        if param is None:
            continue
        output = function.outputs[0]()
        ok = output is not None and _reaches_normalization(
            output, consumers, verdict)
        invariant[id(param)] = invariant.get(id(param), True) and ok
    return {key for key, ok in invariant.items() if ok}


def _functions_of(loss):
    """Every function node that ``loss`` depends on."""
    seen, stack, out = set(), [loss.creator_node], []
    while stack:
        function = stack.pop()
        if function is None or id(function) in seen:
            continue
        seen.add(id(function))
        out.append(function)
        for node in function.inputs:
            stack.append(node.creator_node)
    return out


def _reaches_normalization(node, consumers, verdict) -> bool:
    key = id(node)
    if key in verdict:
        return verdict[key]
    verdict[key] = False        # no cycles in a graph; guards recursion
    uses = consumers.get(key, [])
    ok = bool(uses)
    for function, index in uses:
        if isinstance(function, NORMALIZING_FUNCTIONS):
            ok = ok and index == 0
        elif _passes_scale(function) and len(function.inputs) == 1:
            output = function.outputs[0]()
            ok = ok and output is not None and _reaches_normalization(
                output, consumers, verdict)
        else:
            ok = False
        if not ok:
            break
    verdict[key] = ok
    return ok


def _passes_scale(function) -> bool:
    if isinstance(function, _PASS_THROUGH):
        return True
    if isinstance(function, _AVERAGE_POOLING):
        pad = getattr(function, 'pad', None)
        if pad is None:
            pad = (getattr(function, 'ph', 0), getattr(function, 'pw', 0))
        pad = pad if isinstance(pad, (tuple, list)) else (pad,)
        return all(p == 0 for p in pad)
    return False
