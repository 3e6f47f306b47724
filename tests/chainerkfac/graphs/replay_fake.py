"""A CuPy stand-in whose CUDA graphs replay a real (NumPy) training step,
for StepGraph driving K-FAC and GuardedOptimizer on a CPU.

CUDA's capture runs the step's Python once (its host effects happen) and
records its device work without running it; a launch runs that device
work on the static inputs, and no Python. Here the step computes on NumPy
arrays, so the stand-in emulates both halves:

* **capture**: ``begin_capture`` copies the emulated device memory (the
  arrays ``device_arrays()`` returns: parameters, states, statistics, the
  guard's and the hyperparameters' buffers); the step runs; ``end_capture``
  puts that memory back (the device work did not happen), leaving the
  step's host effects (``t``, the damping, the due factors ...) once;
* **launch**: the step runs again on the static inputs, and every host
  effect is undone around it: the adapter's ``host_state`` /
  ``restore_host_state`` (what StepGraph relies on after a failed
  capture), and its reports go to a reporter of their own; the arrays the
  capture reported (loss, accuracy) are overwritten with the new values,
  as a replay rewrites the memory of the captured ones.

A host effect the adapter's state misses therefore happens twice, a
report it misses never: tests that compare with eager runs see both.
``capturing`` says whether a capture is open (the tests' host-read
checks).
"""
import numpy

import chainer

from tests.chainerkfac.graphs.cupy_graph_fake import FakeCupy


class Array(numpy.ndarray):
    """The inputs' type (CuPy's ndarray here), NumPy otherwise."""


class ReplayCupy(FakeCupy):
    """Parameters
    ----------
    device_arrays : callable
        ``() -> list`` of the arrays that are device memory.
    """

    def __init__(self, device_arrays):
        super().__init__()
        fake = self
        self.ndarray = Array
        self.step_graph = None         # the StepGraph whose graphs launch
        self.captures = 0
        base = self.cuda.Stream

        class Graph:
            def launch(self, stream=None):
                fake.log.append(('launch', stream.name))
                fake._replay()

        class Stream(base):
            def begin_capture(self):
                assert fake.capturing is None
                fake.capturing = []
                fake._saved = [(a, a.copy()) for a in device_arrays()]
                fake.log.append(('begin_capture', self.name,
                                 fake.allocator))

            def end_capture(self):
                for array, copy in fake._saved:
                    array[...] = copy
                fake.capturing = None
                fake.captures += 1
                return Graph()

            def is_capturing(self):
                return fake.capturing is not None

        self.cuda.Stream = Stream
        main = Stream()
        main.name = 'main'
        self.current = [main]

    def empty(self, shape, dtype):
        # what a capture reads before its launch wrote it shows as NaN
        fill = numpy.nan if numpy.dtype(dtype).kind == 'f' else -1
        return numpy.full(shape, fill, dtype).view(Array)

    def asarray(self, array):
        return numpy.array(array).view(Array)

    def _replay(self):
        graph = self.step_graph
        adapter = graph.adapter
        host = adapter.host_state()
        observation = {}
        with chainer.reporter.Reporter().scope(observation):
            graph.step(*graph._static)
        adapter.restore_host_state(host)
        for key, old in graph._reported.items():
            new = observation.get(key)
            if isinstance(old, chainer.Variable):
                old, new = old.array, new.array
            if isinstance(old, numpy.ndarray):
                old[...] = new


def device_arrays_of(optimizer, model):
    """The emulated device memory of a K-FAC or guarded optimizer (its
    wrapped optimizer for GuardedOptimizer) and its model."""
    arrays = []
    for _, link in model.namedlinks():
        for name in link._persistent:
            value = getattr(link, name)
            if isinstance(value, numpy.ndarray):
                arrays.append(value)
    for param in model.params():
        arrays.append(param.array)
        state = param.update_rule.state
        if state:
            arrays += list(state.values())
        for value in vars(param.update_rule.hyperparam).values():
            if isinstance(value, numpy.ndarray):
                arrays.append(value.base if value.base is not None
                              else value)
    guard = optimizer.guard
    for name in ('_flag', '_count'):
        value = getattr(guard, name, None)
        if value is not None:
            arrays.append(value)
    for copies in (getattr(guard, '_updates', None),
                   getattr(guard, '_persistent', None)):
        if copies is not None:
            arrays += [buffer for _, buffer in copies._groups]
    damping = getattr(optimizer, 'device_damping', None)
    if damping is not None:
        arrays.append(damping.base)
    return [a for a in arrays if isinstance(a, numpy.ndarray)]
