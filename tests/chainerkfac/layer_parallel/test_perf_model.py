"""The performance model replays the solver's schedule: on one process its
step counts are the solver's (tests/.../test_mpi.py checks every rank of
several processes, and the messages), and its time is their cost."""
import math

import pytest

from chainerkfac import layer_parallel as lp
from chainerkfac.layer_parallel import perf_model
from tests.chainerkfac.layer_parallel import common

UNIT = perf_model.Costs(step=1.0, adjoint_step=0.0, slope=0.0,
                        layer_grad=0.0, message=0.0, latency=0.0, axpy=0.0)


@pytest.mark.parametrize('n_layers,relax,levels,tol,max_iter', [
    (64, 'FCF', None, 1e-9, 50),     # stops on the tolerance
    (30, 'F', 3, 0.0, 3),            # stops on the cap
    (13, 'FCF', 2, 0.0, 1),
    (5, 'F', 1, 0.0, 3),             # serial
])
def test_step_counts_are_the_solvers(n_layers, relax, levels, tol, max_iter):
    net = common.dense_net(n_layers=n_layers, width=3)
    x, t = common.batch(net, size=4)
    mgrit = lp.MGRIT(net, relax=relax, levels=levels, tol=tol,
                     max_iter=max_iter)
    _, _, history, adjoint_history, _ = common.mgrit_gradients(mgrit, x, t)
    model = perf_model.gradient_time(
        n_layers, 1, UNIT, len(history), len(adjoint_history),
        levels=levels, relax=relax, converged=len(history) < max_iter)
    forward, adjoint = model['schedules']
    assert forward.steps[0] == mgrit.forward_solver.steps
    assert adjoint.steps[0] == mgrit.adjoint_solver.steps
    # Unit forward steps, everything else free: time = forward steps.
    assert model['time'] == sum(mgrit.forward_solver.steps)


def test_more_processes_shorten_the_critical_path():
    costs = UNIT._replace(adjoint_step=1.0, message=0.1, latency=0.01)
    times = [perf_model.gradient_time(256, p, costs, 8, 8)['time']
             for p in (1, 4, 16, 64)]
    assert times == sorted(times, reverse=True)
    # Oversubscription: 4 processes on 2 cores are twice as slow.
    alone = perf_model.gradient_time(256, 4, costs, 8, 8)['time']
    shared = perf_model.gradient_time(256, 4, costs, 8, 8, cores=2)['time']
    assert shared == pytest.approx(2 * alone)


# -- the order of the operations, against a written-out V-cycle -----------
#
# The solver and the model share cycle.VCycle, so comparing their step
# counts cannot catch a wrong order in it. Here both are compared with the
# textbook FAS V-cycle written out below (Falgout et al.; the seed's
# Algorithm 1), independently of VCycle: the solver by the Φ applications
# its propagator actually receives (an instrumented run), the model by the
# work it books.

def _phases(sizes, c, relax, iterations, converged):
    """The V-cycle's Φ applications on one process, phase by phase:
    ``(level, points)``, each point ``j`` of that level in order."""
    last = len(sizes) - 1
    out = []

    def f_points(l):
        return [j for j in range(1, sizes[l] + 1) if j % c]

    def c_points(l):
        return [j for j in range(1, sizes[l] + 1) if not j % c]

    def relax_(l):
        out.append((l, f_points(l)))
        if relax == 'FCF':
            out.append((l, c_points(l)))         # C-relaxation
            out.append((l, f_points(l)))

    def cycle(l):
        if l == last:
            out.append((l, list(range(1, sizes[l] + 1))))   # serial
            return
        relax_(l)
        out.append((l, c_points(l)))             # C-point values
        out.append((l + 1, list(range(1, sizes[l + 1] + 1))))  # restrict
        cycle(l + 1)
        out.append((l, f_points(l)))             # after the correction

    if last == 0:
        out.append((0, list(range(1, sizes[0] + 1))))
        out.append((0, c_points(0)))             # the residual
        return out
    for it in range(iterations):
        relax_(0)
        out.append((0, c_points(0)))             # values and residual
        if converged and it == iterations - 1:
            return out
        out.append((1, list(range(1, sizes[1] + 1))))
        cycle(1)
    out.append((0, f_points(0)))
    return out


class _Recorder:
    """A propagator that records each Φ as (level, point of that level)."""

    def __init__(self, propagator, c):
        self.propagator, self.c, self.calls = propagator, c, []

    def step(self, start, stop, u, out=None):
        width = stop - start
        level = round(math.log(width, self.c))
        assert self.c ** level == width, (start, stop)
        self.calls.append((level, stop // width))
        return self.propagator.step(start, stop, u, out)


@pytest.mark.parametrize('n_layers,relax,levels,tol,max_iter', [
    (64, 'FCF', None, 1e-9, 50),     # stops on the tolerance
    (30, 'F', 3, 0.0, 3),            # stops on the cap
    (13, 'FCF', 2, 0.0, 1),
    (5, 'F', 1, 0.0, 3),             # serial
])
def test_solver_and_model_follow_the_written_out_cycle(
        n_layers, relax, levels, tol, max_iter, monkeypatch):
    net = common.dense_net(n_layers=n_layers, width=3)
    x, t = common.batch(net, size=4)
    mgrit = lp.MGRIT(net, relax=relax, levels=levels, tol=tol,
                     max_iter=max_iter)
    c = mgrit.forward_solver.coarsening
    recorders = []
    for solver in (mgrit.forward_solver, mgrit.adjoint_solver):
        solver.propagator = _Recorder(solver.propagator, c)
        recorders.append(solver.propagator)
    _, _, history, adjoint_history, _ = common.mgrit_gradients(mgrit, x, t)

    booked = {}
    work = perf_model.Schedule._work

    def recording_work(self, rank, level, count, start):
        if count:
            booked.setdefault(id(self), []).append((level, count))
        return work(self, rank, level, count, start)
    monkeypatch.setattr(perf_model.Schedule, '_work', recording_work)
    perf_model.gradient_time(n_layers, 1, UNIT, len(history),
                             len(adjoint_history), levels=levels,
                             relax=relax,
                             converged=len(history) < max_iter)
    sizes = [layout.steps for layout in mgrit.forward_solver.layouts]
    assert sizes[0] == n_layers
    models = list(booked.values())
    assert len(models) == 2
    for recorder, iterations, model in zip(
            recorders, (len(history), len(adjoint_history)), models):
        phases = _phases(sizes, c, relax, iterations,
                         converged=iterations < max_iter)
        expected = [(level, j) for level, points in phases for j in points]
        assert recorder.calls == expected
        assert model == [(level, len(points)) for level, points in phases
                         if points]


def test_the_written_out_cycle_tells_orders_apart():
    # Restriction before relaxation, or F-relaxation alone where FCF is
    # asked, gives other sequences: the comparison above can fail.
    fcf = _phases([16, 4], 4, 'FCF', 1, converged=False)
    f = _phases([16, 4], 4, 'F', 1, converged=False)
    assert fcf != f
    assert [p for p, _ in fcf] == [0, 0, 0, 0, 1, 1, 0]
