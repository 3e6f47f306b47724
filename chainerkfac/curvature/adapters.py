"""Per-sample maths of the parameter-carrying functions, one adapter each.

A backward pass through a call ``y = f(x, θ)`` delivers the gradient ``gy``
w.r.t. its output for every sample at once. An adapter turns the call's
retained input and ``gy`` into the per-sample gradients w.r.t. the call's
parameters, ``(J_θ y_n)ᵀ gy_n``, or directly into what is wanted of them
(sums of squares, squared norms) without forming them where that is
cheaper, and, for the Kronecker-factored links, into the factors' pieces:
the unfolded inputs (``A``) and the output-side vectors (``B``).

Adapters exist for

* ``LinearFunction`` (``L.Linear``, ``F.linear`` with one batch axis):
  weight and bias;
* ``Convolution2DFunction`` (``L.Convolution2D``, any stride, padding,
  dilation, ``cover_all`` and groups): weight and bias; Kronecker factors
  for ``groups=1`` only (a grouped convolution is one Kronecker product per
  group);
* ``FixedBatchNormalization`` (``L.BatchNormalization`` in test mode, an
  affine map per channel): ``γ`` and ``β``; no Kronecker factors.

Nothing here depends on where a gradient comes from: the gradient pass and
every extra pass call the same methods with their own ``gy``.
"""
from typing import Dict, NamedTuple, Optional, Tuple

import numpy

import chainer
import chainer.functions.connection.convolution_2d as conv2d_module
import chainer.functions.connection.linear as linear_module
import chainer.functions.normalization.batch_normalization as bn_module
from chainer.backend import get_array_module
from chainer.utils import conv

from chainerkfac import linalg
from chainerkfac.fisher_blocks import patches

#: Elements of per-sample kernel gradients formed at a time for their sums
#: of squares and norms (see :meth:`ConvolutionAdapter._chunks`).
CHUNK_ELEMENTS = 2 ** 20


class Call:
    """One call of a parameter-carrying function seen in the gradient pass.

    Attributes
    ----------
    function : chainer.FunctionNode
    adapter : Adapter
    in_data : tuple of arrays
        The inputs the function retained for its backward (None for the
        others).
    output : chainer.variable.VariableNode
        Its output; extra passes ask Chainer for the gradient w.r.t. it.
    params : dict
        ``{role: parameter path}`` of the tracked parameters among its
        inputs (``'weight'``, ``'bias'``, ``'scale'``, ``'shift'``).
    """

    def __init__(self, function, adapter, in_data, output):
        self.function = function
        self.adapter = adapter
        self.in_data = in_data
        self.output = output
        self.params: Dict[str, str] = {}
        self._cache: Dict[str, object] = {}

    def cached(self, key: str, make):
        """``make()``, computed once per call (unfolded inputs, x̂)."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    @property
    def output_variable(self) -> chainer.Variable:
        return self.output.get_variable()


class Adapter:
    """The maths of one function type; subclasses fill in the methods.

    ``gy`` is the gradient w.r.t. the call's output, ``(N, ...)``, or the
    gradients of K backward passes stacked pass-major, ``(K·N, ...)`` (row
    ``k·N + n``: pass ``k``, sample ``n``; :mod:`.columns`): per-sample
    results then have K·N rows and sums run over passes and samples.
    ``role`` names the parameter (:attr:`positions`); ``weights`` (one per
    row) multiplies each row's contribution (signs of the Hessian's
    residual terms).
    """

    #: FunctionNode types this adapter handles.
    function_types: tuple = ()
    #: ``{input index: role}`` of the parameter inputs.
    positions: Dict[int, str] = {}
    #: Whether the call's weight gets Kronecker factors.
    kronecker = False

    def accepts(self, call: Call, batch: int) -> Optional[str]:
        """None if the call's first axis is the sample axis of ``batch``
        samples and its inputs are available; else why not."""
        x = call.in_data[0]
        if x is None:
            return 'its input was not retained'
        if x.shape[0] != batch:
            return ('its input has {} rows for {} samples (more than one '
                    'batch axis?)'.format(x.shape[0], batch))
        return None

    def per_sample(self, call: Call, gy, role: str):
        """Per-sample gradients ``[rows, *param.shape]``."""
        raise NotImplementedError

    def square_sum(self, call: Call, gy, role: str, weights=None):
        """``Σ_n w_n per_sample[n]²``, shaped like the parameter."""
        grads = self.per_sample(call, gy, role)
        squares = grads * grads
        if weights is not None:
            squares *= weights.reshape((-1,) + (1,) * (squares.ndim - 1))
        return squares.sum(axis=0)

    def sample_norms(self, call: Call, gy, role: str):
        """``‖per_sample[n]‖²`` per row."""
        grads = self.per_sample(call, gy, role)
        return (grads * grads).reshape(len(grads), -1).sum(axis=1)

    # -- Kronecker factors (kronecker adapters only) -----------------------
    def output_vectors(self, call: Call, gy):
        """The per-sample gradient w.r.t. the bias, (rows, d_out): ``gy``
        summed over output positions (BackPACK's ``B`` outer products)."""
        raise NotImplementedError

    def output_positions(self, call: Call) -> int:
        """Output positions per sample (1 for a Linear)."""
        raise NotImplementedError

    def position_gram(self, call: Call, gy):
        """``Σ_n Σ_positions g gᵀ`` (d_out, d_out) (KFC's ``Γ`` times the
        positions)."""
        raise NotImplementedError

    def input_factor(self, call: Call, scale: float):
        """``scale · Σ_n Σ_positions u uᵀ`` over the unfolded inputs."""
        raise NotImplementedError


def _passes(call: Call, gy) -> int:
    """Passes stacked in ``gy`` (K·N rows, pass-major, for N samples)."""
    return gy.shape[0] // call.in_data[0].shape[0]


def _weighted(values, weights):
    if weights is None:
        return values
    return values * weights.reshape((-1,) + (1,) * (values.ndim - 1))


class LinearAdapter(Adapter):
    """``y = x Wᵀ + b`` with ``x`` of shape (N, D): per-sample
    ``gy_n x_nᵀ``; squares and norms factor into the two sides."""

    function_types = (linear_module.LinearFunction,)
    positions = {1: 'weight', 2: 'bias'}
    kronecker = True

    def accepts(self, call, batch):
        why = super().accepts(call, batch)
        if why is None and call.in_data[0].ndim != 2:
            why = 'its input is not (N, D)'
        return why

    def per_sample(self, call, gy, role):
        if role == 'bias':
            return gy
        x = call.in_data[0]
        passes = _passes(call, gy)
        if passes == 1:
            return gy[:, :, None] * x[:, None, :]
        grads = gy.reshape((passes,) + x.shape[:1] + gy.shape[1:])[
            :, :, :, None] * x[None, :, None, :]
        return grads.reshape((len(gy),) + grads.shape[2:])

    def square_sum(self, call, gy, role, weights=None):
        squares = _weighted(gy * gy, weights)
        if role == 'bias':
            return squares.sum(axis=0)
        x = call.in_data[0]
        passes = _passes(call, gy)
        if passes > 1:
            # Σ_k Σ_n g_kn² x_n²: the passes summed before the product.
            squares = squares.reshape(
                (passes, len(x)) + squares.shape[1:]).sum(axis=0)
        return squares.T.dot(x * x)

    def sample_norms(self, call, gy, role):
        norms = (gy * gy).sum(axis=1)
        if role == 'bias':
            return norms
        x = call.in_data[0]
        return norms * (x * x).sum(axis=1)

    def output_vectors(self, call, gy):
        return gy

    def output_positions(self, call):
        return 1

    def position_gram(self, call, gy):
        return linalg.gram(gy, 1.0)

    def input_factor(self, call, scale):
        return linalg.gram(call.in_data[0], scale)


class ConvolutionAdapter(Adapter):
    """``convolution_2d(x, W, b)`` with groups: per-sample kernel gradients
    from the unfolded input (Chainer's ``im2col``, kept for the call),
    ``Σ_positions gy_n,t u_n,tᵀ`` per group as a batched product."""

    function_types = (conv2d_module.Convolution2DFunction,)
    positions = {1: 'weight', 2: 'bias'}
    kronecker = True

    @staticmethod
    def groups(call) -> int:
        return int(getattr(call.function, 'groups', 1))

    def geometry(self, call) -> patches.ConvGeometry:
        return patches.ConvGeometry.of(call.function,
                                       call.in_data[1].shape[2:])

    def columns(self, call):
        """The unfolded input, (N, groups, C/groups·kh·kw, positions)."""
        def unfold():
            x = call.in_data[0]
            g = self.geometry(call)
            im2col = (conv.im2col_cpu if get_array_module(x) is numpy
                      else conv.im2col_gpu)
            col = im2col(x, g.kh, g.kw, g.sy, g.sx, g.ph, g.pw,
                         cover_all=g.cover_all, dy=g.dy, dx=g.dx)
            n = x.shape[0]
            return col.reshape(n, self.groups(call), -1,
                               col.shape[4] * col.shape[5])
        return call.cached('columns', unfold)

    def per_sample(self, call, gy, role):
        n, channels = gy.shape[:2]
        if role == 'bias':
            return gy.reshape(n, channels, -1).sum(axis=2)
        return self._kernel_grads(call, gy, slice(None),
                                  slice(0, call.in_data[0].shape[0]))

    def _kernel_grads(self, call, gy, passes: slice, rows: slice):
        """Per-sample kernel gradients of the samples ``rows`` in the
        stacked passes ``passes``, (passes·samples, *W.shape): one product
        broadcast over the passes."""
        columns = self.columns(call)[rows]
        n, groups = call.in_data[0].shape[0], columns.shape[1]
        g = gy.reshape((_passes(call, gy), n, groups,
                        gy.shape[1] // groups, -1))[passes, rows]
        grads = get_array_module(gy).matmul(g, columns.transpose(0, 1, 3, 2))
        return grads.reshape((-1,) + call.in_data[1].shape)

    def _chunks(self, call, gy):
        """``(passes, samples)`` slices whose kernel gradients take about
        :data:`CHUNK_ELEMENTS` (sums of squares and norms need them one
        chunk at a time: small temporaries stay in cache and in the
        allocator's pool; whole-batch products of the 3C3D layers, 14-28
        MB, took 2-4x longer)."""
        n = call.in_data[0].shape[0]
        passes = _passes(call, gy)
        per_sample = call.in_data[1].size
        step = max(1, CHUNK_ELEMENTS // per_sample)
        if step < n:
            return [(slice(k, k + 1), slice(i, min(n, i + step)))
                    for k in range(passes) for i in range(0, n, step)]
        step = max(1, step // n)
        return [(slice(k, min(passes, k + step)), slice(0, n))
                for k in range(0, passes, step)]

    def square_sum(self, call, gy, role, weights=None):
        if role == 'bias':
            return super().square_sum(call, gy, role, weights)
        xp = get_array_module(gy)
        if weights is not None:
            weights = weights.reshape(_passes(call, gy), -1)
        total = None
        for passes, rows in self._chunks(call, gy):
            grads = self._kernel_grads(call, gy, passes, rows)
            xp.square(grads, out=grads)
            if weights is not None:
                grads *= weights[passes, rows].reshape(
                    (-1,) + (1,) * (grads.ndim - 1))
            part = grads.sum(axis=0)
            if total is None:
                total = part
            else:
                total += part
        return total

    def sample_norms(self, call, gy, role):
        if role == 'bias':
            return super().sample_norms(call, gy, role)
        xp = get_array_module(gy)
        norms = []
        for passes, rows in self._chunks(call, gy):
            grads = self._kernel_grads(call, gy, passes, rows)
            norms.append((grads * grads).reshape(len(grads), -1).sum(axis=1))
        return xp.concatenate(norms)

    def output_vectors(self, call, gy):
        return gy.reshape(gy.shape[0], gy.shape[1], -1).sum(axis=2)

    def output_positions(self, call):
        return int(numpy.prod(call.output.shape[2:]))

    def position_gram(self, call, gy):
        return patches.channel_gram(gy, 1.0, gy.dtype)

    def input_factor(self, call, scale):
        return patches.patch_gram(call.in_data[0], self.geometry(call), scale,
                                  call.in_data[0].dtype)


class FixedBatchNormalizationAdapter(Adapter):
    """Batch normalization with fixed statistics (test mode):
    ``y = γ x̂ + β`` with ``x̂ = (x − μ)/√(σ² + ε)`` per channel, an affine
    layer; per-sample ``Σ_positions gy x̂`` and ``Σ_positions gy``."""

    function_types = (bn_module.FixedBatchNormalization,)
    positions = {1: 'scale', 2: 'shift'}

    def accepts(self, call, batch):
        why = super().accepts(call, batch)
        if why is None and 0 not in tuple(call.function.axis):
            why = 'it normalises without the sample axis in its axes'
        if why is None and (call.in_data[3] is None or
                            call.in_data[4] is None):
            why = 'its statistics were not retained'
        return why

    def _summed_axes(self, call) -> Tuple[int, ...]:
        return tuple(a for a in call.function.axis if a != 0)

    def normalized(self, call):
        def make():
            x, _, _, mean, var = call.in_data
            xp = get_array_module(x)
            shape = [1] * x.ndim
            for i, axis in enumerate(call.function.key_axis):
                shape[axis] = mean.shape[i]
            inv_std = 1 / xp.sqrt(var + call.function.eps)
            return (x - mean.reshape(shape)) * inv_std.reshape(shape)
        return call.cached('normalized', make)

    def per_sample(self, call, gy, role):
        axes = self._summed_axes(call)
        if role == 'shift':
            return gy.sum(axis=axes)
        normalized = self.normalized(call)
        passes = _passes(call, gy)
        if passes == 1:
            return (gy * normalized).sum(axis=axes)
        products = gy.reshape((passes,) + normalized.shape) * normalized
        sums = products.sum(axis=tuple(a + 1 for a in axes))
        return sums.reshape((len(gy),) + sums.shape[2:])


ADAPTERS = (LinearAdapter(), ConvolutionAdapter(),
            FixedBatchNormalizationAdapter())


def adapter_for(function) -> Optional[Adapter]:
    """The adapter of a function node's type, or None."""
    for adapter in ADAPTERS:
        if isinstance(function, adapter.function_types):
            return adapter
    return None


def function_types() -> tuple:
    """Every function type an adapter handles (the capture's routes)."""
    return tuple(t for a in ADAPTERS for t in a.function_types)


class Use(NamedTuple):
    """A parameter's role in one call."""
    call: Call
    role: str
