"""The stacked inverses of a batch of blocks (stage 5 on the GPU,
:class:`chainerkfac.fisher_blocks.kronecker.InverseStack`) when inverses
are refreshed in place (``commit(..., refill=True)``, the CUDA-graph
replay's way): the stacks keep their arrays and take the new values, also
for a batch its refresh step did not precondition; a new inverse array
makes new stacks. Exact copies: compared bit for bit."""
import types

import numpy

from chainerkfac import low_rank
from chainerkfac.fisher_blocks import kronecker


def _block(rng, n=3, m=2):
    return types.SimpleNamespace(
        inverses={'A': rng.randn(n, n), 'G': rng.randn(m, m)},
        inverse_count={'A': 1, 'G': 1})


def _refresh(block, name, value, refill=True):
    """What FisherBlock.commit does to the inverse and its count."""
    old = block.inverses[name]
    block.inverses[name] = (low_rank.refilled(old, value) if refill
                            else value)
    block.inverse_count[name] += 1


def _expected(blocks):
    return [numpy.stack([b.inverses[n] for b in blocks]) for n in 'AG']


def test_a_refill_reaches_the_same_stacks():
    rng = numpy.random.RandomState(0)
    blocks = [_block(rng) for _ in range(3)]
    stack = kronecker.InverseStack()
    a, g = stack.get(blocks)
    _refresh(blocks[1], 'A', rng.randn(3, 3))
    _refresh(blocks[2], 'G', rng.randn(2, 2))
    again = stack.get(blocks)
    assert again[0] is a and again[1] is g
    for got, want in zip(again, _expected(blocks)):
        numpy.testing.assert_array_equal(got, want)
    assert stack.arrays() == [a, g]


def test_a_batch_not_preconditioned_is_refreshed_on_request():
    """The refresh step had no gradient for this batch: ``refresh()`` (the
    optimizer's ``refresh_inverse_stacks`` after a kept refresh) copies
    the new inverses in; nothing changes where nothing was refreshed."""
    rng = numpy.random.RandomState(1)
    blocks = [_block(rng) for _ in range(2)]
    stack = kronecker.InverseStack()
    a, g = stack.get(blocks)
    before = a.copy(), g.copy()
    stack.refresh()
    numpy.testing.assert_array_equal(a, before[0])
    _refresh(blocks[0], 'G', rng.randn(2, 2))
    stack.refresh()
    numpy.testing.assert_array_equal(g, _expected(blocks)[1])
    numpy.testing.assert_array_equal(a, before[0])
    kronecker.InverseStack().refresh()          # nothing stacked: nothing


def test_a_new_inverse_array_makes_new_stacks():
    rng = numpy.random.RandomState(2)
    blocks = [_block(rng) for _ in range(2)]
    stack = kronecker.InverseStack()
    a, g = stack.get(blocks)
    _refresh(blocks[0], 'A', rng.randn(3, 3), refill=False)
    stack.refresh()                 # left to get(): the member changed
    new = stack.get(blocks)
    assert new[0] is not a
    for got, want in zip(new, _expected(blocks)):
        numpy.testing.assert_array_equal(got, want)
    # another batch (one block fewer) is stacked anew
    fewer = stack.get(blocks[:1])
    assert fewer[0].shape == (1, 3, 3)
