"""How K-FAC finds its communicator, without the caller's frame
(:mod:`chainerkfac.process_group`), in one process: ChainerMN's wrapper is
found by identity (its class or a subclass, holding this very optimizer),
however its ``update`` reaches K-FAC; a process group of several
processes without a communicator is refused (a stand-in mpi4py world of
2; the real one is ``multi_node/test_process_group.py``)."""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import sys
import types

import chainermn
import numpy
import pytest

from chainerkfac import process_group
from tests.chainerkfac import helpers


class Communicator:
    """Only held by the wrapper here."""


def test_chainermn_wrapper_found_by_identity_not_by_name():
    kfac = helpers.kfac()
    comm = Communicator()
    wrapper = chainermn.create_multi_node_optimizer(kfac, comm)
    assert process_group.chainermn_wrapper(kfac) is wrapper
    # Another K-FAC is held by no wrapper.
    assert process_group.chainermn_wrapper(helpers.kfac()) is None


def test_subclass_and_materialised_attribute_dictionary():
    class Clipping(chainermn.optimizers._MultiNodeOptimizer):
        pass

    kfac = helpers.kfac()
    wrapper = Clipping(kfac, Communicator(), zero_fill=True)
    vars(wrapper)          # the instance dict is a real dict from now on
    assert process_group.chainermn_wrapper(kfac) is wrapper


def test_double_buffering_wrapper_refused():
    kfac = helpers.kfac()
    # Its constructor makes a CUDA stream: set its two attributes only.
    wrapper = object.__new__(chainermn.optimizers._DoubleBufferingOptimizer)
    object.__setattr__(wrapper, 'actual_optimizer', kfac)
    object.__setattr__(wrapper, 'communicator', Communicator())
    with pytest.raises(ValueError, match='double_buffering=False'):
        process_group.chainermn_wrapper(kfac)


def test_two_wrappers_of_different_communicators_refused():
    kfac = helpers.kfac()
    first = chainermn.create_multi_node_optimizer(kfac, Communicator())
    second = chainermn.create_multi_node_optimizer(kfac, Communicator())
    with pytest.raises(ValueError, match='2 ChainerMN multi-node wrappers'):
        process_group.chainermn_wrapper(kfac)
    del first, second


@pytest.fixture
def world_of_two(monkeypatch):
    fake = types.SimpleNamespace(
        Is_initialized=lambda: True, Is_finalized=lambda: False,
        COMM_WORLD=types.SimpleNamespace(Get_size=lambda: 2))
    monkeypatch.setitem(sys.modules, 'mpi4py.MPI', fake)
    assert process_group.world_size() == 2


def _step(optimizer, model):
    x, t = helpers.data(n=4, shape=(5,), n_class=3)
    optimizer.setup(model)
    optimizer.update(helpers.loss_of(model), x, t)


def test_plain_kfac_in_a_process_group_raises_naming_the_ways(world_of_two):
    model = helpers.MLP()
    before = {n: p.array.copy() for n, p in model.namedparams()}
    with pytest.raises(RuntimeError) as info:
        _step(helpers.kfac(), model)
    message = str(info.value)
    for name in ('2 processes', 'chainerkfac.create_multi_node_optimizer',
                 'chainermn.create_multi_node_optimizer',
                 'process_local=True'):
        assert name in message
    for name, param in model.namedparams():      # nothing was updated
        numpy.testing.assert_array_equal(param.array, before[name])


def test_process_local_keeps_local_factors_on_purpose(world_of_two):
    optimizer = helpers.kfac(process_local=True)
    _step(optimizer, helpers.MLP())
    assert optimizer.t == 1 and optimizer.transport.size == 1
    with pytest.raises(ValueError, match='process_local=True'):
        chainerkfac.create_multi_node_optimizer(
            helpers.kfac(process_local=True), Communicator())


def test_one_process_world_needs_nothing():
    optimizer = helpers.kfac()
    _step(optimizer, helpers.MLP())
    assert optimizer.t == 1


def test_no_import_circle():
    """The optimizer module does not import the multi-node one (which
    imports it)."""
    import chainerkfac.optimizers.kfac as kfac_module
    source = open(kfac_module.__file__).read()
    assert 'multi_node_optimizer' not in source
    assert '_getframe' not in source and 'f_locals' not in source
