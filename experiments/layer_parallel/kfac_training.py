"""Simultaneous layer-parallel training with Adam and with K-FAC: validation
accuracy against optimizer steps, on Peaks and on the digits.

    python -m experiments.layer_parallel.kfac_training [--cases peaks,digits]
        [--layers 32] [--steps 200] [--processes 2] [--layer-procs 2]
        [--adam-lr 0.01] [--kfac-lr 0.05] [--kfac-damping 1e-2]
        [--eval-every 10] [--targets 0.8,0.9] [--out DIR] [--timeout S]

Both runs of a case start from the same weights (smooth in the layer
index), take the same full-batch steps of the seed's Algorithm 2 — m1 = m2
= 2 MGRIT iterations per step, warm-started, c = 4, FCF — on
``--processes`` processes under ``mpiexec`` arranged as a
:class:`chainerkfac.layer_parallel.ProcessGrid` of ``--layer-procs``
processes per layer group times the rest as data replicas, and differ only
in the optimizer:

* **Adam** (``--adam-lr``; the optimizer of Table 2 here), each process on
  the parameters it owns, gradients averaged over the replicas;
* **K-FAC** (:class:`chainerkfac.optimizers.KFAC`, ``--kfac-lr``, momentum
  0.9, ``--kfac-damping``, factors refreshed every step) set up by
  :func:`chainerkfac.layer_parallel.setup_kfac`: Fisher blocks of the owned
  layers, their factors from MGRIT's finest-level states and adjoints,
  distributed over the data replicas.

Peaks: the seed's network (width 8, smoothed ReLU, T = 5) on 5000 points,
validation on 1000 others. Digits (standing in for MNIST): 8 channels of
3 × 3 convolutions, tanh, on ``--digits-train`` of scikit-learn's images,
validation on the held-out 297. Every ``--eval-every`` steps the weights
are gathered and the validation accuracy of the whole network is measured
(evaluation time is not training time). The table gives the final
accuracy, the steps each optimizer needs to first reach each of
``--targets``, and the time per step.

Writes ``kfac_training.json`` and ``fig_kfac_training.png``.
"""
import json
import os
import sys
import tempfile
import time

import chainer

from chainerkfac import layer_parallel as lp
from chainerkfac.layer_parallel import data
from chainerkfac.optimizers import KFAC
from benchmarks import _args
from benchmarks import _common
from experiments.layer_parallel import common

OPTIMIZERS = ('adam', 'kfac')


def _data(case, args):
    if case == 'peaks':
        return data.peaks_dataset(1000, seed=0), data.peaks_dataset(200,
                                                                    seed=1)
    (x, t), validation = data.digits_dataset(seed=0)
    return (x[:args.digits_train], t[:args.digits_train]), validation


def _optimizer(name, args):
    if name == 'adam':
        return chainer.optimizers.Adam(alpha=args.adam_lr)
    return KFAC(lr=args.kfac_lr, momentum=0.9, damping=args.kfac_damping,
                verbose=False, **KFAC_OPTIONS)


#: The study's K-FAC, pinned (not the library's defaults, which moved
#: since: refreshes every 20 steps and the bounded step): every factor
#: refreshed at every step, no bound, dense factors. Recorded in the JSON.
KFAC_OPTIONS = dict(refresh_interval_a=1, refresh_interval_g=1,
                    refresh_interval_f=1, kl_clip=None, low_rank=False)


def worker(args) -> None:
    """Both optimizers on every case under mpiexec; rank 0 writes JSON."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    grid = lp.ProcessGrid(world, layer_procs=args.layer_procs)
    out = {}
    for case in args.cases:
        (x, t), (x_val, t_val) = _data(case, args)
        local = grid.local_batch(x, t)
        for name in OPTIMIZERS:
            net = common.make_net(case, args.layers)
            mgrit = lp.MGRIT(net, comm=grid.layer_comm)
            training = lp.SimultaneousTraining(
                mgrit, _optimizer(name, args), m1=args.m1, m2=args.m2,
                grid=grid)
            history, seconds, preconditioned = [], 0.0, None
            for step in range(args.steps + 1):
                if step % args.eval_every == 0 or step == args.steps:
                    mgrit.share_weights()
                    with chainer.no_backprop_mode():
                        accuracy = float((net(x_val).array.argmax(axis=1)
                                          == t_val).mean())
                    history.append({'step': step, 'validation': accuracy,
                                    'seconds': seconds,
                                    'loss': result.loss if step else None})
                    if rank == 0 and step % (args.steps // 4 or 1) == 0:
                        common.logger.info(
                            '%s %-4s step %4d/%d: validation %.3f, %.1f s',
                            case, name, step, args.steps, accuracy, seconds)
                if step == args.steps:
                    break
                world.Barrier()
                begin = time.perf_counter()
                result = training.step(*local)
                seconds += world.allreduce(time.perf_counter() - begin,
                                           op=MPI.MAX)
                if name == 'kfac' and step == 0:
                    # Every owned block preconditioned from the first step:
                    # its factors came from MGRIT's states and adjoints.
                    blocks = [b for b in training.optimizer.blocks
                              if b.factor_names]
                    preconditioned = world.allreduce(
                        int(all(b.last_refresh[n] == 0 for b in blocks
                                for n in b.factor_names)), op=MPI.MIN)
            out.setdefault(case, {})[name] = {
                'history': history, 'steps': args.steps,
                'seconds_per_step': seconds / args.steps,
                'all_blocks_refreshed_at_step_0': preconditioned}
    if rank == 0:
        common.write_json(args.result, out)


def steps_to(history, target):
    """The first evaluated step whose validation accuracy is at least
    ``target``, or None."""
    for record in history:
        if record['validation'] >= target:
            return record['step']
    return None


def plot(results, args, path) -> None:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    cases = list(results)
    fig, axes = plt.subplots(1, len(cases), figsize=(6 * len(cases), 4),
                             squeeze=False)
    for ax, case in zip(axes[0], cases):
        for name, color, label in (('adam', 'C0', 'Adam'),
                                   ('kfac', 'C3', 'K-FAC')):
            history = results[case][name]['history']
            ax.plot([r['step'] for r in history],
                    [r['validation'] for r in history], color=color,
                    label='{} ({:.3f} s/step)'.format(
                        label, results[case][name]['seconds_per_step']))
        for target in args.targets:
            ax.axhline(target, color='grey', lw=0.6, ls=':')
        ax.set_xlabel('optimizer step (m1 = m2 = {} MGRIT iterations)'
                      .format(args.m1))
        ax.set_ylabel('validation accuracy')
        ax.set_title('{}: {} layers, {} processes ({} per layer group)'
                     .format(case, args.layers, args.processes,
                             args.layer_procs), fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc='lower right')
    fig.suptitle('Simultaneous layer-parallel training: Adam vs K-FAC on '
                 'the layers each process owns')
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = _common.argument_parser(
        'experiments.layer_parallel.kfac_training', __doc__)
    parser.add_argument('--cases', type=_args.names(list(common.CASES)),
                        default='peaks,digits',
                        help='comma-separated, of {} (default: '
                        '%(default)s)'.format(', '.join(common.CASES)))
    parser.add_argument('--layers', type=_args.at_least(2), default=32,
                        help='layers N of each network (default: '
                        '%(default)s)')
    parser.add_argument('--steps', type=_args.positive_int, default=200,
                        help='training steps (default: %(default)s)')
    parser.add_argument('--processes', type=_args.positive_int, default=2,
                        help='processes of the launch (default: '
                        '%(default)s)')
    parser.add_argument('--layer-procs', type=_args.positive_int, default=2,
                        help='processes per layer group (the rest are data '
                             'replicas; default: %(default)s)')
    parser.add_argument('--adam-lr', type=_args.positive_float, default=0.01,
                        help="Adam's learning rate (default: %(default)s)")
    parser.add_argument('--kfac-lr', type=_args.positive_float, default=0.05,
                        help="K-FAC's learning rate (default: %(default)s)")
    parser.add_argument('--kfac-damping', type=_args.positive_float,
                        default=1e-2,
                        help="K-FAC's damping (default: %(default)s)")
    parser.add_argument('--digits-train', type=_args.positive_int,
                        default=300, help='training images of the digits '
                        'case (default: %(default)s)')
    parser.add_argument('--targets',
                        type=_args.or_empty(_args.accuracy_list),
                        default='0.8,0.9',
                        help='validation accuracies to count steps to '
                        '(default: %(default)s)')
    parser.add_argument('--worker', action='store_true',
                        help='(internal) the runs under mpiexec')
    parser.add_argument('--result', help='(internal) the worker JSON')
    common.add_training_options(parser, 'kfac_training.json and its PNG')
    raw = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(raw)
    if args.processes % args.layer_procs:
        parser.error('--layer-procs {} does not divide --processes {}'
                     .format(args.layer_procs, args.processes))
    if not args.worker:
        _args.check_paths(parser, args, files=(), folders=('out',))
    common.setup_logging()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, 'runs.json')
        common.launch(args.processes,
                      'experiments.layer_parallel.kfac_training',
                      list(raw) + ['--worker', '--result', result],
                      timeout=args.timeout)
        with open(result) as f:
            results = json.load(f)
    table = {}
    for case, runs in results.items():
        table[case] = {name: {
            'final_validation': run['history'][-1]['validation'],
            'best_validation': max(r['validation'] for r in run['history']),
            'steps_to': {str(target): steps_to(run['history'], target)
                         for target in args.targets},
            'seconds_per_step': run['seconds_per_step']}
            for name, run in runs.items()}
    payload = common.header('kfac_training', raw)
    payload.update(
        layers=args.layers, steps=args.steps, processes=args.processes,
        layer_procs=args.layer_procs, m1=args.m1, m2=args.m2,
        adam_lr=args.adam_lr, kfac_lr=args.kfac_lr,
        kfac_damping=args.kfac_damping, kfac_options=KFAC_OPTIONS,
        digits_train=args.digits_train,
        targets=args.targets, runs=results, table=table)
    common.write_json(os.path.join(args.out, 'kfac_training.json'), payload)
    plot(results, args, os.path.join(args.out, 'fig_kfac_training.png'))
    for case, rows in table.items():
        for name, row in rows.items():
            common.logger.info(
                '%-6s %-4s final validation %.3f (best %.3f), steps to %s: '
                '%s, %.3f s per step', case, name, row['final_validation'],
                row['best_validation'], ', '.join(map(str, args.targets)),
                ', '.join(str(row['steps_to'][str(t)])
                          for t in args.targets), row['seconds_per_step'])
    common.logger.info('wrote %s', os.path.join(
        args.out, 'kfac_training.json (and fig_kfac_training.png)'))


if __name__ == '__main__':
    main()
