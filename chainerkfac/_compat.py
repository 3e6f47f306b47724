"""Run Chainer 7.8.1 / ChainerMN on NumPy 2 and Python 3.12.

Chainer 7.8.1 (the last release) predates NumPy 2 and Python 3.12. CuPy 14
requires NumPy >= 2, so the GPU stack needs the patches below; the CPU pin
(Python 3.11, NumPy 1.26) needs only one of them (the ``np.float`` alias,
removed in NumPy 1.24).

Each patch is applied only when a feature probe shows that it is needed, is
idempotent (calling :func:`apply` again changes nothing), and restores the
old behaviour exactly where Chainer relies on it:

``numpy_sctypes``
    ``chainer/functions/array/as_strided.py`` reads ``np.sctypes`` at import
    time (and in its backward), so ``import chainer`` fails on NumPy 2, which
    removed the table. We put back NumPy 1.x's table with the same types;
    NumPy 2 gives the name no other meaning.
``numpy_distutils``
    ``chainer/_environment_check.py`` imports ``numpy.distutils.system_info``
    at ``import chainer``; ``numpy.distutils`` does not exist on Python >= 3.12
    (NumPy 1.26 refuses it there, NumPy 2 ships it only for Python < 3.12).
    Chainer calls only its ``get_info('blas_opt')``, only on macOS, to warn
    about Accelerate. We register a stub whose ``get_info`` returns ``{}``
    (what numpy.distutils returns when it finds nothing), so that check
    becomes a no-op. The stub is not a package: importing any other part of
    ``numpy.distutils`` still fails as before.
``numpy_float``
    ``F.resize_images`` uses ``numpy.float``, removed in NumPy 1.24. We restore
    the alias to the builtin ``float``, its value in NumPy <= 1.23 (so
    ``dtype=numpy.float`` means float64 as before).
``chainermn_unpack_params``
    ``chainermn.communicators._memory_utility.unpack_params`` casts each
    gradient to the transfer dtype with ``xp.array(v, copy=False, dtype=...)``
    and only takes that line when the dtypes differ. NumPy 2 (and CuPy 14)
    made ``copy=False`` mean "never copy", so it raises ``ValueError``
    (ChainerMN's GPU communicators with an fp16 ``allreduce_grad_dtype``). We
    replace the function with one that casts by ``xp.asarray(v, dtype=...)``,
    which is what ``copy=False`` meant under NumPy 1. The replacement is
    installed when ChainerMN's module is imported, or at once if it already is.

Import order: ``numpy_sctypes`` and ``numpy_distutils`` are needed *while*
Chainer is imported, so on NumPy 2 / Python 3.12 ``import chainerkfac`` (or
``import chainerkfac._compat``) must come before ``import chainer``; without
it ``import chainer`` fails at once with an ``AttributeError`` /
``ImportError``, never silently. The other two patches are looked up at call
time and work in either order.

This module never imports Chainer, ChainerMN or CuPy itself.
"""
import sys
import types
import warnings

import numpy

_UNPACK_MODULE = 'chainermn.communicators._memory_utility'

#: Names of the patches this process needed, in the order they were applied.
APPLIED = []


def needs_numpy_sctypes():
    return not hasattr(numpy, 'sctypes')


def needs_numpy_distutils():
    """True where ``numpy.distutils.system_info`` (which Chainer imports)
    cannot be imported: absent (NumPy 2 on Python 3.12), or failing as it
    imports (its DeprecationWarning under ``-W error``, NumPy 2's removed
    names)."""
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        try:
            import numpy.distutils.system_info  # NOQA
        except Exception:
            return True
    return False


def needs_numpy_float():
    return not hasattr(numpy, 'float')


def needs_chainermn_unpack_params():
    """True when ``numpy.array(copy=False)`` refuses a cast (NumPy 2)."""
    module = sys.modules.get(_UNPACK_MODULE)
    if module is not None and module.unpack_params is _unpack_params:
        return False
    if module is None and _pending_hook(_UNPACK_MODULE):
        return False
    try:
        numpy.array(numpy.zeros(1, numpy.float32), copy=False,
                    dtype=numpy.float16)
    except ValueError:
        return True
    return False


def _patch_numpy_sctypes():
    numpy.sctypes = {
        'int': [numpy.int8, numpy.int16, numpy.int32, numpy.int64],
        'uint': [numpy.uint8, numpy.uint16, numpy.uint32, numpy.uint64],
        'float': [numpy.float16, numpy.float32, numpy.float64,
                  numpy.longdouble],
        'complex': [numpy.complex64, numpy.complex128, numpy.clongdouble],
        'others': [bool, object, bytes, str, numpy.void],
    }


def _patch_numpy_distutils():
    package = types.ModuleType(
        'numpy.distutils', 'Stub by chainerkfac._compat: only system_info.')
    system_info = types.ModuleType(
        'numpy.distutils.system_info',
        'Stub by chainerkfac._compat: get_info() finds nothing.')
    system_info.get_info = lambda name, notfound_action=0: {}
    package.system_info = system_info
    sys.modules['numpy.distutils'] = package
    sys.modules['numpy.distutils.system_info'] = system_info
    numpy.distutils = package


def _patch_numpy_float():
    numpy.float = float


def _unpack_params(params, attr_name, buffer,
                   transfer_dtype, zero_fill, stream=None):
    """ChainerMN 7.8.1's ``unpack_params``, casting with ``xp.asarray``.

    Identical to the original except for the cast, which NumPy 2's
    ``copy=False`` rejects (see the module docstring).
    """
    import chainer

    if len(params) == 0:
        return
    xp = chainer.backend.get_array_module(getattr(params[0], attr_name))
    offset = 0
    for param in params:
        v = getattr(param, attr_name)
        if attr_name == 'grad' and v is None and zero_fill:
            v = param.xp.empty_like(param.data)
            setattr(param, attr_name, v)
        size = v.size * numpy.dtype(transfer_dtype).itemsize
        grad_dtype = v.dtype
        if grad_dtype != transfer_dtype:
            v = xp.asarray(v, dtype=transfer_dtype)
        buffer.to_device(v, size, offset, stream)
        offset += size
        if grad_dtype != transfer_dtype:
            # avoid using setattr as ChainerX array cannot be directly updated
            getattr(param, attr_name)[...] = v.astype(grad_dtype)


def _replace_unpack_params(module):
    module.unpack_params = _unpack_params


class _PatchingLoader:
    """Wraps a loader to call ``patch(module)`` after the module has run."""

    def __init__(self, loader, patch):
        self._loader = loader
        self._patch = patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name):  # get_source, get_code, is_package, ...
        return getattr(self._loader, name)


class _AfterImport:
    """A one-shot ``sys.meta_path`` finder that patches one module on import.

    It finds the module with the other finders and only wraps its loader, so
    the module is loaded from where it would have been anyway.
    """

    def __init__(self, name, patch):
        self.name = name
        self.patch = patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            find_spec = getattr(finder, 'find_spec', None)
            if finder is self or find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                sys.meta_path.remove(self)
                spec.loader = _PatchingLoader(spec.loader, self.patch)
                return spec
        return None


def _patch_chainermn_unpack_params():
    module = sys.modules.get(_UNPACK_MODULE)
    if module is not None:
        _replace_unpack_params(module)
        return
    if not _pending_hook(_UNPACK_MODULE):
        sys.meta_path.insert(
            0, _AfterImport(_UNPACK_MODULE, _replace_unpack_params))


def _pending_hook(name):
    return any(isinstance(finder, _AfterImport) and finder.name == name
               for finder in sys.meta_path)


#: (name, probe, patch) in the order they must be applied.
PATCHES = (
    ('numpy_sctypes', needs_numpy_sctypes, _patch_numpy_sctypes),
    ('numpy_distutils', needs_numpy_distutils, _patch_numpy_distutils),
    ('numpy_float', needs_numpy_float, _patch_numpy_float),
    ('chainermn_unpack_params', needs_chainermn_unpack_params,
     _patch_chainermn_unpack_params),
)


def check_import_order():
    """Raise ``ImportError`` where Chainer was imported (or tried) before
    this module on a NumPy without ``sctypes`` (NumPy 2): that import
    failed inside Chainer, and left parts of it in ``sys.modules`` that
    make every later ``import chainer`` fail with a circular-import error
    naming neither NumPy nor this library."""
    if not needs_numpy_sctypes():
        return
    loaded = sorted(name for name in sys.modules
                    if name == 'chainer' or name.startswith('chainer.'))
    if loaded:
        raise ImportError(
            'chainer was imported before chainerkfac on NumPy {} ({} of its '
            'modules are loaded, e.g. {}): Chainer 7.8.1 needs the '
            'compatibility shims chainerkfac installs before it loads. '
            'Restart the interpreter and `import chainerkfac` before '
            '`import chainer`'.format(numpy.__version__, len(loaded),
                                      loaded[0]))


def apply():
    """Apply every patch whose probe says it is needed; return their names."""
    applied = []
    for name, needed, patch in PATCHES:
        if needed():
            patch()
            applied.append(name)
            if name not in APPLIED:
                APPLIED.append(name)
    return applied


check_import_order()
apply()
