"""One BLAS thread for the stock-architecture tests.

On a shared machine with few cores, OpenBLAS's threads spin against each
other and against other processes: NiN's six K-FAC steps took 143 s with
two threads on the 2-core CI machine under load, 12 s with one (the
analysis tests do the same for the same reason)."""
import pytest


@pytest.fixture(autouse=True)
def one_blas_thread():
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:      # scikit-learn brings it; without, as is
        yield
        return
    with threadpool_limits(limits=1, user_api='blas'):
        yield
