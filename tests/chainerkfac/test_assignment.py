"""Assignment of blocks to processes: LPT balance, redundancy, determinism."""
import itertools

import numpy
import pytest

import chainer
import chainer.links as L

from chainerkfac import fisher_blocks
from chainerkfac.assignment import Assignment


def optimal_makespan(costs, size):
    """Smallest possible heaviest load, by brute force (tiny inputs)."""
    best = float('inf')
    for placement in itertools.product(range(size), repeat=len(costs)):
        loads = [0.0] * size
        for cost, rank in zip(costs, placement):
            loads[rank] += cost
        best = min(best, max(loads))
    return best


@pytest.mark.parametrize('seed', range(30))
def test_lpt_within_the_greedy_bounds(seed):
    rng = numpy.random.RandomState(seed)
    size = int(rng.randint(2, 4))
    costs = list(rng.randint(1, 50, size=int(rng.randint(size, 8))) ** 3)
    assignment = Assignment(costs, size)
    heaviest = max(assignment.loads)
    assert heaviest <= sum(costs) / size + max(costs)
    assert heaviest <= (4.0 / 3 - 1.0 / (3 * size)) * \
        optimal_makespan(costs, size) * (1 + 1e-12)


def test_every_block_owned_once_when_enough_blocks():
    costs = [8.0, 1.0, 27.0, 64.0, 1.0, 125.0]
    assignment = Assignment(costs, 3)
    assert all(len(o) == 1 for o in assignment.owners)
    assert sorted(i for r in range(3) for i in assignment.blocks_of(r)) == \
        list(range(len(costs)))
    assert sum(assignment.loads) == sum(costs)
    assert assignment.redundant == []


def test_lpt_places_heaviest_first_on_least_loaded():
    # 5 → r0, 4 → r1, 3 → r1 (load 4 < 5), 3 → r0.
    assignment = Assignment([3.0, 5.0, 3.0, 4.0], 2)
    assert assignment.owners == ((1,), (0,), (0,), (1,))
    assert assignment.loads == (8.0, 7.0)


def test_fewer_kfac_blocks_than_ranks_gives_redundancy():
    costs = [100.0, 10.0, 1000.0, 2.0]
    curvature = [True, True, True, False]
    assignment = Assignment(costs, 7, names=['a', 'b', 'c', 'plain'],
                            curvature=curvature)
    # Heaviest first, round robin: c → 0,3,6; a → 1,4; b → 2,5.
    assert assignment.owners[:3] == ((1, 4), (2, 5), (0, 3, 6))
    assert all(any(r in assignment.owners[i] for i in range(3))
               for r in range(7))
    assert len(assignment.owners[3]) == 1
    assert sorted(assignment.redundant) == [0, 1, 2]
    assert 'computed redundantly' in assignment.describe()


def test_every_rank_owns_a_kfac_block_whenever_l_lt_p():
    for n_blocks in range(1, 6):
        for size in range(n_blocks + 1, 9):
            costs = list(numpy.arange(1, n_blocks + 1, dtype=float) ** 3)
            assignment = Assignment(costs, size)
            assert all(assignment.blocks_of(r) for r in range(size))
            assert all(o for o in assignment.owners)


def test_one_rank_owns_everything():
    assignment = Assignment([5.0, 0.0, 2.0], 1)
    assert assignment.owners == ((0,), (0,), (0,))


def test_deterministic_with_ties():
    costs = [1.0] * 7 + [8.0] * 3
    first = Assignment(costs, 3)
    assert all(Assignment(costs, 3).owners == first.owners
               for _ in range(5))
    assert first.owners[7:] == ((0,), (1,), (2,))


def test_rejects_bad_input():
    with pytest.raises(ValueError, match='size'):
        Assignment([1.0], 0)
    with pytest.raises(ValueError, match='non-negative'):
        Assignment([-1.0], 2)
    with pytest.raises(ValueError, match='one entry per block'):
        Assignment([1.0, 2.0], 2, names=['a'])


def test_from_blocks_uses_the_cost_model():
    with chainer.using_config('dtype', numpy.float64):
        model = chainer.Sequential(L.Linear(9, 4), L.BatchNormalization(4),
                                   L.PReLU())
    blocks = fisher_blocks.build_blocks(model, fisher_blocks.BlockOptions(
        bn_fisher='full'))
    assignment = Assignment.from_blocks(blocks, 2)
    cost = {type(b).__name__: c for b, c in zip(blocks, assignment.costs)}
    assert cost == {'LinearBlock': 10.0 ** 3 + 4.0 ** 3,
                    'BatchNormalizationBlock': 8.0 ** 3, 'PlainBlock': 1.0}
    # 2 K-FAC blocks on 2 ranks: no redundancy, one on each rank.
    assert assignment.redundant == []
    kfac = [o for b, o in zip(blocks, assignment.owners) if b.factor_names]
    assert sorted(kfac) == [(0,), (1,)]


def test_describe_lists_every_rank_with_its_share():
    assignment = Assignment([3.0, 1.0], 3, names=['/big', '/small'])
    text = assignment.describe()
    for rank in range(3):
        assert 'rank {}:'.format(rank) in text
    assert '/big on ranks 0,2' in text
    assert '75.0% of cost' in text and '25.0% of cost' in text
