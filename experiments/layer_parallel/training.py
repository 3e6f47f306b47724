"""Table 2 / Fig. 7: layer-serial training against simultaneous
layer-parallel training on Peaks.

    python -m experiments.layer_parallel.training [--layers 128]
        [--iterations 400] [--processes 2] [--lr 0.01] [--m1 2] [--m2 2]
        [--smoothness 1e-3] [--weights smooth] [--eval-every 10]
        [--at-scale 1024:256] [--out DIR] [--timeout S]

Both runs start from the same weights (the seed's Peaks network: width 8,
smoothed ReLU, T = 5; initial weights smooth in the layer index) and take
full-batch steps on the same 5000 training points, minimising the same
objective — the mean cross-entropy plus the seed's time-derivative
regularisation with β = ``--smoothness`` — with the same optimizer, Adam
(the seed preconditions with L-BFGS and a line search, which Chainer does
not have):

* **layer-serial**: Chainer's forward and backward of ``net(x)`` (exact
  gradients), in this process;
* **simultaneous layer-parallel** (the seed's Algorithm 2): ``m1`` forward
  and ``m2`` adjoint MGRIT iterations per step, warm-started from the last
  step's states, c = 4, FCF, on ``--processes`` processes under
  ``mpiexec`` (:class:`chainerkfac.layer_parallel.SimultaneousTraining`).

Every ``--eval-every`` steps both record the validation accuracy on 1000
other Peaks points (evaluation time is not training time). Times per
step are measured here, and modelled for the seed's configuration (N =
1024 on 256 cores) with the performance model; the layer-serial time there
is measured (Chainer) and, as a second baseline, that of the same layer
kernels run serially (a one-level MGRIT), whose gradients are bitwise
Chainer's.

Writes ``table2_training.json`` and ``fig7_training.png``.
"""
import json
import math
import os
import statistics
import sys
import tempfile
import time

import chainer
import chainer.functions as F

from chainerkfac import layer_parallel as lp
from chainerkfac.layer_parallel import data
from chainerkfac.layer_parallel import perf_model
from benchmarks import _args
from benchmarks import _common
from experiments.layer_parallel import common


def _data():
    train = data.peaks_dataset(1000, seed=0)
    validation = data.peaks_dataset(200, seed=1)
    return train, validation


def _accuracy(net, x, t) -> float:
    with chainer.no_backprop_mode():
        return float((net(x).array.argmax(axis=1) == t).mean())


def _progress(label, record, iterations):
    common.logger.info('%s step %4d/%d: loss %.4f, validation %.3f, '
                       '%.1f s', label, record['iteration'], iterations,
                       record['loss'], record['validation'],
                       record['seconds'])


def _objective(net, x, t, smoothness):
    def loss():
        return (F.softmax_cross_entropy(net(x), t)
                + lp.time_smoothness(net, smoothness))
    return loss


def serial_run(args) -> list:
    """Layer-serial training with Chainer's autodiff."""
    (x, t), (x_val, t_val) = _data()
    net = common.make_net('peaks', args.layers, args.weights)
    optimizer = chainer.optimizers.Adam(alpha=args.lr).setup(net)
    objective = _objective(net, x, t, args.smoothness)
    history, seconds = [], 0.0
    for step in range(args.iterations + 1):
        if step % args.eval_every == 0 or step == args.iterations:
            with chainer.no_backprop_mode():
                loss = float(F.softmax_cross_entropy(net(x), t).array)
            history.append({'iteration': step, 'loss': loss,
                            'validation': _accuracy(net, x_val, t_val),
                            'seconds': seconds})
            if step % (args.iterations // 5 or 1) == 0:
                _progress('serial  ', history[-1], args.iterations)
        if step == args.iterations:
            break
        begin = time.perf_counter()
        optimizer.update(objective)
        seconds += time.perf_counter() - begin
    return history


def worker(args) -> None:
    """Simultaneous layer-parallel training under mpiexec."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    (x, t), (x_val, t_val) = _data()
    net = common.make_net('peaks', args.layers, args.weights)
    mgrit = lp.MGRIT(net, comm=world)
    training = lp.SimultaneousTraining(
        mgrit, chainer.optimizers.Adam(alpha=args.lr), m1=args.m1,
        m2=args.m2, smoothness=args.smoothness)
    history, seconds = [], 0.0
    for step in range(args.iterations + 1):
        if step % args.eval_every == 0 or step == args.iterations:
            mgrit.share_weights()
            record = {'iteration': step, 'seconds': seconds}
            if rank == 0:
                with chainer.no_backprop_mode():
                    record['loss'] = float(
                        F.softmax_cross_entropy(net(x), t).array)
                record['validation'] = _accuracy(net, x_val, t_val)
                if history:
                    record['step_loss'] = result.loss
                    record['state_residual'] = result.state_residual
                    record['adjoint_residual'] = result.adjoint_residual
                history.append(record)
                if step % (args.iterations // 5 or 1) == 0:
                    _progress('parallel', record, args.iterations)
        if step == args.iterations:
            break
        world.Barrier()
        begin = time.perf_counter()
        result = training.step(x, t)
        seconds += world.allreduce(time.perf_counter() - begin, op=MPI.MAX)
    # The cost of a message on uncontended cores (the modelled machine's):
    # on this shared machine a ping-pong often waits for a time slice.
    messages = perf_model.measure_messages(
        mgrit.transport, net.state_shape(x.shape), net.opening.W.dtype,
        statistic=min)
    if rank == 0:
        common.write_json(args.result, {'history': history,
                                        'messages': messages})


def step_times(n_layers, smoothness, repeats=3) -> dict:
    """Seconds per training step at ``n_layers``, one process: Chainer's
    layer-serial step, and the same layer kernels run serially."""
    (x, t), _ = _data()
    net = common.make_net('peaks', n_layers)
    optimizer = chainer.optimizers.Adam().setup(net)
    objective = _objective(net, x, t, smoothness)
    times = []
    for _ in range(repeats + 1):
        begin = time.perf_counter()
        optimizer.update(objective)
        times.append(time.perf_counter() - begin)
    chainer_step = sorted(times[1:])[len(times[1:]) // 2]
    serial = lp.SimultaneousTraining(lp.MGRIT(net, levels=1),
                                     chainer.optimizers.Adam(),
                                     smoothness=smoothness)
    times = []
    for _ in range(repeats + 1):
        begin = time.perf_counter()
        serial.step(x, t)
        times.append(time.perf_counter() - begin)
    kernels_step = sorted(times[1:])[len(times[1:]) // 2]
    times = []
    for _ in range(repeats + 1):             # grads are still there
        begin = time.perf_counter()
        serial.optimizer.update()
        times.append(time.perf_counter() - begin)
    update = sorted(times[1:])[len(times[1:]) // 2]
    costs = perf_model.measure_layer_costs(net, x, t)
    return {'chainer': chainer_step, 'kernels': kernels_step,
            'update_per_layer': update / n_layers, 'costs': costs}


def plot(serial, parallel, label, path) -> None:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, x_key, x_label in ((axes[0], 'iteration', 'optimizer step'),
                               (axes[1], 'seconds', 'training time (s)')):
        for history, name, color in ((serial, 'layer-serial', 'k'),
                                     (parallel, label, 'C1')):
            xs = [r[x_key] for r in history]
            ax.plot(xs, [r['loss'] for r in history], color=color,
                    label=name + ': training loss')
            ax.plot(xs, [r['validation'] for r in history], color=color,
                    ls='--', label=name + ': validation accuracy')
        ax.set_xlabel(x_label)
        ax.set_ylim(0, 1.6)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle('Fig. 7: Peaks, layer-serial vs simultaneous layer-parallel'
                 ' training (Adam)')
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = _common.argument_parser(
        'experiments.layer_parallel.training', __doc__)
    parser.add_argument('--layers', type=_args.at_least(2), default=128,
                        help='layers N of the peaks network (default: '
                        '%(default)s)')
    parser.add_argument('--iterations', type=_args.positive_int,
                        default=400, help='training steps (default: '
                        '%(default)s)')
    parser.add_argument('--processes', type=_args.positive_int, default=2,
                        help='processes of the layer-parallel run '
                        '(default: %(default)s)')
    parser.add_argument('--lr', type=_args.positive_float, default=0.01,
                        help='learning rate (default: %(default)s)')
    parser.add_argument('--smoothness', type=float, default=1e-3,
                        help='β of the time-derivative regularisation '
                        '(default: %(default)s)')
    parser.add_argument('--weights', default='smooth',
                        choices=common.WEIGHTS,
                        help='initial weights smooth in the layer index or '
                        'drawn per layer (default: %(default)s)')
    parser.add_argument('--at-scale', type=_args.int_pairs,
                        default='1024:256',
                        help='layers:cores of the modelled configuration '
                        '(default: %(default)s)')
    parser.add_argument('--worker', action='store_true',
                        help='(internal) the layer-parallel run')
    parser.add_argument('--result', help='(internal) the worker JSON')
    common.add_training_options(parser, 'table2_training.json and '
                                'fig7_training.png')
    raw = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(raw)
    common.setup_logging()
    if args.worker:
        worker(args)
        return
    if len(args.at_scale) != 1:
        parser.error('--at-scale: one layers:cores pair, got {}'.format(
            len(args.at_scale)))
    _args.check_paths(parser, args, files=(), folders=('out',))
    [(n_scale, cores_scale)] = args.at_scale
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, 'parallel.json')
        common.launch(args.processes, 'experiments.layer_parallel.training',
                      ['--worker', '--result', result,
                       '--layers', str(args.layers),
                       '--iterations', str(args.iterations),
                       '--lr', str(args.lr), '--m1', str(args.m1),
                       '--m2', str(args.m2),
                       '--smoothness', str(args.smoothness),
                       '--weights', args.weights,
                       '--eval-every', str(args.eval_every)],
                      timeout=args.timeout)
        with open(result) as f:
            parallel = json.load(f)
    load.append(os.getloadavg()[0])
    serial = serial_run(args)
    here = step_times(args.layers, args.smoothness)
    scale = step_times(n_scale, args.smoothness)
    load.append(os.getloadavg()[0])
    costs = perf_model.Costs(**scale['costs'], **parallel['messages'])
    modelled = perf_model.gradient_time(n_scale, cores_scale, costs,
                                        args.m1, args.m2, converged=False)
    # Each process updates its own layers (4 at the seed's scale), and
    # trades a layer with each neighbour and a few floats with everyone
    # for the regularisation.
    modelled['time'] += (
        scale['update_per_layer'] * -(-n_scale // cores_scale)
        + (2 + math.ceil(math.log2(cores_scale))) * costs.latency)
    final = {'serial': serial[-1]['validation'],
             'parallel': parallel['history'][-1]['validation']}
    # Full-batch Adam at a fixed rate oscillates by a point or two from
    # step to step: the mean over the last quarter of the steps as well.
    late = {name: statistics.mean(
        r['validation'] for r in history
        if r['iteration'] > 3 * args.iterations // 4)
        for name, history in (('serial', serial),
                              ('parallel', parallel['history']))}
    steps = args.iterations
    table = {
        'here': {
            'layers': args.layers, 'processes': args.processes,
            'oversubscribed': args.processes > common.usable_cores(),
            'serial_seconds': serial[-1]['seconds'],
            'parallel_seconds': parallel['history'][-1]['seconds'],
            'serial_step': serial[-1]['seconds'] / steps,
            'parallel_step': parallel['history'][-1]['seconds'] / steps,
            'kernels_serial_step': here['kernels'],
            'load_average': load,
        },
        'at_scale': {
            'layers': n_scale, 'cores': cores_scale,
            'serial_step_chainer': scale['chainer'],
            'serial_step_kernels': scale['kernels'],
            'parallel_step_model': modelled['time'],
            'speedup_vs_chainer': scale['chainer'] / modelled['time'],
            'speedup_vs_kernels': scale['kernels'] / modelled['time'],
            'speedup': (min(scale['chainer'], scale['kernels'])
                        / modelled['time']),
        },
        'final_validation': final,
        'validation_gap_points': 100 * (final['parallel'] - final['serial']),
        'last_quarter_validation': late,
        'last_quarter_gap_points': 100 * (late['parallel'] - late['serial']),
    }
    payload = common.header('training', raw)
    payload.update(layers=args.layers, iterations=steps, lr=args.lr,
                   optimizer='Adam', m1=args.m1, m2=args.m2,
                   smoothness=args.smoothness, weights=args.weights,
                   serial=serial, parallel=parallel['history'], table=table,
                   goal='simultaneous within 1 point of serial validation')
    stem = os.path.join(args.out, 'table2_training')
    common.write_json(stem + '.json', payload)
    label = 'layer-parallel (m1={}, m2={}, {} processes)'.format(
        args.m1, args.m2, args.processes)
    plot(serial, parallel['history'], label,
         os.path.join(args.out, 'fig7_training.png'))
    common.logger.info(
        '\nfinal validation accuracy: serial %.3f, simultaneous %.3f '
        '(%+.1f points; over the last quarter %+.1f)\nhere (N = %d): %.3f s per step serial (Chainer), '
        '%.3f s same kernels serial, %.3f s layer-parallel on %d processes'
        '\nat N = %d on %d cores (model): %.4f s per step; speed-up %.1fx '
        'over Chainer, %.1fx over the same kernels serial (measured)',
        final['serial'], final['parallel'], table['validation_gap_points'],
        table['last_quarter_gap_points'],
        args.layers, table['here']['serial_step'], here['kernels'],
        table['here']['parallel_step'], args.processes, n_scale,
        cores_scale, modelled['time'],
        table['at_scale']['speedup_vs_chainer'],
        table['at_scale']['speedup_vs_kernels'])


if __name__ == '__main__':
    main()
