"""Multi-tensor kernels: one launch works on many parameters.

Chainer's ``MomentumSGD`` launches one kernel per parameter (161 for
ResNet-50), and so did K-FAC's update and its device guard's finite check;
PyTorch's SGD updates lists of tensors per launch (its ``foreach`` path,
the default on CUDA). In a replayed CUDA graph the host cost of a launch
is gone but each small kernel still takes a few microseconds of the GPU,
and in an eager step each launch costs the host tens of microseconds.
Here one launch takes up to :data:`CHUNK` tensors:

* :func:`momentum_sgd`: Chainer's ``MomentumSGDRule`` (``v ← m·v − η·g``,
  ``w ← w + v``), optionally after Chainer's ``WeightDecay`` hook (``g ←
  g + λ·w``) in the same pass;
* :func:`momentum_step`: K-FAC's eq. (19), and with eq. (20) (the
  rescale to a norm per weight) in two launches per 32 weights: the
  unscaled step with each block's sum of squares, then the rescale from
  those sums added in a fixed order (no atomics: a replay computes what
  the eager step did) (:func:`chainerkfac.fused.momentum_step`'s kernels);
* :func:`flag_nonfinite`: set a device flag where any element is NaN or
  Inf (the device guard's check);
* :func:`regularized`: eq. (13)'s ``g + γ (w − μ)`` of many parameters
  written into the slots of one stacked array (what K-FAC's batched
  preconditioning multiplies): in place of ``xp.stack``, whose CuPy
  implementation copies a table of pointers from the host for more than 8
  small arrays, which a CUDA graph's capture refuses;
* :func:`bound_terms` and :func:`scale`: the bounded step's per-parameter
  terms ``⟨d, g⟩ + γ⟨d, w⟩ − γ μ Σd`` (two deterministic passes: each
  block's float64 sums, then a tensor's blocks added in order) and its
  scaling of the directions by ν.

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
from typing import Optional, Sequence

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
                 lr, momentum, weight_decay: Optional[float] = None
                 ) -> None:
    """``v ← m·v − η·g``, then ``w ← w + v``, in place, for every triple
    (Chainer's ``MomentumSGDRule``); with ``weight_decay`` first ``g ← g +
    λ·w`` (Chainer's ``WeightDecay`` hook, the gradient left so).

    Parameters
    ----------
    params, grads, velocities : sequences of arrays
        Aligned, each triple of one shape and dtype, on one device; on the
        GPU float32 or float64 and C-contiguous.
    lr, momentum : float or 0-d array
        η and m: host numbers (rounded to the arrays' dtype, as Chainer's
        kernel takes them), or 0-d device arrays read when the kernel runs.
    weight_decay : float, optional
        λ, a host number (rounded to the dtype, as the hook's kernel takes
        it).
    """
    if not params:
        return
    if get_array_module(params[0]) is numpy:
        from chainerkfac.fused import _host_scalar
        for w, g, v in zip(params, grads, velocities):
            if weight_decay is not None:
                g += weight_decay * w      # the hook's expression
            v *= _host_scalar(momentum, v.dtype)
            v -= _host_scalar(lr, v.dtype) * g
            w += v
        return
    if weight_decay is None:
        _launch_update('momentum_sgd', [params, grads, velocities], lr,
                       momentum)
    else:
        _launch_update('momentum_sgd_wd', [params, grads, velocities], lr,
                       momentum, weight_decay)


def momentum_step(weights: Sequence, velocities: Sequence,
                  directions: Sequence, lr, momentum,
                  rescale_norms: Optional[Sequence[float]] = None) -> None:
    """Eq. (19) in place for every triple: ``new = w + (m v − η G)``; with
    ``rescale_norms`` (one per weight) eq. (20), ``new ← r · new / (‖new‖ +
    ε)``; then ``v ← new − w`` and ``w ← new``
    (:func:`chainerkfac.fused.momentum_step`; on NumPy that function,
    parameter by parameter). Arguments as :func:`momentum_sgd`'s, the
    directions in the place of the gradients."""
    if not weights:
        return
    if get_array_module(weights[0]) is numpy:
        from chainerkfac import fused
        for k, (w, v, d) in enumerate(zip(weights, velocities, directions)):
            fused.momentum_step(w, v, d, lr, momentum,
                                None if rescale_norms is None
                                else rescale_norms[k])
        return
    if rescale_norms is None:
        _launch_update('momentum_step', [weights, directions, velocities],
                       lr, momentum)
        return
    from chainerkfac import fused
    dtype = numpy.dtype(weights[0].dtype)
    tensors = [weights, directions, velocities]
    _check(dtype, tensors)
    xp = get_array_module(weights[0])
    head = _update_head(lr, momentum, dtype, velocities[0])
    targets = [dtype.type(r) for r in rescale_norms]
    eps = dtype.type(fused.RESCALE_EPS)
    for chunk, blocks in _chunks(weights):
        # the same chunks and grid for both: the second reads the first's
        # partial sums by (tensor, block)
        partials = xp.empty((len(chunk), blocks), numpy.float64)
        _launch(_kernel('unscaled', dtype), head + [partials], tensors,
                chunk, blocks)
        _launch(_kernel('rescaled', dtype), [partials, eps],
                [weights, velocities], chunk, blocks, [targets])


def regularized(grads: Sequence, weights: Sequence, damping, mean: float,
                outs: Sequence) -> None:
    """``outs[k] ← grads[k] + γ (weights[k] − μ)`` (eq. 13,
    :func:`chainerkfac.fused.regularized_grad`'s expression) for every
    ``k``: the regularised gradients written where the caller wants them,
    the slots of one stacked array (``[stack[k] for k ...]``, or row
    pieces ``stack[k, :c]``).

    Parameters
    ----------
    grads, weights, outs : sequences of arrays
        Aligned, each triple of one size and dtype on one device; ``outs``
        are written, not read.
    damping : float or 0-d array
        γ: a host number (rounded to the dtype), or a 0-d device array
        read when the kernel runs (a CUDA graph's replay takes its step's
        value).
    mean : float
        μ, a host number.

    On the GPU one launch per :data:`CHUNK` parameters where every array
    is C-contiguous float32 / float64; otherwise (float16, strided views)
    :func:`chainerkfac.fused.regularized_grad` per parameter and a copy
    into its slot. Neither copies from the host, so both may be captured.
    On NumPy each slot is the fused function's NumPy twin.
    """
    if not grads:
        return
    from chainerkfac import fused
    dtype = numpy.dtype(grads[0].dtype)
    if get_array_module(grads[0]) is numpy or dtype not in DTYPES or any(
            a.dtype != dtype or not a.flags.c_contiguous
            for group in (grads, weights, outs) for a in group):
        for g, w, out in zip(grads, weights, outs):
            out[...] = fused.regularized_grad(g, w, damping, mean)
        return
    d_ptr, d_value = _scalar(damping, dtype, outs[0])
    head = [d_ptr, d_value, numpy.int32(not _is_host(damping)),
            dtype.type(mean)]
    _launches(_kernel('regularized', dtype), head, [grads, weights, outs])


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


def bound_terms(directions: Sequence, grads: Sequence, weights: Sequence,
                dampings: Sequence, means: Sequence[float]):
    """Per parameter, ``⟨d, g⟩ + γ ⟨d, w⟩`` and, where its regularisation
    mean μ is not 0, ``− γ μ Σd`` (:func:`chainerkfac.step_bound.
    metric_term`'s terms), in float64 on the device: a ``(count,)`` array.

    ``directions``, ``grads``, ``weights``: C-contiguous device arrays of
    one dtype (float32 or float64); ``dampings``: each parameter's γ, a 0-d
    float64 device array (read when the kernel runs); ``means``: host
    numbers. The sums are float64 from each element on.
    """
    xp = get_array_module(directions[0])
    dtype = numpy.dtype(directions[0].dtype)
    tensors = [directions, grads, weights]
    _check(dtype, tensors)
    terms = xp.empty(len(directions), numpy.float64)
    means = [numpy.float64(m) for m in means]
    for chunk, blocks in _chunks(directions):
        partials = xp.empty((len(chunk), blocks, 3), numpy.float64)
        _launch(_kernel('dots', dtype), [partials], tensors, chunk, blocks)
        # one thread per tensor adds its blocks' sums in order and writes
        # its term at its own index
        _launch(_kernel('terms', dtype),
                [partials, numpy.int32(blocks), terms], [dampings], chunk, 1,
                [means, [numpy.int64(k) for k in range(len(directions))]])
    return terms


def scale(arrays: Sequence, factor) -> None:
    """``x *= factor`` in place for every array (C-contiguous device
    arrays of one dtype), ``factor`` a 0-d float64 device array cast to
    the arrays' dtype first (as ``x *= factor.astype(x.dtype)``)."""
    if not arrays:
        return
    dtype = numpy.dtype(arrays[0].dtype)
    _check(dtype, [arrays])
    _launches(_kernel('scale', dtype), [factor], [arrays])


def _launch_update(op, tensors, lr, momentum, *more) -> None:
    """An update kernel's launches: its head (:func:`_update_head`, then
    ``more`` host numbers rounded to the dtype) and the tensors."""
    dtype = numpy.dtype(tensors[0][0].dtype)
    _check(dtype, tensors)
    _launches(_kernel(op, dtype),
              _update_head(lr, momentum, dtype, tensors[2][0]) +
              [dtype.type(value) for value in more], tensors)


def _update_head(lr, momentum, dtype, unused) -> list:
    """The update kernels' first arguments (``_UPDATE_HEAD``): η's and m's
    device pointers and host values, and the bits saying which is read
    (``unused``, an array never read, stands in for a host number's
    pointer)."""
    (lr_ptr, lr_val), (m_ptr, m_val) = (
        _scalar(value, dtype, unused) for value in (lr, momentum))
    on_device = numpy.int32(int(not _is_host(lr)) |
                            int(not _is_host(momentum)) << 1)
    return [lr_ptr, m_ptr, lr_val, m_val, on_device]


def group_key(value):
    """What groups parameters by a hyperparameter: a host number's value,
    or a device scalar itself (the kernel reads it by its address)."""
    if isinstance(value, (int, float)):
        return ('host', float(value))
    return ('device', id(value))


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
    largest first (:func:`_chunks`, :func:`_launch`)."""
    for chunk, blocks in _chunks(tensors[0]):
        _launch(kernel, head, tensors, chunk, blocks)


def _chunks(first):
    """``(indices, blocks)`` of each launch: :data:`CHUNK` tensors at
    most, the largest first, and the blocks along x for the widest."""
    order = sorted(range(len(first)), key=lambda k: -first[k].size)
    for start in range(0, len(order), CHUNK):
        chunk = order[start:start + CHUNK]
        widest = first[chunk[0]].size
        yield chunk, int(min(MAX_BLOCKS,
                             max(1, -(-widest // (THREADS * 4)))))


def _launch(kernel, head, tensors, chunk, blocks, scalars=()) -> None:
    """One launch: the ``head`` arguments, then per slot each list's array,
    each of ``scalars``' values, and the size (empty slots repeat the
    first tensor, size 0)."""
    args = list(head)
    for slot in range(CHUNK):
        k = chunk[slot] if slot < len(chunk) else chunk[0]
        size = tensors[0][k].size if slot < len(chunk) else 0
        args += [group[k] for group in tensors]
        args += [values[k] for values in scalars] + [numpy.int64(size)]
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


# -- the kernels -----------------------------------------------------------------
#: op -> (the slot's arguments: (name, kind), the head's parameters, code
#: before the loop, the per-element body, code after). Kinds: ``'in'``,
#: ``'out'`` (pointers of the dtype), ``'scalar'`` (the dtype),
#: ``'dptr'`` / ``'dscalar'`` (float64 pointer / value), ``'iscalar'``.
#: The update bodies are the per-parameter kernels' expressions: Chainer's
#: ``v = momentum * v - lr * grad; param += v;`` and
#: :mod:`chainerkfac.fused`'s ``momentum``, ``unscaled`` and ``rescaled``
#: kernels (the norm between them: each block's sum of squares in float64,
#: then the blocks' sums in order, its square root cast to the dtype).
_UPDATE_HEAD = ('const {c}* lr_ptr, const {c}* momentum_ptr, '
                'const {c} lr_value, const {c} momentum_value, '
                'const int on_device')   # bit 0: lr, bit 1: momentum
_SCALARS = '''
    const {c} lr = (on_device & 1) ? lr_ptr[0] : lr_value;
    const {c} momentum = (on_device & 2) ? momentum_ptr[0] : momentum_value;
'''
_BLOCK_SUM = '''
    __shared__ double block_sum[{threads}];
    block_sum[threadIdx.x] = sum;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half >>= 1) {{
        if (threadIdx.x < half)
            block_sum[threadIdx.x] += block_sum[threadIdx.x + half];
        __syncthreads();
    }}
    if (threadIdx.x == 0)
        partials[(long long) blockIdx.y * gridDim.x + blockIdx.x] =
            block_sum[0];
'''
_NORM = '''
    __shared__ double total;
    if (threadIdx.x == 0) {{
        double s = 0;
        for (int b = 0; b < gridDim.x; ++b)
            s += partials[(long long) blockIdx.y * gridDim.x + b];
        total = sqrt(s);
    }}
    __syncthreads();
    const {c} norm = ({c}) total;
    const {c} factor = target / (norm + eps);
'''
_BLOCK_SUMS3 = '''
    __shared__ double block_sums[3][{threads}];
    block_sums[0][threadIdx.x] = dg;
    block_sums[1][threadIdx.x] = dw;
    block_sums[2][threadIdx.x] = sd;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half >>= 1) {{
        if (threadIdx.x < half)
            for (int j = 0; j < 3; ++j)
                block_sums[j][threadIdx.x] +=
                    block_sums[j][threadIdx.x + half];
        __syncthreads();
    }}
    if (threadIdx.x == 0)
        for (int j = 0; j < 3; ++j)
            partials[((long long) blockIdx.y * gridDim.x + blockIdx.x) * 3
                     + j] = block_sums[j][0];
'''
_TERM = '''
    if (threadIdx.x == 0) {{
        double sums[3] = {{0, 0, 0}};
        for (int b = 0; b < blocks; ++b)
            for (int j = 0; j < 3; ++j)
                sums[j] += partials[((long long) blockIdx.y * blocks + b) * 3
                                    + j];
        const double gamma = damping[0];
        double term = sums[0] + gamma * sums[1];
        if (mean != 0) term = term - gamma * mean * sums[2];
        terms[index] = term;
    }}
    return;
'''
_OPS = {
    'dots': (
        (('d', 'in'), ('g', 'in'), ('w', 'in')), 'double* partials',
        '\n    double dg = 0, dw = 0, sd = 0;\n', '''
        const double di = (double) d[i];
        dg += di * (double) g[i];
        dw += di * (double) w[i];
        sd += di;''', _BLOCK_SUMS3),
    'terms': (
        (('damping', 'dptr'), ('mean', 'dscalar'), ('index', 'iscalar')),
        'const double* partials, const int blocks, double* terms', _TERM,
        '', ''),
    'scale': (
        (('x', 'out'),), 'const double* factor',
        '\n    const {c} f = ({c}) factor[0];\n', '''
        x[i] *= f;''', ''),
    'momentum_sgd': (
        (('p', 'out'), ('g', 'in'), ('v', 'out')), _UPDATE_HEAD,
        _SCALARS, '''
        {c} vi = v[i];
        vi = momentum * vi - lr * g[i];
        v[i] = vi;
        p[i] += vi;''', ''),
    'momentum_sgd_wd': (
        (('p', 'out'), ('g', 'out'), ('v', 'out')),
        _UPDATE_HEAD + ', const {c} decay', _SCALARS, '''
        {c} gi = g[i];
        gi += decay * p[i];
        g[i] = gi;
        {c} vi = v[i];
        vi = momentum * vi - lr * gi;
        v[i] = vi;
        p[i] += vi;''', ''),
    'momentum_step': (
        (('w', 'out'), ('d', 'in'), ('v', 'out')), _UPDATE_HEAD,
        _SCALARS, '''
        const {c} wi = w[i];
        {c} step = momentum * v[i] - lr * d[i];
        {c} new_w = wi + step;
        v[i] = new_w - wi;
        w[i] = new_w;''', ''),
    'unscaled': (
        (('w', 'in'), ('d', 'in'), ('v', 'out')),
        _UPDATE_HEAD + ', double* partials',
        _SCALARS + '    double sum = 0;\n', '''
        const {c} u = w[i] + (momentum * v[i] - lr * d[i]);
        v[i] = u;
        sum += (double) u * (double) u;''', _BLOCK_SUM),
    'rescaled': (
        (('w', 'out'), ('v', 'out'), ('target', 'scalar')),
        'const double* partials, const {c} eps', _NORM, '''
        const {c} scaled = v[i] * factor;
        v[i] = scaled - w[i];
        w[i] = scaled;''', ''),
    'regularized': (
        (('g', 'in'), ('w', 'in'), ('out', 'out')),
        'const {c}* d_ptr, const {c} d_value, const int d_on_device, '
        'const {c} mu',
        '\n    const {c} d = d_on_device ? d_ptr[0] : d_value;\n', '''
        out[i] = g[i] + d * (w[i] - mu);''', ''),
    'nonfinite': (
        (('x', 'in'),), 'int* flag', '', '''
        if (!isfinite(x[i])) flag[0] = 1;''', ''),
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
    }}{before}
    const long long stride = (long long) gridDim.x * blockDim.x;
    for (long long i = (long long) blockIdx.x * blockDim.x + threadIdx.x;
         i < size; i += stride) {{{body}
    }}{after}
}}
'''


def source(op: str, dtype) -> str:
    """The CUDA source of kernel ``op`` for ``dtype`` (float32 or
    float64)."""
    name, c = DTYPES[numpy.dtype(dtype)]
    slots, head, before, body, after = _OPS[op]

    def typed(argument, kind):
        return {'in': 'const {c}* {a}', 'out': '{c}* {a}',
                'scalar': '{c} {a}', 'dptr': 'const double* {a}',
                'dscalar': 'double {a}', 'iscalar': 'long long {a}'}[
                    kind].format(c=c, a=argument)
    args = ',\n        '.join(
        ', '.join([typed('{}{}'.format(t, k), kind) for t, kind in slots] +
                  ['const long long n{}'.format(k)]) for k in range(CHUNK))
    decls = '\n    '.join('{} = 0;'.format(typed(t, kind))
                          for t, kind in slots)
    cases = '\n        '.join(
        'case {k}: {sets} size = n{k}; break;'.format(
            k=k, sets=' '.join('{t} = {t}{k};'.format(t=t, k=k)
                               for t, _ in slots)) for k in range(CHUNK))
    return _SOURCE.format(op=op, name=name, head=head.format(c=c),
                          args=args, decls=decls, cases=cases,
                          before=before.format(c=c),
                          body=body.format(c=c),
                          after=after.format(c=c, threads=THREADS))


@functools.lru_cache(maxsize=None)
def _kernel(op: str, dtype):
    import cupy
    name, _ = DTYPES[numpy.dtype(dtype)]
    return cupy.RawKernel(source(op, dtype),
                          'chainerkfac_{}_{}'.format(op, name))
