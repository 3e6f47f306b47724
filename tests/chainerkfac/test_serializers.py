"""``chainerkfac.serializers``: ``.npz`` files load with pickle off. A file
whose array was replaced by a pickled object (here one whose unpickling
creates a marker file, as an attacker's would run code) is refused naming
the file and the key, and the marker is never created; a clean file loads
as with Chainer's ``load_npz``."""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import io

import chainer
import numpy
import pytest

from chainerkfac import serializers
from tests.chainerkfac import helpers
from tests.harness.damage import pickled


@pytest.fixture
def weights_file(tmp_path):
    model = helpers.MLP()
    path = str(tmp_path / 'model.npz')
    chainer.serializers.save_npz(path, model)
    return path, model


def test_the_payload_runs_where_pickle_is_on(weights_file, tmp_path):
    """The attack is real: numpy's pickle-on load creates the marker."""
    path, _ = weights_file
    marker = tmp_path / 'ran'
    pickled(path, 'l1/W', marker)
    with numpy.load(path, allow_pickle=True) as data:
        data['l1/W']
    assert marker.exists()


def test_refused_naming_file_and_key_before_anything_is_loaded(
        weights_file, tmp_path):
    path, _ = weights_file
    marker = tmp_path / 'ran'
    pickled(path, 'l2/b', marker)
    model = helpers.MLP()
    before = {n: p.array.copy() for n, p in model.namedparams()}
    with pytest.raises(serializers.PickledArrayError) as info:
        serializers.load_npz(path, model)
    assert not marker.exists()
    assert (info.value.path, info.value.key) == (path, 'l2/b')
    assert path in str(info.value) and "'l2/b'" in str(info.value)
    # Refused before loading: not even the arrays before it in the file.
    for name, param in model.namedparams():
        numpy.testing.assert_array_equal(param.array, before[name])
    with pytest.raises(serializers.PickledArrayError):
        serializers.open_npz(path)
    assert not marker.exists()


def test_refused_from_a_file_object(weights_file, tmp_path):
    path, _ = weights_file
    marker = tmp_path / 'ran'
    pickled(path, 'l1/b', marker)
    with open(path, 'rb') as f:
        with pytest.raises(serializers.PickledArrayError, match="'l1/b'"):
            serializers.load_npz(f, helpers.MLP())
    assert not marker.exists()


def test_clean_file_loads_as_with_chainer(weights_file):
    path, model = weights_file
    mine, chainers = helpers.MLP(sizes=(5, 4, 3)), helpers.MLP()
    for link in (mine, chainers):
        for param in link.params():
            param.array[...] = 0
    serializers.load_npz(path, mine)
    with open(path, 'rb') as f:
        data = io.BytesIO(f.read())
    chainer.serializers.load_npz(data, chainers)
    for (name, a), (_, b) in zip(sorted(mine.namedparams()),
                                 sorted(chainers.namedparams())):
        numpy.testing.assert_array_equal(a.array, b.array, name)
        numpy.testing.assert_array_equal(
            a.array, dict(model.namedparams())[name].array)


def test_optimizer_state_round_trip(tmp_path):
    """K-FAC's state (factors, damping, refresh bookkeeping) saved with
    Chainer's ``save_npz`` loads here: nothing in it needs pickle."""
    model = helpers.MLP()
    optimizer = helpers.kfac(damping_target=1e-3, damping_warmup_steps=5)
    optimizer.setup(model)
    x, t = helpers.data(n=4, shape=(5,), n_class=3)
    optimizer.update(helpers.loss_of(model), x, t)
    path = str(tmp_path / 'optimizer.npz')
    chainer.serializers.save_npz(path, optimizer)
    restored = helpers.kfac(damping_target=1e-3, damping_warmup_steps=5)
    restored.setup(helpers.MLP())
    serializers.load_npz(path, restored)
    assert (restored.t, restored.damping) == (optimizer.t, optimizer.damping)
    for mine, theirs in zip(restored.blocks, optimizer.blocks):
        assert sorted(mine.factors) == sorted(theirs.factors)
        for name in theirs.factors:
            numpy.testing.assert_array_equal(mine.factors[name],
                                             theirs.factors[name])


@pytest.mark.parametrize('how', ['roll back', 'load twice'])
def test_loading_into_an_optimizer_that_holds_factors(tmp_path, how):
    """A snapshot loaded into a K-FAC that already holds factors (rolled
    back after later steps, or the same file loaded twice) trains on as
    one loaded into a fresh optimizer, to the bit. The live factor was
    the target of the file's packed triangle: ``could not broadcast
    input array from shape (66,) into shape (11,11)``, the optimizer left
    half-loaded."""
    x, t = helpers.data(n=4, shape=(5,), n_class=3)

    def run(optimizer, model, steps):
        for _ in range(steps):
            optimizer.update(helpers.loss_of(model), x, t)

    numpy.random.seed(0)
    model = helpers.MLP()
    optimizer = helpers.kfac()
    optimizer.setup(model)
    run(optimizer, model, 5)
    chainer.serializers.save_npz(str(tmp_path / 'o.npz'), optimizer)
    chainer.serializers.save_npz(str(tmp_path / 'm.npz'), model)
    if how == 'roll back':
        run(optimizer, model, 3)
    else:
        chainer.serializers.load_npz(str(tmp_path / 'o.npz'), optimizer)
    chainer.serializers.load_npz(str(tmp_path / 'o.npz'), optimizer)
    chainer.serializers.load_npz(str(tmp_path / 'm.npz'), model)
    assert optimizer.t == 5
    run(optimizer, model, 4)

    numpy.random.seed(1)
    fresh_model = helpers.MLP()
    fresh = helpers.kfac()
    fresh.setup(fresh_model)
    chainer.serializers.load_npz(str(tmp_path / 'o.npz'), fresh)
    chainer.serializers.load_npz(str(tmp_path / 'm.npz'), fresh_model)
    run(fresh, fresh_model, 4)
    for (name, mine), (_, theirs) in zip(
            sorted(model.namedparams()), sorted(fresh_model.namedparams())):
        numpy.testing.assert_array_equal(mine.array, theirs.array,
                                         err_msg=name)


def test_none_values_left_out():
    target = {'a': numpy.zeros(2), 'b': numpy.asarray(None)}
    assert sorted(serializers.without_none(target)) == ['a']


def test_error_survives_pickling():
    """Errors travel between processes (mpi4py pickles them)."""
    import pickle
    error = serializers.PickledArrayError('/x/f.npz', 'k')
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.path, copy.key, str(copy)) == (error.path, error.key,
                                                str(error))


@pytest.mark.parametrize('started', [False, True])
def test_a_snapshot_of_another_model_is_refused_naming_what_differs(
        tmp_path, started):
    """A snapshot of an MLP 5-4-3 loaded into the optimizer of an MLP
    5-6-3: the error named neither layer nor factor ('triu_unpack: 10
    elements do not make the upper triangle of a 6x6 matrix'), and an
    optimizer not yet updated took the file's velocities as they were
    (shape (4, 5) for a (6, 5) weight)."""
    import chainer
    from tests.chainerkfac import helpers
    x, t = helpers.data(n=8, shape=(5,), n_class=3)
    numpy.random.seed(0)
    small = helpers.MLP((5, 4, 3))
    optimizer = helpers.kfac().setup(small)
    for _ in range(2):
        optimizer.update(helpers.loss_of(small), x, t)
    path = str(tmp_path / 'o.npz')
    chainer.serializers.save_npz(path, optimizer)
    wide = helpers.MLP((5, 6, 3))
    other = helpers.kfac().setup(wide)
    if started:
        other.update(helpers.loss_of(wide), x, t)
        expected = (r"K-FAC: the snapshot's velocities do not fit this "
                    r"model's parameters \(could not broadcast input array "
                    r'from shape \(4,5\) into shape \(6,5\)\)')
    else:
        expected = r"K-FAC state of /l1/W: the snapshot's v has shape " \
            r'\(4, 5\), the parameter \(6, 5\)'
    with pytest.raises(ValueError, match=expected):
        chainer.serializers.load_npz(path, other)


def test_a_factor_that_does_not_fit_names_its_block():
    from chainerkfac.fisher_blocks import base
    with pytest.raises(ValueError, match="K-FAC state of /l1: the "
                       r"snapshot's factor A has shape \(10,\), which does "
                       r'not fit this model.s 6x6 \(stored as its upper '
                       'triangle, 21 elements\\)'):
        base._check_loaded('/l1', 'A', numpy.zeros(10), 1, (6, 6))
    base._check_loaded('/l1', 'A', numpy.zeros(21), 1, (6, 6))
    base._check_loaded('/l1', 'A', numpy.zeros((6, 2)), 2, (6, 6))
    with pytest.raises(ValueError, match='a diagonal'):
        base._check_loaded('/bn', 'F', numpy.zeros(3), 1, (4,))


def test_saving_inside_an_accumulation_says_nothing(tmp_path):
    """A snapshot after 1 of 2 micro-batches holds the step so far (it
    warned that the resumed run would take the step again, which under a
    Trainer, whose iterator has gone on, lost the micro-batch):
    nothing is said, at a step's end or inside one."""
    model = helpers.MLP()
    optimizer = helpers.kfac(acc_iters=2).setup(model)
    x, t = helpers.data(n=4, shape=(5,), n_class=3)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        optimizer.update(helpers.loss_of(model), x, t)
        chainer.serializers.save_npz(str(tmp_path / 'mid.npz'), optimizer)
        optimizer.update(helpers.loss_of(model), x, t)
        chainer.serializers.save_npz(str(tmp_path / 'end.npz'), optimizer)
