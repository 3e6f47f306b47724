"""The Hessian diagonal's residual terms (BackPACK's ``DiagHessian``).

The Hessian of the mean loss w.r.t. a parameter is its GGN plus, for every
function ``v = f(u)`` between the parameter and the logits, the function's
own curvature weighted by the loss gradient at its output and pulled back
to the parameter (Dangel et al., appendix A.3; the second-order chain rule
holds on any graph, residual connections included):

    ``∇²_θ L = GGN + Σ_f J_θuᵀ R_f J_θu``,
    ``R_f = Σ_j (∂L/∂v_j) ∇²_u v_j``.

For an elementwise ``f`` (sigmoid, tanh, softplus, ELU, ...) ``R_f`` is
diagonal per sample, ``r = (∂L/∂v) ⊙ f''(u)``, and Chainer gives it by
double backprop (no hand-written second derivative): the gradient of the
sum of ``f``'s backward output. Its diagonal contribution is then
``Σ_n Σ_j sign(r_nj) (J_θu_nᵀ √|r_nj| e_j)²``: one backward pass from
``u`` per feature ``j`` of ``u`` (every sample at once, each with its own
sign), the passes stacked as for the GGN
(:mod:`~chainerkfac.curvature.columns`), through the adapters.

Defined here when every function between the parameters and the logits is
either linear or piecewise linear in its inputs (:data:`ZERO_CURVATURE`,
and the Linear / Convolution2D / fixed BatchNormalization calls, whose
parameters enter linearly) or elementwise (:data:`ELEMENTWISE`), and each
parameter enters one call; a clear error otherwise.
"""
import logging
from typing import Dict

import chainer
import chainer.functions.activation.clipped_relu as clipped_relu
import chainer.functions.activation.elu as elu
import chainer.functions.activation.hard_sigmoid as hard_sigmoid
import chainer.functions.activation.leaky_relu as leaky_relu
import chainer.functions.activation.relu as relu
import chainer.functions.activation.sigmoid as sigmoid
import chainer.functions.activation.softplus as softplus
import chainer.functions.activation.tanh as tanh
import chainer.functions.array.broadcast as broadcast
import chainer.functions.array.cast as cast
import chainer.functions.array.concat as concat
import chainer.functions.array.copy as copy
import chainer.functions.array.depth2space as depth2space
import chainer.functions.array.diagonal as diagonal
import chainer.functions.array.dstack as dstack
import chainer.functions.array.expand_dims as expand_dims
import chainer.functions.array.flip as flip
import chainer.functions.array.fliplr as fliplr
import chainer.functions.array.flipud as flipud
import chainer.functions.array.get_item as get_item
import chainer.functions.array.hstack as hstack
import chainer.functions.array.im2col as im2col
import chainer.functions.array.moveaxis as moveaxis
import chainer.functions.array.pad as pad
import chainer.functions.array.permutate as permutate
import chainer.functions.array.repeat as repeat
import chainer.functions.array.reshape as reshape
import chainer.functions.array.rollaxis as rollaxis
import chainer.functions.array.separate as separate
import chainer.functions.array.space2depth as space2depth
import chainer.functions.array.split_axis as split_axis
import chainer.functions.array.squeeze as squeeze
import chainer.functions.array.stack as stack
import chainer.functions.array.swapaxes as swapaxes
import chainer.functions.array.tile as tile
import chainer.functions.array.transpose as transpose
import chainer.functions.array.vstack as vstack
import chainer.functions.array.where as where
import chainer.functions.math.average as average
import chainer.functions.math.basic_math as basic_math
import chainer.functions.math.cumsum as cumsum
import chainer.functions.math.exponential as exponential
import chainer.functions.math.identity as identity
import chainer.functions.math.maximum as maximum
import chainer.functions.math.minimum as minimum
import chainer.functions.math.minmax as minmax
import chainer.functions.math.sqrt as sqrt
import chainer.functions.math.square as square
import chainer.functions.math.sum as sum_module
import chainer.functions.math.trigonometric as trigonometric
import chainer.functions.noise.dropout as dropout
import chainer.functions.pooling.average_pooling_2d as average_pooling_2d
import chainer.functions.pooling.average_pooling_nd as average_pooling_nd
import chainer.functions.pooling.max_pooling_nd as max_pooling_nd
import chainer.functions.pooling.unpooling_2d as unpooling_2d
import chainer.functions.pooling.unpooling_nd as unpooling_nd
import chainer.functions.pooling.upsampling_2d as upsampling_2d

from chainerkfac import capture as capture_module
from chainerkfac.curvature.graph import UnsupportedGraph

logger = logging.getLogger(__name__)

#: Functions linear or piecewise linear in all their inputs: no residual.
ZERO_CURVATURE = (
    relu.ReLU, leaky_relu.LeakyReLU, clipped_relu.ClippedReLU,
    hard_sigmoid.HardSigmoid, basic_math.Absolute,
    reshape.Reshape, transpose.Transpose, concat.Concat,
    split_axis.SplitAxis, get_item.GetItem, broadcast.BroadcastTo,
    squeeze.Squeeze, expand_dims.ExpandDims, pad.Pad, copy.Copy, cast.Cast,
    identity.Identity, basic_math.Add, basic_math.AddConstant,
    basic_math.Sub, basic_math.SubFromConstant, basic_math.Neg,
    basic_math.MulConstant, sum_module.Sum, average.Mean,
    dropout.Dropout, max_pooling_nd.MaxPoolingND,
    average_pooling_2d.AveragePooling2D,
    average_pooling_nd.AveragePoolingND, unpooling_2d.Unpooling2D,
    minmax.Max, minmax.Min, maximum.Maximum, minimum.Minimum,
    stack.Stack, swapaxes.Swapaxes, tile.Tile, flip.Flip,
    rollaxis.Rollaxis,
    # Chainer's other linear rearrangements (and ``where``, linear in
    # both branches for a fixed condition), upsampling and cumsum
    space2depth.Space2Depth, depth2space.Depth2Space, diagonal.Diagonal,
    dstack.Dstack, hstack.Hstack, vstack.Vstack, fliplr.FlipLR,
    flipud.FlipUD, im2col.Im2Col, moveaxis.Moveaxis, permutate.Permutate,
    repeat.Repeat, separate.Separate,
    where.Where, cumsum.Cumsum, unpooling_nd.UnpoolingND,
    upsampling_2d.Upsampling2D)
#: Elementwise functions of one input with a second derivative.
ELEMENTWISE = (
    sigmoid.Sigmoid, tanh.Tanh, softplus.Softplus, elu.ELU,
    exponential.Exp, exponential.Log, sqrt.Sqrt, square.Square,
    basic_math.PowVarConst, trigonometric.Sin, trigonometric.Cos)


def residual_diagonals(graph, loss, passes) -> Dict[str, object]:
    """``{path: Σ_f diag(J_θuᵀ R_f J_θu)}`` over the curved functions (this
    process's samples).

    Parameters
    ----------
    graph : chainerkfac.curvature.graph.ModelGraph
    loss : chainer.Variable
        The mean loss (scaled to the global batch).
    passes : chainerkfac.curvature.columns.Passes
        Runs the backward passes from ``u``, one per feature (stacked).
    """
    curved = _curved_functions(graph)
    out: Dict[str, object] = {}
    if not curved:
        return out
    outputs = [f.outputs[0]().get_variable() for f in curved]
    with capture_module.unobserved():
        adjoints = chainer.grad([loss], outputs)
    count = 0
    for function, output, adjoint in zip(curved, outputs, adjoints):
        if adjoint is None:
            continue
        u = function.inputs[0].get_variable()
        residual = _residual(output, u, adjoint)
        xp = chainer.backend.get_array_module(residual)
        n = residual.shape[0]
        flat = residual.reshape(n, -1)
        features = chainer.backend.CpuDevice().send(
            xp.flatnonzero(flat.any(axis=0)))
        roots = xp.sqrt(xp.abs(flat))
        signs = xp.sign(flat)

        def make(part):   # used within this iteration only
            chosen = xp.asarray(features[part])
            k = len(chosen)
            # (pass, feature, sample): pass k has feature chosen[k] alone.
            columns = xp.zeros((k, flat.shape[1], n), flat.dtype)
            columns[xp.arange(k), chosen] = roots[:, chosen].T
            return (columns.transpose(0, 2, 1).reshape(
                (k,) + residual.shape),
                    signs[:, chosen].T)
        for slot, grads, weights in passes.run(u, len(features), make):
            _add(out, slot.path, slot.square_sum(grads, weights))
        count += len(features)
    logger.debug('curvature: diag_hessian took %d residual passes', count)
    return out


def _add(out, path, value):
    if value is not None:
        out[path] = value if path not in out else out[path] + value


def _residual(output, u, adjoint):
    """``(∂L/∂v) ⊙ f''(u)`` of an elementwise ``v = f(u)``, by double
    backprop: the gradient w.r.t. ``u`` of ``Σ (∂L/∂v ⊙ f'(u))``."""
    with capture_module.unobserved():
        first, = chainer.grad([output], [u], grad_outputs=[adjoint],
                              enable_double_backprop=True)
        xp = chainer.backend.get_array_module(first.array)
        second, = chainer.grad([first], [u], grad_outputs=[
            chainer.Variable(xp.ones_like(first.array))])
    if second is None:
        return xp.zeros_like(first.array)
    return second.array


def _curved_functions(graph):
    """The elementwise curved functions between the parameters and the
    logits; raise for a function whose curvature is not handled."""
    graph.require_slots('diag_hessian')
    shared = [slot.path for slot in graph.slots if len(slot.uses) > 1]
    if shared:
        raise UnsupportedGraph(
            'diag_hessian is implemented for parameters used once; {} is '
            'used by {} calls'.format(shared[0],
                                      len(graph.slot[shared[0]].uses)))
    calls = {call.function for call in graph.slot_calls}
    curved = []
    for function in graph.functions:
        if not any(node.requires_grad for node in function.inputs):
            continue
        if function in calls or isinstance(function, ZERO_CURVATURE):
            continue
        if isinstance(function, ELEMENTWISE):
            curved.append(function)
            continue
        raise UnsupportedGraph(
            'diag_hessian needs the second derivative of {}, which is '
            'neither zero nor elementwise (supported: Linear, '
            'Convolution2D, BatchNormalization in test mode, {})'.format(
                type(function).__name__, ', '.join(sorted(
                    t.__name__ for t in ZERO_CURVATURE + ELEMENTWISE))))
    return curved
