"""The two collectives K-FAC adds to a ChainerMN communicator.

:class:`KfacCommunicatorMixin` is mixed into ChainerMN's own communicator
classes (see :mod:`chainerkfac.communicators.naive` and
:mod:`chainerkfac.communicators.pure_nccl`), so everything ChainerMN offers
keeps working. The mixin packs arrays with :mod:`chainerkfac.packing` and
leaves the transport of one flat buffer to the flavour's
``_reduce_scatter`` / ``_all_gather``.
"""
import collections
from typing import List, Optional, Sequence

import numpy

import chainer

from chainerkfac import packing


WIRE_DTYPES = ('float16', 'float32', 'float64')


def check_wire_dtype(wire_dtype) -> Optional[numpy.dtype]:
    """The wire dtype as a NumPy dtype (None: the arrays' own, see
    :func:`wire_dtype_for`); ValueError if it is not supported."""
    if wire_dtype is None:
        return None
    dtype = numpy.dtype(wire_dtype)
    if dtype.name not in WIRE_DTYPES:
        raise ValueError('wire_dtype must be one of {}, got {!r}'.format(
            ', '.join(WIRE_DTYPES), wire_dtype))
    return dtype


def wire_dtype_for(arrays: Sequence) -> numpy.dtype:
    """The default wire dtype of a call: the arrays' common type, at least
    float32 — a float64 model's factors and gradients travel unrounded (N
    processes then take one process's step to float64 precision), float16
    ones are summed in float32."""
    return numpy.result_type(numpy.float32, *[a.dtype for a in arrays])


class KfacCommunicatorMixin(object):
    """Adds ``reduce_scatter_v`` and ``all_gather_v`` to a communicator.

    Each call packs all its arrays into one buffer and makes one collective.
    The layout of that buffer is computed once per call signature (shapes,
    dtypes, owners, symmetric flags) and cached, as the same arrays travel
    every step.

    Bytes are counted per collective in :attr:`bytes_sent`: every call adds
    the size in bytes of the buffer this rank *sends* into the collective:
    the whole packed buffer for ``reduce_scatter_v`` (every rank's segment,
    arrays with several owners once per owner), and this rank's own segment
    for ``all_gather_v``. Symmetric arrays count as their packed triangles,
    elements count at the wire dtype's size, and zero padding (NCCL) counts
    too. What MPI or NCCL move internally (their algorithm's traffic) is not
    counted.

    A flavour sets ``_pad_segments`` and implements
    ``_reduce_scatter(sendbuf, layout) -> this rank's reduced segment`` and
    ``_all_gather(segment, layout) -> whole gathered buffer``.
    """

    _pad_segments = False
    _max_cached_layouts = 64

    def _init_kfac(self, wire_dtype) -> None:
        self.wire_dtype = check_wire_dtype(wire_dtype)
        self._layouts = collections.OrderedDict()
        self.reset_byte_counts()

    @property
    def bytes_sent(self) -> dict:
        """``{'reduce_scatter_v': int, 'all_gather_v': int}`` since reset."""
        return dict(self._bytes_sent)

    def reset_byte_counts(self) -> None:
        """Set both byte counters to zero."""
        self._bytes_sent = {'reduce_scatter_v': 0, 'all_gather_v': 0}

    def split(self, color, key):
        # ChainerMN's split rebuilds the class from mpi_comm alone.
        return self.__class__(mpi_comm=self.mpi_comm.Split(color, key),
                              wire_dtype=self.wire_dtype)

    def reduce_scatter_v(self, arrays: Sequence, owners: Sequence,
                         symmetric: Optional[Sequence[bool]] = None,
                         wire_dtype=None) -> List:
        """Sum each array over all ranks and return it on its owners.

        Parameters
        ----------
        arrays : sequence of numpy.ndarray or cupy.ndarray
            The same list on every rank: same length, shapes and dtypes.
        owners : sequence of int or tuple of int
            Per array, the rank or ranks (redundantly computed layers) that
            receive its sum. Identical on every rank.
        symmetric : sequence of bool, optional
            Per array, whether it is a symmetric square matrix, sent as its
            upper triangle. Default: none is.
        wire_dtype : dtype-like, optional
            Element type on the wire for this call (default: the
            communicator's :attr:`wire_dtype`; where that is None, the
            arrays' common type, at least float32).

        Returns
        -------
        list
            Aligned with ``arrays``: the sum over ranks (a new array of the
            input's shape and dtype) where this rank is an owner, else None.
        """
        layout = self._layout(arrays, owners, symmetric, wire_dtype)
        sendbuf = layout.pack_reduce_scatter(arrays)
        self._bytes_sent['reduce_scatter_v'] += layout.reduce_scatter_nbytes
        if layout.reduce_scatter_size == 0:
            segment = sendbuf[:0]
        else:
            segment = self._reduce_scatter(sendbuf, layout)
        return layout.unpack_reduce_scatter(segment, self.rank)

    def all_gather_v(self, arrays: Sequence, owners: Sequence,
                     symmetric: Optional[Sequence[bool]] = None,
                     wire_dtype=None) -> List:
        """Give every rank each array as held by its first owner.

        Parameters
        ----------
        arrays : sequence of numpy.ndarray or cupy.ndarray
            Same length, shapes and dtypes on every rank; only the arrays
            whose first owner is this rank are read.
        owners : sequence of int or tuple of int
            As in :meth:`reduce_scatter_v`; only the first owner matters.
        symmetric : sequence of bool, optional
            As in :meth:`reduce_scatter_v`.
        wire_dtype : dtype-like, optional
            As in :meth:`reduce_scatter_v` (weight-update sharding sends
            weights at their own dtype: :mod:`chainerkfac.sharding`).

        Returns
        -------
        list
            Aligned with ``arrays``: new arrays, the first owner's copies.
        """
        layout = self._layout(arrays, owners, symmetric, wire_dtype)
        segment = layout.pack_all_gather(arrays, self.rank)
        self._bytes_sent['all_gather_v'] += layout.all_gather_nbytes(self.rank)
        if layout.all_gather_size == 0:
            buffer = segment
        else:
            buffer = self._all_gather(segment, layout)
        return layout.unpack_all_gather(buffer)

    def _layout(self, arrays, owners, symmetric,
                wire_dtype=None) -> packing.Layout:
        wire_dtype = check_wire_dtype(wire_dtype)
        if wire_dtype is None:
            wire_dtype = self.wire_dtype
        if wire_dtype is None:
            wire_dtype = check_wire_dtype(wire_dtype_for(arrays))
        if symmetric is None:
            symmetric = (False,) * len(arrays)
        if not len(arrays) == len(owners) == len(symmetric):
            raise ValueError(
                'got {} arrays, {} owners and {} symmetric flags'.format(
                    len(arrays), len(owners), len(symmetric)))
        key = (tuple(a.shape for a in arrays),
               tuple(a.dtype.str for a in arrays),
               packing.normalize_owners(owners, self.size),
               tuple(bool(s) for s in symmetric), wire_dtype.str)
        if chainer.is_debug():
            self._check_same_on_all_ranks(key)
        layout = self._layouts.get(key)
        if layout is None:
            shapes, dtypes, owners, symmetric, _ = key
            layout = packing.Layout(shapes, dtypes, owners, symmetric,
                                    self.size, wire_dtype,
                                    pad=self._pad_segments)
            self._layouts[key] = layout
            if len(self._layouts) > self._max_cached_layouts:
                self._layouts.popitem(last=False)
        else:
            self._layouts.move_to_end(key)
        return layout

    def _check_same_on_all_ranks(self, key) -> None:
        # Every rank gets the same answer, so all raise or none does.
        keys = self.mpi_comm.allgather(key)
        differing = [r for r, k in enumerate(keys) if k != keys[0]]
        if differing:
            raise ValueError('arrays, owners or symmetric flags differ '
                             'between rank 0 and ranks {}'.format(differing))
