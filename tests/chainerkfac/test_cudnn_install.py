"""When chainerkfac.cudnn installs itself as CuPy's cuDNN modules, what
describe() says, and that the installed modules answer every name the
installed Chainer looks up in them (served, or refused with the way out)."""
import os
import re
import types

import pytest

import chainer

from chainerkfac.cudnn import describe
from chainerkfac.cudnn import installer as installer
from chainerkfac.cudnn import highlevel
from chainerkfac.cudnn import lowlevel
from chainerkfac.cudnn import not_served
from chainerkfac.cudnn import runtime
from tests.chainerkfac.cudnn_fake import FakeCudnn

ON = {'CHAINERKFAC_CUDNN': '1'}


def fake_cupy(version='14.2.0', cuda=13000):
    def runtime_version():
        if cuda is None:
            raise RuntimeError('no CUDA runtime')
        return cuda
    cupy = types.ModuleType('cupy')
    cupy.__version__ = version
    cupy.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(
        runtimeGetVersion=runtime_version))
    return cupy


@pytest.fixture
def clean():
    """Install's and the runtime's state are restored after the test."""
    status = installer._status
    previous = runtime.activate(None)
    yield
    installer._status = status
    runtime.activate(previous)


def _install(environ, modules=None, cupy=None, fake=None, load_error=None):
    modules = {} if modules is None else modules

    def load():
        if load_error:
            raise OSError(load_error)
        return (fake or FakeCudnn()).library()

    def import_cupy():
        if cupy is None:
            raise ImportError("No module named 'cupy'")
        return cupy
    return installer.install(environ, modules, import_cupy, load), \
        modules


@pytest.mark.parametrize('environ, why', [
    ({'CHAINERKFAC_CUDNN': '0'}, "CHAINERKFAC_CUDNN='0': off"),
    ({'CHAINERKFAC_CUDNN': 'yes'}, 'neither 0 nor 1'),
])
def test_off_when_told(clean, environ, why, monkeypatch):
    monkeypatch.setattr(chainer.backends.cuda, 'available', True)
    installed, modules = _install(environ, cupy=fake_cupy())
    assert not installed and not modules
    assert describe() == ("none, Chainer's own path (convolutions as "
                          'im2col + cuBLAS, batch normalization and pooling '
                          'as CuPy kernels) serves Chainer: ' +
                          installer._status.reason)
    assert why in describe()


def test_without_cupy_the_line_says_there_is_no_gpu_stack(clean):
    """A CPU-only run: no GPU path (im2col + cuBLAS, CuPy kernels) is
    described, only that Chainer runs on NumPy and why."""
    installed, _ = _install({}, cupy=None)
    assert not installed
    assert describe() == ("none, no GPU stack: CuPy cannot be imported "
                          "(ImportError: No module named 'cupy'); Chainer "
                          'runs on NumPy')


@pytest.mark.parametrize('environ', [{'CHAINERKFAC_CUDNN': '0'},
                                     {'CHAINERKFAC_CUDNN': 'yes'}])
def test_turned_off_without_cupy_the_line_says_there_is_no_gpu_stack(
        clean, environ, monkeypatch):
    """Turned off (or mistyped) before CuPy was looked for, on a machine
    where Chainer has no CuPy: the line says Chainer runs on NumPy, not
    which GPU path serves it."""
    monkeypatch.setattr(chainer.backends.cuda, 'available', False)
    installed, _ = _install(environ, cupy=None)
    assert not installed
    assert describe() == ('none, no GPU stack: Chainer finds no CuPy; '
                          'Chainer runs on NumPy (' +
                          installer._status.reason + ')')
    assert 'im2col' not in describe()


@pytest.mark.parametrize('environ', [{}, {'CHAINERKFAC_CUDNN': ''}])
def test_on_by_default(clean, environ):
    """Unset or empty: on, wherever CuPy >= 14 and a cuDNN 9 are found."""
    installed, modules = _install(environ, cupy=fake_cupy())
    assert installed and modules['cupy.cudnn'] is installer.highlevel


def test_the_default_is_one_constant(clean, monkeypatch, caplog):
    """The default is DEFAULT = '1' (on since the GPU suite passed with
    it): an unset variable installs, '0' turns it off, and where it cannot
    install (no CuPy: a CPU run) nothing is logged above debug; DEFAULT
    '0' would make it opt-in again."""
    assert installer.DEFAULT == '1'
    installed, _ = _install({}, cupy=fake_cupy(cuda=None))
    assert installed
    installed, _ = _install({'CHAINERKFAC_CUDNN': '0'}, cupy=fake_cupy())
    assert not installed and "CHAINERKFAC_CUDNN='0': off" in describe()
    installed, _ = _install({}, cupy=None)
    assert not installed and 'CuPy cannot be imported' in describe()
    assert not [r for r in caplog.records if r.levelname != 'DEBUG']
    monkeypatch.setattr(installer, 'DEFAULT', '0')
    installed, _ = _install({}, cupy=fake_cupy())
    assert not installed and 'CHAINERKFAC_CUDNN unset: off' in describe()


def test_not_after_chainer(clean):
    installed, _ = _install(ON, {'chainer': chainer}, cupy=fake_cupy())
    assert not installed
    assert 'import chainerkfac first' in describe()


@pytest.mark.parametrize('kwargs, why', [
    (dict(cupy=None), "CuPy cannot be imported (ImportError: No module "
                      "named 'cupy')"),
    (dict(cupy=fake_cupy('13.6.0')), 'CuPy 13.6.0 has its own cupy.cudnn'),
    (dict(cupy=fake_cupy(), load_error='libcudnn.so.9: cannot open'),
     'no usable cuDNN 9: libcudnn.so.9: cannot open'),
    (dict(cupy=fake_cupy(), fake=FakeCudnn(version=8907)),
     'cuDNN 8.9.7 at fake libcudnn.so.9 is not cuDNN 9'),
    (dict(cupy=fake_cupy(cuda=12080), fake=FakeCudnn(cudart=13000)),
     'built for CUDA 13.0 but CuPy runs CUDA 12.8: install '
     'nvidia-cudnn-cu12'),
])
def test_refused_with_the_reason(clean, kwargs, why, caplog):
    installed, modules = _install(ON, **kwargs)
    assert not installed and not modules
    assert why in describe()
    assert why in caplog.text       # asked for, so a warning in the log


def test_not_over_another_provider(clean):
    other = types.ModuleType('cupy.cudnn')
    installed, _ = _install(ON, {'cupy.cudnn': other}, cupy=fake_cupy())
    assert not installed
    assert 'cupy.cudnn is already provided' in describe()


def test_installs(clean):
    cupy = fake_cupy(cuda=None)      # no runtime to compare with: allowed
    installed, modules = _install(ON, cupy=cupy)
    assert installed
    assert modules['cupy.cudnn'] is highlevel is cupy.cudnn
    assert modules['cupy.cuda.cudnn'] is lowlevel is cupy.cuda.cudnn
    assert lowlevel.getVersion() == 92801
    text = describe()
    assert text.startswith('cuDNN 9.28.1 from fake libcudnn.so.9 (built for '
                           'CUDA 13.0) serves Chainer through '
                           'chainerkfac.cudnn')
    assert "may use TF32 (use_cudnn_tensor_core='auto'" in text
    assert 'workspace limit 8 MiB' in text
    # idempotent: a second install changes nothing
    assert installer.install(ON, modules, lambda: None, None)
    with chainer.using_config('use_cudnn_tensor_core', 'never'):
        assert 'exact FMA math' in describe()


def test_import_installs_when_asked():
    """A fresh interpreter: the variable alone decides, and without CuPy
    the reason says so (this machine has none)."""
    import subprocess
    import sys
    code = ('import chainerkfac, chainer; '
            'print(chainerkfac.cudnn.describe())')
    root = os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    for value, expected in (('0', "CHAINERKFAC_CUDNN='0': off"),
                            ('1', None)):
        env = dict(os.environ, CHAINERKFAC_CUDNN=value)
        out = subprocess.run([sys.executable, '-c', code], cwd=root, env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        if expected:
            assert expected in out.stdout
        else:
            try:
                import cupy  # NOQA
            except ImportError:
                assert 'CuPy cannot be imported' in out.stdout
                assert 'CuPy cannot be imported' in out.stderr   # warned


# -- every name Chainer looks up ---------------------------------------------
def _chainer_lookups():
    """(module as Chainer imports it, name) for every cuDNN name in the
    installed Chainer's source, comments left out."""
    root = os.path.dirname(chainer.__file__)
    found = set()
    for folder, _, files in os.walk(root):
        for filename in files:
            if not filename.endswith('.py') or 'testing' in folder:
                continue
            path = os.path.join(folder, filename)
            with open(path) as f:
                text = '\n'.join(line.split('#')[0] for line in f)
            in_backend = path.endswith(os.path.join('backends', 'cuda.py'))
            for pattern, module in (
                    (r'cuda\.cuda\.cudnn\.(\w+)', 'cupy.cuda.cudnn'),
                    (r'\blibcudnn\.(\w+)', 'cupy.cuda.cudnn'),
                    (r'cupy\.cudnn\.(\w+)', 'cupy.cudnn'),
                    # chainer/backends/cuda.py: `cuda` is cupy.cuda there
                    (r'(?<![\w.])cuda\.cudnn\.(\w+)',
                     'cupy.cuda.cudnn' if in_backend else 'cupy.cudnn'),
                    (r'(?<![\w.])cudnn\.(\w+)', 'cupy.cudnn')):
                found.update((module, n) for n in re.findall(pattern, text))
    return found


def test_every_name_chainer_looks_up_is_answered():
    modules = {'cupy.cudnn': highlevel, 'cupy.cuda.cudnn': lowlevel}
    lookups = _chainer_lookups()
    served = {(m, n) for m, n in lookups if n in vars(modules[m])}
    refused = lookups - served
    # the calls of a ResNet-50 step (issue 19) are among those served
    for name in ('convolution_forward', 'convolution_backward_filter',
                 'convolution_backward_data',
                 'batch_normalization_forward_training_ex',
                 'batch_normalization_backward',
                 'batch_normalization_forward_inference', 'pooling_forward',
                 'pooling_backward', 'softmax_forward', 'softmax_backward',
                 'activation_forward', 'activation_backward',
                 'get_max_workspace_size', 'set_max_workspace_size',
                 'is_tensor_core_available', 'DropoutStates'):
        assert ('cupy.cudnn', name) in served, name
    assert ('cupy.cuda.cudnn', 'getVersion') in served
    assert ('cupy.cuda.cudnn', 'CUDNN_BN_MIN_EPSILON') in served
    # every other name is refused with the Chainer function that needs it
    assert refused, 'expected the RNN and spatial transformer names'
    for module, name in refused:
        assert name in not_served.CHAINER_CALLERS[module], (module, name)
    assert {n for _, n in refused} == {
        n for names in not_served.CHAINER_CALLERS.values() for n in names}
