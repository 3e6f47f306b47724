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
* **launch**: the step of the StepGraph that captured the graph runs
  again on its static inputs, and every host effect is undone around it:
  the adapter's ``host_state`` / ``restore_host_state`` (what StepGraph
  relies on after a failed capture), and its reports go to a reporter of
  their own; the arrays the capture made and a replay rewrites are
  overwritten with the new values, as a replay rewrites their memory:
  what it reported (loss, accuracy), the outputs StepGraph rebinds
  (gradients, the model's loss) and the adapter's ``captured_arrays()``
  (K-FAC's captured factor sums, against ``current_arrays()``); then the
  attributes of the adapter's ``step_objects()`` that hold device arrays
  (or Variables of them) are put back as they were before the launch, as
  a replay sets none. What the captured kernels hold is the capture's
  too: the re-run sees, as they were at the capture, then as they are now
  again, ``chainer.config.train`` (which kernels were recorded: batch or
  running statistics), each watched link's plain attributes (numbers,
  bools, strings: kernel arguments such as a BatchNormalization's
  ``decay`` and ``eps``, or ``N``, from which fine-tune mode computes the
  decay on the host), and each watched parameter's array, update rule,
  its ``enabled`` flag and its state's arrays as the captured step left
  them (the buffers and the kernels a capture records: a link frozen
  since is updated as captured, an array replaced since is not the one
  the replay writes). (NumPy
  scalars stand for CuPy's 0-d results, which NumPy's 0-d arithmetic
  gives as scalars: they keep the re-run's values, as the 0-d arrays the
  capture made would hold the replay's.)

A host effect the adapter's state misses therefore happens twice, a
report it misses never: tests that compare with eager runs see both.
``capturing`` says whether a capture is open (the tests' host-read
checks).
"""
import sys

import numpy

import chainer

from tests.chainerkfac.graphs.cupy_graph_fake import FakeCupy


class Array(numpy.ndarray):
    """What ``empty`` and ``asarray`` make (CuPy's ndarray is NumPy's
    here)."""


class ReplayCupy(FakeCupy):
    """Parameters
    ----------
    device_arrays : callable
        ``() -> list`` of the arrays that are device memory.
    watched : callable, optional
        ``() -> list`` of objects whose attributes holding device arrays a
        replay must leave as they were (besides the adapter's
        ``step_objects()``): the optimizer, its bounded step, the model's
        links and parameters. What an adapter fails to rebind there shows.
    """

    def __init__(self, device_arrays, watched=list):
        super().__init__()
        fake = self
        self.watched = watched
        # every NumPy array stands for device memory (the gradients that
        # NumPy's products make are plain ndarrays)
        self.ndarray = numpy.ndarray
        self.step_graph = None         # the StepGraph whose graphs launch
        self.captures = 0
        base = self.cuda.Stream

        class Graph:
            def __init__(self, owner, before, held):
                self.owner = owner
                # the host state the captured step began from (the first
                # launch follows the capture, whose host effects stay)
                self.before = before
                # what the captured kernels hold (_held)
                self.held = held

            def launch(self, stream=None):
                fake.log.append(('launch', stream.name))
                now = _held(fake.watched())
                _hold(self.held)
                try:
                    fake._replay(self.owner, self.before)
                finally:
                    _hold(now)
                self.before = None

        class Stream(base):
            def begin_capture(self):
                assert fake.capturing is None
                # the StepGraph that captures (its _capture calls this)
                fake._owner = sys._getframe(1).f_locals.get('self')
                fake._before = (None if fake._owner is None else
                                fake._owner.adapter.host_state())
                fake.capturing = []
                fake._held = _held(fake.watched())
                fake._saved = [(a, a.copy()) for a in device_arrays()]
                fake.log.append(('begin_capture', self.name,
                                 fake.allocator))

            def end_capture(self):
                for array, copy in fake._saved:
                    array[...] = copy
                fake.capturing = None
                fake.captures += 1
                # the values the step's Python read (as it began), the
                # buffers it left (as it ended: those made in the capture)
                train, links, _ = fake._held
                held = (train, links, _held(fake.watched())[2])
                return Graph(fake._owner, fake._before, held)

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

    def _replay(self, graph=None, before=None):
        graph = graph if graph is not None else self.step_graph
        adapter = graph.adapter
        host = adapter.host_state()
        if before is not None:
            adapter.restore_host_state(before)
        captured = getattr(adapter, 'captured_arrays', list)()
        # a replay sets no Python attribute: those of the objects the step
        # sets are put back after it (StepGraph rebinds the outputs)
        objects = {id(o): o for o in list(self.watched()) + list(
            getattr(adapter, 'step_objects', list)())}
        saved = [(o, dict(vars(o))) for o in objects.values()]
        observation = {}
        with chainer.reporter.Reporter().scope(observation):
            graph.step(*graph._static)
        if captured:
            fresh = adapter.current_arrays()
            assert len(fresh) == len(captured)
            for old, new in zip(captured, fresh):
                old[...] = new
        for owner, name, old in graph._outputs:
            new = vars(owner).get(name)
            if new is old:
                continue
            if isinstance(old, chainer.Variable):
                old, new = old.array, new.array
            old[...] = new
        for owner, attributes in saved:
            for name, value in attributes.items():
                if _device_value(value):
                    vars(owner)[name] = value
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


def watched_of(optimizer, model) -> list:
    """What a replay of ``optimizer``'s steps must not rebind (the
    ``watched`` of :class:`ReplayCupy`)."""
    objects = [optimizer, getattr(optimizer, 'step_bound', None)]
    objects += list(model.links()) + list(model.params())
    return [o for o in objects if o is not None]


_PLAIN = (bool, int, float, str, numpy.number, numpy.bool_)


def _held(objects) -> tuple:
    """What a capture records of the watched ``objects`` as it runs the
    step's Python once (the module docstring): the configuration's
    ``train``, each link's plain attributes, and each parameter's array,
    update rule, ``enabled`` flag and state (a shallow copy: the arrays)."""
    links, params = [], []
    for o in objects:
        if isinstance(o, chainer.Link):
            links.append((o, {k: v for k, v in vars(o).items()
                              if isinstance(v, _PLAIN)}))
        elif isinstance(o, chainer.Parameter):
            rule = o.update_rule
            params.append((o, o.array, rule, None if rule is None else (
                rule.enabled, None if rule._state is None else
                dict(rule._state))))
    return chainer.config.train, links, params


def _hold(held) -> None:
    """Set back what :func:`_held` took."""
    train, links, params = held
    chainer.config.train = train
    for link, values in links:
        vars(link).update(values)
    for param, array, rule, kept in params:
        param.array, param.update_rule = array, rule
        if rule is not None:
            rule.enabled = kept[0]
            rule._state = None if kept[1] is None else dict(kept[1])


def _device_value(value) -> bool:
    """An emulated device array, or a Variable of one."""
    if isinstance(value, chainer.Variable):
        value = value.array
    return isinstance(value, numpy.ndarray)
