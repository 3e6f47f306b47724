"""A performance model of layer-parallel MGRIT: critical-path layer
applications × the measured time of one layer + messages × the measured
time of one message + the coarsest level's serial solve.

The model replays the schedule of :class:`.cycle.FASSolver` — the same
partition, levels and operations, the same rule for which point each
process waits for — with a clock per process instead of arrays: an
operation starts on a process when its previous one has finished and the
values it receives have arrived (sent + one message time), and costs one
layer time per application of Φ. The step and message counts it implies
are the solver's own (a test compares them process by process), so the
model's only assumptions are the per-layer and per-message costs, and that
a process computes alone on its core (with more processes than cores,
every cost is scaled by processes / cores).
"""
import math
import time
from typing import List, NamedTuple, Optional, Sequence

import numpy

from chainerkfac.layer_parallel import cycle
from chainerkfac.layer_parallel import partition


class Costs(NamedTuple):
    """Measured unit costs in seconds (for one batch)."""

    #: One forward layer step Φ (``ResidualODE.step``).
    step: float
    #: One adjoint layer step (``ResidualODE.step_adjoint``).
    adjoint_step: float
    #: Linearising one layer (``ResidualODE.slope``).
    slope: float
    #: One layer's weight gradient (``ResidualODE.accumulate_layer_grad``).
    layer_grad: float
    #: One state-sized message between two processes.
    message: float
    #: One small message (a layer's weights, a round of the residual
    #: norm's allgather, which takes log2 P rounds).
    latency: float
    #: One elementwise operation on a state (a copy, an addition).
    axpy: float
    #: One forward + backward of the opening layer and the classifier.
    ends: float = 0.0


class Schedule(cycle.VCycle):
    """The clocks of every process through the solves of one direction
    (the order of :class:`.cycle.VCycle`, timed).

    Parameters
    ----------
    fine_owners : sequence of int
        Owner of every fine point (:func:`.partition.forward_point_owners`
        or :func:`.partition.adjoint_point_owners`).
    n_procs, coarsening, levels, relax
        As :class:`.cycle.FASSolver`.
    """

    def __init__(self, fine_owners: Sequence[int], n_procs: int,
                 coarsening: int, levels: Optional[int], relax: str):
        if relax not in cycle.RELAXATIONS:
            raise ValueError('relax must be one of {}, not {!r}'.format(
                cycle.RELAXATIONS, relax))
        self.n_procs = n_procs
        self.relax = relax
        sizes = partition.level_sizes(len(fine_owners) - 1, coarsening,
                                      levels)
        self.layouts = [
            [_Layout(steps, coarsening ** level, fine_owners, rank,
                     coarsening) for rank in range(n_procs)]
            for level, steps in enumerate(sizes)]
        # Processes in the order of their points on each level: every
        # value a process waits for comes from one earlier in this order.
        self.order = [sorted((r for r in range(n_procs) if lay[r].count),
                             key=lambda r, lay=lay: lay[r].first)
                      for lay in self.layouts]
        self.clock = [0.0] * n_procs
        self.steps = [[0] * len(sizes) for _ in range(n_procs)]
        self.messages = [0] * n_procs

    # -- a whole solve -----------------------------------------------------

    def solve(self, iterations: int, converged: bool, t_step: float,
              t_message: float, t_latency: float, t_axpy: float) -> None:
        """Advance the clocks by one solve of ``iterations`` iterations
        that stopped on the tolerance (``converged``) or on the cap, as
        :meth:`.cycle.FASSolver.solve` runs it.

        Costs: Φ is ``t_step`` (plus one ``t_axpy`` to add g on a coarse
        level); a C-point's residual on the finest level three
        ``t_axpy`` (difference, square, sum); restriction one ``t_axpy``
        per coarse point (injection) and one per coarse step (g);
        correction one per coarse point.
        """
        self._t, self._m = t_step, t_message
        self._lat, self._axpy = t_latency, t_axpy
        if len(self.layouts) == 1:
            self._serial(0)
            self._c_values(0, residual=True)
            self._collective()
        else:
            for it in range(iterations):
                self._relax(0)
                self._c_values(0, residual=True)
                self._collective()
                if converged and it == iterations - 1:
                    break
                self._restrict(0)
                self._cycle(1)
                self._correct(0)
            else:
                self._f_relax(0)
        self._ghost(0)

    def receive_weights(self, routes, t_latency: float) -> None:
        """The forward's fetch of remote coarse-level weights."""
        begin = list(self.clock)
        for _, src, dst in routes:
            self.clock[dst] = max(self.clock[dst], begin[src] + t_latency)
            self.messages[src] += 1

    def wait_all(self, extra: float = 0.0) -> None:
        """A collective that synchronises everyone (a broadcast)."""
        self.clock = [max(self.clock) + extra] * self.n_procs

    def add(self, rank_costs: List[float]) -> None:
        """Local work of given cost on every process."""
        self.clock = [c + w for c, w in zip(self.clock, rank_costs)]

    @property
    def time(self) -> float:
        return max(self.clock)

    # -- the operations of FASSolver ---------------------------------------

    def _f_relax(self, level: int) -> None:
        layouts, ready = self.layouts[level], {}
        for r in self.order[level]:
            lay = layouts[r]
            begin = start = self.clock[r]
            if lay.left is not None and not lay.is_c(lay.first):
                start = max(start, ready[lay.left] + self._m)
                self.messages[lay.left] += 1
            self._work(r, level, lay.n_f, start)
            # A C-point goes at once, an F-point when computed.
            ready[r] = begin if lay.is_c(lay.last) else self.clock[r]

    def _c_relax(self, level: int) -> None:
        self._c_values(level)

    def _c_values(self, level: int, residual: bool = False) -> None:
        layouts, begin = self.layouts[level], list(self.clock)
        for r in self.order[level]:
            lay = layouts[r]
            start = self.clock[r]
            if lay.left is not None and lay.is_c(lay.first):
                start = max(start, begin[lay.left] + self._m)
                self.messages[lay.left] += 1
            self._work(r, level, lay.n_c, start)
            if residual:
                self.clock[r] += 3 * lay.n_c * self._axpy

    def _restrict(self, level: int, values=None) -> None:
        # ``values``: the solver's C-point values (None here, only timed).
        layouts, begin = self.layouts[level + 1], list(self.clock)
        for r in self.order[level + 1]:
            lay = layouts[r]
            self.clock[r] += lay.count * self._axpy
            start = self.clock[r]
            if lay.left is not None:
                start = max(start, begin[lay.left] + self._m)
                self.messages[lay.left] += 1
            self._work(r, level + 1, lay.n_c + lay.n_f, start)

    def _correct(self, level: int) -> None:
        layouts = self.layouts[level + 1]
        for r in self.order[level + 1]:
            lay = layouts[r]
            self.clock[r] += (lay.n_c + lay.n_f) * self._axpy

    def _serial(self, level: int) -> None:
        layouts = self.layouts[level]
        for r in self.order[level]:
            lay = layouts[r]
            start = self.clock[r]
            if lay.left is not None:
                start = max(start, self.clock[lay.left] + self._m)
                self.messages[lay.left] += 1
            self._work(r, level, lay.n_c + lay.n_f, start)

    def _ghost(self, level: int) -> None:
        layouts, begin = self.layouts[level], list(self.clock)
        for r in self.order[level]:
            lay = layouts[r]
            if lay.left is not None:
                self.clock[r] = max(self.clock[r], begin[lay.left] + self._m)
                self.messages[lay.left] += 1

    def _collective(self) -> None:
        rounds = math.ceil(math.log2(self.n_procs)) if self.n_procs > 1 else 0
        self.wait_all(rounds * self._lat)

    def _work(self, rank: int, level: int, count: int, start: float) -> None:
        """``count`` applications of Φ on ``level`` (each adds g on a
        coarse level)."""
        self.steps[rank][level] += count
        per_step = self._t + (self._axpy if level > 0 else 0.0)
        self.clock[rank] = start + count * per_step


class _Layout(partition.LevelLayout):
    """A level layout with its counts of points to update (j >= 1)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.n_c = len(self.owned_c_points())
        self.n_f = len(self.owned_f_points())


def gradient_time(n_layers: int, n_procs: int, costs: Costs,
                  forward_iterations: int, adjoint_iterations: int,
                  coarsening: int = 4, levels: Optional[int] = None,
                  relax: str = 'FCF', converged: bool = True,
                  cores: Optional[int] = None) -> dict:
    """Modelled time of one :meth:`.MGRIT.forward` + :meth:`.MGRIT.backward`.

    Parameters
    ----------
    forward_iterations, adjoint_iterations : int
        Iterations of the two solves (``len`` of their histories).
    converged : bool
        The solves stopped on the tolerance (not on the cap).
    cores : int or None
        Cores the processes share; with more processes, every cost is
        multiplied by processes / cores.

    Returns
    -------
    dict
        ``time`` (s) and its parts ``forward`` and ``backward``, and the
        critical path in layer applications ``forward_steps`` (most steps
        on any process) and ``messages`` (most sent by any process).
    """
    scale = max(1.0, n_procs / cores) if cores else 1.0
    blocks = partition.layer_blocks(n_layers, n_procs, coarsening)
    owners = partition.layer_owners(blocks)
    owned = [len(block) for block in blocks]
    forward = Schedule(partition.forward_point_owners(owners), n_procs,
                       coarsening, levels, relax)
    forward.receive_weights(
        partition.coarse_weight_routes(
            owners, coarsening,
            partition.level_sizes(n_layers, coarsening, levels)),
        scale * costs.latency)
    forward.solve(forward_iterations, converged, scale * costs.step,
                  scale * costs.message, scale * costs.latency,
                  scale * costs.axpy)
    forward.wait_all()                       # the logits' broadcast
    adjoint = Schedule(partition.adjoint_point_owners(owners), n_procs,
                       coarsening, levels, relax)
    adjoint.clock = [forward.time + scale * costs.ends] * n_procs
    adjoint.add([scale * costs.slope * k for k in owned])
    adjoint.solve(adjoint_iterations, converged, scale * costs.adjoint_step,
                  scale * costs.message, scale * costs.latency,
                  scale * costs.axpy)
    adjoint.add([scale * costs.layer_grad * k for k in owned])
    return {
        'time': adjoint.time,
        'forward': forward.time,
        'backward': adjoint.time - forward.time,
        'forward_steps': max(sum(s) for s in forward.steps),
        'adjoint_steps': max(sum(s) for s in adjoint.steps),
        'messages': max(f + a for f, a in zip(forward.messages,
                                               adjoint.messages)),
        'schedules': (forward, adjoint),
    }


def measure_layer_costs(net, x, t, repeats: int = 3) -> dict:
    """Seconds of each operation of :class:`Costs` that involves no
    messages, measured as the solver performs it: a one-level (serial)
    :class:`.MGRIT` forward and backward of ``net`` on the batch ``x``,
    labels ``t``, each phase's time divided by its count (the median of
    ``repeats`` runs); ``axpy`` from a sweep of additions over states.
    Leaves the grads of ``net`` cleared.
    """
    from chainerkfac.layer_parallel.mgrit import MGRIT
    serial = MGRIT(net, levels=1, warm_start=False)
    runs = []
    for _ in range(repeats + 1):             # the first warms the caches
        net.cleargrads()
        serial.timings.clear()
        serial.forward(x)
        serial.backward(t)
        runs.append(dict(serial.timings))
    net.cleargrads()
    median = {phase: float(numpy.median([run[phase] for run in runs[1:]]))
              for phase in runs[0]}
    n_layers = net.n_layers
    solves = repeats + 1
    states = serial.forward_solver.u[0]

    def additions():
        for n in range(n_layers):
            states[n + 1] += states[n]
        net.synchronize()

    return {
        'step': median['forward_solve']
        / (serial.forward_solver.steps[0] / solves),
        'adjoint_step': median['adjoint_solve']
        / (serial.adjoint_solver.steps[0] / solves),
        'slope': median['linearise'] / n_layers,
        'layer_grad': median['layer_grads'] / n_layers,
        'axpy': _median_time(additions, repeats) / n_layers,
        'ends': median['ends'],
    }


def measure_messages(transport, shape, dtype, repeats: int = 50,
                     statistic=numpy.median, xp=numpy) -> dict:
    """Seconds of one state-sized message (``message``) and of one small
    one (``latency``): half a ping-pong between ranks 0 and 1, the
    ``statistic`` of ``repeats`` (the median; the minimum for the cost on
    an uncontended core), broadcast to every process (zero on one). With
    ``xp`` CuPy the buffers are device arrays (staged through the host, as
    MGRIT's states are)."""
    if transport.size == 1:
        return {'message': 0.0, 'latency': 0.0}
    result = {}
    for name, buf_shape in (('message', shape), ('latency', (1,))):
        buf = xp.zeros(buf_shape, dtype)
        times = []
        for _ in range(repeats):
            begin = time.perf_counter()
            if transport.rank == 0:
                transport.waitall([transport.isend(buf, 1, 0)])
                transport.recv(buf, 1, 0)
            elif transport.rank == 1:
                transport.recv(buf, 0, 0)
                transport.waitall([transport.isend(buf, 0, 0)])
            times.append((time.perf_counter() - begin) / 2)
        result[name] = transport.bcast(float(statistic(times)), root=0)
    return result


def _median_time(call, repeats: int) -> float:
    call()                                   # warm caches and allocators
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        call()
        times.append(time.perf_counter() - begin)
    return float(numpy.median(times))
