"""The correctness test of distributed K-FAC: N processes with local batch b
take the same steps as one process with ``acc_iters = N`` fed the same N
chunks in rank order (Algorithm 1 against the single-process optimizer)."""
import numpy
import pytest

from tests.chainerkfac.multi_node import common

pytestmark = pytest.mark.mpi

STALE = dict(refresh_interval_a=2, refresh_interval_g=1,
             refresh_interval_f=3)
STEPS = 5


def _compare(comm, steps, acc_iters=1, tolerance=1e-9,
             net=common.ConvBNNet, **options):
    model, optimizer = common.distributed(comm, acc_iters=acc_iters,
                                          net=net, **options)
    ref_model, ref_optimizer = common.single(
        acc_iters=acc_iters * comm.size, net=net, **options)
    initial = common.params(ref_model)
    common.train_distributed(model, optimizer, comm, steps)
    common.train_single(ref_model, ref_optimizer, comm.size * acc_iters,
                        steps)
    mine, ref = common.params(model), common.params(ref_model)
    diff = common.max_relative_diff(mine, ref)
    moved = common.max_relative_diff(ref, initial)
    diffs = common.gathered(diff)
    assert max(diffs) < tolerance, 'rank-wise max relative diff {}'.format(
        diffs)
    # The test means something only if the weights moved.
    common.assert_everywhere(moved > 1e-2, 'weights moved')
    common.assert_everywhere(optimizer.t == ref_optimizer.t == steps,
                             'step count')
    return optimizer, ref_optimizer


@pytest.mark.parametrize('bn_fisher', ['full', 'diag'])
@pytest.mark.parametrize('stale', [False, True], ids=['fresh', 'stale'])
def test_n_ranks_equal_one_process_accumulating_n_chunks(bn_fisher, stale):
    comm = common.naive('float64')
    options = STALE if stale else {}
    optimizer, ref = _compare(comm, STEPS, bn_fisher=bn_fisher, **options)
    # Stale steps really skipped refreshes, identically in both runs.
    common.assert_everywhere(optimizer.last_refresh == ref.last_refresh,
                             'refresh bookkeeping')
    if stale:
        common.assert_everywhere(optimizer.last_refresh['F'] == 3,
                                 'F refreshed at step 3 last')


def test_accumulation_on_every_rank():
    """acc_iters=2 on N ranks equals acc_iters=2N on one process."""
    comm = common.naive('float64')
    _compare(comm, 4, acc_iters=2, **STALE)


def test_fewer_layers_than_ranks_computed_redundantly():
    comm = common.naive('float64')
    optimizer, _ = _compare(comm, 4, net=common.SmallMLP, **STALE)
    assignment = optimizer.transport.assignment
    common.assert_everywhere(
        bool(assignment.redundant) == (comm.size > 2) and
        all(assignment.blocks_of(r) for r in range(comm.size)),
        'redundant owners: {}'.format(assignment.owners))


def test_float32_wire():
    """The default wire (fp32) rounds sums; the steps still agree closely."""
    comm = common.naive('float32')
    _compare(comm, 3, tolerance=1e-4)


def test_every_rank_ends_with_identical_weights():
    comm = common.naive('float32')
    model, optimizer = common.distributed(comm, **STALE)
    common.train_distributed(model, optimizer, comm, 3)
    flat = numpy.concatenate([a.ravel() for a in
                              common.params(model).values()])
    everyone = common.gathered(flat)
    common.assert_everywhere(all(numpy.array_equal(everyone[0], f)
                                 for f in everyone), 'identical weights')


def test_setup_after_create_or_before_and_first_step_not_skipped():
    comm = common.naive('float64')
    model = common.ConvBNNet(seed=comm.rank)
    kfac = common.helpers.kfac(**common.kfac_options())
    kfac.setup(model)  # set up first, then made distributed
    optimizer = common.create_multi_node_optimizer(kfac, comm)
    assert optimizer is kfac
    ref_model, ref_optimizer = common.single(acc_iters=comm.size)
    common.train_distributed(model, optimizer, comm, 1)
    common.train_single(ref_model, ref_optimizer, comm.size, 1)
    diff = common.max_relative_diff(common.params(model),
                                    common.params(ref_model))
    common.assert_everywhere(optimizer.t == 1 and diff < 1e-9,
                             'first step taken from rank 0 weights')


def test_a_rank_with_an_empty_micro_batch_adds_nothing():
    """At step 1 the last rank's micro-batch is empty (its share of an
    epoch's end): the step equals one process's on the other ranks'
    samples (it counted in the gradient's average: the step was
    (N-1)/N of that, 0.778 at N = 2 with the stranger's batches)."""
    import chainer.functions as F
    import numpy
    comm = common.naive()

    def loss_of(model):
        def loss(x, t):
            per = -F.select_item(F.log_softmax(model(x)), t)
            return F.sum(per) / max(len(t), 1)
        return loss
    model, optimizer = common.distributed(comm, net=common.SmallMLP,
                                          momentum=0.0)
    ref_model, ref_optimizer = common.single(net=common.SmallMLP,
                                             momentum=0.0)
    for step in range(3):
        batch = common.chunks(step, comm.size, 0, model.in_shape)
        empty = comm.size - 1 if step == 1 else None
        x, t = batch[comm.rank]
        if comm.rank == empty:
            x, t = x[:0], t[:0]
        optimizer.update(loss_of(model), x, t)
        # (on one process the whole step is empty: so is the reference's)
        kept = [b for r, b in enumerate(batch) if r != empty] or [
            (batch[0][0][:0], batch[0][1][:0])]
        ref_optimizer.update(loss_of(ref_model),
                             numpy.concatenate([b[0] for b in kept]),
                             numpy.concatenate([b[1] for b in kept]))
    diffs = common.gathered(common.max_relative_diff(
        common.params(model), common.params(ref_model)))
    assert max(diffs) < 1e-12, diffs
