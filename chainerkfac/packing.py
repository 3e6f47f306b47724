"""Packing of many arrays into one flat buffer for ReduceScatterV / AllGatherV.

The MPI and NCCL communicators share this module: it decides where every
array travels in the flat wire buffer and copies arrays in and out of it. It
is written once for NumPy and CuPy (``xp``) and never imports CuPy itself.

Two collectives are served (stages 3 and 6 of Algorithm 1 of the paper):

* **reduce-scatter**: the flat buffer is the concatenation of one *segment*
  per rank; rank ``r``'s segment holds, in input order, every array that
  ``r`` owns. An array with several owners (a layer computed redundantly) is
  placed in each owner's segment, so it is duplicated in the buffer. After a
  summing reduce-scatter, rank ``r`` holds its segment summed over all ranks.
* **all-gather**: rank ``r``'s segment holds every array whose *first* owner
  is ``r``, each array once. After an all-gather every rank holds all
  segments.

Symmetric 2-D arrays travel as their upper triangle, ``N(N+1)/2`` elements
instead of ``N*N``. Arrays are cast to the wire dtype on packing and back to
their own dtype on unpacking. With ``pad=True`` every segment is padded with
zeros to the longest one, as NCCL's ``reduceScatter`` / ``allGather`` take one
count for all ranks.
"""
import collections
import functools
from typing import List, Optional, Sequence, Tuple

import numpy

import chainer


def normalize_owners(owners, size: int) -> Tuple[Tuple[int, ...], ...]:
    """Turn per-array owners into tuples of ranks, checking them.

    Parameters
    ----------
    owners : sequence of int or sequence of int
        Per array, one rank or a non-empty sequence of distinct ranks.
    size : int
        Number of ranks in the communicator.

    Returns
    -------
    tuple of tuple of int
        Per array, its owners in the given order; the first one is the owner
        whose copy ``all_gather`` distributes.
    """
    normalized = []
    for i, owner in enumerate(owners):
        ranks = (owner,) if isinstance(owner, (int, numpy.integer)) \
            else tuple(owner)
        ranks = tuple(int(r) for r in ranks)
        if not ranks:
            raise ValueError('array {} has no owner'.format(i))
        if len(set(ranks)) != len(ranks):
            raise ValueError(
                'array {} lists an owner twice: {}'.format(i, ranks))
        for r in ranks:
            if not 0 <= r < size:
                raise ValueError(
                    'array {} has owner {} outside [0, {})'.format(
                        i, r, size))
        normalized.append(ranks)
    return tuple(normalized)


@functools.lru_cache(maxsize=64)
def _triu_indices(xp, n: int, device_id: Optional[int]):
    # Cached: the same factor sizes are packed every step. ``device_id`` is
    # part of the key because CuPy index arrays live on one GPU.
    del device_id
    return xp.triu_indices(n)


def _cached_triu_indices(xp, n: int):
    device_id = None if xp is numpy else xp.cuda.runtime.getDevice()
    return _triu_indices(xp, n, device_id)


def triu_pack(m):
    """Upper triangle (diagonal included) of a square matrix, row by row.

    Parameters
    ----------
    m : numpy.ndarray or cupy.ndarray, shape (N, N)

    Returns
    -------
    array, shape (N * (N + 1) // 2,)
        Same dtype as ``m``.
    """
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise ValueError(
            'triu_pack needs a square matrix, got shape {}'.format(m.shape))
    xp = chainer.backend.get_array_module(m)
    if xp is numpy:
        n = m.shape[0]
        out = numpy.empty(n * (n + 1) // 2, m.dtype)
        _pack_triangle(m, out)
        return out
    return m[_cached_triu_indices(xp, m.shape[0])]


def triu_unpack(v, n: int):
    """Symmetric N x N matrix from its packed upper triangle.

    Inverse of :func:`triu_pack` for symmetric matrices: the lower triangle
    is the mirror of the upper one, so the round trip is exact.

    Parameters
    ----------
    v : numpy.ndarray or cupy.ndarray, shape (N * (N + 1) // 2,)
    n : int

    Returns
    -------
    array, shape (N, N)
        Same dtype as ``v``.
    """
    if v.shape != (n * (n + 1) // 2,):
        raise ValueError('triu_unpack: {} elements do not make the upper '
                         'triangle of a {}x{} matrix'.format(v.size, n, n))
    xp = chainer.backend.get_array_module(v)
    if xp is numpy:
        return _unpack_triangle(v, n, v.dtype)
    rows, cols = _cached_triu_indices(xp, n)
    m = xp.empty((n, n), dtype=v.dtype)
    m[rows, cols] = v
    m[cols, rows] = v
    return m


class Layout(object):
    """Where each array travels in the flat buffers of both collectives.

    A layout depends only on the call signature (shapes, dtypes, owners,
    symmetric flags) and the communicator, so communicators compute it once
    and reuse it every step.

    Parameters
    ----------
    shapes : sequence of tuple of int
        Shape of each array.
    dtypes : sequence of dtype-like
        Dtype of each array; unpacked arrays are cast back to it.
    owners : sequence of int or sequence of int
        Owner rank(s) of each array (see :func:`normalize_owners`).
    symmetric : sequence of bool
        Per array, whether it is a symmetric square matrix that travels as
        its upper triangle.
    size : int
        Number of ranks.
    wire_dtype : dtype-like
        Element type in the buffers.
    pad : bool
        Pad every segment with zeros to the longest segment (NCCL).

    Attributes
    ----------
    reduce_scatter_counts, all_gather_counts : tuple of int
        Per rank, the length in elements of its segment (padding included).
    reduce_scatter_offsets, all_gather_offsets : tuple of int
        Per rank, where its segment starts in the flat buffer.
    reduce_scatter_size : int
        Length of the whole reduce-scatter buffer, in elements.
    all_gather_size : int
        Length of the whole all-gather buffer, in elements.
    """

    def __init__(self, shapes: Sequence[Tuple[int, ...]], dtypes,
                 owners, symmetric: Sequence[bool], size: int,
                 wire_dtype='float32', pad: bool = False):
        self.shapes = tuple(tuple(int(d) for d in s) for s in shapes)
        self.dtypes = tuple(numpy.dtype(d) for d in dtypes)
        self.owners = normalize_owners(owners, size)
        self.symmetric = tuple(bool(s) for s in symmetric)
        n = len(self.shapes)
        if not len(self.dtypes) == len(self.owners) == \
                len(self.symmetric) == n:
            raise ValueError('shapes, dtypes, owners and symmetric must have '
                             'one entry per array')
        for i, (shape, sym) in enumerate(zip(self.shapes, self.symmetric)):
            if sym and (len(shape) != 2 or shape[0] != shape[1]):
                raise ValueError('array {} is marked symmetric but has shape '
                                 '{}'.format(i, shape))
        self.size = size
        self.wire_dtype = numpy.dtype(wire_dtype)
        self.pad = pad
        # Elements each array occupies on the wire.
        self.wire_lengths = tuple(
            s[0] * (s[0] + 1) // 2 if sym else int(numpy.prod(s))
            for s, sym in zip(self.shapes, self.symmetric))

        rs_members = [[i for i in range(n) if r in self.owners[i]]
                      for r in range(size)]
        ag_members = [[i for i in range(n) if self.owners[i][0] == r]
                      for r in range(size)]
        (self.reduce_scatter_counts, self.reduce_scatter_offsets,
         self._rs_slots) = self._place(rs_members)
        (self.all_gather_counts, self.all_gather_offsets,
         self._ag_slots) = self._place(ag_members)
        self.reduce_scatter_size = sum(self.reduce_scatter_counts)
        self.all_gather_size = sum(self.all_gather_counts)

    def _place(self, members):
        # Per rank: [(array index, offset within the segment)], the segment
        # lengths, and where each segment starts.
        slots, counts = [], []
        for indices in members:
            offset, rank_slots = 0, []
            for i in indices:
                rank_slots.append((i, offset))
                offset += self.wire_lengths[i]
            slots.append(rank_slots)
            counts.append(offset)
        if self.pad and counts:
            counts = [max(counts)] * len(counts)
        offsets = numpy.concatenate([[0], numpy.cumsum(counts)[:-1]])
        return (tuple(counts), tuple(int(o) for o in offsets),
                tuple(tuple(s) for s in slots))

    @property
    def reduce_scatter_nbytes(self) -> int:
        """Bytes of the whole reduce-scatter send buffer (every rank's)."""
        return self.reduce_scatter_size * self.wire_dtype.itemsize

    def all_gather_nbytes(self, rank: int) -> int:
        """Bytes of ``rank``'s all-gather send segment."""
        return self.all_gather_counts[rank] * self.wire_dtype.itemsize

    # -- index maps: every pack / unpack is one gather (see gather_cast) ----
    def _build_index(self, key, xp=numpy):
        """The index map of one pack or unpack (see :func:`gather_cast`),
        built where it is used (``xp``: NumPy, or CuPy on the current
        device).

        Built from one template per matrix size (:func:`_wire_template`,
        :func:`_mirror_template`) plus each array's start, in the smallest
        integer type that holds every position of the source.
        """
        kind, rank = key
        if kind == 'pack_rs':        # buffer <- concat(all arrays)
            return self._pack_index(
                xp, range(len(self.shapes)),
                [(self.reduce_scatter_offsets[r],
                  self.reduce_scatter_counts[r], self._rs_slots[r])
                 for r in range(self.size)])
        if kind == 'pack_ag':        # segment <- concat(rank's arrays)
            slots = self._ag_slots[rank]
            return self._pack_index(
                xp, [i for i, _ in slots],
                [(0, self.all_gather_counts[rank], slots)])
        if kind == 'unpack_rs':      # concat(rank's arrays) <- segment
            return self._unpack_index(
                xp, self._rs_slots[rank], self.reduce_scatter_counts[rank])
        # 'unpack_ag': concat(all arrays) <- gathered buffer
        base = {}
        for r in range(self.size):
            for i, offset in self._ag_slots[r]:
                base[i] = self.all_gather_offsets[r] + offset
        return self._unpack_index(xp, [(i, base[i]) for i in
                                   range(len(self.shapes))],
                                  self.all_gather_size)

    def _sizes(self, indices) -> List[int]:
        """Elements of each array of ``indices``."""
        return [int(numpy.prod(self.shapes[i])) for i in indices]

    def _pack_index(self, xp, sources, segments):
        """Wire buffer <- the flat concatenation of the arrays ``sources``:
        per segment ``(offset, count, slots)``, each slot's array's wire
        elements at the slot, -1 in the padding."""
        sources = list(sources)
        sizes = self._sizes(sources)
        starts = dict(zip(sources, _cumulative(sizes)))
        index = xp.empty(sum(count for _, count, _ in segments),
                         _index_dtype(sum(sizes)))
        placements = []
        for offset, count, slots in segments:
            used = 0
            for i, at in slots:
                placements.append((offset + at, i, starts[i]))
                used = at + self.wire_lengths[i]
            index[offset + used:offset + count] = -1
        self._fill(xp, index, placements, _wire_template)
        return index

    def _unpack_index(self, xp, slots, source_size):
        """Flat arrays <- wire buffer: for every element of each array of
        ``slots`` ``(array, where its wire elements start)``, in order, the
        position of its wire element (a symmetric array's lower triangle
        reads the upper one)."""
        sizes = self._sizes([i for i, _ in slots])
        index = xp.empty(sum(sizes), _index_dtype(source_size))
        placements = [(at, i, base) for at, (i, base)
                      in zip(_cumulative(sizes), slots)]
        self._fill(xp, index, placements, _mirror_template)
        return index

    def _fill(self, xp, index, placements, template_of):
        """``index[at:at + len]`` = positions of array ``i`` starting at
        ``base``, for every ``(at, i, base)``: consecutive for a plain array,
        ``base + template_of(n)`` for an n×n symmetric one (one template per
        size, built once on the host and sent to ``index``'s device)."""
        by_size = collections.defaultdict(list)
        for at, i, base in placements:
            if self.symmetric[i]:
                by_size[self.shapes[i][0]].append((at, base))
            else:
                length = int(numpy.prod(self.shapes[i]))
                index[at:at + length] = xp.arange(
                    base, base + length, dtype=index.dtype)
        for n, spots in by_size.items():
            template = xp.asarray(template_of(n))
            for at, base in spots:
                xp.add(template, index.dtype.type(base),
                       out=index[at:at + template.size])

    def _index(self, xp, kind: str, rank: Optional[int] = None):
        device = None if xp is numpy else xp.cuda.runtime.getDevice()
        key = (kind, rank, device)
        cache = self.__dict__.setdefault('_index_cache', {})
        if key not in cache:
            cache[key] = self._build_index((kind, rank), xp)
        return cache[key]

    def _source(self, arrays, indices):
        xp = _module_of(arrays)
        for i in indices:
            if arrays[i] is None or arrays[i].shape != self.shapes[i]:
                raise ValueError('array {} has shape {}, the layout expects '
                                 '{}'.format(i, getattr(arrays[i], 'shape',
                                                        None),
                                             self.shapes[i]))
        if not indices:
            return xp, xp.empty(0, dtype=self.wire_dtype)
        return xp, xp.concatenate([arrays[i].ravel() for i in indices])

    def _split(self, flat, indices):
        out, start = {}, 0
        for i in indices:
            size = int(numpy.prod(self.shapes[i]))
            out[i] = flat[start:start + size].reshape(self.shapes[i]).astype(
                self.dtypes[i], copy=False)
            start += size
        return out

    # -- the NumPy path: per array, no layout-sized index maps --------------
    def _pack_numpy(self, arrays, segments, size):
        """Wire buffer of ``size`` elements: per segment ``(offset,
        slots)``, each slot's array (its upper triangle if symmetric) at
        ``offset + slot``, cast to the wire dtype; zeros in the padding.
        The same buffer as the index-map gather (the GPU's one kernel),
        without building layout-sized maps."""
        out = numpy.zeros(size, self.wire_dtype)
        for offset, slots in segments:
            for i, at in slots:
                array = arrays[i]
                if array is None or array.shape != self.shapes[i]:
                    raise ValueError(
                        'array {} has shape {}, the layout expects {}'.format(
                            i, getattr(array, 'shape', None), self.shapes[i]))
                start = offset + at
                if self.symmetric[i]:
                    _pack_triangle(array, out[start:start +
                                              self.wire_lengths[i]])
                else:
                    out[start:start + self.wire_lengths[i]] = array.ravel()
        return out

    def _unpack_numpy(self, source, slots):
        """``(array index, new array)`` for every ``(array index, where its
        wire elements start in source)`` (a symmetric array's lower
        triangle mirrors the upper one)."""
        for i, base in slots:
            piece = source[base:base + self.wire_lengths[i]]
            if self.symmetric[i]:
                yield i, _unpack_triangle(piece, self.shapes[i][0],
                                          self.dtypes[i])
            else:
                yield i, piece.reshape(self.shapes[i]).astype(self.dtypes[i])

    def pack_reduce_scatter(self, arrays: Sequence):
        """Flat send buffer of a reduce-scatter (one gather).

        Parameters
        ----------
        arrays : sequence of arrays
            One per layout entry, all of one array module.

        Returns
        -------
        array, shape (reduce_scatter_size,), dtype wire_dtype
        """
        xp = _module_of(arrays)
        if xp is numpy:
            return self._pack_numpy(
                arrays, [(self.reduce_scatter_offsets[r], self._rs_slots[r])
                         for r in range(self.size)],
                self.reduce_scatter_size)
        xp, source = self._source(arrays, range(len(self.shapes)))
        return gather_cast(source, self._index(xp, 'pack_rs'),
                           self.wire_dtype)

    def unpack_reduce_scatter(self, segment, rank: int) -> List:
        """Arrays of ``rank`` from its received reduce-scatter segment.

        Parameters
        ----------
        segment : array, shape (reduce_scatter_counts[rank],)
            The part of the reduced buffer that ``rank`` received.
        rank : int

        Returns
        -------
        list
            Aligned with the layout's arrays: a new array of the array's
            shape and dtype where ``rank`` is an owner, else None.
        """
        xp = chainer.backend.get_array_module(segment)
        owned = [i for i, _ in self._rs_slots[rank]]
        result = [None] * len(self.shapes)
        if xp is numpy:
            for i, array in self._unpack_numpy(segment,
                                               self._rs_slots[rank]):
                result[i] = array
        elif owned:
            flat = gather_cast(segment, self._index(xp, 'unpack_rs', rank),
                               _common_dtype(self.dtypes[i] for i in owned))
            for i, array in self._split(flat, owned).items():
                result[i] = array
        return result

    def pack_all_gather(self, arrays: Sequence, rank: int):
        """``rank``'s all-gather send segment (one gather).

        Only the arrays whose first owner is ``rank`` are read; the other
        entries of ``arrays`` may be None.

        Returns
        -------
        array, shape (all_gather_counts[rank],), dtype wire_dtype
        """
        xp = _module_of(arrays)
        if xp is numpy:
            return self._pack_numpy(arrays, [(0, self._ag_slots[rank])],
                                    self.all_gather_counts[rank])
        xp, source = self._source(arrays, [i for i, _ in
                                           self._ag_slots[rank]])
        return gather_cast(source, self._index(xp, 'pack_ag', rank),
                           self.wire_dtype)

    def unpack_all_gather(self, buffer) -> List:
        """All arrays from the gathered buffer (one gather).

        Parameters
        ----------
        buffer : array, shape (all_gather_size,)

        Returns
        -------
        list
            One new array per layout entry, its first owner's copy.
        """
        xp = chainer.backend.get_array_module(buffer)
        indices = list(range(len(self.shapes)))
        if not indices:
            return []
        if xp is numpy:
            slots = [(i, self.all_gather_offsets[r] + offset)
                     for r in range(self.size)
                     for i, offset in self._ag_slots[r]]
            unpacked = dict(self._unpack_numpy(buffer, slots))
            return [unpacked[i] for i in indices]
        flat = gather_cast(buffer, self._index(xp, 'unpack_ag'),
                           _common_dtype(self.dtypes))
        split = self._split(flat, indices)
        return [split[i] for i in indices]


def gather_cast(source, index, dtype):
    """``out[k] = source[index[k]]`` cast to ``dtype``; 0 where
    ``index[k] < 0`` (padding).

    Every pack and unpack of a collective is one call: on the GPU one
    elementwise kernel launch (gather, triangle (un)packing and the cast to
    or from the wire dtype together); on the CPU its NumPy twin, which the
    tests compare against.
    """
    xp = chainer.backend.get_array_module(source)
    if xp is numpy:
        out = numpy.zeros(len(index), dtype=dtype)
        valid = index >= 0
        if len(source):
            out[valid] = source[index[valid]]
        return out
    out = xp.empty(len(index), dtype=dtype)
    if len(index):
        _gather_cast_kernel()(source, index, out)
    return out


_KERNEL = []


def _gather_cast_kernel():
    if not _KERNEL:
        import cupy
        _KERNEL.append(cupy.ElementwiseKernel(
            'raw S source, I index', 'T out',
            'out = index >= 0 ? (T)source[index] : (T)0',
            'chainerkfac_gather_cast'))
    return _KERNEL[0]


def _common_dtype(dtypes):
    return numpy.result_type(*list(dtypes))


def _cumulative(sizes) -> List[int]:
    """Where each of consecutive pieces of these sizes starts."""
    starts, total = [], 0
    for size in sizes:
        starts.append(total)
        total += size
    return starts


def _index_dtype(source_size: int) -> numpy.dtype:
    """int32 when every position of a source of this length fits (half the
    bytes of int64 to build, hold on the device and read), else int64."""
    if source_size < numpy.iinfo(numpy.int32).max:
        return numpy.dtype(numpy.int32)
    return numpy.dtype(numpy.int64)


def _pack_triangle(matrix, out) -> None:
    """``out`` ← the upper triangle of ``matrix`` row by row (cast), by
    contiguous row copies (NumPy)."""
    n, start = matrix.shape[0], 0
    for r in range(n):
        out[start:start + n - r] = matrix[r, r:]
        start += n - r


def _unpack_triangle(piece, n: int, dtype):
    """The symmetric n×n matrix (``dtype``) whose packed upper triangle is
    ``piece``: rows copied into the upper triangle, then mirrored by
    cache-sized panels (NumPy)."""
    from chainerkfac.linalg import mirror_upper
    matrix = numpy.empty((n, n), dtype)
    start = 0
    for r in range(n):
        matrix[r, r:] = piece[start:start + n - r]
        start += n - r
    return mirror_upper(matrix)


def _wire_template(n: int):
    """Positions, in a flat n×n matrix, of its upper triangle row by row
    (``triu_pack``'s order): the k-th wire element of row r is at
    ``k + r(r+1)/2``."""
    dtype = _index_dtype(n * n)
    rows = numpy.arange(n, dtype=dtype)
    shift = numpy.repeat(rows * (rows + 1) // 2, n - rows)
    return numpy.add(numpy.arange(n * (n + 1) // 2, dtype=dtype), shift,
                     out=shift)


def _mirror_template(n: int):
    """For every element (r, c) of a flat n×n matrix, the position of
    element (min, max) in its packed upper triangle: ``off(r) + c - r`` on
    and above the diagonal, ``off(c) + r - c`` below it, where
    ``off(r) = r·n - r(r-1)/2`` starts row r of the triangle."""
    dtype = _index_dtype(n * (n + 1) // 2)
    wide = numpy.arange(n, dtype=numpy.int64)  # r·n may overflow int32
    shift = (wide * n - wide * (wide - 1) // 2 - wide).astype(dtype)
    rows = wide.astype(dtype)                  # shift = off(r) - r
    template = numpy.empty((n, n), dtype)
    # Row by row: sequential writes (a transposed copy is slow at n = 2^k).
    for r in range(n):
        numpy.add(shift[:r], dtype.type(r), out=template[r, :r])
        numpy.add(rows[r:], shift[r], out=template[r, r:])
    return template.ravel()


def _module_of(arrays):
    present = [a for a in arrays if a is not None]
    return chainer.backend.get_array_module(*present) if present else numpy
