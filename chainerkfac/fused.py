"""Fused GPU kernels of the per-step work, each beside its NumPy twin.

A K-FAC step touches every parameter a few times: the regularised gradient
of eq. (13), the update of eqs. (19)-(20), the check that no direction is
NaN or Inf. Written as array expressions, each is several CuPy kernels per
parameter (ResNet-50 has 161): hundreds of launches and, for the finite
check, a host synchronisation per array. Here each is one kernel per
parameter (three with eq. 20's norm) and the finite check is one kernel
and one synchronisation for all arrays of a step.

The NumPy twins compute the same expressions in the same order; the tests
compare the two (CPU vs GPU in float64). The scalars (γ, η, m) may be
host floats or 0-d arrays on the arrays' device, which the kernels read
when they run (a replayed CUDA graph then takes the values of its step:
:mod:`chainerkfac.graphs.hyper`). Importing this module does not import
CuPy.
"""
import functools
from typing import Sequence

import numpy

from chainer.backend import get_array_module

#: ε of eq. (20).
RESCALE_EPS = 1e-9


def regularized_grad(grad, weight, damping: float, mean: float = 0.0):
    """∇E = ∇L + γ (w − μ) of eq. (13)."""
    xp = get_array_module(grad)
    if xp is numpy:
        damping = _host_scalar(damping, grad.dtype)
        if mean:
            return grad + damping * (weight - mean)
        return grad + damping * weight
    return _kernels().regularized(grad, weight, _scalar(damping, grad.dtype),
                                  grad.dtype.type(mean))


def momentum_step(weight, velocity, direction, lr: float, momentum: float,
                  rescale_norm=None) -> None:
    """Eqs. (19)-(20) in place: ``new = w + (m v − η G)``, optionally
    ``new ← rescale_norm · new / (‖new‖ + ε)``; then ``v ← new − w`` and
    ``w ← new``."""
    xp = get_array_module(weight)
    if xp is numpy:
        lr = _host_scalar(lr, weight.dtype)
        momentum = _host_scalar(momentum, weight.dtype)
        new = weight + (momentum * velocity - lr * direction)
        if rescale_norm is not None:
            new *= rescale_norm / (numpy.linalg.norm(new) + RESCALE_EPS)
        velocity[...] = new - weight
        weight[...] = new
        return
    kernels = _kernels()
    dtype = weight.dtype.type
    lr = _scalar(lr, weight.dtype)
    momentum = _scalar(momentum, weight.dtype)
    if rescale_norm is None:
        kernels.momentum(direction, lr, momentum, weight, velocity)
        return
    # The unscaled new weight goes into ``velocity`` first: its norm is
    # needed before the rescaled weight can be written.
    kernels.unscaled(weight, direction, lr, momentum, velocity)
    norm = kernels.norm(velocity)
    kernels.rescaled(norm, dtype(rescale_norm), dtype(RESCALE_EPS), weight,
                     velocity)


def _scalar(value, dtype):
    """A kernel's scalar argument of ``dtype``: a host number rounded to
    it, or a 0-d device array cast to it on the device."""
    if isinstance(value, (int, float, numpy.generic)):
        return numpy.dtype(dtype).type(value)
    return value.astype(dtype, copy=False)


def _host_scalar(value, dtype):
    """A NumPy operand: a Python number as it is (NumPy rounds it to the
    array's dtype), a NumPy scalar or 0-d array rounded to ``dtype``
    first, so that it computes as the Python number would (NumPy 2 would
    otherwise promote a float32 array to float64)."""
    if isinstance(value, (numpy.ndarray, numpy.generic)):
        return numpy.dtype(dtype).type(value)
    return value


def all_finite(arrays: Sequence) -> bool:
    """Whether every element of every array is finite.

    On the GPU: one kernel over all float32 / float64 arrays (a table of
    their pointers) and one host synchronisation.
    """
    arrays = [a for a in arrays if a is not None and a.size]
    if not arrays:
        return True
    xp = get_array_module(arrays[0])
    if xp is numpy:
        return all(bool(numpy.isfinite(a).all()) for a in arrays)
    bad = xp.zeros(1, numpy.int32)
    by_dtype = {}
    for array in arrays:
        by_dtype.setdefault(numpy.dtype(array.dtype), []).append(
            xp.ascontiguousarray(array))
    keep = []   # keep contiguous copies alive until the kernels ran
    for dtype, group in by_dtype.items():
        kernel = _kernels().finite.get(dtype)
        if kernel is None:
            flags = [xp.isfinite(a).all() for a in group]
            bad |= ~xp.stack(flags).all()
            continue
        pointers = xp.asarray(numpy.array([a.data.ptr for a in group],
                                          numpy.uint64))
        sizes = xp.asarray(numpy.array([a.size for a in group], numpy.int64))
        keep.append((group, pointers, sizes))
        blocks = int(min(64, max(1, max(a.size for a in group) // 1024)))
        kernel((blocks, len(group)), (256,),
               (pointers, sizes, bad))
    return not bool(bad.get()[0])


_FINITE_SOURCE = r'''
extern "C" __global__ void all_finite_{name}(
        const unsigned long long* pointers, const long long* sizes,
        int* bad) {{
    const {ctype}* x = (const {ctype}*) pointers[blockIdx.y];
    const long long size = sizes[blockIdx.y];
    const long long stride = (long long) gridDim.x * blockDim.x;
    for (long long i = (long long) blockIdx.x * blockDim.x + threadIdx.x;
         i < size; i += stride) {{
        if (!isfinite(x[i])) {{
            *bad = 1;
            return;
        }}
    }}
}}
'''


@functools.lru_cache(maxsize=None)
def _kernels():
    import cupy

    class Kernels:
        regularized = cupy.ElementwiseKernel(
            'T g, T w, T d, T mu', 'T out', 'out = g + d * (w - mu)',
            'chainerkfac_regularized_grad')
        momentum = cupy.ElementwiseKernel(
            'T d, T lr, T m', 'T w, T v',
            'T step = m * v - lr * d; T new_w = w + step; '
            'v = new_w - w; w = new_w;',
            'chainerkfac_momentum_step')
        unscaled = cupy.ElementwiseKernel(
            'T w, T d, T lr, T m', 'T v',
            'v = w + (m * v - lr * d)',
            'chainerkfac_unscaled_step')
        norm = cupy.ReductionKernel(
            'T x', 'T y', 'x * x', 'a + b', 'y = sqrt(a)', '0',
            'chainerkfac_norm')
        rescaled = cupy.ElementwiseKernel(
            'T norm, T target, T eps', 'T w, T v',
            'T scaled = v * (target / (norm + eps)); v = scaled - w; '
            'w = scaled;',
            'chainerkfac_rescaled_step')
        finite = {
            numpy.dtype(numpy.float32): cupy.RawKernel(
                _FINITE_SOURCE.format(name='f32', ctype='float'),
                'all_finite_f32'),
            numpy.dtype(numpy.float64): cupy.RawKernel(
                _FINITE_SOURCE.format(name='f64', ctype='double'),
                'all_finite_f64'),
        }

    return Kernels()
