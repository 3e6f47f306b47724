"""Weight-update sharding without MPI: who owns what, and the two
collective steps against a stand-in world whose other ranks' inputs are
given up front (the packing is the real one, :mod:`chainerkfac.packing`).
"""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import numpy
import pytest

import chainer

from chainerkfac import packing, sharding
from chainerkfac.sharding import ParameterOwners
from tests.chainerkfac import helpers


class StandInWorld:
    """The collectives of ``rank`` among ``len(inputs)`` ranks: rank ``r``
    passes ``inputs[r]`` (this rank what it is given). Records the wire
    dtypes used."""

    def __init__(self, rank, inputs, wire_dtype='float16'):
        self.rank = rank
        self.inputs = inputs
        self.size = len(inputs)
        self.wire_dtype = numpy.dtype(wire_dtype)
        self.wires = []

    def _layout(self, arrays, owners, wire_dtype):
        wire = self.wire_dtype if wire_dtype is None else \
            numpy.dtype(wire_dtype)
        self.wires.append(wire)
        return packing.Layout([a.shape for a in arrays],
                              [a.dtype for a in arrays], owners,
                              [False] * len(arrays), self.size, wire)

    def _of(self, r, arrays):
        return arrays if r == self.rank else self.inputs[r]

    def reduce_scatter_v(self, arrays, owners, symmetric=None,
                         wire_dtype=None):
        layout = self._layout(arrays, owners, wire_dtype)
        total = sum(layout.pack_reduce_scatter(self._of(r, arrays))
                    for r in range(self.size))
        start = layout.reduce_scatter_offsets[self.rank]
        count = layout.reduce_scatter_counts[self.rank]
        return layout.unpack_reduce_scatter(total[start:start + count],
                                            self.rank)

    def all_gather_v(self, arrays, owners, symmetric=None, wire_dtype=None):
        layout = self._layout(arrays, owners, wire_dtype)
        buffer = numpy.concatenate([
            layout.pack_all_gather(self._of(r, arrays), r)
            for r in range(self.size)])
        return layout.unpack_all_gather(buffer)


# -- ownership ---------------------------------------------------------------
@pytest.mark.parametrize('size', [1, 2, 3, 4, 7])
def test_balanced_owners_give_every_parameter_one_owner(size):
    rng = numpy.random.RandomState(size)
    sizes = list(rng.randint(1, 1000, size=13))
    owners = ParameterOwners.balanced(sizes, size)
    assert len(owners.owners) == 13
    assert sorted(i for r in range(size) for i in owners.params_of(r)) == \
        list(range(13))
    assert sum(owners.loads) == sum(sizes)
    # Longest processing time first: within the mean plus the largest.
    assert max(owners.loads) <= sum(sizes) / size + max(sizes)
    assert owners.owners == ParameterOwners.balanced(sizes, size).owners
    assert all(owners.owns(owners.owners[i], i) for i in range(13))
    assert 'rank {}'.format(size - 1) in owners.describe()


def test_block_owners_are_the_first_owners_of_the_blocks():
    owners = ParameterOwners.of_blocks([(2,), (0, 1), (1,)],
                                       [[6, 2], [4], [3, 1]], 3)
    assert owners.owners == (2, 2, 0, 1, 1)
    assert owners.loads == (4, 4, 8)


def test_bad_owners_are_refused():
    with pytest.raises(ValueError, match='outside'):
        ParameterOwners([0, 3], 3)
    with pytest.raises(ValueError, match='size'):
        ParameterOwners([], 0)
    with pytest.raises(ValueError, match='one entry per'):
        ParameterOwners([0, 1], 2, sizes=[1])


# -- the collective steps ----------------------------------------------------
def _arrays(seed, dtype=numpy.float64):
    rng = numpy.random.RandomState(seed)
    return [rng.randn(3, 2).astype(dtype), rng.randn(4).astype(dtype),
            rng.randn(2, 2, 2).astype(dtype)]


@pytest.mark.parametrize('rank', [0, 1, 2])
def test_reduce_scatter_mean_leaves_the_mean_on_the_owner(rank):
    inputs = [_arrays(r) for r in range(3)]
    owners = [2, 0, 1]
    world = StandInWorld(rank, inputs)
    out = sharding.reduce_scatter_mean(world, _arrays(rank), owners, 3)
    for i, owner in enumerate(owners):
        if owner == rank:
            mean = sum(inputs[r][i] for r in range(3)) / 3
            numpy.testing.assert_allclose(out[i], mean, rtol=1e-15)
        else:
            assert out[i] is None
    # Summed at the gradients' dtype, not the communicator's float16.
    assert world.wires == [numpy.dtype(numpy.float64)]


@pytest.mark.parametrize('rank', [0, 1, 2])
def test_all_gather_weights_writes_the_owners_weights_in_place(rank):
    inputs = [_arrays(10 + r, numpy.float32) for r in range(3)]
    owners = [1, (2, 0), 0]
    world = StandInWorld(rank, inputs)
    params = [chainer.Parameter(a.copy()) for a in inputs[rank]]
    arrays = [p.array for p in params]
    sharding.all_gather_weights(world, params, owners, rank)
    for i, owner in enumerate(owners):
        sender = owner if isinstance(owner, int) else owner[0]
        # Bit for bit: float32 weights on a float16 wire travel as float32.
        numpy.testing.assert_array_equal(params[i].array, inputs[sender][i])
        assert params[i].array is arrays[i]
    assert world.wires == [numpy.dtype(numpy.float32)]


# -- optimizer state ---------------------------------------------------------
def test_drop_unowned_state_and_its_bytes():
    numpy.random.seed(0)
    model = helpers.MLP()
    optimizer = chainer.optimizers.MomentumSGD(lr=0.1).setup(model)
    optimizer.update(helpers.loss_of(model),
                     *helpers.data(shape=(5,), n_class=3))
    params = [p for _, p in sorted(model.namedparams())]
    total = sharding.state_nbytes(params)
    assert total == sum(p.array.nbytes for p in params)
    owned = [i % 2 == 0 for i in range(len(params))]
    assert sharding.drop_unowned_state(params, owned) == owned.count(False)
    assert sharding.state_nbytes(params) == sum(
        p.array.nbytes for p, mine in zip(params, owned) if mine)
    assert all((p.update_rule.state is None) != mine
               for p, mine in zip(params, owned))
    # A dropped state is created again at the parameter's next update.
    optimizer.update(helpers.loss_of(model),
                     *helpers.data(shape=(5,), n_class=3))
    assert sharding.state_nbytes(params) == total


def test_an_owned_parameter_without_its_state_is_reported(caplog):
    numpy.random.seed(0)
    model = helpers.MLP()
    optimizer = chainer.optimizers.MomentumSGD(lr=0.1).setup(model)
    optimizer.update(helpers.loss_of(model),
                     *helpers.data(shape=(5,), n_class=3))
    params = [p for _, p in sorted(model.namedparams())]
    sharding.drop_state(params[0].update_rule)
    with caplog.at_level('WARNING', logger='chainerkfac.sharding'):
        sharding.drop_unowned_state(params, [True] * len(params))
    assert 'restarts from zero' in caplog.text
