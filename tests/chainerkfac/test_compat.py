"""chainerkfac._compat: each patch is applied iff this interpreter needs it,
and Chainer / ChainerMN work after it (run in both CI legs: NumPy 1.x on
Python 3.11 by ``make test``, NumPy 2 on Python 3.12 by ``make test-numpy2``).
"""
import os
import subprocess
import sys

import numpy
import pytest

from chainerkfac import _compat

import chainer  # NOQA  (after chainerkfac, as the compat rule says)
import chainer.functions as F
import chainer.links as L

NUMPY2 = numpy.lib.NumpyVersion(numpy.__version__) >= '2.0.0'
REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))

# What NumPy's and Python's release notes say each patch is for; the module
# itself probes features instead, and these tests check both agree.
EXPECTED = {
    'numpy_sctypes': NUMPY2,
    # NumPy 2.0-2.4 still ship numpy.distutils for Python < 3.12.
    'numpy_distutils': sys.version_info >= (3, 12),
    'numpy_float': numpy.lib.NumpyVersion(numpy.__version__) >= '1.24.0',
    'chainermn_unpack_params': NUMPY2,
}


def _python(code):
    """Run ``code`` in a fresh interpreter from the repository root."""
    return subprocess.run(
        [sys.executable, '-c', code], cwd=REPO, capture_output=True,
        text=True, timeout=120)


@pytest.mark.parametrize('name', sorted(EXPECTED))
def test_patch_applied_iff_needed(name):
    assert (name in _compat.APPLIED) == EXPECTED[name]


def test_nothing_else_is_patched():
    assert set(_compat.APPLIED) <= set(EXPECTED)
    assert [name for name, _, _ in _compat.PATCHES] == list(EXPECTED)


def test_apply_is_idempotent():
    before = list(_compat.APPLIED)
    hooks = [f for f in sys.meta_path if isinstance(f, _compat._AfterImport)]
    assert _compat.apply() == []
    assert _compat.APPLIED == before
    assert [f for f in sys.meta_path
            if isinstance(f, _compat._AfterImport)] == hooks


def test_numpy_1_on_python_311_is_left_alone():
    if NUMPY2 or sys.version_info >= (3, 12):
        pytest.skip('only on the NumPy 1.x / Python 3.11 leg')
    # Only np.float, which NumPy 1.24 removed, is needed on the CPU pin.
    assert _compat.APPLIED == ['numpy_float']
    assert hasattr(sys.modules['numpy.distutils'], '__path__')  # the real one
    from chainermn.communicators import _memory_utility
    assert _memory_utility.unpack_params is not _compat._unpack_params


def test_sctypes_table_matches_numpy_1():
    assert [t().itemsize for t in numpy.sctypes['int']] == [1, 2, 4, 8]
    assert numpy.float32 in numpy.sctypes['float']
    assert numpy.float64 in numpy.sctypes['float']


# Asked for BLAS, NumPy 1's distutils warns that it finds no vendor BLAS.
@pytest.mark.filterwarnings('ignore::UserWarning')
def test_distutils_system_info_is_importable():
    import numpy.distutils.system_info
    info = numpy.distutils.system_info.get_info('blas_opt')
    assert isinstance(info, dict)
    if 'numpy_distutils' in _compat.APPLIED:
        assert info == {}
        with pytest.raises(ImportError):
            import numpy.distutils.misc_util  # NOQA


@pytest.mark.parametrize('error', [AttributeError, DeprecationWarning])
def test_a_distutils_that_fails_as_it_imports_needs_the_patch(
        monkeypatch, error):
    """NumPy 2 on Python 3.11 still has numpy.distutils, whose import
    warns (DeprecationWarning) and reads the removed ``np.sctypes``: under
    ``python -W error::DeprecationWarning`` the probe let it through and
    ``import chainerkfac`` failed. Any failure of that import means the
    patch is needed; its warnings are not the caller's."""
    import importlib.abc
    import importlib.util
    import warnings

    class Failing(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path=None, target=None):
            if name == 'numpy.distutils.system_info':
                return importlib.util.spec_from_loader(name, self)
            return None

        def create_module(self, spec):
            return None

        def exec_module(self, module):
            if error is DeprecationWarning:
                warnings.warn('numpy.distutils is deprecated', error)
            raise AttributeError('np.sctypes was removed in NumPy 2.0')

    monkeypatch.delitem(sys.modules, 'numpy.distutils.system_info',
                        raising=False)
    monkeypatch.setattr(sys, 'meta_path', [Failing()] + sys.meta_path)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert _compat.needs_numpy_distutils()


def test_numpy_float_is_the_old_alias():
    assert numpy.float is float
    assert numpy.dtype(numpy.float) == numpy.float64


def test_resize_images():
    x = numpy.arange(2 * 3 * 4 * 5, dtype=numpy.float32).reshape(2, 3, 4, 5)
    y = chainer.Variable(x)
    out = F.resize_images(y, (8, 10))
    assert out.shape == (2, 3, 8, 10) and out.dtype == numpy.float32
    numpy.testing.assert_allclose(out.array[:, :, 0, 0], x[:, :, 0, 0])
    numpy.testing.assert_allclose(out.array[:, :, -1, -1], x[:, :, -1, -1])
    F.sum(out).backward()
    assert y.grad.shape == x.shape
    half = F.resize_images(x, (2, 2), align_corners=False)
    assert half.shape == (2, 3, 2, 2)


def test_as_strided_backward():
    x = chainer.Variable(numpy.arange(12, dtype=numpy.float32))
    # Overlapping windows y[i, j] = x[i + j] (strides in elements): the
    # backward reads np.sctypes['float'].
    y = F.as_strided(x, (3, 4), (1, 1))
    F.sum(y).backward()
    numpy.testing.assert_array_equal(
        x.grad, [1, 2, 3, 3, 2, 1, 0, 0, 0, 0, 0, 0])


class _HostBuffer:
    """The ``to_device`` half of ChainerMN's buffer API on host memory."""

    def __init__(self, data):
        self.data = numpy.ascontiguousarray(data).view(numpy.uint8).ravel()

    def to_device(self, array, size, offset, stream=None):
        array.reshape(-1).view(numpy.uint8)[:] = \
            self.data[offset:offset + size]


def test_unpack_params_casts_from_the_transfer_dtype():
    from chainermn.communicators import _memory_utility
    assert (_memory_utility.unpack_params is _compat._unpack_params) == \
        ('chainermn_unpack_params' in _compat.APPLIED)
    params = [chainer.Parameter(numpy.zeros((2, 2), numpy.float32)),
              chainer.Parameter(numpy.zeros(3, numpy.float32))]
    for param in params:
        param.grad = numpy.full(param.shape, -1, numpy.float32)
    wire = numpy.arange(1, 8, dtype=numpy.float16)
    _memory_utility.unpack_params(
        params, 'grad', _HostBuffer(wire), numpy.float16, zero_fill=False)
    numpy.testing.assert_array_equal(params[0].grad, [[1, 2], [3, 4]])
    numpy.testing.assert_array_equal(params[1].grad, [5, 6, 7])
    assert params[0].grad.dtype == numpy.float32


def test_unpack_params_is_patched_when_chainermn_is_imported_later():
    if 'chainermn_unpack_params' not in _compat.APPLIED:
        pytest.skip('NumPy 1.x: copy=False still casts')
    result = _python(
        'import sys\n'
        'import chainerkfac._compat as c\n'
        'assert "chainermn" not in sys.modules\n'
        'from chainermn.communicators import _memory_utility as m\n'
        'assert m.unpack_params is c._unpack_params\n'
        'hooks = [f for f in sys.meta_path if isinstance(f, c._AfterImport)]\n'
        'assert hooks == []\n'
        'import inspect; inspect.getsource(m)\n')
    assert result.returncode == 0, result.stderr


def test_import_order_rule():
    # Without chainerkfac first, ``import chainer`` fails loudly exactly when
    # an import-time patch is needed; with it, it always works.
    bare = _python('import chainer')
    needed = bool({'numpy_sctypes', 'numpy_distutils'} & set(_compat.APPLIED))
    assert (bare.returncode != 0) == needed, bare.stderr
    ordered = _python('import chainerkfac, chainer, chainer.functions')
    assert ordered.returncode == 0, ordered.stderr


class _ConvBNLinear(chainer.Chain):

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.conv = L.Convolution2D(3, 4, 3, pad=1)
            self.bn = L.BatchNormalization(4)
            self.fc = L.Linear(4 * 4 * 4, 5)

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x)))
        return self.fc(F.max_pooling_2d(h, 2))


def _data():
    rng = numpy.random.RandomState(0)
    x = rng.randn(8, 3, 8, 8).astype(numpy.float32)
    t = (numpy.arange(8) % 5).astype(numpy.int32)
    return x, t


def test_smoke_train_update_and_npz_round_trip(tmp_path):
    x, t = _data()
    model = L.Classifier(_ConvBNLinear())
    optimizer = chainer.optimizers.MomentumSGD(lr=0.1, momentum=0.9)
    optimizer.setup(model)
    losses = []
    for _ in range(5):
        optimizer.update(model, x, t)
        losses.append(float(model.loss.array))
    assert losses[-1] < losses[0]
    for name, param in model.namedparams():
        assert param.dtype == param.grad.dtype == numpy.float32, name
    assert model.predictor.bn.avg_mean.dtype == numpy.float32

    chainer.serializers.save_npz(str(tmp_path / 'model.npz'), model)
    chainer.serializers.save_npz(str(tmp_path / 'opt.npz'), optimizer)
    restored = L.Classifier(_ConvBNLinear())
    restored_opt = chainer.optimizers.MomentumSGD(lr=0.1, momentum=0.9)
    restored_opt.setup(restored)
    chainer.serializers.load_npz(str(tmp_path / 'model.npz'), restored)
    chainer.serializers.load_npz(str(tmp_path / 'opt.npz'), restored_opt)
    for (name, a), (_, b) in zip(sorted(model.namedparams()),
                                 sorted(restored.namedparams())):
        numpy.testing.assert_array_equal(a.array, b.array, err_msg=name)
    numpy.testing.assert_array_equal(model.predictor.bn.avg_var,
                                     restored.predictor.bn.avg_var)
    assert restored_opt.t == optimizer.t == 5
    # The restored pair continues exactly as the original.
    optimizer.update(model, x, t)
    restored_opt.update(restored, x, t)
    numpy.testing.assert_array_equal(model.predictor.fc.W.array,
                                     restored.predictor.fc.W.array)


def test_smoke_trainer_with_naive_communicator(tmp_path):
    import chainermn
    from chainer import training
    from chainer.training import extensions

    comm = chainermn.create_communicator('naive')
    x, t = _data()
    model = L.Classifier(_ConvBNLinear())
    comm.bcast_data(model)
    optimizer = chainermn.create_multi_node_optimizer(
        chainer.optimizers.MomentumSGD(lr=0.05), comm)
    optimizer.setup(model)
    dataset = chainermn.scatter_dataset(
        chainer.datasets.TupleDataset(x, t), comm, shuffle=True, seed=0)
    train_iter = chainer.iterators.SerialIterator(dataset, 4)
    val_iter = chainer.iterators.SerialIterator(
        dataset, 4, repeat=False, shuffle=False)
    updater = training.updaters.StandardUpdater(train_iter, optimizer)
    trainer = training.Trainer(updater, (2, 'epoch'), out=str(tmp_path))
    trainer.extend(chainermn.create_multi_node_evaluator(
        extensions.Evaluator(val_iter, model), comm))
    trainer.extend(extensions.LogReport())
    trainer.extend(extensions.ExponentialShift('lr', 0.5))
    trainer.extend(extensions.snapshot(), trigger=(1, 'epoch'))
    trainer.run()
    log = trainer.get_extension('LogReport').log
    assert [entry['epoch'] for entry in log] == [1, 2]
    assert numpy.isfinite(log[-1]['validation/main/loss'])
    assert optimizer.lr == pytest.approx(0.05 * 0.5 ** 4)
    resumed = training.Trainer(
        training.updaters.StandardUpdater(
            chainer.iterators.SerialIterator(dataset, 4), optimizer),
        (3, 'epoch'), out=str(tmp_path))
    chainer.serializers.load_npz(str(tmp_path / 'snapshot_iter_4'), resumed)
    assert resumed.updater.iteration == 4


def test_chainer_imported_first_on_numpy_2_is_named():
    """On NumPy 2 ``import chainer`` before chainerkfac fails inside
    Chainer and leaves parts of it loaded, after which ``import
    chainerkfac`` failed with a circular-import error naming neither:
    now an ImportError says what happened and what to do. (NumPy 2 is
    emulated by removing ``numpy.sctypes``; the leftovers of the failed
    import by a stand-in module.)"""
    code = '\n'.join([
        'import sys, types',
        'import numpy',
        "if hasattr(numpy, 'sctypes'):",
        '    del numpy.sctypes',
        "sys.modules['chainer.function_node'] = types.ModuleType('x')",
        'try:',
        '    import chainerkfac._compat',
        'except ImportError as error:',
        "    print('ImportError:', error)"])
    out = _python(code)
    assert 'ImportError: chainer was imported before chainerkfac' in \
        out.stdout, out.stdout + out.stderr
    assert 'import chainerkfac` before `import chainer`' in out.stdout
    assert 'chainer.function_node' in out.stdout


def test_importing_the_stack_warns_nothing():
    """``import chainerkfac, chainer`` with UserWarnings as errors: setuptools
    80.9 and later warn at every import of ``pkg_resources`` (Chainer's),
    once a process, a UserWarning under mpiexec on every rank; the
    constraints hold it below 80.9 (on the NumPy-2 leg's fresh venv
    too)."""
    out = _python('import warnings\n'
                  "warnings.simplefilter('error', UserWarning)\n"
                  'import chainerkfac, chainer\n'
                  "print('imported')")
    assert out.stdout.strip() == 'imported', out.stdout + out.stderr
