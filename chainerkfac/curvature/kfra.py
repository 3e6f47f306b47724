"""KFRA's output factors (Botev, Ritter & Barber 2017; BackPACK's ``KFRA``).

KFRA propagates one batch-averaged curvature matrix instead of one per
sample: starting from the mean loss Hessian ``Ḡ = (1/N) Σ_n ∇²ℓ_n`` at the
logits, each function ``y = f(x)`` of the chain maps ``Ḡ_y`` to

    ``Ḡ_x = (1/N) Σ_n J_nᵀ Ḡ_y J_n``,  ``J_n = ∂y_n/∂x_n``,

and a Linear's ``B`` is ``Ḡ`` at its output (a convolution's: summed over
output positions on both sides, BackPACK's convention). The products are
Chainer's own backward of ``f``: with ``Ḡ_y = R Rᵀ`` (its eigenvectors
scaled by the square roots of its eigenvalues), one backward pass of ``f``
per column ``r`` of ``R``, the same ``r`` for every sample, gives
``J_nᵀ r`` for all ``n`` at once; the columns go through ``f`` stacked
(:func:`chainerkfac.curvature.columns.transpose_jacobian`). Cost:
``rank(Ḡ_y)`` columns through each function, and dense ``h × h`` matrices
for ``h`` features per sample.

Defined here for a **chain**: every function between the inputs and the
logits has one non-parameter input that needs a gradient, used by that
function alone, and each parameter enters one call (the recursion of
Botev et al.; a residual connection or a shared weight has no single
``Ḡ`` per layer). Elsewhere, and when a layer has more than
:data:`MAX_FEATURES` features per sample, :func:`output_factors` raises.
"""
import collections
from typing import Dict, List, Optional, Tuple

import numpy

import chainer

from chainerkfac import capture as capture_module
from chainerkfac.curvature import columns as columns_module
from chainerkfac.curvature import reduction
from chainerkfac.curvature.adapters import ConvolutionAdapter
from chainerkfac.curvature.graph import UnsupportedGraph

#: Features per sample beyond which a dense ``Ḡ`` is refused (h² entries).
MAX_FEATURES = 4096
#: Eigenvalues of ``Ḡ`` below this fraction of the largest are dropped.
RANK_TOLERANCE = 1e-12


def output_factors(graph, root, batch, chunk: Optional[int] = None
                   ) -> Dict[str, object]:
    """``{path: B}`` of KFRA for the Kronecker-factored parameters.

    Parameters
    ----------
    graph : chainerkfac.curvature.graph.ModelGraph
    root : array (n, C, K)
        The exact loss-Hessian roots (carrying ``1/√N``).
    batch : chainerkfac.curvature.reduction.Batch
    chunk : int, optional
        Columns propagated together at most (``extract``'s
        ``column_chunk``; 1: one backward pass of Chainer's autodiff each).
    """
    chain = _chain(graph)
    calls = {call.function: call for call in graph.slot_calls}
    slots = {slot.path: slot for slot in graph.slots}
    left = sum(1 for function, _ in chain if function in calls)
    curvature, = reduction.sum_over_processes(
        batch, [chainer.backend.get_array_module(root).einsum(
            'nck,ndk->cd', root, root)])
    factors = {}
    for function, index in chain:
        call = calls.get(function)
        if call is not None:
            left -= 1
            factor = _per_channel(call, curvature)
            for path in call.params.values():
                if slots[path].kronecker:
                    factors[path] = factor
        if not left:
            break
        curvature = _propagate(function, index, curvature, batch, chunk)
    return factors


def _chain(graph) -> List[Tuple[object, Optional[int]]]:
    """``[(function, index of its chain input)]`` from the logits down (the
    last function's index is None: its inputs need no gradient)."""
    graph.require_slots('kfra')
    shared = [slot.path for slot in graph.slots if len(slot.uses) > 1]
    if shared:
        raise UnsupportedGraph(
            'kfra is defined for a chain of layers; {} is used by {} calls'
            .format(shared[0], len(graph.slot[shared[0]].uses)))
    params = {id(p) for p in graph.params.values()}
    consumers = collections.Counter(
        node for function in graph.functions for node in function.inputs)
    chain = []
    function = graph.logits.creator_node
    while function is not None:
        if len(function.outputs) != 1:
            raise UnsupportedGraph(
                'kfra is defined for a chain of layers; {} has {} outputs'
                .format(type(function).__name__, len(function.outputs)))
        inputs = [i for i, node in enumerate(function.inputs)
                  if node.requires_grad and
                  id(node.get_variable_or_none()) not in params]
        if len(inputs) > 1:
            raise UnsupportedGraph(
                'kfra is defined for a chain of layers (Botev et al.); {} '
                'joins {} branches (a residual connection?)'.format(
                    type(function).__name__, len(inputs)))
        chain.append((function, inputs[0] if inputs else None))
        if not inputs:
            break
        node = function.inputs[inputs[0]]
        if consumers[node] > 1:
            raise UnsupportedGraph(
                'kfra is defined for a chain of layers; the input of {} '
                'also feeds another function (a branch)'.format(
                    type(function).__name__))
        function = node.creator_node
    return chain


def _per_channel(call, curvature):
    """``Ḡ`` at a call's output as its ``B``: summed over output positions
    for a convolution."""
    if not isinstance(call.adapter, ConvolutionAdapter):
        return curvature
    channels = call.in_data[1].shape[0]
    positions = curvature.shape[0] // channels
    return curvature.reshape(channels, positions, channels,
                             positions).sum(axis=(1, 3))


def _propagate(function, index, curvature, batch, chunk):
    """``(1/N) Σ_n J_nᵀ Ḡ J_n`` through ``function``'s input ``index``."""
    output = function.outputs[0]()
    node = function.inputs[index]
    features = int(numpy.prod(node.shape[1:]))
    if features > MAX_FEATURES:
        raise UnsupportedGraph(
            'kfra propagates a dense matrix per layer: the input of {} has '
            '{} features per sample (more than {})'.format(
                type(function).__name__, features, MAX_FEATURES))
    xp = chainer.backend.get_array_module(curvature)
    if not bool(xp.isfinite(curvature).all()):
        raise FloatingPointError(
            'kfra: the curvature reaching {} is not finite (a NaN or an '
            'infinity in the input, the weights or the loss)'.format(
                type(function).__name__))
    values, vectors = xp.linalg.eigh(curvature)
    keep = values > RANK_TOLERANCE * max(float(values.max()), 0.0)
    columns = (vectors[:, keep] * xp.sqrt(values[keep])).T.astype(
        output.dtype)
    total = xp.zeros((features, features), dtype=curvature.dtype)
    shape, n = output.shape, output.shape[0]
    if chunk == 1:
        y, x = output.get_variable(), node.get_variable()
        with capture_module.unobserved():
            for column in columns:
                grad = xp.broadcast_to(column.reshape(shape[1:]), shape)
                gx, = chainer.grad([y], [x], grad_outputs=[
                    chainer.Variable(xp.ascontiguousarray(grad))])
                if gx is not None:
                    rows = gx.array.reshape(n, -1)
                    total += rows.T.dot(rows)
    else:
        size = columns_module.passes_per_chunk(
            len(columns), n, max(features, int(numpy.prod(shape[1:]))),
            chunk, xp)
        for part in columns_module.chunks(len(columns), size):
            k = part.stop - part.start
            stacked = xp.ascontiguousarray(xp.broadcast_to(
                columns[part].reshape((k, 1) + shape[1:]),
                (k,) + shape)).reshape((k * n,) + shape[1:])
            gx, = columns_module.transpose_jacobian(
                function, (index,), [stacked], k, n)
            if gx is not None:
                rows = gx.reshape(k * n, -1)
                total += rows.T.dot(rows)
    total, = reduction.sum_over_processes(batch, [total])
    return total / batch.total
