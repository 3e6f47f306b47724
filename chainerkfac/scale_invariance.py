"""Which weights eq. (20) may rescale: scale invariance from the graph.

Eq. (20) rescales a weight ``W`` to the norm ``√(2·d_out)`` after every
step. That leaves the network's function unchanged only where the layer is
*scale invariant*: its output ``y = W x + b`` reaches a BatchNormalization,
which removes any positive factor on ``W`` and any per-channel constant
``b`` (``BN(c W x + b) = BN(W x)`` for ``c > 0``, up to BN's ε). Elsewhere
— a BN-free MLP, the classifier of a ResNet — rescaling changes the
function even at learning rate 0.

:func:`scale_invariant_weights` takes the function nodes of a graph and
returns the weights whose *every* use reaches a normalising input,
directly or through operations that commute with a positive factor and keep
a per-channel constant per channel:

* reshape, transpose, copy, identity;
* max pooling;
* average pooling without padding (zero padding would weight the bias
  differently at the borders).

Anything else in between (an activation, an addition of a skip
connection, a concatenation) makes the layer not scale invariant. Which
functions carry a weight and which normalise come from the Fisher blocks
(the registry): the optimizer passes them in.
"""
from typing import Dict, Iterable, List, Set

from chainer.functions.array import copy as copy_module
from chainer.functions.array import reshape as reshape_module
from chainer.functions.array import transpose as transpose_module
from chainer.functions.math import identity as identity_module
from chainer.functions.pooling import average_pooling_2d as avg2d_module
from chainer.functions.pooling import average_pooling_nd as avgnd_module
from chainer.functions.pooling import max_pooling_nd as maxnd_module

from chainerkfac.capture import GraphNode
from chainerkfac.capture import graph_of  # NOQA (re-exported)

_PASS_THROUGH = (reshape_module.Reshape, transpose_module.Transpose,
                 copy_module.Copy, identity_module.Identity,
                 maxnd_module.MaxPoolingND)
_AVERAGE_POOLING = (avg2d_module.AveragePooling2D,
                    avgnd_module.AveragePoolingND)


def scale_invariant_weights(graph: Iterable[GraphNode], weighted: tuple,
                            normalizing: tuple) -> Set[int]:
    """``id`` of every weight parameter whose layer is scale invariant in
    ``graph`` (see the module docstring).

    Parameters
    ----------
    graph : iterable of GraphNode
        The function nodes (:func:`graph_of`, or the capture's record of
        the backward passes); a node may appear several times.
    weighted : tuple of type
        Function types whose output is linear in their weight (input 1).
    normalizing : tuple of type
        Function types that normalise their first input per channel.

    Returns
    -------
    set of int
        ``id(param)`` of the weight of every call of a ``weighted``
        function whose output reaches only ``normalizing`` inputs; a weight
        used in several calls counts only if every call does.
    """
    nodes = {}
    for record in graph:
        nodes.setdefault(id(record.function), record)
    consumers: Dict[int, List] = {}
    for record in nodes.values():
        for index, node in enumerate(record.inputs):
            consumers.setdefault(id(node), []).append((record, index))
    verdict: Dict[int, bool] = {}
    invariant: Dict[int, bool] = {}
    for record in nodes.values():
        if not isinstance(record.function, weighted) or \
                len(record.inputs) < 2:
            continue
        param = record.inputs[1].get_variable_or_none()
        if param is None:
            continue
        output = record.outputs[0] if record.outputs else None
        ok = output is not None and _reaches_normalization(
            output, consumers, verdict, normalizing)
        invariant[id(param)] = invariant.get(id(param), True) and ok
    return {key for key, ok in invariant.items() if ok}


def _reaches_normalization(node, consumers, verdict, normalizing) -> bool:
    key = id(node)
    if key in verdict:
        return verdict[key]
    verdict[key] = False        # no cycles in a graph; guards recursion
    uses = consumers.get(key, [])
    ok = bool(uses)
    for record, index in uses:
        function = record.function
        if isinstance(function, normalizing):
            ok = ok and index == 0
        elif _passes_scale(function) and len(record.inputs) == 1:
            output = record.outputs[0] if record.outputs else None
            ok = ok and output is not None and _reaches_normalization(
                output, consumers, verdict, normalizing)
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
