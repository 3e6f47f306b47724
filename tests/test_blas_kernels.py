"""The forced-kernel pass of CI (tests/blas_kernels.py): it picks kernels
other than the default, and OpenBLAS really runs what it forces."""
import os
import platform

import pytest

from tests import blas_kernels


def test_other_kernels_never_include_the_default():
    assert blas_kernels.other_kernels('Haswell', 'x86_64') == \
        ['Prescott', 'Sandybridge']
    assert blas_kernels.other_kernels('SANDYBRIDGE', 'x86_64') == \
        ['Prescott', 'Nehalem']
    assert blas_kernels.other_kernels('Prescott', 'x86_64') == \
        ['Sandybridge', 'Nehalem']
    with pytest.raises(SystemExit, match='no 2 OpenBLAS kernels'):
        blas_kernels.other_kernels('Haswell', 'riscv64')


@pytest.mark.skipif(platform.machine() not in blas_kernels.KERNELS,
                    reason='no kernels listed for ' + platform.machine())
def test_each_forced_kernel_runs_instead_of_the_default():
    default = blas_kernels.current_kernel()
    for forced in blas_kernels.other_kernels(default):
        env = dict(os.environ, OPENBLAS_CORETYPE=forced)
        assert blas_kernels.current_kernel(env).lower() != default.lower()
