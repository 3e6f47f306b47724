"""Choosing a convolution algorithm, once per shape.

cuDNN offers several algorithms per convolution direction, each needing its
own workspace. As CuPy 13 does, the backend asks cuDNN's heuristics
(``cudnnGetConvolution*Algorithm_v7``) or, under
``chainer.config.autotune``, times them all on the real arrays
(``cudnnFindConvolution*AlgorithmEx``, with a workspace of Chainer's
maximum size from CuPy's pool), and keeps the answer per
:class:`AlgorithmKey` for the rest of the process.

From the ranked answer it takes the first entry that cuDNN reports as
usable (cuDNN 8+ also lists algorithms with ``CUDNN_STATUS_NOT_SUPPORTED``;
CuPy 13 did not skip them), deterministic when
``chainer.config.cudnn_deterministic`` asks for it, in exact FMA math when
that was asked for (see :mod:`chainerkfac.cudnn.convolution`), and within
the workspace limit; a :class:`PerformanceWarning` says when a faster
algorithm was passed over for lack of workspace.
"""
import ctypes
import warnings
from typing import Callable, NamedTuple, Sequence, Tuple

from chainerkfac.cudnn import constants as C
from chainerkfac.cudnn import library

#: Entries asked of cuDNN (it has 8 forward, 7 backward-filter and 6
#: backward-data algorithms; more is harmless).
REQUESTED = 10


class PerformanceWarning(RuntimeWarning):
    """A faster convolution algorithm needed more workspace than allowed
    (raise it with ``chainer.backends.cuda.set_max_workspace_size``)."""


class AlgorithmKey(NamedTuple):
    """What an algorithm choice depends on."""

    direction: str          # 'forward', 'backward_filter', 'backward_data'
    timed: bool             # Find*Ex (autotune) rather than heuristics
    device: int
    x_shape: Tuple[int, ...]
    w_shape: Tuple[int, ...]
    y_shape: Tuple[int, ...]
    dtype: str
    pad: Tuple[int, ...]
    stride: Tuple[int, ...]
    dilation: Tuple[int, ...]
    groups: int
    math_type: int
    deterministic: bool
    max_workspace_size: int


class Algorithm(NamedTuple):
    algo: int
    memory: int       # workspace bytes
    math_type: int


def query(lib, name: str, head: Sequence, tail: Sequence = ()) -> list:
    """Call a ``cudnnGet...Algorithm_v7`` or ``cudnnFind...AlgorithmEx``
    function: ``head`` are its arguments before (count, returned count,
    results), ``tail`` those after (Find's workspace). Returns the ranked
    entries."""
    results = (library.AlgoPerf * REQUESTED)()
    returned = ctypes.c_int()
    lib.call(name, *head, REQUESTED, ctypes.byref(returned), results, *tail)
    return list(results[:returned.value])


def choose(entries: Sequence, key: AlgorithmKey) -> Algorithm:
    """The first usable entry of a ranked cuDNN answer (module docstring).

    Raises
    ------
    RuntimeError
        No entry qualifies; the message gives the key.
    """
    short_of_workspace = False
    for entry in entries:
        if entry.status != C.CUDNN_STATUS_SUCCESS:
            continue
        if key.deterministic and entry.determinism != C.CUDNN_DETERMINISTIC:
            continue
        if (key.math_type == C.CUDNN_FMA_MATH and
                entry.mathType != C.CUDNN_FMA_MATH):
            continue
        if entry.memory > key.max_workspace_size:
            short_of_workspace = True
            continue
        if short_of_workspace:
            warnings.warn(
                'cuDNN: a faster convolution {} algorithm needs more than '
                'the maximum workspace of {} bytes ({}); raise it with '
                'chainer.backends.cuda.set_max_workspace_size'.format(
                    key.direction.replace('_', ' '), key.max_workspace_size,
                    _shapes(key)), PerformanceWarning)
        return Algorithm(entry.algo, entry.memory, entry.mathType)
    raise RuntimeError(
        'cuDNN has no convolution {} algorithm{}{} within a workspace of {} '
        'bytes for {}'.format(
            key.direction.replace('_', ' '),
            ' that is deterministic' if key.deterministic else '',
            ' in FMA math' if key.math_type == C.CUDNN_FMA_MATH else '',
            key.max_workspace_size, _shapes(key)))


def cached(cache: dict, key: AlgorithmKey,
           ask: Callable[[], Sequence]) -> Algorithm:
    """The algorithm for ``key``: from ``cache``, or chosen from ``ask()``
    (the ranked entries) and remembered."""
    algorithm = cache.get(key)
    if algorithm is None:
        algorithm = cache[key] = choose(ask(), key)
    return algorithm


def _shapes(key: AlgorithmKey) -> str:
    return ('x {}, W {}, y {}, {}, pad {}, stride {}, dilation {}, '
            'groups {}'.format(key.x_shape, key.w_shape, key.y_shape,
                               key.dtype, key.pad, key.stride, key.dilation,
                               key.groups))
