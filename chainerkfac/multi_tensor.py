"""Multi-tensor kernels: one launch works on many parameters.

Chainer's ``MomentumSGD`` launches one kernel per parameter (161 for
ResNet-50), and so did K-FAC's update and its device guard's finite check;
PyTorch's SGD updates lists of tensors per launch (its ``foreach`` path,
the default on CUDA). In a replayed CUDA graph the host cost of a launch
is gone but each small kernel still takes a few microseconds of the GPU,
and in an eager step each launch costs the host tens of microseconds.
Here one launch takes up to :data:`CHUNK` tensors:

* :func:`momentum_sgd`: Chainer's ``MomentumSGDRule`` (``v ← m·v − η·g``,
  ``w ← w + v``);
* :func:`momentum_step`: K-FAC's eqs. (19) without (20)
  (:func:`chainerkfac.fused.momentum_step`'s kernel);
* :func:`flag_nonfinite`: set a device flag where any element is NaN or
  Inf (the device guard's check).

The tensors' addresses and sizes go as the kernel's arguments (no table in
device memory: nothing is copied from the host, so the launch may be
captured into a CUDA graph, and a gradient at a new address each eager
step needs nothing rebuilt); a block's tensor is chosen by a switch on
``blockIdx.y``. The learning rate and momentum are host numbers, or 0-d
device arrays that the kernel reads when it runs
(:mod:`chainerkfac.graphs.hyper`). On NumPy each function computes its
per-parameter original's expression in its order, so the results are
those of the code it replaces bit for bit. Importing this module does not
import CuPy.
"""
import functools
from typing import Sequence

import numpy

from chainer.backend import get_array_module

#: Tensors per launch: 32 × (up to three pointers and a size) of kernel
#: arguments, at most 1 KiB of the 4 KiB a launch may pass.
CHUNK = 32
#: Threads per block; blocks along x per tensor at most.
THREADS = 256
MAX_BLOCKS = 512
#: The dtypes the kernels serve (float16 parameters keep their own path).
DTYPES = {numpy.dtype(numpy.float32): ('f32', 'float'),
          numpy.dtype(numpy.float64): ('f64', 'double')}


def momentum_sgd(params: Sequence, grads: Sequence, velocities: Sequence,
                 lr, momentum) -> None:
    """``v ← m·v − η·g``, then ``w ← w + v``, in place, for every triple
    (Chainer's ``MomentumSGDRule``).

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
    if get_array_module(params[0]) is numpy:
        for w, g, v in zip(params, grads, velocities):
            v *= _host(momentum, v.dtype)
            v -= _host(lr, v.dtype) * g
            w += v
        return
    _launch_update('momentum_sgd', [params, grads, velocities], lr,
                   momentum)


def momentum_step(weights: Sequence, velocities: Sequence,
                  directions: Sequence, lr, momentum) -> None:
    """Eq. (19) in place for every triple: ``new = w + (m v − η G)``,
    ``v ← new − w``, ``w ← new`` (:func:`chainerkfac.fused.momentum_step`
    without eq. 20; on NumPy that function, parameter by parameter).
    Arguments as :func:`momentum_sgd`'s, the directions in the place of
    the gradients."""
    if not weights:
        return
    if get_array_module(weights[0]) is numpy:
        from chainerkfac import fused
        for w, v, d in zip(weights, velocities, directions):
            fused.momentum_step(w, v, d, lr, momentum)
        return
    _launch_update('momentum_step', [weights, directions, velocities], lr,
                   momentum)


def flag_nonfinite(arrays: Sequence, flag) -> None:
    """``flag[0] = 1`` where any element of ``arrays`` (float32 or float64,
    C-contiguous device arrays) is NaN or Inf; the flag is not cleared
    here. One launch per :data:`CHUNK` arrays of a dtype."""
    groups = {}
    for array in arrays:
        groups.setdefault(numpy.dtype(array.dtype), []).append(array)
    for dtype, members in groups.items():
        _check(dtype, [members])
        _launches(_kernel('nonfinite', dtype), [flag], [members])


def _launch_update(op, tensors, lr, momentum) -> None:
    dtype = numpy.dtype(tensors[0][0].dtype)
    _check(dtype, tensors)
    unused = tensors[2][0]
    (lr_ptr, lr_val), (m_ptr, m_val) = (
        _scalar(value, dtype, unused) for value in (lr, momentum))
    on_device = numpy.int32(int(not _is_host(lr)) |
                            int(not _is_host(momentum)) << 1)
    _launches(_kernel(op, dtype),
              [lr_ptr, m_ptr, lr_val, m_val, on_device], tensors)


def _check(dtype, tensors) -> None:
    if dtype not in DTYPES:
        raise TypeError('multi-tensor kernels take float32 or float64 arrays '
                        'on the GPU, got {}'.format(dtype))
    for array in (a for group in tensors for a in group):
        if array.dtype != dtype or not array.flags.c_contiguous:
            raise ValueError('multi-tensor kernels take C-contiguous arrays '
                             'of one dtype ({}), got {} {}'.format(
                                 dtype, array.dtype, array.shape))


def _launches(kernel, head, tensors) -> None:
    """Launch ``kernel`` over the tensors, :data:`CHUNK` per launch, the
    largest first: the ``head`` arguments, then per slot each list's
    array and the size (empty slots repeat the first tensor, size 0)."""
    first = tensors[0]
    order = sorted(range(len(first)), key=lambda k: -first[k].size)
    for start in range(0, len(order), CHUNK):
        chunk = order[start:start + CHUNK]
        widest = first[chunk[0]].size
        blocks = int(min(MAX_BLOCKS, max(1, -(-widest // (THREADS * 4)))))
        args = list(head)
        for slot in range(CHUNK):
            k = chunk[slot] if slot < len(chunk) else chunk[0]
            size = first[k].size if slot < len(chunk) else 0
            args += [group[k] for group in tensors] + [numpy.int64(size)]
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


# -- the kernels -----------------------------------------------------------------
#: op -> (the tensors of a slot: (name, const?), the head's parameters,
#: the per-element body). The update bodies are the per-parameter kernels'
#: expressions: Chainer's ``v = momentum * v - lr * grad; param += v;`` and
#: :mod:`chainerkfac.fused`'s ``momentum`` kernel.
_UPDATE_HEAD = ('const {c}* lr_ptr, const {c}* momentum_ptr, '
                'const {c} lr_value, const {c} momentum_value, '
                'const int on_device')   # bit 0: lr, bit 1: momentum
_SCALARS = '''
    const {c} lr = (on_device & 1) ? lr_ptr[0] : lr_value;
    const {c} momentum = (on_device & 2) ? momentum_ptr[0] : momentum_value;'''
_OPS = {
    'momentum_sgd': (
        (('p', False), ('g', True), ('v', False)), _UPDATE_HEAD,
        _SCALARS, '''
        {c} vi = v[i];
        vi = momentum * vi - lr * g[i];
        v[i] = vi;
        p[i] += vi;'''),
    'momentum_step': (
        (('w', False), ('d', True), ('v', False)), _UPDATE_HEAD,
        _SCALARS, '''
        const {c} wi = w[i];
        {c} step = momentum * v[i] - lr * d[i];
        {c} new_w = wi + step;
        v[i] = new_w - wi;
        w[i] = new_w;'''),
    'nonfinite': (
        (('x', True),), 'int* flag', '', '''
        if (!isfinite(x[i])) flag[0] = 1;'''),
}

_SOURCE = r'''
extern "C" __global__ void chainerkfac_{op}_{name}(
        {head},
        {args}) {{
    {decls}
    long long size = 0;
    switch (blockIdx.y) {{
        {cases}
        default: return;
    }}{scalars}
    const long long stride = (long long) gridDim.x * blockDim.x;
    for (long long i = (long long) blockIdx.x * blockDim.x + threadIdx.x;
         i < size; i += stride) {{{body}
    }}
}}
'''


def source(op: str, dtype) -> str:
    """The CUDA source of kernel ``op`` for ``dtype`` (float32 or
    float64)."""
    name, c = DTYPES[numpy.dtype(dtype)]
    slots, head, scalars, body = _OPS[op]

    def typed(tensor, const):
        return '{}{}* {}'.format('const ' if const else '', c, tensor)
    args = ',\n        '.join(
        ', '.join([typed('{}{}'.format(t, k), const) for t, const in slots] +
                  ['const long long n{}'.format(k)]) for k in range(CHUNK))
    decls = '\n    '.join('{} = 0;'.format(typed(t, const))
                          for t, const in slots)
    cases = '\n        '.join(
        'case {k}: {sets} size = n{k}; break;'.format(
            k=k, sets=' '.join('{t} = {t}{k};'.format(t=t, k=k)
                               for t, _ in slots)) for k in range(CHUNK))
    return _SOURCE.format(op=op, name=name, head=head.format(c=c),
                          args=args, decls=decls, cases=cases,
                          scalars=scalars.format(c=c),
                          body=body.format(c=c))


@functools.lru_cache(maxsize=None)
def _kernel(op: str, dtype):
    import cupy
    name, _ = DTYPES[numpy.dtype(dtype)]
    return cupy.RawKernel(source(op, dtype),
                          'chainerkfac_{}_{}'.format(op, name))
