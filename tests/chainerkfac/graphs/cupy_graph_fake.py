"""A stand-in for the few CuPy names :class:`chainerkfac.graphs.step.
StepGraph` uses, with stream capture emulated: device work is a Python
callable passed to :meth:`FakeCupy.kernel`; it runs at once, or, while a
stream captures, is recorded into the graph that ``end_capture`` returns
and runs at each ``launch``. Streams record their waits and launches."""
import contextlib
import itertools
import types

import numpy


class Array(numpy.ndarray):
    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)


class Graph:
    def __init__(self, kernels, log):
        self.kernels = kernels
        self.log = log

    def launch(self, stream=None):
        self.log.append(('launch', stream.name))
        for kernel in self.kernels:
            kernel()


_POINTERS = itertools.count(0x9000)


class FakeCupy:
    def __init__(self):
        self.log = []
        self.capturing = None          # the kernels of the open capture
        self.allocator = 'default'
        self.sync_error = None
        fake = self

        class Stream:
            count = 0

            def __init__(self, non_blocking=False):
                Stream.count += 1
                self.name = 'side{}'.format(Stream.count)
                self.ptr = next(_POINTERS)     # unique in the process
                self.non_blocking = non_blocking

            def record(self):
                return self.name

            def wait_event(self, event):
                fake.log.append(('wait', self.name, event))

            def __enter__(self):
                fake.current.append(self)

            def __exit__(self, *exc):
                fake.current.pop()

            def begin_capture(self):
                assert fake.capturing is None
                fake.capturing = []
                fake.log.append(('begin_capture', self.name,
                                 fake.allocator))

            def end_capture(self):
                kernels, fake.capturing = fake.capturing, None
                if kernels is None:
                    raise RuntimeError('cudaErrorStreamCaptureInvalidated')
                return Graph(kernels, fake.log)

        class MemoryPool:
            made = 0    # a serial number: id() is reused once one is freed

            def __init__(self):
                MemoryPool.made += 1
                self.malloc = 'private pool {}'.format(MemoryPool.made)
                self.cached = 1024     # bytes of free blocks it keeps
                self.in_use = 0        # bytes of arrays cut from it
                self.frees = 0

            def free_all_blocks(self):
                self.frees += 1
                self.cached = 0

            def total_bytes(self):
                return self.cached + self.in_use

        @contextlib.contextmanager
        def using_allocator(allocator):
            previous, fake.allocator = fake.allocator, allocator
            try:
                yield
            finally:
                fake.allocator = previous

        self.default_pool = MemoryPool()
        self.default_pool.malloc = 'default'
        main = Stream()
        main.name = 'main'
        self.current = [main]
        self.ndarray = Array
        self.cuda = types.SimpleNamespace(
            Stream=Stream, MemoryPool=MemoryPool,
            using_allocator=using_allocator,
            get_current_stream=lambda: fake.current[-1],
            runtime=types.SimpleNamespace(getDevice=lambda: 0))

    def get_default_memory_pool(self):
        return self.default_pool

    def empty(self, shape, dtype):
        return numpy.full(shape, numpy.nan, dtype).view(Array)

    def asarray(self, array):
        return numpy.array(array).view(Array)

    def kernel(self, function):
        """Device work: run now, or record while a stream captures."""
        if self.capturing is not None:
            self.capturing.append(function)
        else:
            function()

    def synchronize(self):
        """A host synchronisation: refused while capturing (as CUDA
        refuses it and invalidates the capture)."""
        if self.capturing is not None:
            self.capturing = None
            raise RuntimeError('cudaErrorStreamCaptureUnsupported: '
                               'operation not permitted when stream is '
                               'capturing')


class OutOfMemoryError(MemoryError):
    """CuPy's ``cupy.cuda.memory.OutOfMemoryError`` (a MemoryError)."""
