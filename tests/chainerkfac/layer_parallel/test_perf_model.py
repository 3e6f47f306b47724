"""The performance model replays the solver's schedule: on one process its
step counts are the solver's (tests/.../test_mpi.py checks every rank of
several processes, and the messages), and its time is their cost."""
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
