"""The library's CUDA kernel sources, compiled by the host's C++ compiler
and run on the CPU, so that the kernels themselves (not a Python re-telling
of them) are tested on machines without a GPU.

What runs is the source text that CuPy would compile, under a small
header that gives it CUDA's names (``threadIdx``, ``blockIdx``,
``__syncthreads`` ...). Each thread of a block is a fiber (``ucontext``)
on one OS thread; a round resumes every live fiber until it reaches a
``__syncthreads()`` or returns, so a barrier holds as on the GPU, and
threads that have returned are out of the later barriers (as on Volta
and later). ``__shared__`` variables are static: blocks run one after
another. What is checked on every launch, beyond the results:

* each argument against the parameter the source declares, as CuPy
  would marshal it (a Python ``int`` is ``long long``, a ``float`` is
  ``double``, NumPy scalars are their dtype; an array's dtype must have
  the pointee's size): a mismatch is the bug CuPy would not report;
* the threads of a block meet at the same ``__syncthreads()`` (by source
  line), or the launch fails;
* the order of the fibers within a round (``schedule``: forward or
  reverse) is a parameter, so a missing barrier shows as two results.

``ElementwiseKernel`` and ``ReductionKernel`` are emulated from their
parameter lists and bodies as CuPy generates them (``i``, ``raw`` arrays
indexed flat, typed placeholders bound from the arrays, outputs allocated
when not given), on C-contiguous arrays of one size or 0-d, run
sequentially.

Floating point: ``-ffp-contract=off`` (no fused multiply-add), so a kernel
and its NumPy twin agree bit for bit where they compute the same
expression in the same order; NVRTC contracts by default, so the GPU may
differ from both in the last bit. Needs ``g++`` (C++17); :func:`compiler`
says whether it is there, :func:`unavailable` whether a probe kernel
builds and runs.
"""
import atexit
import ctypes
import functools
import hashlib
import os
import re
import shutil
import stat
import subprocess
import tempfile

import numpy

#: The fiber stack of each thread of a block.
STACK_BYTES = 1 << 16

_HEADER = r'''
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ucontext.h>
#include <vector>

struct dim3 { unsigned int x, y, z; };

namespace emu {
struct Fiber {
    ucontext_t context;
    dim3 index;
    bool done;
    int line;             // the __syncthreads it waits at, 0 if none
    std::vector<char> stack;
};
inline dim3 thread_idx, block_idx, block_dim, grid_dim;
inline ucontext_t scheduler;
inline Fiber* current = nullptr;
inline char error[512];
inline void (*body)(void**) = nullptr;
inline void** body_args = nullptr;

inline void syncthreads(int line) {
    current->line = line;
    swapcontext(&current->context, &scheduler);
    current->line = 0;
}

inline void entry() {
    body(body_args);
    current->done = true;     // uc_link returns to the scheduler
}

inline int launch(dim3 grid, dim3 block, void (*fn)(void**), void** args,
                  int reverse) {
    grid_dim = grid;
    block_dim = block;
    body = fn;
    body_args = args;
    error[0] = 0;
    const size_t n = (size_t) block.x * block.y * block.z;
    std::vector<Fiber> fibers(n);
    for (auto& f : fibers) f.stack.resize(STACK_BYTES);
    for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
    for (unsigned x = 0; x < grid.x; ++x) {
        block_idx = dim3{x, y, z};
        for (size_t t = 0; t < n; ++t) {
            Fiber& f = fibers[t];
            f.index = dim3{(unsigned) (t % block.x),
                           (unsigned) ((t / block.x) % block.y),
                           (unsigned) (t / ((size_t) block.x * block.y))};
            f.done = false;
            f.line = 0;
            getcontext(&f.context);
            f.context.uc_stack.ss_sp = f.stack.data();
            f.context.uc_stack.ss_size = f.stack.size();
            f.context.uc_link = &scheduler;
            makecontext(&f.context, entry, 0);
        }
        for (bool live = true; live;) {
            live = false;
            int line = 0;
            for (size_t k = 0; k < n; ++k) {
                Fiber& f = fibers[reverse ? n - 1 - k : k];
                if (f.done) continue;
                current = &f;
                thread_idx = f.index;
                swapcontext(&scheduler, &f.context);
                if (f.done) continue;
                live = true;
                if (line == 0) line = f.line;
                if (f.line != line && !error[0])
                    snprintf(error, sizeof error,
                             "block (%u, %u, %u): threads wait at "
                             "__syncthreads() of lines %d and %d",
                             x, y, z, line, f.line);
            }
        }
    }
    return error[0] ? 1 : 0;
}
}  // namespace emu

extern "C" const char* emu_error() { return emu::error; }

#define threadIdx (emu::thread_idx)
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __shared__ static
#define __syncthreads() emu::syncthreads(__LINE__)

typedef _Float16 float16;
typedef _Float16 __half;
using std::isfinite; using std::isnan; using std::isinf; using std::sqrt;
using std::exp; using std::log; using std::fabs; using std::abs;
using std::min; using std::max;
inline bool isfinite(_Float16 x) { return std::isfinite((float) x); }
inline bool isnan(_Float16 x) { return std::isnan((float) x); }
inline bool isinf(_Float16 x) { return std::isinf((float) x); }
inline float sqrt(_Float16 x) { return std::sqrt((float) x); }
template <class T> T atomicAdd(T* address, T value) {
    T old = *address;
    *address = old + value;
    return old;
}
'''.replace('STACK_BYTES', str(STACK_BYTES))

#: C parameter types -> NumPy dtypes (scalars by value; pointees by size).
_C_TYPES = {
    'float': numpy.float32, 'double': numpy.float64,
    'float16': numpy.float16, '__half': numpy.float16,
    'bool': numpy.bool_, 'char': numpy.int8, 'signed char': numpy.int8,
    'unsigned char': numpy.uint8, 'short': numpy.int16,
    'unsigned short': numpy.uint16, 'int': numpy.int32,
    'unsigned int': numpy.uint32, 'unsigned': numpy.uint32,
    'long': numpy.int64, 'long long': numpy.int64,
    'unsigned long': numpy.uint64, 'unsigned long long': numpy.uint64,
    'ptrdiff_t': numpy.int64, 'size_t': numpy.uint64,
    'int32_t': numpy.int32, 'int64_t': numpy.int64,
    'uint32_t': numpy.uint32, 'uint64_t': numpy.uint64,
}
#: CuPy's dtype names in kernel parameter lists -> C types.
_CUPY_NAMES = {
    'float16': 'float16', 'float32': 'float', 'float64': 'double',
    'bool': 'bool', 'int8': 'signed char', 'uint8': 'unsigned char',
    'int16': 'short', 'uint16': 'unsigned short', 'int32': 'int',
    'uint32': 'unsigned int', 'int64': 'long long',
    'uint64': 'unsigned long long',
}
_DTYPE_TO_C = {numpy.dtype(n): c for n, c in _CUPY_NAMES.items()}


class LaunchError(RuntimeError):
    """A launch the GPU would have run wrongly or not at all."""


@functools.lru_cache(maxsize=None)
def compiler():
    """The C++ compiler's path, or None."""
    return shutil.which(os.environ.get('CXX', 'g++'))


_PROBE = r'''
extern "C" __global__ void probe(const float* x, float* out) {
    __shared__ float s[4];
    s[threadIdx.x] = x[threadIdx.x] + (float) (_Float16) 0.5f;
    __syncthreads();
    if (threadIdx.x == 0) out[blockIdx.x] = s[0] + s[1] + s[2] + s[3];
}
'''


@functools.lru_cache(maxsize=None)
def unavailable():
    """Why the kernels cannot run here (no compiler, or it cannot build
    and run a probe kernel: C++17, ``_Float16``, ``ucontext``), or None."""
    if compiler() is None:
        return 'no C++ compiler (g++) to run the CUDA sources on the CPU'
    try:
        out = numpy.zeros(2, numpy.float32)
        RawKernel(_PROBE, 'probe')((2,), (4,), (
            numpy.arange(4, dtype=numpy.float32), out))
    except Exception as error:   # any failure: the reason is the message
        return ('the CUDA sources cannot be built and run here (compiled '
                'into {}, which a noexec TMPDIR cannot load from): {}'.format(
                    _cache_dir(), str(error).strip().splitlines()[-1][:300]))
    if out.tolist() != [8.0, 8.0]:
        return 'the probe kernel computed {} (expected [8, 8])'.format(
            out.tolist())
    return None


@functools.lru_cache(maxsize=None)
def _cache_dir():
    """The compiled kernels' cache, shared by this user's test processes:
    ``$TMPDIR/chainerkfac-cuda-cpu-<uid>``, private (0700: this user's
    own, made so where an earlier version left it group-writable). Where
    that name is someone else's or a link (a library planted there would
    be loaded), a directory of this process's own instead (removed at
    exit): the tests run, compiled again."""
    path = os.path.join(tempfile.gettempdir(),
                        'chainerkfac-cuda-cpu-{}'.format(os.getuid()))
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        info = os.lstat(path)
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
            if info.st_mode & 0o077:
                os.chmod(path, 0o700)
            return path
    except OSError:
        pass
    private = tempfile.mkdtemp(prefix='chainerkfac-cuda-cpu-')
    atexit.register(shutil.rmtree, private, True)
    return private


@functools.lru_cache(maxsize=None)
def _library(code: str):
    """``code`` (after the header) compiled into a shared library, cached
    by its text."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError('tests.cuda_cpu needs a C++ compiler (g++)')
    text = _HEADER + '\n#line 1 "kernel.cu"\n' + code
    digest = hashlib.sha1((cxx + "\0" + text).encode()).hexdigest()[:20]
    target = os.path.join(_cache_dir(), digest + '.so')
    if not os.path.exists(target):
        # per process: concurrent test processes may compile the same text
        source = os.path.join(_cache_dir(), '{}.{}.cpp'.format(
            digest, os.getpid()))
        with open(source, 'w') as f:
            f.write(text)
        partial = target + '.{}.tmp'.format(os.getpid())
        result = subprocess.run(
            [cxx, '-std=c++17', '-O1', '-fPIC', '-shared',
             '-ffp-contract=off', '-fno-strict-aliasing', '-w',
             source, '-o', partial],
            capture_output=True, text=True)
        os.remove(source)
        if result.returncode:
            raise RuntimeError('the kernel source does not compile as '
                               'C++:\n' + result.stderr[-4000:])
        os.replace(partial, target)
    return ctypes.CDLL(target)


def _split_params(text: str):
    """``[(type, name)]`` of a comma-separated C parameter list."""
    params = []
    for part in text.split(','):
        part = ' '.join(part.replace('__restrict__', '').split())
        match = re.match(r'^(.*?)\s*\b([A-Za-z_]\w*)$', part)
        if not match:
            raise ValueError('cannot read the parameter {!r}'.format(part))
        params.append((match.group(1).strip(), match.group(2)))
    return params


def _base_type(ctype: str) -> str:
    """A C type without ``const`` and without the pointer."""
    words = ctype.replace('*', ' ').split()
    return ' '.join(w for w in words if w not in ('const', 'volatile'))


class _Arguments:
    """The ``void* args[]`` of a launch, each argument's bytes kept alive
    and checked against its parameter's C type."""

    def __init__(self, params, values, where):
        if len(values) != len(params):
            raise LaunchError('{}: {} arguments for {} parameters'.format(
                where, len(values), len(params)))
        self._keep = []
        self.array = (ctypes.c_void_p * max(1, len(params)))()
        for k, ((ctype, name), value) in enumerate(zip(params, values)):
            base = _base_type(ctype)
            if '*' in ctype:
                cell = ctypes.c_void_p(self._pointer(base, name, value,
                                                     where))
            else:
                cell = self._scalar(base, name, value, where)
            self._keep.append(cell)
            self.array[k] = ctypes.cast(ctypes.pointer(cell),
                                        ctypes.c_void_p)

    @staticmethod
    def _pointer(base, name, value, where):
        if value is None:
            return 0
        interface = getattr(value, '__array_interface__', None)
        if interface is None or isinstance(value, numpy.generic):
            raise LaunchError('{}: parameter {} ({} *) takes a device '
                              'array, got {}'.format(
                                  where, name, base, type(value).__name__))
        if base != 'void':
            expected = numpy.dtype(_C_TYPES[base])
            if numpy.dtype(value.dtype).itemsize != expected.itemsize:
                raise LaunchError(
                    '{}: parameter {} ({} *) takes {}-byte elements, got '
                    'an array of {}'.format(where, name, base,
                                            expected.itemsize, value.dtype))
        return interface['data'][0]

    @staticmethod
    def _scalar(base, name, value, where):
        if isinstance(value, bool):
            dtype = numpy.dtype(numpy.bool_)
        elif isinstance(value, int):
            dtype = numpy.dtype(numpy.int64)     # CuPy: Python int is int64
        elif isinstance(value, float):
            dtype = numpy.dtype(numpy.float64)
        elif isinstance(value, numpy.generic):
            dtype = value.dtype
        else:
            raise LaunchError('{}: parameter {} ({}) takes a scalar, got '
                              '{}'.format(where, name, base,
                                          type(value).__name__))
        expected = numpy.dtype(_C_TYPES[base])
        if dtype != expected:
            raise LaunchError('{}: parameter {} is {} ({}), the argument is '
                              '{}: CuPy would pass other bytes'.format(
                                  where, name, base, expected, dtype))
        data = numpy.array(value, dtype)
        return (ctypes.c_char * dtype.itemsize).from_buffer_copy(
            data.tobytes())


def _grid(value):
    value = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    return tuple(int(v) for v in value) + (1,) * (3 - len(value))


class RawKernel:
    """``cupy.RawKernel(code, name)`` run on the CPU: ``kernel(grid, block,
    args)`` on NumPy arrays standing in for device memory.

    ``schedule``: ``'forward'`` or ``'reverse'``, the order in which the
    threads of a block run between barriers. ``launches`` counts the
    calls.
    """

    def __init__(self, code, name, options=(), schedule='forward'):
        self.code, self.name, self.schedule = code, name, schedule
        self.launches = 0
        match = re.search(r'\b{}\s*\(([^)]*)\)\s*\{{'.format(re.escape(name)),
                          code)
        if match is None:
            raise ValueError('no kernel named {} in the source'.format(name))
        self.params = _split_params(match.group(1))
        calls = ', '.join('*({} *) a[{}]'.format(ctype, k)
                          for k, (ctype, _) in enumerate(self.params))
        self._lib = _library(
            code + '\nstatic void emu_body(void** a) {{ {}({}); }}\n'
            'extern "C" int emu_launch(unsigned gx, unsigned gy, unsigned gz,'
            ' unsigned bx, unsigned by, unsigned bz, void** a, int reverse) '
            '{{ return emu::launch(dim3{{gx, gy, gz}}, dim3{{bx, by, bz}}, '
            'emu_body, a, reverse); }}\n'.format(name, calls))
        self._lib.emu_launch.argtypes = [ctypes.c_uint] * 6 + [
            ctypes.c_void_p, ctypes.c_int]
        self._lib.emu_error.restype = ctypes.c_char_p

    def __call__(self, grid, block, args, shared_mem=0):
        grid, block = _grid(grid), _grid(block)
        if min(grid + block) < 1:
            raise LaunchError('{}: grid {} / block {}'.format(
                self.name, grid, block))
        if numpy.prod(block) > 1024 or grid[1] > 65535 or grid[2] > 65535:
            raise LaunchError('{}: grid {} / block {} is past CUDA\'s '
                              'limits'.format(self.name, grid, block))
        arguments = _Arguments(self.params, list(args), self.name)
        self.launches += 1
        if self._lib.emu_launch(*grid, *block, arguments.array,
                                int(self.schedule == 'reverse')):
            raise LaunchError('{}: {}'.format(
                self.name, self._lib.emu_error().decode()))


# -- CuPy's generated kernels ----------------------------------------------------
def _parse_kernel_params(text: str):
    """CuPy's ``'raw T x, int64 n'`` -> ``[(raw, type, name)]``."""
    out = []
    for part in (p.split() for p in text.split(',') if p.strip()):
        raw = part[0] == 'raw'
        if raw:
            part = part[1:]
        out.append((raw, part[0], part[1]))
    return out


def _bind(params, values, types):
    """Bind placeholder types from the arrays, then from the scalars
    (CuPy's order)."""
    for pass_arrays in (True, False):
        for (raw, typename, _), value in zip(params, values):
            if typename in _CUPY_NAMES or value is None:
                continue
            is_array = isinstance(value, numpy.ndarray)
            if is_array != pass_arrays or typename in types:
                continue
            types[typename] = numpy.dtype(
                value.dtype if hasattr(value, 'dtype') else
                (numpy.float64 if isinstance(value, float) else numpy.int64))


def _dtype_of(typename, types):
    if typename in _CUPY_NAMES:
        return numpy.dtype(typename)
    return types[typename]


class ElementwiseKernel:
    """``cupy.ElementwiseKernel`` on the CPU: the body in a sequential loop
    over ``i``; C-contiguous arrays of one size (or 0-d) for the
    non-``raw`` parameters."""

    def __init__(self, in_params, out_params, operation, name='kernel',
                 **unused):
        self.inputs = _parse_kernel_params(in_params)
        self.outputs = _parse_kernel_params(out_params)
        self.operation, self.name = operation, name
        self.launches = 0

    def __call__(self, *args, size=None):
        params = self.inputs + self.outputs
        if len(args) not in (len(self.inputs), len(params)):
            raise LaunchError('{}: {} arguments'.format(self.name, len(args)))
        values = list(args) + [None] * (len(params) - len(args))
        types = {}
        _bind(params, values, types)
        sizes = {v.size for (raw, _, _), v in zip(params, values)
                 if not raw and isinstance(v, numpy.ndarray) and v.ndim}
        if size is None:
            if len(sizes) > 1:
                raise NotImplementedError('{}: broadcasting {}'.format(
                    self.name, sizes))
            size = sizes.pop() if sizes else 1
        shape = next((v.shape for (raw, _, _), v in zip(params, values)
                      if not raw and isinstance(v, numpy.ndarray)
                      and v.ndim), (size,))
        for k, (raw, typename, name) in enumerate(params):
            if values[k] is None:
                values[k] = numpy.empty(shape, _dtype_of(typename, types))
        declarations, per_element, call_args = [], [], []
        for k, ((raw, typename, name), value) in enumerate(
                zip(params, values)):
            ctype = _DTYPE_TO_C[_dtype_of(typename, types)]
            is_input = k < len(self.inputs)
            qualifier = 'const ' if is_input else ''
            if isinstance(value, numpy.ndarray):
                if not value.flags.c_contiguous:
                    if not is_input:
                        raise NotImplementedError('{}: a strided output {}'
                                                  .format(self.name, name))
                    value = numpy.ascontiguousarray(value)   # CuPy: strides
                if numpy.dtype(value.dtype) != _dtype_of(typename, types):
                    raise LaunchError('{}: {} is {}, the array {}'.format(
                        self.name, name, _dtype_of(typename, types),
                        value.dtype))
                call_args.append(value)
                declarations.append('{q}{c}* {n}_ = *({q}{c}**) emu_args[{k}];'
                                    .format(q=qualifier, c=ctype, n=name,
                                            k=k))
                if raw:
                    declarations.append('{q}{c}* {n} = {n}_;'.format(
                        q=qualifier, c=ctype, n=name))
                else:
                    step = '[i]' if value.ndim else '[0]'
                    per_element.append(
                        ('const {c} {n} = {n}_{s};' if is_input else
                         '{c}& {n} = {n}_{s};').format(c=ctype, n=name,
                                                       s=step))
            else:
                dtype = _dtype_of(typename, types)
                call_args.append(numpy.array(value, dtype))
                declarations.append('const {c} {n} = **({c}**) emu_args[{k}];'
                                    .format(c=ctype, n=name, k=k))
        typedefs = ''.join('typedef {} {};\n'.format(_DTYPE_TO_C[d], t)
                           for t, d in sorted(types.items()))
        code = ('{typedefs}struct Index {{ ptrdiff_t n; ptrdiff_t size() const'
                ' {{ return n; }} }};\n'
                'extern "C" void emu_elementwise(void** emu_args, long long emu_size) {{\n'
                '    {declarations}\n    const Index _ind{{emu_size}};\n'
                '    for (ptrdiff_t i = 0; i < emu_size; ++i) {{\n'
                '        {per_element}\n#line 1 "{name}"\n{body};\n    }}\n}}\n'
                ).format(typedefs=typedefs,
                         declarations='\n    '.join(declarations),
                         per_element='\n        '.join(per_element),
                         name=self.name, body=self.operation)
        lib = _library(code)
        pointers = (ctypes.c_void_p * len(call_args))()
        cells = [ctypes.c_void_p(a.__array_interface__['data'][0])
                 for a in call_args]
        for k, cell in enumerate(cells):
            pointers[k] = ctypes.cast(ctypes.pointer(cell), ctypes.c_void_p)
        lib.emu_elementwise.argtypes = [ctypes.c_void_p, ctypes.c_longlong]
        lib.emu_elementwise(pointers, size)
        self.launches += 1
        outputs = values[len(self.inputs):]
        return outputs[0] if len(outputs) == 1 else tuple(outputs)


class ReductionKernel:
    """``cupy.ReductionKernel`` on the CPU, over the whole array (no
    ``axis``), its elements in order."""

    def __init__(self, in_params, out_params, map_expr, reduce_expr,
                 post_map_expr, identity, name='reduce', reduce_type=None,
                 **unused):
        self.inputs = _parse_kernel_params(in_params)
        self.outputs = _parse_kernel_params(out_params)
        self.map, self.reduce, self.post = map_expr, reduce_expr, post_map_expr
        self.identity, self.name, self.reduce_type = (identity, name,
                                                      reduce_type)
        self.launches = 0

    def __call__(self, *args):
        if len(self.inputs) != 1 or len(args) != 1:
            raise NotImplementedError('{}: one input'.format(self.name))
        (_, typename, name), = self.inputs
        (_, out_type, out_name), = self.outputs
        x = numpy.ascontiguousarray(args[0])
        types = {typename: numpy.dtype(x.dtype)}
        ctype = _DTYPE_TO_C[types[typename]]
        out_dtype = _dtype_of(out_type, types)
        acc = self.reduce_type or ctype
        out = numpy.empty((), out_dtype)
        code = ('typedef {c} {t};\n'
                'extern "C" void emu_reduce(const {c}* x_, {o}* y_, long long '
                'size) {{\n    {acc} a = {identity};\n'
                '    for (long long i = 0; i < size; ++i) {{\n'
                '        const {c} {n} = x_[i];\n        {acc} b = {map};\n'
                '        a = {reduce};\n    }}\n    {o}& {out} = *y_;\n'
                '    {post};\n}}\n').format(
                    c=ctype, t=typename, o=_DTYPE_TO_C[out_dtype], acc=acc,
                    identity=self.identity, n=name, map=self.map,
                    reduce=self.reduce, out=out_name, post=self.post)
        lib = _library(code)
        lib.emu_reduce.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_longlong]
        lib.emu_reduce(x.ctypes.data, out.ctypes.data, x.size)
        self.launches += 1
        return out


# -- device memory with guards -----------------------------------------------------
class Guarded:
    """Arrays in buffers with a guard band on each side, filled with a
    pattern; :meth:`check` fails if a kernel wrote outside an array."""

    GUARD = 64

    def __init__(self):
        self._buffers = []

    def __call__(self, array, dtype=None):
        array = numpy.asarray(array, dtype)
        itemsize = array.dtype.itemsize
        pad = -(-self.GUARD // itemsize)
        raw = numpy.empty(array.size + 2 * pad, array.dtype)
        raw.view(numpy.uint8)[:] = 0xA5
        inner = raw[pad:pad + array.size].reshape(array.shape)
        inner[...] = array
        self._buffers.append((raw, pad, array.size))
        return inner

    def check(self):
        for raw, pad, size in self._buffers:
            bytes_ = raw.view(numpy.uint8).reshape(-1, raw.dtype.itemsize)
            for band in (bytes_[:pad], bytes_[pad + size:]):
                if (band != 0xA5).any():
                    raise AssertionError(
                        'a kernel wrote outside an array of {} elements'
                        .format(size))
