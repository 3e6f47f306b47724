"""Putting the backend where Chainer looks for cuDNN, when it may.

:func:`install` (run by ``import chainerkfac``) makes
:mod:`~chainerkfac.cudnn.lowlevel` and :mod:`~chainerkfac.cudnn.highlevel`
CuPy's ``cupy.cuda.cudnn`` and ``cupy.cudnn`` only when all of these hold,
and otherwise records why not for :func:`describe`:

1. ``CHAINERKFAC_CUDNN=1`` in the environment, or the variable unset (or
   empty) and :data:`DEFAULT` ``'1'`` (it is: on by default since the
   whole GPU suite passed with the backend on, 2026-11-26, one H200:
   152 single-process and 68 ``mpiexec -n 1..4`` tests);
   ``CHAINERKFAC_CUDNN=0`` turns it off;
2. Chainer has not been imported yet (Chainer decides whether cuDNN exists
   once, when ``chainer.backends.cuda`` is imported);
3. CuPy >= 14 imports (CuPy 13 and older have their own ``cupy.cudnn``)
   and nothing else provides ``cupy.cudnn`` already;
4. a cuDNN 9 loads, exports every function the backend binds, and was
   built for the CUDA major version CuPy runs.
"""
import atexit
import importlib.util
import logging
import os
import sys
from typing import Callable, MutableMapping, NamedTuple, Optional

from chainerkfac.cudnn import highlevel
from chainerkfac.cudnn import library
from chainerkfac.cudnn import lowlevel
from chainerkfac.cudnn import runtime

ENV_VAR = 'CHAINERKFAC_CUDNN'
#: What an unset (or empty) ``CHAINERKFAC_CUDNN`` means: ``'1'`` (on
#: wherever the conditions below hold; ``'0'`` turns it off).
DEFAULT = '1'
MIN_CUPY_MAJOR = 14
#: Which path serves Chainer's convolutions, batch normalization and
#: pooling when this backend does not (the start-up line says it).
OWN_PATH = ("Chainer's own path (convolutions as im2col + cuBLAS, batch "
            'normalization and pooling as CuPy kernels)')

logger = logging.getLogger(__name__)


class Status(NamedTuple):
    """Whether the backend is installed, and the words for the log."""

    installed: bool
    reason: str
    #: CuPy imports (``False``: no GPU stack, Chainer runs on NumPy).
    cupy: bool = True


_status = Status(False, 'chainerkfac.cudnn.install() has not run')


def _import_cupy():
    import cupy
    return cupy


def install(environ: Optional[MutableMapping[str, str]] = None,
            modules: Optional[MutableMapping[str, object]] = None,
            import_cupy: Callable[[], object] = _import_cupy,
            load: Callable[[], library.Library] = library.load) -> bool:
    """Install the backend if the conditions of the module docstring hold.

    Parameters
    ----------
    environ, modules
        ``os.environ`` and ``sys.modules`` (the tests pass their own).
    import_cupy, load
        How CuPy is imported and cuDNN loaded (the tests pass fakes).

    Returns
    -------
    bool
        Whether the backend is installed (now or before).
    """
    global _status
    environ = os.environ if environ is None else environ
    modules = sys.modules if modules is None else modules
    if modules.get('cupy.cudnn') is highlevel:
        return True
    _status = _check(environ, modules, import_cupy, load)
    if _status.installed:
        atexit.register(runtime.current().close)
    if _status.installed or environ.get(ENV_VAR, '') != '1':
        logger.debug('chainerkfac.cudnn: %s', _status.reason)
    else:   # asked for and refused
        logger.warning('chainerkfac.cudnn not installed: %s', _status.reason)
    return _status.installed


def _check(environ, modules, import_cupy, load) -> Status:
    given = environ.get(ENV_VAR, '')
    value = given or DEFAULT
    if value == '0':
        return Status(False, '{}: off (unset it or set {}=1 to turn it '
                             'on)'.format(
                                 '{}={!r}'.format(ENV_VAR, given) if given
                                 else ENV_VAR + ' unset', ENV_VAR))
    if value != '1':
        return Status(False, '{}={!r} is neither 0 nor 1'.format(
            ENV_VAR, value))
    if 'chainer' in modules:
        return Status(False, 'chainer was imported before chainerkfac, and '
                             'Chainer looks for cuDNN only when it is '
                             'imported: import chainerkfac first')
    try:
        cupy = import_cupy()
    except Exception as error:  # not installed, or a broken install
        return Status(False, 'CuPy cannot be imported ({}: {})'.format(
            type(error).__name__, error), cupy=False)
    major = int(str(cupy.__version__).split('.')[0])
    if major < MIN_CUPY_MAJOR:
        return Status(False, 'CuPy {} has its own cupy.cudnn (the backend '
                             'is for CuPy >= {})'.format(cupy.__version__,
                                                         MIN_CUPY_MAJOR))
    for name in ('cupy.cudnn', 'cupy.cuda.cudnn'):
        if name in modules:
            return Status(False, '{} is already provided by {!r}'.format(
                name, modules[name]))
    try:
        lib = load()
    except OSError as error:
        return Status(False, 'no usable cuDNN {}: {}'.format(
            library.MAJOR, error))
    version = lib.version()
    if version // 10000 != library.MAJOR:
        return Status(False, 'cuDNN {} at {} is not cuDNN {}'.format(
            _dotted(version), lib.path, library.MAJOR))
    mismatch = _cuda_mismatch(cupy, lib)
    if mismatch:
        return Status(False, mismatch)
    runtime.activate(runtime.Runtime(lib, runtime.CupyArrays(cupy)))
    modules['cupy.cuda.cudnn'] = cupy.cuda.cudnn = lowlevel
    modules['cupy.cudnn'] = cupy.cudnn = highlevel
    return Status(True, 'cuDNN {} from {} (built for CUDA {}) serves Chainer '
                        'through chainerkfac.cudnn'.format(
                            _dotted(version), lib.path,
                            _dotted_cuda(lib.cudart_version())))


def _cuda_mismatch(cupy, lib) -> str:
    """Why the cuDNN cannot run under CuPy's CUDA runtime, or ''."""
    try:
        cuda = cupy.cuda.runtime.runtimeGetVersion()
    except Exception:  # no CUDA runtime to ask: cuDNN's own check will do
        return ''
    built = lib.cudart_version()
    if cuda // 1000 == built // 1000:
        return ''
    return ('cuDNN at {} is built for CUDA {} but CuPy runs CUDA {}: install '
            'nvidia-cudnn-cu{}'.format(lib.path, _dotted_cuda(built),
                                       _dotted_cuda(cuda), cuda // 1000))


def describe() -> str:
    """Which cuDNN serves Chainer in this process, or why none does (a line
    for a run's start-up log)."""
    if _status.installed:
        rt = runtime.current()
        text = '{}; float32 convolutions {}; workspace limit {} MiB'.format(
            _status.reason, _math_words(), rt.max_workspace_size >> 20)
        chainer_cuda = sys.modules.get('chainer.backends.cuda')
        if chainer_cuda is not None and not chainer_cuda.cudnn_enabled:
            text += ' (but Chainer has cuDNN off: CHAINER_CUDNN=0)'
        return text
    if not _status.cupy:
        return 'none, no GPU stack: {}; Chainer runs on NumPy'.format(
            _status.reason)
    if not _chainer_has_cupy():  # turned off before CuPy was looked for
        return ('none, no GPU stack: Chainer finds no CuPy; Chainer runs on '
                'NumPy ({})'.format(_status.reason))
    own = _cupy_own_cudnn()
    return own if own else 'none, {} serves Chainer: {}'.format(
        OWN_PATH, _status.reason)


def _chainer_has_cupy() -> bool:
    """Whether Chainer runs on CuPy here (its ``cuda.available`` once it is
    imported; before that, whether a CuPy can be found)."""
    cuda = sys.modules.get('chainer.backends.cuda')
    if cuda is not None:
        return bool(cuda.available)
    return importlib.util.find_spec('cupy') is not None


def _math_words() -> str:
    config = getattr(sys.modules.get('chainer'), 'config', None)
    mode = getattr(config, 'use_cudnn_tensor_core', 'auto')
    if mode == 'never':
        return "in exact FMA math (use_cudnn_tensor_core='never')"
    return ("may use TF32 (use_cudnn_tensor_core={!r}; 'never' for exact "
            "float32)".format(mode))


def _cupy_own_cudnn() -> str:
    """CuPy 13's own cuDNN, if this process has one, in words; or ''."""
    cupy_cudnn = sys.modules.get('cupy.cuda.cudnn')
    if cupy_cudnn is None or cupy_cudnn is lowlevel:
        return ''
    try:
        return "cuDNN {} through CuPy {}'s own cupy.cudnn".format(
            _dotted(cupy_cudnn.getVersion()),
            sys.modules['cupy'].__version__)
    except Exception:  # CuPy without a loadable cuDNN
        return ''


def _dotted(version: int) -> str:
    """A cuDNN version number as 'major.minor.patch' (cuDNN 9: 92801 is
    9.28.1; cuDNN 8 and older: 8907 is 8.9.7)."""
    if version < 10000:
        return '{}.{}.{}'.format(version // 1000, version // 100 % 10,
                                 version % 100)
    return '{}.{}.{}'.format(version // 10000, version // 100 % 100,
                             version % 100)


def _dotted_cuda(version: int) -> str:
    """A CUDA version number (e.g. 13000) as '13.0'."""
    return '{}.{}'.format(version // 1000, version % 1000 // 10)
