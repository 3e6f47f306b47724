"""The skipped-step guard on the device: a step with a non-finite
direction changes nothing, and the host never waits for the answer.

:class:`~chainerkfac.step_guard.StepGuard` reads its finite check on the
host and skips the update there; a CUDA graph cannot capture that (a host
synchronisation, and Python control flow on a device value).
:class:`DeviceStepGuard` has the same methods and keeps the decision on
the device:

* :meth:`DeviceStepGuard.check` writes a device flag (set when any element
  of the step's directions is NaN or Inf: one kernel per array, nothing
  read back), and copies what the update may write (every parameter and
  its update rule's state arrays) into buffers of its own; the caller then
  launches the update in any case;
* :meth:`DeviceStepGuard.checkpoint`, at the end of the step, settles it:
  where the flag is set the parameters, their states and the persistent
  values the step's forward passes moved (BatchNormalization's running
  statistics) get their copies back — ``where(finite, new, old)`` — then
  the persistent values are copied for the next step;
* the flag reaches the host only when asked: :attr:`~DeviceStepGuard.
  skipped` reads it (a synchronisation, after the step), and
  :meth:`~DeviceStepGuard.observation` hands it to the reporter as a
  device scalar, read when the report is.

The copies live in fixed buffers, one per item size, and on the GPU each
set of arrays has a pointer table in device memory, built once for the
arrays' addresses (parameters, states and statistics keep theirs from step
to step): one kernel saves a set, one restores it. A table to build while
a stream is being captured is refused with an error (the capture then
fails cleanly; the step runs eagerly). NumPy arrays take a NumPy twin of
every kernel, so the CPU runs the same decisions.

What the device guard does not restore: Python scalars among the
persistent values (they change on the host: BatchNormalization's ``N``
only in fine-tuning mode). One difference from the host guard: the update
is launched and undone, so the optimizer's host counters (``t``) count a
skipped step, which the host cannot know without a synchronisation.
"""
import functools
import logging
from typing import Callable, List, Optional, Sequence

import numpy

import chainer
from chainer.backend import get_array_module

from chainerkfac import multi_tensor

logger = logging.getLogger(__name__)


class DeviceStepGuard:
    """The skipped-step guard with its finite check, its flag and its
    restore on the device (module docstring).

    It serves one process: a flag agreed over processes would be read on
    the host (``agree``), which :meth:`check` does only when given one.
    """

    #: The finite check is read on the host during the step (False: the
    #: flag stays on the device; see :attr:`skipped`).
    checks_on_host = False

    def __init__(self):
        self._link = None
        self._flag = None          # int32 (1,): the step's verdict
        self._count = None         # int32 (1,): skipped steps so far
        self._counted = 0          # skipped steps counted on the host
        self._updates = _Copies()       # parameters and their states
        self._persistent = _Copies()    # the link's persistent arrays
        self._persistent_saved = False
        self._open = False         # check() ran, checkpoint() not yet

    # -- the StepGuard methods -------------------------------------------
    def checkpoint(self, link) -> None:
        """Settle the step in progress (undo it where the flag is set),
        then copy the persistent arrays of ``link`` and its children."""
        self._link = link
        arrays = _persistent_arrays(link)
        if self._open:
            self._settle(arrays)
        if arrays:
            self._make_flags(arrays[0])
        self._persistent.save(arrays)
        self._persistent_saved = True

    def forget(self) -> None:
        """Drop the copy of the persistent arrays (a restored model: a
        skipped step before the next :meth:`checkpoint` leaves them as
        they are; its parameters are still put back)."""
        self._persistent_saved = False

    def restore(self) -> None:
        """Put the persistent arrays of the last :meth:`checkpoint` back,
        unconditionally (as :meth:`StepGuard.restore
        <chainerkfac.step_guard.StepGuard.restore>`)."""
        if self._persistent_saved and self._link is not None:
            self._persistent.restore(_persistent_arrays(self._link))

    def check(self, arrays: Sequence,
              agree: Optional[Callable[[bool], bool]] = None,
              updated: Optional[Sequence] = None) -> bool:
        """Flag the step if any element of ``arrays`` is not finite, and
        copy what the update may write.

        Returns whether the caller should launch the update: True, since
        :meth:`checkpoint` undoes it on the device where the flag is set.
        False only where the host had to decide: with ``agree`` (several
        processes: the flag is read and agreed on the host), and at a
        step whose update rules have no state yet (the first: what the
        update creates has no copy to go back to). ``updated``: the
        parameters the update will write, where not every parameter with
        a gradient (K-FAC leaves alone one no loss reached, whose rule
        never gets a state): only their rules are asked.
        """
        if self._link is None:
            raise RuntimeError('DeviceStepGuard.check before checkpoint: '
                               'the guard has not seen the model')
        arrays = [a for a in arrays if a is not None and a.size]
        params = [p for p in self._link.params() if p.array is not None]
        if not arrays and not params:
            return True
        self._make_flags(arrays[0] if arrays else params[0].array)
        _flag_nonfinite(arrays, self._flag)
        asked = params if updated is None else updated
        host_decides = agree is not None or any(
            p.update_rule is not None and p.grad is not None and
            p.update_rule.state is None for p in asked)
        if host_decides:
            # The update is launched only if finite: nothing to settle
            # (the caller restores the statistics of a skipped step).
            finite = not bool(int(self._flag[0]))
            if agree is not None:
                finite = agree(finite)
            self._flag[0] = int(not finite)
            self._counted += int(not finite)
            return finite
        self._updates.save(_update_arrays(params))
        self._open = True
        return True

    # -- the flag on the host ----------------------------------------------
    @property
    def skipped(self) -> bool:
        """Whether the last step was skipped (reads the device flag: a
        synchronisation; read it after the step)."""
        return self._flag is not None and bool(int(self._flag[0]))

    @property
    def skipped_steps(self) -> int:
        """How many steps were skipped (a synchronisation)."""
        if self._count is None:
            return self._counted
        return self._counted + int(self._count[0])

    def observation(self):
        """The last step's flag for :func:`chainer.reporter.report`: a 0-d
        view of the device flag (0 or 1), read when the report is (by a
        LogReport after the step), not now."""
        if self._flag is None:
            return 0.0
        return self._flag[0:1].reshape(())

    @property
    def ready(self) -> bool:
        """Whether the persistent arrays have a copy to go back to (False
        after :meth:`forget`, until the next :meth:`checkpoint`)."""
        return self._persistent_saved

    def count_from(self, skipped_steps: int) -> None:
        """Continue the count of another guard (the one this replaces)."""
        self._counted += int(skipped_steps)

    # -- internals -----------------------------------------------------------
    def _make_flags(self, like) -> None:
        xp = get_array_module(like)
        if self._flag is None or get_array_module(self._flag) is not xp:
            with chainer.using_device(chainer.backend.get_device_from_array(
                    like)):
                self._flag = xp.zeros(1, numpy.int32)
                self._count = xp.zeros(1, numpy.int32)

    def _settle(self, persistent) -> None:
        self._open = False
        self._updates.restore_where(self._flag, _update_arrays(
            [p for p in self._link.params() if p.array is not None]))
        if self._persistent_saved:
            self._persistent.restore_where(self._flag, persistent)
        self._count += self._flag


def _persistent_arrays(link) -> List:
    """The persistent arrays of ``link`` and its children (running
    statistics), in a fixed order."""
    arrays = []
    for _, child in sorted(link.namedlinks(), key=lambda item: item[0]):
        for name in sorted(child._persistent):
            value = getattr(child, name)
            if isinstance(value, chainer.get_array_types()) and value.size:
                arrays.append(value)
    return arrays


def _update_arrays(params) -> List:
    """What an update may write: each parameter and its rule's state
    arrays."""
    arrays = []
    for param in params:
        arrays.append(param.array)
        rule = param.update_rule
        if rule is not None and rule.state is not None:
            arrays += [rule.state[k] for k in sorted(rule.state)
                       if rule.state[k] is not None]
    return arrays


def _flag_nonfinite(arrays, flag) -> None:
    """``flag[0] = 1`` if any element of ``arrays`` is NaN or Inf, else 0;
    on the GPU a fill and one multi-tensor kernel per 32 float32 / float64
    arrays (:func:`chainerkfac.multi_tensor.flag_nonfinite`; one kernel
    per array for any other floating dtype or a strided view), nothing
    read back."""
    xp = get_array_module(flag)
    if xp is numpy:
        flag[0] = int(not all(bool(numpy.isfinite(a).all())
                              for a in arrays))
        return
    flag.fill(0)
    grouped = []
    for array in arrays:
        if array.dtype.kind != 'f':
            continue
        if array.dtype in multi_tensor.DTYPES and array.flags.c_contiguous:
            grouped.append(array)
        else:
            _kernels().nonfinite(array, flag)
    multi_tensor.flag_nonfinite(grouped, flag)


class _Copies:
    """Copies of a set of arrays in fixed buffers, one per item size.

    GPU: per item size, a pointer table, the arrays' sizes and their
    offsets in the buffer live in device memory, built when the set of
    addresses changes (outside a capture); saving or restoring is one
    kernel per item size. NumPy: a copy per array.
    """

    def __init__(self):
        self._key = None
        self._groups = []          # (table arrays or None, buffer)

    def save(self, arrays) -> None:
        self._prepare(arrays)
        if not arrays:
            return
        if get_array_module(arrays[0]) is numpy:
            for array, (_, buffer) in zip(arrays, self._groups):
                numpy.copyto(buffer, array)
            return
        for tables, buffer in self._groups:
            _launch(_kernels().save, tables, buffer, None)

    def restore(self, arrays) -> None:
        """Every array back to its copy."""
        self._check_same(arrays)
        if arrays and get_array_module(arrays[0]) is numpy:
            for array, (_, buffer) in zip(arrays, self._groups):
                numpy.copyto(array, buffer)
            return
        for tables, buffer in self._groups:
            _launch(_kernels().restore, tables, buffer, None)

    def restore_where(self, flag, arrays) -> None:
        """Every array back to its copy where ``flag[0]`` is set (on the
        device: the kernel reads the flag)."""
        self._check_same(arrays)
        if arrays and get_array_module(arrays[0]) is numpy:
            if flag[0]:
                self.restore(arrays)
            return
        for tables, buffer in self._groups:
            _launch(_kernels().restore_where, tables, buffer, flag)

    def _check_same(self, arrays) -> None:
        if _key_of(arrays) != self._key:
            raise RuntimeError(
                'DeviceStepGuard: the arrays to restore are not those '
                'copied ({} then {}): a parameter or state was '
                'reallocated within the step'.format(
                    len(self._key or ()), len(arrays)))

    def _prepare(self, arrays) -> None:
        key = _key_of(arrays)
        if key == self._key:
            return
        if not arrays:
            self._key, self._groups = key, []
            return
        xp = get_array_module(arrays[0])
        if xp is numpy:
            self._groups = [(None, numpy.empty_like(a)) for a in arrays]
            self._key = key
            return
        if xp.cuda.get_current_stream().is_capturing():
            raise RuntimeError(
                'DeviceStepGuard: its arrays changed while a CUDA graph '
                'is being captured (their copies and pointer tables are '
                'built outside a capture, at an eager step)')
        groups = {}
        for array in arrays:
            groups.setdefault(array.dtype.itemsize, []).append(array)
        self._groups = [_device_group(xp, itemsize, members)
                        for itemsize, members in sorted(groups.items())]
        self._key = key


def _key_of(arrays) -> tuple:
    if arrays and get_array_module(arrays[0]) is numpy:
        return tuple((id(a), a.shape, a.dtype.str) for a in arrays)
    return tuple((a.data.ptr, a.size, a.dtype.itemsize) for a in arrays)


def _device_group(xp, itemsize, arrays):
    """The device tables of one item size: (pointers, sizes, offsets,
    count, widest) and the flat buffer."""
    for array in arrays:
        if not array.flags.c_contiguous:
            raise ValueError('DeviceStepGuard copies contiguous arrays '
                             '(got a view of shape {})'.format(array.shape))
    sizes = numpy.array([a.size for a in arrays], numpy.int64)
    offsets = numpy.concatenate([[0], numpy.cumsum(sizes)[:-1]])
    tables = (xp.asarray(numpy.array([a.data.ptr for a in arrays],
                                     numpy.uint64)),
              xp.asarray(sizes), xp.asarray(offsets.astype(numpy.int64)),
              len(arrays), int(sizes.max()), itemsize)
    buffer = xp.empty(int(sizes.sum()), _WORD[itemsize])
    return tables, buffer


#: The unsigned integer of each item size: copies move bits, any dtype.
_WORD = {1: numpy.uint8, 2: numpy.uint16, 4: numpy.uint32, 8: numpy.uint64}


def _launch(kernels, tables, buffer, flag) -> None:
    pointers, sizes, offsets, count, widest, itemsize = tables
    blocks = int(min(64, max(1, widest // 1024)))
    args = (pointers, sizes, offsets, buffer)
    if flag is not None:
        args += (flag,)
    kernels[itemsize]((blocks, count), (256,), args)


_COPY_SOURCE = r'''
extern "C" __global__ void guard_{op}_{bits}(
        const unsigned long long* pointers, const long long* sizes,
        const long long* offsets, {word}* buffer{flag_arg}) {{
    {early}
    {word}* x = ({word}*) pointers[blockIdx.y];
    {word}* copy = buffer + offsets[blockIdx.y];
    const long long size = sizes[blockIdx.y];
    const long long stride = (long long) gridDim.x * blockDim.x;
    for (long long i = (long long) blockIdx.x * blockDim.x + threadIdx.x;
         i < size; i += stride) {{
        {body}
    }}
}}
'''

_OPS = {
    'save': ('', '', 'copy[i] = x[i];'),
    'restore': ('', '', 'x[i] = copy[i];'),
    'restore_where': (', const int* flag', 'if (!flag[0]) return;',
                      'x[i] = copy[i];'),
}
_WORD_TYPES = {1: 'unsigned char', 2: 'unsigned short', 4: 'unsigned int',
               8: 'unsigned long long'}


@functools.lru_cache(maxsize=None)
def _kernels():
    import cupy

    def copies(op):
        flag_arg, early, body = _OPS[op]
        out = {}
        for itemsize, word in _WORD_TYPES.items():
            name = 'guard_{}_{}'.format(op, itemsize * 8)
            out[itemsize] = cupy.RawKernel(_COPY_SOURCE.format(
                op=op, bits=itemsize * 8, word=word, flag_arg=flag_arg,
                early=early, body=body), name)
        return out

    class Kernels:
        nonfinite = cupy.ElementwiseKernel(
            'T x', 'raw int32 flag',
            'if (!isfinite(x)) flag[0] = 1;',
            'chainerkfac_flag_nonfinite')
        save = copies('save')
        restore = copies('restore')
        restore_where = copies('restore_where')

    return Kernels()
