"""The GPU side of :func:`chainerkfac.linalg.damped_inverses` (CuPy only).

One try inverts every pending factor ``M + d·I`` of a step:

* **Cholesky, then its inverse** — cuSOLVER ``potrf`` then ``potri``
  (≈ n³ flops in all), called through a small ``ctypes`` binding to the
  cuSOLVER library CuPy has loaded (CuPy 14 exposes ``potrf`` but not
  ``potri``), checked once on a known matrix. Where that binding cannot be
  made or fails its check, ``potrs`` against the identity (≈ 7n³/3 flops,
  what ``cupyx.lapack.posv`` does) replaces ``potri``; the result is the
  same to rounding. Under ``chainer.config.autotune`` the two ways are
  timed once per size and dtype and the faster kept
  (:data:`CHOLESKY_INVERSE` ``'auto'``, the default).
* **Batched for equal sizes** — the factors of one size and dtype, at
  most :data:`BATCHED_MAX_DIM` and at least :data:`BATCH_MIN` of them, go
  as one batch: cuSOLVER ``potrfBatched`` (``A = L Lᵀ``), then two cuBLAS
  ``trsmBatched`` against the identity (``L X = I``, then ``Lᵀ Y = X``:
  ``Y = A⁻¹``, ≈ 2n³ flops against potri's 2n³/3, in three library calls
  for the whole size instead of a few kernels per factor; cuSOLVER has no
  batched ``potri``). ResNet-50's 161 factors come in few sizes (64, 128,
  256, 512 ...), most of them small and bound by launches.
* **Concurrency** — single factors and batches are spread over
  :data:`N_STREAMS` non-blocking CUDA streams, largest first onto the
  least loaded stream (each stream with its own cuSOLVER and cuBLAS
  handles).
* **One host synchronisation per try** — every check (non-finite input,
  the ``devInfo`` of ``potrf`` / ``potri``, non-finite output) is written
  by the kernels into one small device array, read back once.

Importing this module does not import CuPy; calling :func:`attempt` does.
"""
import ctypes
import functools
import logging
from typing import List, Optional, Sequence, Tuple

import numpy

from chainerkfac import _binding, dtypes
from chainerkfac.stage_timer import device_timed as _timed

logger = logging.getLogger(__name__)

#: Concurrent CUDA streams for the inverses of one try. On an H100 the
#: potrf + potri of ResNet-50's 161 factors took 0.130 s on 4 streams,
#: 0.144 s on 8, 0.130 s on 16 and 0.134 s on 32 (2026-11-23); the 27
#: factors of n >= 2048 alone 0.092 s on 16.
N_STREAMS = 16
#: The largest factor inverted in a batch of its size (0: none, every
#: factor by potrf + potri, whose blocked algorithms suit large ones).
#: Chosen by ``benchmarks.step_time --gpu --inverse-only
#: --batched-max-dims`` on one H200 (2026-11-26, ResNet-50's 161 factors,
#: fp32, medians of 15): 0.0962 s per-factor, 0.0940 s at 256, 0.0856 s
#: at 1024 (an earlier run of 5: 0.0951, 0.0954 at 128, 0.0929 at 256,
#: 0.104 at 512, 0.0877 at 1024); 128 of the 161 factors go in 6 batches.
BATCHED_MAX_DIM = 1024
#: The fewest factors of one size that make a batch.
BATCH_MIN = 2
#: How a factor inverted on its own goes from its Cholesky factor to its
#: inverse: ``'potri'`` (cuSOLVER's, ≈ 2n³/3 flops), ``'potrs'`` (two
#: triangular solves against the identity, ≈ 2n³ flops in cuBLAS's
#: GEMM-rich ``trsm``, which may run nearer the GPU's peak) or ``'auto'``:
#: under ``chainer.config.autotune`` (``train_imagenet.py --gpu`` where
#: steps are replayed), at the first factor of each size and dtype a
#: matrix of that size is inverted both ways, timed between CUDA events,
#: and the faster kept for that size where the two inverses agree
#: (:func:`timed_routes`); without autotune, potri. Where potri cannot
#: be bound, potrs is used either way. The per-factor inverses of
#: ResNet-50 (n up to 4608) are most of the inverse stage;
#: ``benchmarks.step_time --gpu --inverse-only --cholesky-inverses
#: potri,potrs,auto`` times the ways on the same factors.
CHOLESKY_INVERSE = 'auto'
CHOLESKY_INVERSES = ('potri', 'potrs', 'auto')
#: Of the largest entry: how far the two ways' inverses of the timing
#: matrix (:func:`timing_matrix`, condition number below 3) may be apart
#: for the faster to be kept: rounding in the inverse dtype, with room.
ROUTE_AGREEMENT = {'float32': 1e-3, 'float64': 1e-9}
# (n, dtype, device) → the way timed faster (CHOLESKY_INVERSE 'auto').
_TIMED_ROUTES = {}

# Columns of the per-factor status array written on the device.
_INPUT_NONFINITE, _FACTOR_INFO, _INVERSE_INFO, _OUTPUT_NONFINITE = range(4)
_STATUS_COLUMNS = 4
# cuSOLVER is column-major: its lower triangle is our (row-major) upper one.
_CUBLAS_FILL_MODE_LOWER = 0


def attempt(matrices: Sequence, dampings: Sequence[float],
            check_input: bool) -> List[Tuple[bool, Optional[object]]]:
    """One try for each factor on the current CUDA device.

    Parameters
    ----------
    matrices : sequence of cupy.ndarray
        Square symmetric factors (2-D) or diagonals (1-D), fp16/32/64.
    dampings : sequence of float
        The damping of this try, per factor.
    check_input : bool
        Report non-finite inputs (the first try); later tries ignore them.

    Returns
    -------
    list of (bool, cupy.ndarray or None)
        Per factor: whether its input is finite (always True without
        ``check_input``), and its inverse if the damped factor was positive
        definite and the inverse is finite, else None.
    """
    import cupy
    main = cupy.cuda.get_current_stream()
    device_id = cupy.cuda.runtime.getDevice()
    workers = _workers(device_id)
    matrices = [cupy.ascontiguousarray(m) for m in matrices]
    jobs = batches(matrices)
    routes = {}
    for job in jobs:
        if len(job) == 1 and matrices[job[0]].ndim == 2:
            k = job[0]
            routes[k] = _route(matrices[k], device_id, workers[0].handle)
    status = cupy.zeros((len(matrices), _STATUS_COLUMNS), numpy.int32)
    ready = main.record()
    costs = [sum(_cost(matrices[k]) for k in job) for job in jobs]
    lanes = _assign_lanes(costs, len(workers))
    for lane in sorted(set(lanes)):
        workers[lane].stream.wait_event(ready)
    inverses = [None] * len(matrices)
    for j in sorted(range(len(jobs)), key=lambda j: -costs[j]):
        worker = workers[lanes[j]]
        job = jobs[j]
        with worker.stream:
            if len(job) == 1:
                inverses[job[0]] = _invert(matrices[job[0]],
                                           dampings[job[0]], status,
                                           job[0], worker.handle,
                                           routes.get(job[0], 'potri'))
            else:
                outs = _invert_batch([matrices[k] for k in job],
                                     [dampings[k] for k in job], status,
                                     job, worker)
                for k, out in zip(job, outs):
                    inverses[k] = out
    for lane in sorted(set(lanes)):
        main.wait_event(workers[lane].stream.record())
    flags = status.get()  # the one host synchronisation of this try
    outcomes = []
    for k, row in enumerate(flags):
        finite = not (check_input and row[_INPUT_NONFINITE])
        ok = not row[_FACTOR_INFO:].any()
        outcomes.append((finite, inverses[k] if ok else None))
    return outcomes


def batches(matrices: Sequence) -> List[List[int]]:
    """The jobs of a try: lists of factor indices, each either one factor
    or a batch of equal-size square factors of one dtype (at most
    :data:`BATCHED_MAX_DIM`, at least :data:`BATCH_MIN` of them)."""
    groups, jobs = {}, []
    for k, matrix in enumerate(matrices):
        n = matrix.shape[0]
        if matrix.ndim == 2 and n <= BATCHED_MAX_DIM:
            key = (n, dtypes.inverse_dtype(matrix.dtype))
            groups.setdefault(key, []).append(k)
        else:
            jobs.append([k])
    for members in groups.values():
        if len(members) >= BATCH_MIN:
            jobs.append(members)
        else:
            jobs += [[k] for k in members]
    return sorted(jobs)


def _cost(matrix) -> float:
    n = float(matrix.shape[0])
    return n ** 3 if matrix.ndim == 2 else n


def _assign_lanes(costs: Sequence[float], n_lanes: int) -> List[int]:
    """Largest first, each onto the least loaded lane: per factor, its
    lane."""
    loads = [0.0] * n_lanes
    lanes = [0] * len(costs)
    for k in sorted(range(len(costs)), key=lambda k: -costs[k]):
        lane = loads.index(min(loads))
        lanes[k] = lane
        loads[lane] += costs[k]
    return lanes


def timed_routes() -> dict:
    """The ways :data:`CHOLESKY_INVERSE` ``'auto'`` chose by timing in this
    process: ``(n, dtype, device) → 'potri' or 'potrs'``."""
    return dict(_TIMED_ROUTES)


def _route(matrix, device_id, handle) -> str:
    """How the lone factor ``matrix`` goes from its Cholesky factor to its
    inverse (:data:`CHOLESKY_INVERSE`): under autotune, timed for its size
    and dtype on its first try (on the current stream, before the try is
    queued: a few synchronisations, once per size)."""
    if CHOLESKY_INVERSE not in CHOLESKY_INVERSES:
        raise ValueError('linalg_cuda.CHOLESKY_INVERSE must be one of '
                         '{}, got {!r}'.format(CHOLESKY_INVERSES,
                                               CHOLESKY_INVERSE))
    if _raw_potri() is None:
        return 'potrs'
    if CHOLESKY_INVERSE != 'auto':
        return CHOLESKY_INVERSE
    dtype = dtypes.inverse_dtype(matrix.dtype)
    key = (matrix.shape[0], dtype.name, device_id)
    if key not in _TIMED_ROUTES:
        import chainer
        if not chainer.config.autotune:
            return 'potri'
        _TIMED_ROUTES[key] = _time_routes(matrix.shape[0], dtype, handle)
    return _TIMED_ROUTES[key]


def timing_matrix(xp, n: int, dtype):
    """The positive definite matrix the ways are timed on (their cost does
    not depend on the values: no pivoting): ``1 / (1 + |i − j|)`` off the
    diagonal, ``n`` on it (diagonally dominant), made on the device
    without a random draw."""
    index = xp.arange(n, dtype=dtype)
    matrix = 1 / (1 + abs(index[:, None] - index[None, :]))
    return matrix + (n - 1) * xp.eye(n, dtype=dtype)


def _time_routes(n: int, dtype, handle) -> str:
    """Invert :func:`timing_matrix` of size ``n`` by potri and by potrs
    (each once to warm up, then timed): the faster, or potri where either
    failed or the two inverses disagree."""
    import cupy
    matrix = timing_matrix(cupy, n, dtype)
    status = cupy.zeros((1, _STATUS_COLUMNS), numpy.int32)
    results, seconds = {}, {}
    for route in ('potri', 'potrs'):
        _invert(matrix, 0.0, status, 0, handle, route)    # warm-up
        results[route], seconds[route] = _timed(
            cupy, lambda: _invert(matrix, 0.0, status, 0, handle, route))
    potri, potrs = results['potri'], results['potrs']
    peak = float(abs(potri).max())
    gap = float(abs(potrs - potri).max())
    tolerance = ROUTE_AGREEMENT.get(numpy.dtype(dtype).name, 1e-3) * peak
    if status.get().any() or not gap <= tolerance:
        logger.warning('inverse of n=%d (%s): potrs differs from potri by '
                       '%.3g (largest entry %.3g) or failed; potri is kept',
                       n, numpy.dtype(dtype).name, gap, peak)
        return 'potri'
    chosen = 'potrs' if seconds['potrs'] < seconds['potri'] else 'potri'
    logger.debug('inverse of n=%d (%s): potri %.3g s, potrs %.3g s: %s', n,
                 numpy.dtype(dtype).name, seconds['potri'],
                 seconds['potrs'], chosen)
    return chosen


def _invert(matrix, damping, status, k, handle, route):
    """Queue one factor's try on the current stream (no synchronisation);
    ``route``: potri or potrs after potrf (:func:`_route`)."""
    import cupy
    dtype = dtypes.inverse_dtype(matrix.dtype)
    slot = k * _STATUS_COLUMNS
    if matrix.ndim == 1:
        out = cupy.empty(matrix.shape, dtype)
        _kernels().diagonal(matrix, dtype.type(damping), slot, out, status)
        return out
    n = matrix.shape[0]
    damped = cupy.empty((n, n), dtype)
    _kernels().damp(matrix, dtype.type(damping), n, slot + _INPUT_NONFINITE,
                    damped, status)
    solver = _Solver(dtype, handle, route)
    work = cupy.empty(max(1, solver.potrf_lwork(n, damped),
                          solver.potri_lwork(n, damped)), dtype)
    row = status.data.ptr + status.itemsize * slot   # devInfo pointers
    solver.potrf(n, damped, work, row + status.itemsize * _FACTOR_INFO)
    inverse = solver.potri(n, damped, work,
                           row + status.itemsize * _INVERSE_INFO)
    out = cupy.empty((n, n), dtype)
    _kernels().mirror(inverse, n, slot + _OUTPUT_NONFINITE, out, status)
    return out


def _invert_batch(matrices, dampings, status, rows, worker):
    """Queue the try of a batch of equal-size factors on the current
    stream: potrfBatched, two trsmBatched against the identity, the
    checks of each factor into its status row (no synchronisation)."""
    import cupy
    from cupy_backends.cuda.libs import cublas, cusolver
    n = matrices[0].shape[0]
    dtype = dtypes.inverse_dtype(matrices[0].dtype)
    count = len(matrices)
    damped = cupy.empty((count, n, n), dtype)
    for i, (matrix, damping) in enumerate(zip(matrices, dampings)):
        _kernels().damp(matrix, dtype.type(damping), n,
                        rows[i] * _STATUS_COLUMNS + _INPUT_NONFINITE,
                        damped[i], status)
    inverse = cupy.empty((count, n, n), dtype)
    inverse[...] = cupy.eye(n, dtype=dtype)
    info = cupy.zeros(count, numpy.int32)
    factors, solutions = _pointers(damped), _pointers(inverse)
    prefix = 'd' if dtype == numpy.float64 else 's'
    # A = L Lᵀ (column-major lower: our row-major upper); the other
    # triangle is cuSOLVER's workspace
    getattr(cusolver, prefix + 'potrfBatched')(
        worker.handle, _CUBLAS_FILL_MODE_LOWER, n, factors.data.ptr, n,
        info.data.ptr, count)
    one = numpy.ones((), dtype)      # alpha, read from host memory
    trsm = getattr(cublas, prefix + 'trsmBatched')
    for operation in (cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_T):
        # L X = I, then Lᵀ Y = X: Y = A⁻¹ (column-major, symmetric)
        trsm(worker.blas, cublas.CUBLAS_SIDE_LEFT, _CUBLAS_FILL_MODE_LOWER,
             operation, cublas.CUBLAS_DIAG_NON_UNIT, n, n, one.ctypes.data,
             factors.data.ptr, n, solutions.data.ptr, n, count)
    _kernels().batch_info(info, cupy.asarray(numpy.asarray(rows,
                                                           numpy.int64)),
                          status)
    outs = []
    for i in range(count):
        out = cupy.empty((n, n), dtype)
        _kernels().mirror(inverse[i], n,
                          rows[i] * _STATUS_COLUMNS + _OUTPUT_NONFINITE,
                          out, status)
        outs.append(out)
    return outs


def _pointers(stack):
    """The device addresses of the matrices of a C-contiguous stack
    (B, n, n), as a device array (computed there: no copy from the
    host)."""
    import cupy
    step = stack.shape[1] * stack.shape[2] * stack.itemsize
    return (cupy.arange(stack.shape[0], dtype=numpy.uint64) *
            numpy.uint64(step) + numpy.uint64(stack.data.ptr))


class _Worker(object):
    """A non-blocking stream and the cuSOLVER and cuBLAS handles bound to
    it (CuPy's wrappers set the cuBLAS handle to the current stream)."""

    def __init__(self):
        import cupy
        from cupy_backends.cuda.libs import cublas, cusolver
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.handle = cusolver.create()
        cusolver.setStream(self.handle, self.stream.ptr)
        self.blas = cublas.create()


@functools.lru_cache(maxsize=None)
def _workers(device_id: int) -> Tuple[_Worker, ...]:
    # Made once per device, kept for the life of the process.
    import cupy
    with cupy.cuda.Device(device_id):
        return tuple(_Worker() for _ in range(N_STREAMS))


class _Solver(object):
    """cuSOLVER ``potrf`` and ``potri`` (or ``potrs`` against the identity:
    ``route``, and wherever potri cannot be bound) for one dtype on one
    handle; every call is queued on the current stream."""

    def __init__(self, dtype, handle, route):
        from cupy_backends.cuda.libs import cusolver
        self.cusolver = cusolver
        self.dtype = numpy.dtype(dtype)
        self.handle = handle
        self.prefix = 'd' if self.dtype == numpy.float64 else 's'
        self.raw = _raw_potri()
        self.route = route

    def potrf_lwork(self, n, matrix) -> int:
        return _potrf_lwork(self.prefix, n, self.handle, matrix.data.ptr)

    def potri_lwork(self, n, matrix) -> int:
        if not self._uses_potri():
            return 0
        return _potri_lwork(self.prefix, n, self.handle, matrix.data.ptr)

    def potrf(self, n, matrix, work, info_ptr) -> None:
        # CuPy's wrappers bind the handle to the current stream.
        potrf = getattr(self.cusolver, self.prefix + 'potrf')
        potrf(self.handle, _CUBLAS_FILL_MODE_LOWER, n, matrix.data.ptr, n,
              work.data.ptr, work.size, info_ptr)

    def _uses_potri(self) -> bool:
        return self.raw is not None and self.route == 'potri'

    def potri(self, n, chol, work, info_ptr):
        """Inverse of ``chol``'s Cholesky factorisation (potri, or potrs
        against the identity: the route); its upper (row-major) triangle
        is valid."""
        if self._uses_potri():
            import cupy
            self.cusolver.setStream(self.handle,
                                    cupy.cuda.get_current_stream().ptr)
            potri = self.raw[self.prefix + 'potri']
            _check(potri(self.handle, _CUBLAS_FILL_MODE_LOWER, n,
                         chol.data.ptr, n, work.data.ptr, work.size,
                         info_ptr), 'potri')
            return chol
        import cupy
        inverse = cupy.eye(n, dtype=self.dtype)   # A X = I by potrs
        potrs = getattr(self.cusolver, self.prefix + 'potrs')
        potrs(self.handle, _CUBLAS_FILL_MODE_LOWER, n, n, chol.data.ptr, n,
              inverse.data.ptr, n, info_ptr)
        return inverse


_LWORK = {}


def _potrf_lwork(prefix, n, handle, pointer) -> int:
    # Workspace sizes depend on the size and dtype only: asked once.
    key = ('potrf', prefix, n)
    if key not in _LWORK:
        from cupy_backends.cuda.libs import cusolver
        size = getattr(cusolver, prefix + 'potrf_bufferSize')
        _LWORK[key] = int(size(handle, _CUBLAS_FILL_MODE_LOWER, n, pointer,
                               n))
    return _LWORK[key]


def _potri_lwork(prefix, n, handle, pointer) -> int:
    key = ('potri', prefix, n)
    if key not in _LWORK:
        lwork = ctypes.c_int(0)
        size = _raw_potri()[prefix + 'potri_bufferSize']
        _check(size(handle, _CUBLAS_FILL_MODE_LOWER, n, pointer, n,
                    ctypes.byref(lwork)), 'potri_bufferSize')
        _LWORK[key] = int(lwork.value)
    return _LWORK[key]


def _check(status: int, name: str) -> None:
    if status != 0:
        raise RuntimeError('cusolverDn{} failed with status {}'.format(
            name, status))


@functools.lru_cache(maxsize=None)
def _raw_potri():
    """``{'spotri', 'dpotri', 'spotri_bufferSize', 'dpotri_bufferSize'}``
    from the cuSOLVER library this process has loaded, once they pass
    :func:`_check_potri`; None otherwise (``potrs`` then stands in)."""
    path = _loaded_cusolver()
    if path is None:
        logger.info('cuSOLVER potri not bound (library not found in this '
                    'process): inverting with potrs against the identity')
        return None
    try:
        functions = _bind_potri(path)
    except (OSError, AttributeError) as error:
        logger.info('cuSOLVER potri not bound (%s): inverting with potrs '
                    'against the identity', error)
        return None
    problem = _check_potri(functions)
    if problem is not None:
        logger.warning('cuSOLVER potri from %s fails a check (%s): inverting '
                       'with potrs against the identity', path, problem)
        return None
    logger.debug('cuSOLVER potri bound from %s', path)
    return functions


def _bind_potri(path: str) -> dict:
    """ctypes bindings of ``cusolverDn{S,D}potri[_bufferSize]`` in the
    library at ``path``; OSError or AttributeError if it has none."""
    void, c_int = ctypes.c_void_p, ctypes.c_int
    library = ctypes.CDLL(path)
    functions = {}
    for prefix in ('s', 'd'):
        size = getattr(library, 'cusolverDn{}potri_bufferSize'.format(
            prefix.upper()))
        size.argtypes = [void, c_int, c_int, void, c_int,
                         ctypes.POINTER(c_int)]
        size.restype = c_int
        potri = getattr(library, 'cusolverDn{}potri'.format(prefix.upper()))
        potri.argtypes = [void, c_int, c_int, void, c_int, void, c_int, void]
        potri.restype = c_int
        functions[prefix + 'potri_bufferSize'] = size
        functions[prefix + 'potri'] = potri
    return functions


def _check_potri(functions) -> Optional[str]:
    """Invert a known 3×3 matrix in both dtypes with the bound ``potri``
    (and the conventions of :class:`_Solver`); what went wrong, or None."""
    import cupy
    from cupy_backends.cuda.libs import cusolver
    matrix = numpy.array([[4.0, 2.0, 0.6], [2.0, 3.0, 0.4], [0.6, 0.4, 2.0]])
    expected = numpy.linalg.inv(matrix)
    handle = cupy.cuda.device.get_cusolver_handle()
    uplo = _CUBLAS_FILL_MODE_LOWER
    try:
        for prefix, dtype in (('s', numpy.float32), ('d', numpy.float64)):
            a = cupy.asarray(matrix, dtype)
            info = cupy.zeros(2, numpy.int32)
            lwork = ctypes.c_int(0)
            _check(functions[prefix + 'potri_bufferSize'](
                handle, uplo, 3, a.data.ptr, 3, ctypes.byref(lwork)),
                'potri_bufferSize')
            size = getattr(cusolver, prefix + 'potrf_bufferSize')(
                handle, uplo, 3, a.data.ptr, 3)
            work = cupy.empty(max(1, size, lwork.value), dtype)
            getattr(cusolver, prefix + 'potrf')(
                handle, uplo, 3, a.data.ptr, 3, work.data.ptr, work.size,
                info.data.ptr)
            cusolver.setStream(handle, cupy.cuda.get_current_stream().ptr)
            _check(functions[prefix + 'potri'](
                handle, uplo, 3, a.data.ptr, 3, work.data.ptr, work.size,
                info.data.ptr + info.itemsize), 'potri')
            upper = numpy.triu(a.get())
            got = upper + numpy.triu(upper, 1).T
            if info.get().any() or not numpy.allclose(got, expected,
                                                      rtol=1e-4):
                return '{} inverse {} differs from {}'.format(
                    dtype.__name__, got.tolist(), expected.tolist())
    except Exception as error:  # a cuSOLVER status, a CUDA error
        return '{}: {}'.format(type(error).__name__, error)
    return None


def _loaded_cusolver() -> Optional[str]:
    """Path of the one libcusolver mapped into this process (loaded by
    CuPy), or None; never a guess, as a handle from one cuSOLVER build
    must not reach another."""
    import cupy
    cupy.cuda.device.get_cusolver_handle()  # makes CuPy load cuSOLVER
    paths = _binding.mapped_files(('libcusolver.so',))
    if len(paths) == 1:
        return paths[0]
    return _binding.pathfinder_path('cusolver')


@functools.lru_cache(maxsize=None)
def _kernels():
    import cupy

    # ``status`` is a raw *output*: CuPy passes raw inputs as const arrays,
    # and the kernels count their failures into it with atomicAdd.
    class Kernels(object):
        #: ``out = m + d·I`` (cast to the inverse dtype); counts non-finite
        #: entries of ``m`` into ``status[slot]``.
        damp = cupy.ElementwiseKernel(
            'raw S m, T d, int64 n, int64 slot', 'T out, raw int32 status',
            '''
            T x = (T)m[i];
            if (!isfinite(x)) atomicAdd(&status[slot], 1);
            out = (i % (n + 1) == 0) ? x + d : x;
            ''', 'chainerkfac_damp')
        #: ``out`` = the upper triangle of ``a`` mirrored onto the lower one;
        #: counts non-finite entries into ``status[slot]``.
        mirror = cupy.ElementwiseKernel(
            'raw T a, int64 n, int64 slot', 'T out, raw int32 status',
            '''
            ptrdiff_t r = i / n, c = i % n;
            T x = (r <= c) ? a[i] : a[c * n + r];
            if (!isfinite(x)) atomicAdd(&status[slot], 1);
            out = x;
            ''', 'chainerkfac_mirror_upper')
        #: ``potrfBatched``'s info of each factor of a batch, into the
        #: factor's status row (``rows``).
        batch_info = cupy.ElementwiseKernel(
            'int32 info, int64 row', 'raw int32 status',
            'if (info != 0) atomicAdd(&status[row * {} + {}], 1);'.format(
                _STATUS_COLUMNS, _FACTOR_INFO),
            'chainerkfac_batch_info')
        #: Diagonal Fisher: ``out = 1 / (v + d)`` with the checks of one
        #: status row: non-finite input, ``v + d <= 0`` (not positive
        #: definite), non-finite output.
        diagonal = cupy.ElementwiseKernel(
            'S v, T d, int64 slot', 'T out, raw int32 status',
            '''
            T x = (T)v;
            if (!isfinite(x)) atomicAdd(&status[slot], 1);
            T shifted = x + d;
            if (!(shifted > (T)0)) atomicAdd(&status[slot + 1], 1);
            T inverse = (T)1 / shifted;
            if (!isfinite(inverse)) atomicAdd(&status[slot + 3], 1);
            out = inverse;
            ''', 'chainerkfac_diagonal_inverse')

    return Kernels
