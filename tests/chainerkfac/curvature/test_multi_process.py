"""Under mpiexec: processes with local batches (of different sizes) give
what one process gives on the global batch — per-sample rows of their own
samples, every sum over samples, the gradient, the Monte-Carlo draws."""
import numpy
import pytest

from chainerkfac import curvature
from tests.chainerkfac.curvature import nets
from tests.chainerkfac.multi_node import common

pytestmark = pytest.mark.mpi


def local_rows(comm):
    """Rank r's rows of the global batch: 1 + r samples, in rank order."""
    sizes = [1 + r for r in range(comm.size)]
    start = sum(sizes[:comm.rank])
    rows = slice(start, start + sizes[comm.rank])
    return sum(sizes), rows


def compare(comm, build, quantities, shape, **options):
    total, rows = local_rows(comm)
    x, t = nets.data(n=total, shape=shape, seed=11)
    reference_model = build()
    reference = curvature.extract(reference_model, x, t,
                                  quantities=quantities, **options)
    model = build()
    got = curvature.extract(model, x[rows], t[rows], quantities=quantities,
                            comm=comm, **options)
    worst = 0.0
    for path, values in reference.items():
        for name, expected in values.items():
            if name in curvature.quantities.PER_SAMPLE:
                expected = expected[rows]
            value = got[path][name]
            worst = max(worst, float(numpy.max(
                numpy.abs(value - expected) /
                (numpy.abs(expected).max() + 1e-300))))
    grads = dict(model.namedparams())
    for path, p in reference_model.namedparams():
        worst = max(worst, float(numpy.max(numpy.abs(
            grads[path].grad - p.grad))))
    common.assert_everywhere(set(got) == set(reference), 'parameters')
    common.assert_everywhere(
        all(set(got[p]) == set(reference[p]) for p in reference), 'names')
    common.assert_everywhere(worst < 1e-10, 'equal to one process '
                             '(worst {:.3g})'.format(worst))


def test_every_quantity_equals_one_process_on_the_global_batch():
    compare(common.naive(), nets.Chain, curvature.QUANTITIES,
            nets.IN_SHAPE, mc_samples=3, seed=5)


def test_per_sample_passes_and_kfc_factors_equal_one_process():
    compare(common.naive(), nets.Unmodelled,
            curvature.FIRST_ORDER + ('diag_ggn', 'diag_ggn_mc', 'kfac'),
            (32,), seed=2)
    compare(common.naive(), nets.Residual, ('kflr', 'variance'),
            nets.IN_SHAPE, conv_factors='kfc')
