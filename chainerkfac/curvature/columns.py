"""Many backward passes as one: the columns of a pass travel stacked.

The exact second-order quantities need ``K`` backward passes over the same
graph: one per column of the loss Hessian's root (``C`` classes for
``diag_ggn``, ``kflr``, ``diag_hessian``), one per feature entering a
curved activation (the Hessian's residual terms), one per column of the
propagated curvature (KFRA). Run as ``K`` passes of Chainer's autodiff they
cost ``K`` times the Python and kernel-launch overhead of a pass and ``K``
small products per layer. Here the ``K`` gradients travel together, as one
batch of ``K·N`` rows, pass-major (row ``k·N + n`` is pass ``k``'s gradient
of sample ``n``), through the function nodes of the gradient pass's graph
(:class:`ColumnPropagator`, BackPACK's way of propagating all columns of
the root at once): each function's transposed Jacobian is applied to all
rows by a rule of its type (:func:`transpose_jacobian`):

* **its own backward on all rows** for ``Linear``, whose backward uses
  only its weight, and Chainer's ``deconvolution_2d`` (the backward of
  ``Convolution2D``) on all rows;
* **the identity or its negative** for sums and differences;
* **its derivative, once**, for elementwise functions (ReLU and the other
  activations, dropout, BatchNormalization with fixed statistics): the
  function's own backward of ones, then one product by broadcasting;
* **shapes**: reshapes and sums or means over non-sample axes;
* **pooling**: max pooling adds every pass's gradients at the inputs its
  recorded indexes chose, one window position at a time; average pooling
  runs its own backward with the input's shape stretched to ``K·N`` rows
  (both where the forward did not run in cuDNN, which keeps no indexes);
* **its own backward once per pass** for every other function: exactly
  what ``K`` separate passes do through it.

The samples must be independent (no BatchNormalization in training mode):
:func:`chainerkfac.curvature.extract` runs the per-sample passes there, as
before. Memory is bounded by propagating at most :data:`MAX_ELEMENTS`
elements per stacked array, :data:`MAX_ELEMENTS_CPU` on the CPU
(:func:`passes_per_chunk`).
"""
import copy
import itertools
import logging
from typing import Dict, Iterator, List, Optional, Tuple

import numpy

import chainer
import chainer.functions.activation.clipped_relu as clipped_relu
import chainer.functions.activation.elu as elu
import chainer.functions.activation.hard_sigmoid as hard_sigmoid
import chainer.functions.activation.leaky_relu as leaky_relu
import chainer.functions.activation.relu as relu
import chainer.functions.activation.sigmoid as sigmoid
import chainer.functions.activation.softplus as softplus
import chainer.functions.activation.tanh as tanh
import chainer.functions.array.reshape as reshape
import chainer.functions.connection.convolution_2d as convolution_2d
import chainer.functions.connection.linear as linear
import chainer.functions.math.average as average
import chainer.functions.math.basic_math as basic_math
import chainer.functions.math.exponential as exponential
import chainer.functions.math.identity as identity
import chainer.functions.math.sqrt as sqrt
import chainer.functions.math.square as square
import chainer.functions.math.sum as sum_module
import chainer.functions.math.trigonometric as trigonometric
import chainer.functions.noise.dropout as dropout
import chainer.functions.normalization.batch_normalization as bn_module
import chainer.functions.pooling.average_pooling_2d as average_pooling_2d
import chainer.functions.pooling.average_pooling_nd as average_pooling_nd
import chainer.functions.pooling.max_pooling_nd as max_pooling_nd
from chainer.backend import get_array_module

from chainerkfac import capture as capture_module
from chainerkfac.curvature import graph as graph_module

logger = logging.getLogger(__name__)

#: Elements of the largest stacked gradient propagated at once (2**26:
#: 256 MiB in float32); the passes are split into chunks below it.
MAX_ELEMENTS = 2 ** 26
#: The bound on the CPU (2**22: 16 MiB in float32). Each fresh array of
#: hundreds of MiB is new memory from the system, its pages faulted in:
#: on 3C3D (batch 64) KFLR took 7.0 gradients' time at 2**26, 3.1 at 2**22
#: (diag_ggn 6.1 and 4.4; 2**21 and 2**23 were slower; one thread, AMD
#: EPYC, 2026-11-27). CuPy's memory pool reuses its blocks: the GPU keeps
#: :data:`MAX_ELEMENTS` (fewer, larger products).
MAX_ELEMENTS_CPU = 2 ** 22

#: Functions linear in their inputs with the identity (+1) or its negative
#: (-1) as the Jacobian w.r.t. each input of the output's shape.
SIGNS = {basic_math.Add: (1, 1), basic_math.Sub: (1, -1),
         basic_math.Neg: (-1,), basic_math.AddConstant: (1,),
         basic_math.SubFromConstant: (-1,), identity.Identity: None}
#: Functions elementwise in their first input: the backward multiplies by
#: a derivative of the input's shape.
ELEMENTWISE = (relu.ReLU, leaky_relu.LeakyReLU, clipped_relu.ClippedReLU,
               hard_sigmoid.HardSigmoid, basic_math.Absolute,
               sigmoid.Sigmoid, tanh.Tanh, softplus.Softplus, elu.ELU,
               exponential.Exp, exponential.Log, sqrt.Sqrt, square.Square,
               basic_math.PowVarConst, basic_math.MulConstant,
               trigonometric.Sin, trigonometric.Cos, dropout.Dropout,
               bn_module.FixedBatchNormalization)
#: Average pooling: its backward on K passes is its own with the input's
#: shape stretched to K·N rows.
STRETCHED = (average_pooling_nd.AveragePoolingND,
             average_pooling_2d.AveragePooling2D)


class UnsupportedColumns(ValueError):
    """The graph has a variable on the path of the passes whose first axis
    is not the sample axis: the passes cannot be stacked."""


def element_limit(xp=numpy) -> int:
    """Elements of the largest stacked array on the device of the array
    module ``xp``: :data:`MAX_ELEMENTS`, and on the CPU at most
    :data:`MAX_ELEMENTS_CPU`."""
    return MAX_ELEMENTS if xp is not numpy else \
        min(MAX_ELEMENTS, MAX_ELEMENTS_CPU)


def passes_per_chunk(passes: int, rows: int, features: int,
                     limit: Optional[int] = None, xp=numpy) -> int:
    """How many of ``passes`` propagate together so that a stacked array of
    ``features`` elements per row and ``rows`` rows per pass stays below
    :func:`element_limit` of ``xp`` (``limit`` caps it further; at least
    1)."""
    fit = max(1, element_limit(xp) // max(1, rows * features))
    if limit is not None:
        fit = min(fit, int(limit))
    return max(1, min(passes, fit))


class ColumnPropagator:
    """Stacked backward passes from one variable of a recorded graph down to
    the calls of its slots.

    Parameters
    ----------
    graph : chainerkfac.curvature.graph.ModelGraph
    start : chainer.variable.VariableNode
        Where the passes start (the logits, or a hidden variable).
    batch : int
        Samples N (the first axis of every variable on the way).

    Attributes
    ----------
    features : int
        Largest number of elements per sample of a variable on the way
        (sizes the chunks).
    """

    def __init__(self, graph, start, batch: int):
        self.graph = graph
        self.start = start
        self.batch = batch
        calls = {id(call.output): call for call in graph.slot_calls}
        functions = graph_module.ancestors(start)
        needed: Dict[int, bool] = {}
        for function in sorted(functions, key=lambda f: f.rank):
            below = any(needed.get(id(node), False)
                        for node in function.inputs)
            for output in _outputs(function):
                needed[id(output)] = below or id(output) in calls
        #: (function, input indexes to propagate to), by decreasing rank.
        self.plan: List[Tuple[object, Tuple[int, ...]]] = []
        for function in sorted(functions, key=lambda f: -f.rank):
            if not any(needed.get(id(o), False) for o in _outputs(function)):
                continue
            targets = tuple(i for i, node in enumerate(function.inputs)
                            if needed.get(id(node), False))
            self.plan.append((function, targets))
        shapes = [start.shape] + [node.shape for f, targets in self.plan
                                  for node in (f.inputs[i] for i in targets)]
        wrong = [s for s in shapes if not s or s[0] != batch]
        if wrong:
            raise UnsupportedColumns(
                'a variable between the calls and the start of the passes '
                'has shape {}, not {} samples first'.format(wrong[0], batch))
        self.features = max(int(numpy.prod(s[1:])) for s in shapes)
        #: Calls reached, by their output node.
        self.calls = {key: call for key, call in calls.items()
                      if needed.get(key, False)}
        self._slots = [slot for slot in graph.slots
                       if any(id(use.call.output) in self.calls
                              for use in slot.uses)]
        self._kept_values: Dict[int, object] = {}

    def chunk(self, passes: int, limit: Optional[int] = None,
              xp=numpy) -> int:
        """Passes per chunk (:func:`passes_per_chunk`)."""
        return passes_per_chunk(passes, self.batch, self.features, limit,
                                xp)

    def pull_back(self, stacked) -> Iterator[Tuple[object, Dict]]:
        """Propagate ``stacked`` (K·N, *start.shape[1:]), the gradients of
        K passes w.r.t. the start variable, pass-major.

        Yields
        ------
        (slot, grads)
            Every slot the passes reach, as soon as the gradients w.r.t.
            the outputs of all its reached calls are complete: ``grads``
            maps those calls to their stacked gradients (K·N, ...), the
            form :class:`~chainerkfac.curvature.slots.Slot` takes.
        """
        passes = stacked.shape[0] // self.batch
        grads = {id(self.start): stacked}
        done: Dict[object, object] = {}
        waiting = {slot: {u.call for u in slot.uses
                          if id(u.call.output) in self.calls}
                   for slot in self._slots}
        users: Dict[object, int] = {}
        for calls in waiting.values():
            for call in calls:
                users[call] = users.get(call, 0) + 1
        with chainer.no_backprop_mode():
            for function, targets in self.plan:
                outputs = _outputs(function)
                gys = [grads.pop(id(o), None) for o in outputs]
                for output, gy in zip(outputs, gys):
                    call = self.calls.get(id(output))
                    if call is not None and gy is not None:
                        done[call] = gy
                if targets and any(g is not None for g in gys):
                    gxs = self._transpose(function, targets, gys, passes)
                    for index, gx in zip(targets, gxs):
                        if gx is None:
                            continue
                        key = id(function.inputs[index])
                        grads[key] = gx if key not in grads else \
                            grads[key] + gx
                for slot in [s for s, calls in waiting.items()
                             if calls and calls <= set(done)]:
                    calls = waiting.pop(slot)
                    yield slot, {call: done[call] for call in calls}
                    for call in calls:
                        users[call] -= 1
                        if not users[call]:
                            del done[call]

    def _transpose(self, function, targets, gys, passes):
        if _is_elementwise(function, targets, gys):
            derivative = self._kept(function, lambda: _elementwise_derivative(
                function, gys[0]))
            if derivative is not None:
                return [_times(gys[0], derivative, passes)]
        if _is_cpu_max_pooling(function):
            routes = self._kept(function,
                                lambda: max_pooling_routes(function))
            return [_max_pooling_input_grad(function, gys[0], passes,
                                            routes)]
        return transpose_jacobian(function, targets, gys, passes,
                                  self.batch)

    def _kept(self, function, make):
        """``make()`` once per function (a derivative or pooling positions,
        the same for every chunk)."""
        key = id(function)
        if key not in self._kept_values:
            self._kept_values[key] = make()
        return self._kept_values[key]


def transpose_jacobian(function, targets, gys, passes: int, batch: int):
    """The gradients w.r.t. ``function``'s inputs ``targets`` of K stacked
    passes (``gys``: per output, (K·N, ...) or None), each (K·N, ...) or
    None. Elementwise functions take the derivative each call here
    (:class:`ColumnPropagator` keeps it)."""
    with chainer.no_backprop_mode():
        if _is_elementwise(function, targets, gys):
            derivative = _elementwise_derivative(function, gys[0])
            if derivative is not None:
                return [_times(gys[0], derivative, passes)]
        if isinstance(function, linear.LinearFunction):
            return _own_backward(function, targets, gys)
        if isinstance(function, convolution_2d.Convolution2DFunction) and \
                targets == (0,) and not any(function.input_layouts):
            return [_convolution_input_grad(function, gys[0])]
        signs = SIGNS.get(type(function), False)
        if signs is not False and all(
                function.inputs[i].shape == _outputs(function)[0].shape
                for i in targets):
            signs = signs or (1,) * len(function.inputs)
            return [gys[0] if signs[i] > 0 else -gys[0] for i in targets]
        if isinstance(function, reshape.Reshape):
            node = function.inputs[0]
            return [gys[0].reshape((len(gys[0]),) + node.shape[1:])]
        if isinstance(function, (sum_module.Sum, average.Mean)) and \
                function.axis is not None and 0 not in _axes(function):
            return [_unreduce(function, gys[0])]
        if _is_cpu_max_pooling(function):
            return [_max_pooling_input_grad(function, gys[0], passes)]
        stretched = _stretched(function, passes)
        if stretched is not None:
            return _own_backward(stretched, targets, gys)
        return _per_pass(function, targets, gys, passes, batch)


def _is_elementwise(function, targets, gys) -> bool:
    return isinstance(function, ELEMENTWISE) and targets == (0,) and \
        len(gys) == 1


def _is_cpu_max_pooling(function) -> bool:
    return isinstance(function, max_pooling_nd.MaxPoolingND) and \
        isinstance(getattr(function, 'indexes', None), numpy.ndarray) and \
        not function.is_cudnn_used


def _outputs(function) -> List:
    return [o for o in (ref() for ref in function.outputs) if o is not None]


def _variables(gys):
    return tuple(None if g is None else chainer.Variable(g) for g in gys)


def _own_backward(function, targets, gys):
    out = function.backward(targets, _variables(gys))
    if len(out) == len(function.inputs) and len(out) != len(targets):
        out = [out[i] for i in targets]
    return [None if g is None else g.array for g in out]


def _convolution_input_grad(function, gy):
    """The gradient w.r.t. the input of ``convolution_2d`` on any number of
    rows: ``deconvolution_2d`` as Chainer's backward calls it."""
    weight = function.get_retained_inputs()[1]
    return chainer.functions.deconvolution_2d(
        gy, weight, stride=(function.sy, function.sx),
        pad=(function.ph, function.pw),
        outsize=function.inputs[0].shape[2:],
        dilate=(function.dy, function.dx), groups=function.groups).array


def _elementwise_derivative(function, like):
    """The function's backward of ones (on the device of ``like``), or
    None if its output and first input differ in shape."""
    outputs = _outputs(function)
    if len(outputs) != 1 or outputs[0].shape != function.inputs[0].shape:
        return None
    output = outputs[0]
    ones = get_array_module(like).ones(output.shape, dtype=output.dtype)
    with chainer.no_backprop_mode():
        gx, = _own_backward(function, (0,), [ones])
    return gx


def _times(gy, derivative, passes: int):
    stacked = gy.reshape((passes,) + derivative.shape)
    return (stacked * derivative).reshape(gy.shape)


def _axes(function) -> Tuple[int, ...]:
    ndim = len(function.inputs[0].shape)
    return tuple(a % ndim for a in function.axis)


def _unreduce(function, gy):
    """Sum / Mean over non-sample axes: broadcast back (Chainer's backward
    on every row)."""
    node = function.inputs[0]
    xp = get_array_module(gy)
    if isinstance(function, average.Mean):
        gy = gy * gy.dtype.type(function.multiplier)
    if not function.keepdims:
        shape = list(gy.shape)
        for axis in sorted(_axes(function)):
            shape.insert(axis, 1)
        gy = gy.reshape(shape)
    return xp.ascontiguousarray(
        xp.broadcast_to(gy, (len(gy),) + node.shape[1:]))


def _stretched(function, passes: int):
    """A copy of an average pooling whose backward takes K passes, or None
    (other types, or the forward ran in cuDNN)."""
    if not isinstance(function, STRETCHED) or getattr(
            function, 'is_cudnn_used', False) or getattr(
                function, '_used_cudnn', False):
        return None
    twin = copy.copy(function)
    shape = function._in_shape
    twin._in_shape = (passes * shape[0],) + tuple(shape[1:])
    return twin


def max_pooling_routes(function) -> List[Tuple]:
    """Where a max pooling run on the CPU sends its output gradients, from
    its recorded window indexes: per position in the window, the outputs
    that chose it and the inputs they chose (flat, within one pass; unique
    per position, as outputs differ by a stride)."""
    indexes = function.indexes
    shape = function._in_shape
    outs = indexes.shape[2:]
    offsets = numpy.unravel_index(indexes, function.ksize)
    ndim = len(outs)
    coordinates = [numpy.arange(shape[0]).reshape((-1,) + (1,) * (ndim + 1)),
                   numpy.arange(shape[1]).reshape((-1,) + (1,) * ndim)]
    for d in range(ndim):
        start = numpy.arange(outs[d]) * function.stride[d] - function.pad[d]
        coordinates.append(start.reshape((-1,) + (1,) * (ndim - d - 1)) +
                           offsets[d])
    targets = numpy.ravel_multi_index(numpy.broadcast_arrays(*coordinates),
                                      shape).ravel()
    flat = indexes.ravel()
    routes = []
    for position in range(int(numpy.prod(function.ksize))):
        chosen = numpy.flatnonzero(flat == position)
        if len(chosen):
            routes.append((chosen, targets[chosen]))
    return routes


def _max_pooling_input_grad(function, gy, passes: int, routes=None):
    """Every pass's output gradients added at the inputs the pooling chose,
    window position by window position (Chainer's order of the sums)."""
    if routes is None:
        routes = max_pooling_routes(function)
    shape = function._in_shape
    gy = gy.reshape(passes, -1)
    gx = numpy.zeros((passes, int(numpy.prod(shape))), dtype=gy.dtype)
    for outputs, inputs in routes:
        gx[:, inputs] += gy[:, outputs]
    return gx.reshape((passes * shape[0],) + tuple(shape[1:]))


def _per_pass(function, targets, gys, passes: int, batch: int):
    """The function's own backward once per pass, the results stacked."""
    parts: List[List] = [[] for _ in targets]
    for k in range(passes):
        rows = slice(k * batch, (k + 1) * batch)
        out = _own_backward(function, targets,
                            [None if g is None else g[rows] for g in gys])
        for part, gx in zip(parts, out):
            part.append(gx)
    result = []
    for part in parts:
        if any(gx is None for gx in part):
            result.append(None)
            continue
        result.append(get_array_module(part[0]).concatenate(part))
    return result


def stack_columns(columns) -> object:
    """``(K, N, ...)`` → ``(K·N, ...)`` pass-major rows."""
    return columns.reshape((-1,) + columns.shape[2:])


def chunks(total: int, size: int) -> Iterator[slice]:
    """Consecutive slices of ``size`` over ``range(total)``."""
    for begin in itertools.count(0, size):
        if begin >= total:
            return
        yield slice(begin, min(total, begin + size))



class Passes:
    """K backward passes from one variable to the slots' calls: stacked, a
    chunk of them per propagation (:class:`ColumnPropagator`), or one pass
    of Chainer's autodiff each (``chunk=1``: the reference, and the way for
    graphs whose passes cannot be stacked).

    Parameters
    ----------
    graph : chainerkfac.curvature.graph.ModelGraph
    chunk : int or None
        Passes per propagation at most (None: as many as
        :data:`MAX_ELEMENTS` allows).
    """

    def __init__(self, graph, chunk: Optional[int] = None):
        self.graph = graph
        self.limit = chunk
        self._propagators: Dict[int, Optional[ColumnPropagator]] = {}

    def run(self, start, count: int, make) -> Iterator[Tuple]:
        """The passes from the variable ``start``; ``make(part)`` gives the
        gradients w.r.t. ``start`` of the passes ``part`` (a slice of
        ``range(count)``) as ``(columns (k, N, ...), weights (k, N) or
        None)``.

        Yields
        ------
        (slot, grads, weights)
            As :meth:`ColumnPropagator.pull_back`, with the weights of the
            rows (k·N,) or None.
        """
        propagator = self._propagator(start)
        size = 1 if propagator is None else propagator.chunk(
            count, self.limit, get_array_module(start.array))
        for part in chunks(count, size):
            columns, weights = make(part)
            stacked = stack_columns(columns)
            if weights is not None:
                weights = weights.reshape(-1)
            pairs = (self._one_pass(start, stacked) if propagator is None
                     else propagator.pull_back(stacked))
            for slot, grads in pairs:
                yield slot, grads, weights

    def _propagator(self, start) -> Optional[ColumnPropagator]:
        if self.limit == 1:
            return None
        key = id(start.node)
        if key not in self._propagators:
            try:
                self._propagators[key] = ColumnPropagator(
                    self.graph, start.node, self.graph.batch)
            except UnsupportedColumns as error:
                logger.info('curvature: one backward pass per column (%s)',
                            error)
                self._propagators[key] = None
        return self._propagators[key]

    def _one_pass(self, start, gradient):
        """One pass of Chainer's autodiff, asking for the gradients w.r.t.
        the calls' outputs only."""
        calls = self.graph.slot_calls
        if not calls:
            return
        with capture_module.unobserved():
            grads = chainer.grad([start], [c.output_variable for c in calls],
                                 grad_outputs=[chainer.Variable(gradient)])
        grads = {call: g.array for call, g in zip(calls, grads)
                 if g is not None}
        for slot in self.graph.slots:
            if slot.reached(grads):
                yield slot, grads
