"""What every GPU test shares: its marks, the device, host <-> device.

Every GPU test module sets ``pytestmark = support.MARKS``: Chainer's ``gpu``
marker (``pytest -m gpu`` selects the GPU tests, ``make test-gpu`` runs
them) and a skip, with the reason, where CuPy or a CUDA device is missing,
so that ``make test`` on a CPU machine collects them and counts them as
skipped.
"""
from typing import Optional

import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)
import numpy
import pytest

import chainer


def _why_no_gpu() -> Optional[str]:
    try:
        import cupy
    except Exception as error:  # not installed, or a broken install
        return 'CuPy cannot be imported ({}: {})'.format(
            type(error).__name__, error)
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # no driver, no device
        return 'no CUDA device ({}: {})'.format(type(error).__name__, error)
    if count < 1:
        return 'no CUDA device'
    if not chainer.backends.cuda.available:
        return 'Chainer does not see CuPy (chainer.backends.cuda.available)'
    return None


#: Why the GPU tests are skipped here, or None.
SKIP_REASON = _why_no_gpu()

#: The marks of every GPU test module (``pytestmark = support.MARKS``).
MARKS = [pytest.mark.gpu,
         pytest.mark.skipif(SKIP_REASON is not None,
                            reason='GPU test: {}'.format(SKIP_REASON))]


def cupy_or_skip():
    """CuPy, or skip the calling test with the reason (for test modules
    that also hold CPU tests and cannot use :data:`MARKS`)."""
    if SKIP_REASON is not None:
        pytest.skip('GPU test: {}'.format(SKIP_REASON))
    import cupy
    return cupy


def device():
    """Device 0: every rank of an mpiexec job shares it."""
    return chainer.get_device('@cupy:0')


def to_gpu(*arrays):
    target = device()
    target.use()
    sent = tuple(target.send(a) for a in arrays)
    return sent if len(sent) > 1 else sent[0]


def to_cpu(array):
    return chainer.backend.CpuDevice().send(array)


def is_cupy(array) -> bool:
    return type(array).__module__.startswith('cupy')


def weights(model):
    """Parameter values on the host, by name."""
    return {name: numpy.array(to_cpu(param.array))
            for name, param in sorted(model.namedparams())}


def max_relative_diff(a, b) -> float:
    """max |a − b| / (1 + |b|) over every parameter (b the reference)."""
    return max(float(numpy.max(numpy.abs(a[k] - b[k]) /
                               (1.0 + numpy.abs(b[k])))) for k in a)
