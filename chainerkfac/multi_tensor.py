"""Multi-tensor kernels: one launch updates many parameters.

Chainer's ``MomentumSGD`` launches one kernel per parameter (161 for
ResNet-50); PyTorch's SGD updates lists of tensors per launch (its
``foreach`` path, the default on CUDA). In a replayed CUDA graph the host
cost of a launch is gone but each small kernel still takes a few
microseconds of the GPU, and in an eager step each launch costs the host
tens of microseconds. :func:`momentum_sgd` takes the update of Chainer's
``MomentumSGDRule`` (``v ← m·v − η·g``, ``w ← w + v``) for up to
:data:`CHUNK` parameters per launch.

The tensors' addresses and sizes go as the kernel's arguments (no table in
device memory: nothing is copied from the host, so the launch may be
captured into a CUDA graph, and a gradient at a new address each eager
step needs nothing rebuilt). The learning rate and momentum are host
numbers, or 0-d device arrays that the kernel reads when it runs
(:mod:`chainerkfac.graphs.hyper`). On NumPy the update is Chainer's CPU
expression, in its order (``v *= m; v -= η g; w += v``), so the results
are Chainer's bit for bit. Importing this module does not import CuPy.
"""
import functools
from typing import Sequence

import numpy

from chainer.backend import get_array_module

#: Tensors per launch: 32 × (three pointers and a size) of kernel
#: arguments, 1 KiB of the 4 KiB a launch may pass.
CHUNK = 32
#: Threads per block; blocks along x per tensor at most.
THREADS = 256
MAX_BLOCKS = 512
#: The dtypes the kernel serves (float16 parameters keep Chainer's own).
DTYPES = {numpy.dtype(numpy.float32): ('f32', 'float'),
          numpy.dtype(numpy.float64): ('f64', 'double')}


def momentum_sgd(params: Sequence, grads: Sequence, velocities: Sequence,
                 lr, momentum) -> None:
    """``v ← m·v − η·g``, then ``w ← w + v``, in place, for every triple.

    Parameters
    ----------
    params, grads, velocities : sequences of arrays
        Aligned, each triple of one shape and dtype, on one device; on the
        GPU float32 or float64 and C-contiguous.
    lr, momentum : float or 0-d array
        η and m: host numbers (rounded to the arrays' dtype, as Chainer's
        kernel takes them), or 0-d device arrays read when the kernel runs.
    """
    if not params:
        return
    xp = get_array_module(params[0])
    if xp is numpy:
        for w, g, v in zip(params, grads, velocities):
            v *= _host(momentum, v.dtype)
            v -= _host(lr, v.dtype) * g
            w += v
        return
    dtype = numpy.dtype(params[0].dtype)
    if dtype not in DTYPES:
        raise TypeError('momentum_sgd takes float32 or float64 arrays on the '
                        'GPU, got {}'.format(dtype))
    for array in list(params) + list(grads) + list(velocities):
        if array.dtype != dtype or not array.flags.c_contiguous:
            raise ValueError('momentum_sgd takes C-contiguous arrays of one '
                             'dtype ({}), got {} {}'.format(
                                 dtype, array.dtype, array.shape))
    (lr_ptr, lr_val), (m_ptr, m_val) = (
        _scalar(value, dtype, velocities[0]) for value in (lr, momentum))
    on_device = numpy.int32(int(not _is_host(lr)) |
                            int(not _is_host(momentum)) << 1)
    order = sorted(range(len(params)), key=lambda k: -params[k].size)
    kernel = _kernel(dtype)
    for start in range(0, len(order), CHUNK):
        chunk = order[start:start + CHUNK]
        widest = params[chunk[0]].size
        blocks = int(min(MAX_BLOCKS, max(1, -(-widest // (THREADS * 4)))))
        args = [lr_ptr, m_ptr, lr_val, m_val, on_device]
        for slot in range(CHUNK):
            k = chunk[slot] if slot < len(chunk) else chunk[0]
            size = params[k].size if slot < len(chunk) else 0
            args += [params[k], grads[k], velocities[k], numpy.int64(size)]
        kernel((blocks, len(chunk)), (THREADS,), tuple(args))


def _scalar(value, dtype, unused):
    """``(device array, host value)`` of a kernel scalar: a host number
    rounded to ``dtype`` (the array ``unused``, never read, in its place),
    or a 0-d device array cast to ``dtype``."""
    if _is_host(value):
        return unused, dtype.type(value)
    return value.astype(dtype, copy=False), dtype.type(0)


def _is_host(value) -> bool:
    return isinstance(value, (int, float, numpy.generic))


def _host(value, dtype):
    """A host operand for NumPy: a Python number as it is (NumPy rounds it
    to the array's dtype, as Chainer's CPU update does), a NumPy scalar or
    0-d array rounded to ``dtype``."""
    if isinstance(value, (numpy.ndarray, numpy.generic)):
        return numpy.dtype(dtype).type(value)
    return value


def source(dtype) -> str:
    """The CUDA source of the kernel for ``dtype`` (float32 or float64)."""
    name, ctype = DTYPES[numpy.dtype(dtype)]
    args = ',\n        '.join(
        '{c}* p{k}, const {c}* g{k}, {c}* v{k}, const long long n{k}'.format(
            c=ctype, k=k) for k in range(CHUNK))
    # a switch on the block's tensor (uniform over the block): the
    # arguments stay in the parameter space, nothing goes to local memory
    cases = '\n        '.join(
        'case {k}: param = p{k}; grad = g{k}; v = v{k}; size = n{k}; '
        'break;'.format(k=k) for k in range(CHUNK))
    return _SOURCE.format(name=name, ctype=ctype, args=args, cases=cases)


# Chainer's MomentumSGDRule kernel is ``v = momentum * v - lr * grad;
# param += v;``: the same expression, per element.
_SOURCE = r'''
extern "C" __global__ void chainerkfac_momentum_sgd_{name}(
        const {ctype}* lr_ptr, const {ctype}* momentum_ptr,
        const {ctype} lr_value, const {ctype} momentum_value,
        const int on_device,    /* bit 0: lr, bit 1: momentum */
        {args}) {{
    {ctype}* param = 0;
    const {ctype}* grad = 0;
    {ctype}* v = 0;
    long long size = 0;
    switch (blockIdx.y) {{
        {cases}
        default: return;
    }}
    const {ctype} lr = (on_device & 1) ? lr_ptr[0] : lr_value;
    const {ctype} momentum = (on_device & 2) ? momentum_ptr[0]
                                             : momentum_value;
    const long long stride = (long long) gridDim.x * blockDim.x;
    for (long long i = (long long) blockIdx.x * blockDim.x + threadIdx.x;
         i < size; i += stride) {{
        {ctype} vi = v[i];
        vi = momentum * vi - lr * grad[i];
        v[i] = vi;
        param[i] += vi;
    }}
}}
'''


@functools.lru_cache(maxsize=None)
def _kernel(dtype):
    import cupy
    name, _ = DTYPES[numpy.dtype(dtype)]
    return cupy.RawKernel(source(dtype), 'chainerkfac_momentum_sgd_' + name)
