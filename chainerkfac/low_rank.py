"""Exact low-rank factors: the per-sample form and Woodbury.

A Kronecker factor of one step is a sum of outer products of per-sample
vectors: ``A = (1/N) Σ ã ãᵀ`` over the inputs (augmented by the bias's 1) of
every sample, location, call and micro-batch, ``G`` likewise over the output
gradients, and BatchNormalization's full Fisher ``F = N Σ f fᵀ`` over the
per-sample gradients of (γ, β). With ``k`` such vectors it is
``F = U Uᵀ``, ``U`` of shape
``(d, k)`` (the vectors scaled), and where ``k`` is below ``d`` the damped
inverse needs no ``d × d`` matrix at all (Woodbury):

    ``(U Uᵀ + γ I)⁻¹ = (I − U C⁻¹ Uᵀ) / γ``,   ``C = γ I + Uᵀ U`` (k × k),

inverted by Cholesky of the ``k × k`` kernel ``Uᵀ U`` damped by γ
(:func:`chainerkfac.linalg.damped_inverses`, with its retries), in
``O(d k² + k³)`` instead of ``O(d³)``; and a gradient matrix ``M``
(``o × d``) is preconditioned as ``(M − (M W) Uᵀ) / γ``, ``W = U C⁻¹``, in
``4 o d k`` flops instead of ``2 o d²`` — also the product with the
damping's ``γ w`` term of eq. (13), so no term of the dense result is left
out. The result equals the dense one up to rounding (the tests compare them
to 1e-12 in float64).

:class:`LowRank` holds ``U`` while a factor is captured (the blocks of
:mod:`chainerkfac.fisher_blocks.kronecker` and
:mod:`~chainerkfac.fisher_blocks.batch_norm` build it instead of the Gram
matrix while its rank is within :func:`rank_budget`) and through the
accumulation's sums and scalings (:func:`add`, :func:`scaled`, which also
take dense arrays: a sum with a dense term is dense). At the refresh
:func:`pays` decides per factor, from the rank the step really has, whether
the low-rank form is cheaper than the dense one — compute and, across
processes, communication — and otherwise the factor is made dense
(``U Uᵀ``, what the dense capture would have computed). Where it stops
being low rank — an exponential average of factors (``factor_decay``) adds
the ranks of the averaged factors; accumulated micro-batches and
processes add theirs — the same rule turns it dense.

Across processes (:class:`Exchange`) the factors are summed onto their
owners by the same ReduceScatterV as the dense ones: each process writes its
columns into its own slice of a zero ``(d, k_total)`` buffer (the slices in
rank order), so the sum over processes is the concatenation, exactly (a sum
with zeros rounds nothing). A process sends ``d · k_total`` elements for
such a factor instead of the ``d (d + 1) / 2`` of the packed dense one; the
cost model counts that, and a factor goes low rank only where every process
captured it in that form and the totals say it pays.
"""
import contextlib
import math
import threading
from typing import Dict, Sequence, Tuple

import numpy

import chainer
from chainer.backend import get_array_module

from chainerkfac import linalg
from chainerkfac.dtypes import factor_dtype_for

#: A factor is captured in per-sample form while its rank on a process is
#: at most this fraction of its dimension over the number of processes.
MAX_RANK_FRACTION = 0.5
#: Cost of sending one element in the multi-process exchange, in
#: multiply-add equivalents (MPI over shared memory or a network moves
#: ~1e9 bytes/s against ~1e10-1e11 multiply-adds/s of a BLAS core).
SEND_COST = 20.0


class LowRank:
    """A factor ``U Uᵀ`` kept as ``U`` (``columns``, shape (d, k))."""

    def __init__(self, columns):
        self.columns = columns

    @property
    def dim(self) -> int:
        return int(self.columns.shape[0])

    @property
    def rank(self) -> int:
        """k, the number of columns (an upper bound of the rank)."""
        return int(self.columns.shape[1])

    @property
    def dtype(self):
        return self.columns.dtype

    @property
    def shape(self) -> Tuple[int, int]:
        """The shape of the factor it stands for, (d, d)."""
        return (self.dim, self.dim)

    def dense(self):
        """``U Uᵀ`` (d, d)."""
        return linalg.matmul(self.columns, self.columns.T)

    def kernel(self):
        """``Uᵀ U`` (k, k): the matrix the damped inverse inverts."""
        return linalg.matmul(self.columns.T, self.columns)


def add(a, b):
    """``a + b`` of two factors, either low rank or dense (arrays): the
    columns side by side if both are low rank, else the dense sum."""
    if isinstance(a, LowRank) and isinstance(b, LowRank):
        xp = get_array_module(a.columns)
        return LowRank(xp.concatenate([a.columns, b.columns], axis=1))
    if isinstance(a, LowRank):
        return a.dense() + b
    if isinstance(b, LowRank):
        return a + b.dense()
    a += b
    return a


def scaled(factor, scale: float):
    """``scale · factor`` (``scale`` ≥ 0), low rank or dense; a new
    object."""
    if isinstance(factor, LowRank):
        return LowRank(factor.columns *
                       factor.columns.dtype.type(math.sqrt(scale)))
    return factor * factor.dtype.type(scale)


def columns_of(vectors, scale: float, append_ones: bool = False) -> LowRank:
    """The low-rank factor ``scale · Σ v vᵀ`` of the vectors ``v``, the
    columns of ``vectors`` (d', k), with a row of ones appended (a layer's
    bias) when asked, in the factor dtype."""
    xp = get_array_module(vectors)
    dtype = factor_dtype_for(vectors.dtype)
    root = dtype.type(math.sqrt(scale))
    rows = vectors.shape[0] + int(append_ones)
    out = xp.empty((rows, vectors.shape[1]), dtype=dtype)
    xp.multiply(vectors, root, out=out[:vectors.shape[0]])
    if append_ones:
        out[-1] = root
    return LowRank(out)


def with_zero_row(factor):
    """``factor`` (a matrix, a diagonal or low rank) of ``d`` rows as one of
    ``d + 1`` whose last row and column are 0: the input factor of a call
    of a layer with a bias that passed no bias (``F.linear(x, link.W)``),
    whose bias gradient it does not touch."""
    xp = get_array_module(factor.columns if isinstance(factor, LowRank)
                          else factor)
    if isinstance(factor, LowRank):
        columns = factor.columns
        out = xp.zeros((columns.shape[0] + 1,) + columns.shape[1:],
                       dtype=columns.dtype)
        out[:-1] = columns
        return LowRank(out)
    if factor.ndim == 1:
        return xp.concatenate([factor, xp.zeros(1, dtype=factor.dtype)])
    out = xp.zeros((factor.shape[0] + 1, factor.shape[1] + 1),
                   dtype=factor.dtype)
    out[:-1, :-1] = factor
    return out


def worth_keeping(factor, width: int):
    """``factor``, or its dense form if it is low rank but no longer pays
    (an average of low-rank factors whose ranks add up: ``factor_decay``);
    ``width`` as in :func:`costs`."""
    if isinstance(factor, LowRank) and not pays(factor.dim, factor.rank,
                                                width):
        return factor.dense()
    return factor


def dense(factor):
    """The factor as a dense array."""
    return factor.dense() if isinstance(factor, LowRank) else factor


def mean_eigenvalue(factor) -> float:
    """``tr(F) / dim(F)`` of a factor: low rank, dense or a diagonal
    (within :func:`traces_read_once` of it, the trace read with the
    others')."""
    read = getattr(_traces, 'read', None)
    if read is not None and id(factor) in read:
        return read[id(factor)][1] / _dim(factor)
    return float(_device_trace(factor)) / _dim(factor)


def _dim(factor) -> int:
    return factor.dim if isinstance(factor, LowRank) else factor.shape[0]


def _device_trace(factor):
    """``tr(F)`` where the factor is (a 0-d array on the device)."""
    if isinstance(factor, LowRank):
        columns = factor.columns
        return get_array_module(columns).vdot(columns, columns)
    xp = get_array_module(factor)
    return xp.trace(factor) if factor.ndim == 2 else factor.sum()


_traces = threading.local()


def _to_host(array):
    """The one host read of :func:`traces_read_once` (a NumPy array)."""
    return chainer.backends.cuda.to_cpu(array)


@contextlib.contextmanager
def traces_read_once(factors: Sequence):
    """Within the block, :func:`mean_eigenvalue` of these factors (device
    arrays, or low rank on the device) takes a trace computed on the
    device with all the others and read to the host in one transfer, not
    one host synchronisation per factor (a GPU refresh step of ResNet-50
    read 108 traces one by one, the GPU idle between). The values are the
    ones each read would give. NumPy factors are read as they are asked
    for (there is nothing to wait for)."""
    read = {}
    by_module = {}
    for factor in factors:
        array = factor.columns if isinstance(factor, LowRank) else factor
        by_module.setdefault(get_array_module(array), []).append(factor)
    for xp, group in by_module.items():
        values = _to_host(xp.stack([
            xp.asarray(_device_trace(f)).astype(numpy.float64)
            for f in group]))
        # each factor kept with its value, so that its id stays its own
        read.update((id(f), (f, float(v))) for f, v in zip(group, values))
    previous = getattr(_traces, 'read', None)
    _traces.read = read
    try:
        yield
    finally:
        _traces.read = previous


def rank_budget(dim: int, processes: int = 1) -> int:
    """The most columns a process keeps of a ``dim × dim`` factor before
    building the Gram matrix instead."""
    return int(dim * MAX_RANK_FRACTION) // max(1, processes)


def costs(dim: int, rank: int, width: int, processes: int = 1
          ) -> Dict[str, float]:
    """Multiply-add counts of one refresh and one preconditioning of a
    ``dim × dim`` factor of rank ``rank`` in a block whose gradient matrix
    has ``width`` rows (the other factor's dimension), in each form.

    * dense: the Gram matrix ``U Uᵀ`` (``d² k``; what the dense capture
      computes), the inverse (Cholesky and its inverse, ``d³``), the
      preconditioning ``M F⁻¹`` (``o d²``), and with several processes the
      packed factor sent (``d² / 2`` elements × :data:`SEND_COST`);
    * low rank: the kernel ``Uᵀ U`` and ``W = U C⁻¹`` (``2 d k²``), the
      kernel's inverse (``k³``), the preconditioning (``2 o d k``), and the
      ``d · k`` elements of the columns sent.
    """
    d, k, o = float(dim), float(rank), float(width)
    send = SEND_COST if processes > 1 else 0.0
    return {'dense': d * d * k + d ** 3 + o * d * d + send * d * d / 2,
            'low_rank': 2 * d * k * k + k ** 3 + 2 * o * d * k +
            send * d * k}


def pays(dim: int, rank: int, width: int, processes: int = 1) -> bool:
    """Whether the low-rank form is cheaper (:func:`costs`)."""
    if rank >= dim:
        return False
    cost = costs(dim, rank, width, processes)
    return cost['low_rank'] < cost['dense']


# -- the damped inverse -------------------------------------------------------
class WoodburyInverse:
    """``(U Uᵀ + γ I)⁻¹ = (I − U C⁻¹ Uᵀ) / γ`` applied without forming it.

    Parameters
    ----------
    columns : array (d, k)
        ``U``.
    core_inverse : array (k, k)
        ``C⁻¹ = (Uᵀ U + γ I)⁻¹``.
    damping : float
        γ.
    """

    def __init__(self, columns, core_inverse, damping: float):
        self.columns = columns
        # W = U C⁻¹ (C⁻¹ dense, or a linalg.CholeskyInverse)
        self.weighted = right_multiply(columns, core_inverse)
        self.damping = float(damping)
        # 1/γ by the dtype of the matrices multiplied, as 0-d arrays beside
        # the columns: a captured CUDA graph reads them where they are, so
        # a refresh taken in place (refill) reaches its replays, where a
        # host number would stay baked in its kernels. The columns' dtype's
        # is made now (a refresh is eager), others at their first use.
        self._scales = {}
        self._scale(numpy.dtype(columns.dtype))

    @property
    def dim(self) -> int:
        return int(self.columns.shape[0])

    def left(self, matrix):
        """``F⁻¹ · matrix`` for a (d, o) matrix."""
        u, w = self._operands(matrix.dtype)
        out = matrix - linalg.matmul(u, linalg.matmul(w.T, matrix))
        out *= self._scale(out.dtype)
        return out

    def right(self, matrix):
        """``matrix · F⁻¹`` for an (o, d) matrix."""
        u, w = self._operands(matrix.dtype)
        out = matrix - linalg.matmul(linalg.matmul(matrix, w), u.T)
        out *= self._scale(out.dtype)
        return out

    def refill(self, other: 'WoodburyInverse') -> bool:
        """Take ``other``'s values (the same factor refreshed) into this
        object's arrays, in place, where their shapes and dtypes match:
        what holds this object — and a CUDA graph that reads its arrays —
        then applies the new inverse. Returns whether it did; where not,
        nothing changed."""
        if not (linalg.same_layout(self.columns, other.columns) and
                linalg.same_layout(self.weighted, other.weighted)):
            return False
        if other.columns is not self.columns:
            self.columns[...] = other.columns
        self.weighted[...] = other.weighted
        self.damping = other.damping
        for scale in self._scales.values():
            scale.fill(1.0 / self.damping)
        return True

    def arrays(self) -> list:
        """The device arrays it applies (a CUDA graph's buffers)."""
        return [self.columns, self.weighted] + [
            self._scales[k] for k in sorted(self._scales, key=str)]

    def _scale(self, dtype):
        """``1/γ`` as a 0-d array of ``dtype`` (made once per dtype, by a
        fill: no copy from the host). The same rounding as
        ``dtype.type(1/γ)``.

        Raises
        ------
        RuntimeError
            Asked for a new dtype while a CUDA graph is being captured:
            made there, its fill would be part of the graph and every
            replay would write the capture's 1/γ over a refill's (the
            capture then fails cleanly and the step runs eagerly).
        """
        scale = self._scales.get(dtype)
        if scale is None:
            xp = get_array_module(self.columns)
            if xp is not numpy and \
                    xp.cuda.get_current_stream().is_capturing():
                raise RuntimeError(
                    'WoodburyInverse: 1/γ in {} first asked for while a '
                    'CUDA graph is being captured (it is made at an eager '
                    'step)'.format(numpy.dtype(dtype).name))
            with chainer.using_device(
                    chainer.backend.get_device_from_array(self.columns)):
                scale = self._scales[dtype] = xp.full(
                    (), 1.0 / self.damping, dtype)
        return scale

    def dense(self):
        """The inverse as a (d, d) array (tests)."""
        xp = get_array_module(self.columns)
        return self.left(xp.eye(self.dim, dtype=self.columns.dtype))

    def _operands(self, dtype):
        return (self.columns.astype(dtype, copy=False),
                self.weighted.astype(dtype, copy=False))


def inversion_matrix(factor):
    """What :func:`chainerkfac.linalg.damped_inverses` inverts for a
    factor: the kernel ``Uᵀ U`` of a low-rank one (its damped inverse is
    ``C⁻¹``), else the factor."""
    return factor.kernel() if isinstance(factor, LowRank) else factor


def refilled(old, new):
    """``old`` holding ``new``'s values where it can take them in place (two
    dense inverses of one shape and dtype, or two Woodbury inverses with
    their arrays alike: :meth:`WoodburyInverse.refill`), else ``new``. A
    refreshed inverse then keeps its predecessor's arrays, which a
    captured CUDA graph reads (:mod:`chainerkfac.graphs.kfac_step`)."""
    if old is None or new is None or old is new:
        return new
    for kind in (WoodburyInverse, linalg.CholeskyInverse):
        if isinstance(old, kind):
            return old if isinstance(new, kind) and old.refill(new) else new
    if isinstance(new, (WoodburyInverse, linalg.CholeskyInverse)) or \
            not linalg.same_layout(old, new):
        return new
    old[...] = new
    return old


def inverse_arrays(inverse) -> list:
    """The arrays an inverse (dense, diagonal, Woodbury or Cholesky)
    applies."""
    if isinstance(inverse, (WoodburyInverse, linalg.CholeskyInverse)):
        return inverse.arrays()
    return [] if inverse is None else [inverse]


def inverse_of(factor, inverse, damping: float):
    """The damped inverse of ``factor`` from what
    :func:`chainerkfac.linalg.damped_inverses` returned for
    :func:`inversion_matrix` (None stays None)."""
    if inverse is None or not isinstance(factor, LowRank):
        return inverse
    return WoodburyInverse(factor.columns, inverse, damping)


def left_multiply(inverse, matrix, overwrite: bool = False,
                  tf32: bool = False):
    """``inverse · matrix``: a Woodbury inverse, a Cholesky one
    (:class:`chainerkfac.linalg.CholeskyInverse`), a dense one or a
    diagonal (1-D); with ``overwrite``, a diagonal scales ``matrix`` in
    place; ``tf32``: a dense float32 product on TF32 Tensor Cores
    (:func:`chainerkfac.linalg.matmul`)."""
    if isinstance(inverse, (WoodburyInverse, linalg.CholeskyInverse)):
        return inverse.left(matrix)
    inverse = inverse.astype(matrix.dtype, copy=False)
    if inverse.ndim == 2:
        return linalg.matmul(inverse, matrix, tf32=tf32)
    if overwrite:
        matrix *= inverse[:, None]
        return matrix
    return inverse[:, None] * matrix


def right_multiply(matrix, inverse, overwrite: bool = False,
                   tf32: bool = False):
    """``matrix · inverse``, as :func:`left_multiply`."""
    if isinstance(inverse, (WoodburyInverse, linalg.CholeskyInverse)):
        return inverse.right(matrix)
    inverse = inverse.astype(matrix.dtype, copy=False)
    if inverse.ndim == 2:
        return linalg.matmul(matrix, inverse, tf32=tf32)
    if overwrite:
        matrix *= inverse
        return matrix
    return matrix * inverse


# -- across processes ---------------------------------------------------------
class Exchange:
    """One step's agreement on the form of every captured factor, and its
    transport through the dense factors' ReduceScatterV (see the module
    docstring).

    Attributes
    ----------
    low_rank : dict
        ``{(block, name): k_total}`` of the factors sent low rank at the
        last step.
    """

    def __init__(self):
        self.low_rank: Dict[Tuple[object, str], int] = {}

    def prepare(self, blocks, factors: Dict, transport) -> Dict:
        """Decide each factor's form, identically on every process, and
        put each into it.

        Parameters
        ----------
        blocks : list of FisherBlock
        factors : dict
            ``{block: {name: this process's sum, or None}}``: the same
            blocks and names on every process (those captured anywhere),
            None where this process captured none.
        transport : chainerkfac.transport.Transport

        Returns
        -------
        dict
            The same structure: dense arrays (None where this process
            captured none: the caller sends zeros), and for the low-rank
            factors the zero-padded ``(d, k_total)`` buffer of this
            process's columns (one process: its columns).
        """
        self.low_rank = {}
        candidates = [(b, n) for b in blocks for n in factors[b]
                      if b.low_rank_capable(n)]
        if not candidates:
            return factors
        size, rank = transport.size, transport.rank
        local = numpy.zeros((len(candidates), 1 + size), numpy.int64)
        for i, (block, name) in enumerate(candidates):
            value = factors[block][name]
            if value is not None and not isinstance(value, LowRank):
                local[i, 0] = 1                          # dense here
            elif value is not None:
                local[i, 1 + rank] = value.rank
        totals = transport.all_sum(local.ravel()).reshape(local.shape)
        out = {b: dict(v) for b, v in factors.items()}
        for (block, name), row in zip(candidates, totals):
            value = factors[block][name]
            total = int(row[1:].sum())
            low = not row[0] and total > 0 and pays(
                block.factor_shapes()[name][0], total,
                block.precondition_width(name), size)
            if not low:
                if isinstance(value, LowRank):
                    out[block][name] = value.dense()
                continue
            self.low_rank[(block, name)] = total
            out[block][name] = _padded(block, name, value, row, rank)
        return out

    def receive(self, factors: Dict) -> Dict:
        """After the reduction: the owners' low-rank factors as
        :class:`LowRank` again."""
        for (block, name), _ in self.low_rank.items():
            owned = factors.get(block)
            if owned is not None and name in owned:
                owned[name] = LowRank(owned[name])
        return factors


def _padded(block, name, value, row, rank):
    """This process's columns in its slice (rank order) of a zero
    ``(d, k_total)`` buffer, ``row`` the columns of every process; one
    process: its columns."""
    if len(row) == 2:
        return value.columns
    like = block.params[0].array
    xp = get_array_module(like)
    dim = block.factor_shapes()[name][0]
    dtype = (value.dtype if value is not None else
             factor_dtype_for(like.dtype))
    buffer = xp.zeros((dim, int(row[1:].sum())), dtype=dtype)
    if value is not None and value.rank:
        start = int(row[1:1 + rank].sum())
        buffer[:, start:start + value.rank] = value.columns
    return buffer


def held_low_rank(blocks) -> int:
    """How many factors of ``blocks`` this process holds low rank."""
    return sum(1 for b in blocks for f in b.factors.values()
               if isinstance(f, LowRank))
