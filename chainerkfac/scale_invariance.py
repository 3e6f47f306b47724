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

* copy, identity;
* transpose, and a reshape that keeps the channel a function of one axis
  (flattening ``(N, C, H, W)`` to ``(N, C·H·W)`` does; splitting the
  channels into groups, or merging them with the batch axis, does not);
* max pooling, and average pooling without padding (zero padding would
  weight the bias differently at the borders), over axes other than the
  channel's;
* a concatenation along the channels (a DenseNet's), whose other inputs'
  channels are statistics of their own.

The normalising input must then take its statistics over axes other than
the channel's (a BatchNormalization over the time axis of a Linear's
``(N, T, D)`` output does not remove a bias per D). Anything else in
between (an activation, an addition of a skip connection, a
concatenation along another axis) makes the layer not scale invariant, and
so does any use of
the weight other than as a layer's kernel (a tied decoder's
``F.transpose(W)``, a penalty on ``W``). Which functions carry a weight and
which normalise come from the Fisher blocks and the registered block
classes (the registry): the optimizer passes them in.
"""
from typing import Dict, Iterable, List, Optional, Set

from chainer.functions.array import concat as concat_module
from chainer.functions.array import copy as copy_module
from chainer.functions.array import reshape as reshape_module
from chainer.functions.array import transpose as transpose_module
from chainer.functions.math import identity as identity_module
from chainer.functions.pooling import average_pooling_2d as avg2d_module
from chainer.functions.pooling import average_pooling_nd as avgnd_module
from chainer.functions.pooling import max_pooling_nd as maxnd_module

from chainerkfac.capture import GraphNode
from chainerkfac.capture import graph_of  # NOQA (re-exported)

_PASS_THROUGH = (copy_module.Copy, identity_module.Identity)
_POOLING = (maxnd_module.MaxPoolingND, avg2d_module.AveragePooling2D,
            avgnd_module.AveragePoolingND)
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
        Function types whose output is linear in their weight (input 1),
        with the output channels on axis 1 (``linear``, ``convolution_2d``).
    normalizing : tuple of type
        Function types that normalise their first input over the axes
        named by their ``axis`` attribute (Chainer's BatchNormalization
        after its forward; None: all but axis 1), with one statistic per
        index on the others.

    Returns
    -------
    set of int
        ``id(param)`` of the weight of every call of a ``weighted``
        function whose output reaches only ``normalizing`` inputs, each
        output channel within one of their statistics; a weight used
        anywhere else (tied by a transpose, a penalty on it, a
        deconvolution), or in several calls of which one is not invariant,
        does not count.
    """
    nodes = {}
    for record in graph:
        nodes.setdefault(id(record.function), record)
    consumers: Dict[int, List] = {}
    for record in nodes.values():
        for index, node in enumerate(record.inputs):
            consumers.setdefault(id(node), []).append((record, index))
    verdict: Dict[tuple, bool] = {}
    invariant: Dict[int, bool] = {}
    for record in nodes.values():
        if not isinstance(record.function, weighted) or \
                len(record.inputs) < 2:
            continue
        weight = record.inputs[1]
        param = weight.get_variable_or_none()
        if param is None:
            continue
        output = record.outputs[0] if record.outputs else None
        ok = output is not None and _reaches_normalization(
            output, 1, consumers, verdict, normalizing)
        ok = ok and all(isinstance(use.function, weighted) and index == 1
                        for use, index in consumers[id(weight)])
        invariant[id(param)] = invariant.get(id(param), True) and ok
    return {key for key, ok in invariant.items() if ok}


def _reaches_normalization(node, channel_axis, consumers, verdict,
                           normalizing) -> bool:
    """Whether every use of ``node`` reaches a normalising input, with the
    layer's output channel a function of the index on ``channel_axis``
    alone (so a per-channel constant stays within one statistic)."""
    key = (id(node), channel_axis)
    if key in verdict:
        return verdict[key]
    verdict[key] = False        # no cycles in a graph; guards recursion
    uses = consumers.get(id(node), [])
    ok = bool(uses)
    for record, index in uses:
        function = record.function
        if isinstance(function, normalizing):
            ok = index == 0 and channel_axis not in _normalized_axes(
                function, len(node.shape))
        elif isinstance(function, concat_module.Concat) and \
                record.outputs:
            # along the channels (DenseNet): the other inputs' channels
            # are other statistics' (Chainer's Concat wants axis >= 0 of
            # its inputs, or negative)
            same = function.axis % len(node.shape) == channel_axis
            ok = same and _reaches_normalization(
                record.outputs[0], channel_axis, consumers, verdict,
                normalizing)
        elif len(record.inputs) == 1 and record.outputs:
            axis = _channel_axis_after(function, node.shape,
                                       record.outputs[0].shape,
                                       channel_axis)
            ok = axis is not None and _reaches_normalization(
                record.outputs[0], axis, consumers, verdict, normalizing)
        else:
            ok = False
        if not ok:
            break
    verdict[key] = ok
    return ok


def _normalized_axes(function, ndim: int) -> tuple:
    """The axes a normalising call reduces over (its statistics are one
    per index on the others): its ``axis`` (Chainer's BatchNormalization
    sets it in its forward), else all but axis 1."""
    axis = getattr(function, 'axis', None)
    if axis is None:
        return (0,) + tuple(range(2, ndim))
    axis = axis if isinstance(axis, (tuple, list)) else (axis,)
    return tuple(a % ndim for a in axis)


def _channel_axis_after(function, shape_in, shape_out,
                        channel_axis: int) -> Optional[int]:
    """The axis of ``function``'s output that the channel is a function of
    (see :func:`_reaches_normalization`), where ``function`` commutes with
    a positive factor and keeps a per-channel constant per channel; None
    where it does not."""
    if isinstance(function, _PASS_THROUGH):
        return channel_axis
    if isinstance(function, transpose_module.Transpose):
        axes = function.axes
        if axes is None:
            axes = tuple(reversed(range(len(shape_in))))
        axes = [a % len(shape_in) for a in axes]
        return axes.index(channel_axis)
    if isinstance(function, reshape_module.Reshape):
        return _channel_axis_reshaped(tuple(shape_in), tuple(shape_out),
                                      channel_axis)
    if isinstance(function, _POOLING):
        # windows over the axes after the first two: the channel must be
        # on one of those two
        if channel_axis > 1:
            return None
        if isinstance(function, _AVERAGE_POOLING) and not _unpadded(
                function):
            return None
        return channel_axis
    return None


def _channel_axis_reshaped(shape_in: tuple, shape_out: tuple,
                           channel_axis: int) -> Optional[int]:
    """An axis ``c`` of ``shape_out`` over the same leading elements as
    the axes before ``channel_axis`` in ``shape_in`` (their product), whose
    block of elements (with the axes after it) is the channel axis's
    block, and whose every index falls within one channel (the elements
    after it divide those after the channel): None where there is none
    (the channel merged with a leading axis, or split)."""
    lead = _product(shape_in[:channel_axis])
    inner = _product(shape_in[channel_axis + 1:])
    block = shape_in[channel_axis] * inner
    for axis in range(len(shape_out)):
        after = _product(shape_out[axis + 1:])
        if _product(shape_out[:axis]) == lead and \
                shape_out[axis] * after == block and inner % after == 0:
            return axis
    return None


def _product(dims) -> int:
    result = 1
    for dim in dims:
        result *= int(dim)
    return result


def _unpadded(function) -> bool:
    pad = getattr(function, 'pad', None)
    if pad is None:
        pad = (getattr(function, 'ph', 0), getattr(function, 'pw', 0))
    pad = pad if isinstance(pad, (tuple, list)) else (pad,)
    return all(p == 0 for p in pad)
