"""Table 1 / Fig. 5: weak scaling of one layer-parallel gradient, measured
on 1, 2, 4 processes and modelled up to the seed's 512 cores / 2048 layers.

    python -m experiments.layer_parallel.scaling [--processes 1,2,4]
        [--layers-per-process 64] [--cases peaks,digits] [--repeats 5]
        [--convergence FILE] [--at-scale 256:64,...,2048:512] [--out DIR]
        [--timeout S] [--gpu]

``--gpu``: every process computes on GPU 0 with CuPy arrays, its states
staged through host memory between processes
(:mod:`chainerkfac.layer_parallel.transport`); every timing, the unit
costs of the model included, is synchronised with the device, and the
message costs are those of device states. The results go to
``table1_scaling_gpu.json`` and ``fig5_scaling_gpu.png``.

**Measured.** For every P the script launches itself under
``mpiexec -n P``: N = (layers per process) × P layers, the case's batch,
fixed initial weights (smooth in the layer index, the regime the seed's
regularised training keeps them in). One gradient is one forward and one
adjoint MGRIT solve from zero states to a residual drop of 10⁻⁵ (the
seed's stopping rule for Table 1), c = 4, FCF, plus the weight gradients;
its time is the slowest rank's, the median of ``--repeats`` rounds after
one warm-up. The P = 1 launch also times the layer-serial gradient of
every N of the table twice: Chainer's forward and backward of ``net(x)``,
and the same layer kernels as MGRIT run serially (a one-level MGRIT).
With more processes than cores the launch is marked oversubscribed.

**Modelled** (:mod:`chainerkfac.layer_parallel.perf_model`): the solver's
own schedule replayed with a clock per process — critical-path layer
applications × the time of one layer + messages × the time of one message
+ the coarsest level's serial solve. Its unit costs are measured: the
layer operations by a one-level solve, on every rank at once right after
each timed gradient (so the load of this shared machine, and
oversubscription, are the same in both), the messages by a ping-pong of a
state between two ranks. The check (a) divides, round by round, the model
with that round's costs by that round's time (the median ratio); (b) uses
the 1-process costs scaled by processes / cores against the median time.

**Predicted** for the seed's configurations (4 layers per core, N = 256 ..
2048): the 1-process layer costs, the fastest 2-process ping-pong (a
process alone on its core, as on a cluster) and the iteration counts of
the convergence experiment (run it first; smooth weights, and again with
independent per-layer weights' counts), against the faster of the two
measured layer-serial times.

Writes ``table1_scaling.json`` and ``fig5_scaling.png``.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from chainerkfac import layer_parallel as lp
from chainerkfac.layer_parallel import perf_model
from benchmarks import _args
from benchmarks import _common
from experiments.layer_parallel import common

#: The seed's weak-scaling configurations, layers:cores.
AT_SCALE = '256:64,512:128,1024:256,2048:512'
DROP = 1e-5


# -- the worker (one mpiexec launch) ------------------------------------------

def worker(args) -> None:
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    size = world.Get_size()
    out = {'processes': size, 'cases': {}}
    device = common.device(args.gpu)
    device.use()
    for case in args.cases:
        n_layers = args.layers_per_process * size
        net = common.make_net(case, n_layers)
        net.to_device(device)
        x, t = (device.send(a) for a in common.make_batch(case))
        shape, dtype = net.state_shape(x.shape), net.opening.W.dtype
        mgrit = lp.MGRIT(net, comm=world, coarsening=4, relax='FCF',
                         tol=0.0, rtol=DROP, max_iter=50, warm_start=False)
        rounds = []
        for repeat in range(args.repeats + 1):
            net.cleargrads()
            net.synchronize()
            world.Barrier()
            begin = time.perf_counter()
            _, history = mgrit.forward(x)
            _, adjoint_history = mgrit.backward(t)
            net.synchronize()
            elapsed = world.allreduce(time.perf_counter() - begin,
                                      op=MPI.MAX)
            # The unit costs right after, on every rank at once: what a
            # layer and a message cost under the same load.
            world.Barrier()
            costs = world.gather(
                perf_model.measure_layer_costs(net, x, t, repeats=1), root=0)
            messages = perf_model.measure_messages(
                mgrit.transport, shape, dtype, repeats=20, xp=net.xp)
            if repeat and world.Get_rank() == 0:   # the first warms up
                rounds.append({
                    'time': elapsed,
                    'costs': {name: statistics.median(c[name] for c in costs)
                              for name in costs[0]},
                    'messages': messages, 'load': os.getloadavg()[0]})
        # On uncontended cores (the modelled machine's); on this shared
        # machine a ping-pong often waits for a time slice.
        best_messages = perf_model.measure_messages(
            mgrit.transport, shape, dtype, statistic=min, xp=net.xp)
        serial, kernels = {}, {}
        if size == 1:
            for n in sorted(set(args.serial_layers) | {n_layers}):
                serial[n] = _serial_time(case, n, x, t, args.repeats,
                                         device)
                kernels[n] = _kernels_serial_time(case, n, x, t,
                                                  args.repeats, device)
                common.logger.info(
                    '%s: layer-serial gradient, N = %d: %.3f s (Chainer), '
                    '%.3f s (the same kernels as MGRIT)', case, n, serial[n],
                    kernels[n])
        if world.Get_rank() == 0:
            out['cases'][case] = {
                'layers': n_layers, 'batch': len(x),
                'iterations': [len(history), len(adjoint_history)],
                'time': statistics.median(r['time'] for r in rounds),
                'rounds': rounds,
                'best_messages': best_messages,
                'serial': serial, 'kernels_serial': kernels,
            }
            common.logger.info(
                '%s: P = %d, N = %d: %.3f s per gradient (median of %d; %d + '
                '%d iterations; load %.1f)', case, size, n_layers,
                out['cases'][case]['time'], len(rounds), len(history),
                len(adjoint_history), rounds[-1]['load'])
        del mgrit, net
    if world.Get_rank() == 0:
        common.write_json(args.result, out)


def _serial_time(case, n_layers, x, t, repeats, device) -> float:
    """Chainer's layer-serial forward and backward of ``net(x)``."""
    import chainer.functions as F
    net = common.make_net(case, n_layers)
    net.to_device(device)
    times = []
    for _ in range(repeats + 1):
        net.cleargrads()
        net.synchronize()
        begin = time.perf_counter()
        F.softmax_cross_entropy(net(x), t).backward()
        net.synchronize()
        times.append(time.perf_counter() - begin)
    return statistics.median(times[1:])


def _kernels_serial_time(case, n_layers, x, t, repeats, device) -> float:
    """The layer kernels MGRIT uses, run serially (a one-level MGRIT,
    whose gradient is bitwise Chainer's)."""
    net = common.make_net(case, n_layers)
    net.to_device(device)
    serial = lp.MGRIT(net, levels=1)
    times = []
    for _ in range(repeats + 1):
        net.cleargrads()
        net.synchronize()
        begin = time.perf_counter()
        serial.forward(x)
        serial.backward(t)
        net.synchronize()
        times.append(time.perf_counter() - begin)
    return statistics.median(times[1:])


# -- the driver ---------------------------------------------------------------

def model_checks(launches, cores) -> list:
    """The model against every measured launch: (a) round by round with
    the unit costs measured in that round (the ratio of two measurements
    taken together: the load of the shared machine changes from second to
    second), the median over rounds; (b) with the one-process costs,
    scaled by processes / cores, against the median time."""
    single = {case: _median_costs(entry['rounds'])
              for case, entry in launches[1]['cases'].items()}
    pair = launches.get(2) or launches[max(launches)]
    rows = []
    for size, launch in sorted(launches.items()):
        for case, entry in launch['cases'].items():
            iterations = entry['iterations']
            ratios = []
            for r in entry['rounds']:
                costs = perf_model.Costs(**r['costs'], **r['messages'])
                model = perf_model.gradient_time(entry['layers'], size, costs,
                                                 *iterations)['time']
                ratios.append(model / r['time'])
            prior = perf_model.Costs(
                **single[case], **pair['cases'][case]['best_messages'])
            a_priori = perf_model.gradient_time(
                entry['layers'], size, prior, *iterations,
                cores=cores)['time']
            rows.append({
                'case': case, 'processes': size, 'layers': entry['layers'],
                'oversubscribed': size > cores, 'measured': entry['time'],
                'model_in_situ': entry['time'] * statistics.median(ratios),
                'error_in_situ': statistics.median(ratios) - 1,
                'error_in_situ_rounds': [ratio - 1 for ratio in ratios],
                'model_one_process_costs': a_priori,
                'error_one_process_costs': a_priori / entry['time'] - 1,
                'load': [r['load'] for r in entry['rounds']],
            })
    return rows


def _median_costs(rounds) -> dict:
    return {name: statistics.median(r['costs'][name] for r in rounds)
            for name in rounds[0]['costs']}


def missing_runs(convergence, cases, at_scale):
    """What the convergence experiment's JSON lacks for the modelled
    configurations ``at_scale`` (the predictions read both weights):
    ``(absent, missing)``, the ``(case, weights)`` with no runs at all and
    the ``(case, weights, N)`` of the others without a run of N."""
    results = convergence.get('results', {}) \
        if isinstance(convergence, dict) else {}
    absent, missing = [], []
    for case in cases:
        for weights in common.WEIGHTS:
            runs = results.get(case, {}).get(weights)
            if not runs:
                absent.append((case, weights))
                continue
            have = {run.get('layers') for run in runs
                    if isinstance(run, dict)}
            missing += [(case, weights, n) for n, _ in at_scale
                        if n not in have]
    return absent, missing


def predictions(launches, convergence, at_scale, weights='smooth',
                message_factor=1.0) -> list:
    """The seed's configurations, modelled with the iteration counts of
    the convergence experiment's ``weights``."""
    pair = launches.get(2) or launches[max(launches)]
    rows = []
    for case, entry in launches[1]['cases'].items():
        runs = {run['layers']: run
                for run in convergence['results'][case][weights]}
        messages = {name: value * message_factor for name, value
                    in pair['cases'][case]['best_messages'].items()}
        costs = perf_model.Costs(**_median_costs(entry['rounds']),
                                 **messages)
        for n_layers, cores in at_scale:
            run = runs[n_layers]
            # A solve stopping at a drop of 1e-5 runs one iteration more
            # than the V-cycles it needs (it checks after relaxing).
            iterations = (run['state_iterations'] + 1,
                          run['adjoint_iterations'] + 1)
            model = perf_model.gradient_time(n_layers, cores, costs,
                                             *iterations)
            serial = entry['serial'][str(n_layers)]
            kernels = entry['kernels_serial'][str(n_layers)]
            best = min(serial, kernels)
            rows.append({
                'case': case, 'layers': n_layers, 'cores': cores,
                'iterations': iterations, 'serial_measured': serial,
                'kernels_serial_measured': kernels,
                'parallel_model': model['time'],
                'speedup_vs_chainer': serial / model['time'],
                'speedup_vs_kernels': kernels / model['time'],
                'speedup': best / model['time'],
                'critical_path_steps': [model['forward_steps'],
                                        model['adjoint_steps']],
                'messages_per_rank': model['messages'],
            })
    return rows


def per_core(at_scale) -> str:
    """The modelled configurations in words: ``'4 layers per core'`` when
    every ``(layers, cores)`` pair has the same ratio, else the pairs."""
    ratios = {layers / cores for layers, cores in at_scale}
    if len(ratios) == 1:
        return '{:g} layers per core'.format(ratios.pop())
    return ', '.join('{} layers on {} cores'.format(*pair)
                     for pair in at_scale)


def x_label(layers_per_process: int, at_scale) -> str:
    """Fig. 5's x-axis label, from the run's ``--layers-per-process`` and
    ``--at-scale``."""
    return 'layers N (measured: {} layers per process; model: {})'.format(
        layers_per_process, per_core(at_scale))


def plot(launches, checks, predicted, path, layers_per_process,
         at_scale) -> None:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    cases = list(launches[1]['cases'])
    fig, axes = plt.subplots(1, len(cases), figsize=(6 * len(cases), 4.2),
                             squeeze=False)
    for ax, case in zip(axes[0], cases):
        serial = launches[1]['cases'][case]['serial']
        layers = sorted(int(n) for n in serial)
        kernels = launches[1]['cases'][case]['kernels_serial']
        ax.loglog(layers, [serial[str(n)] for n in layers], 'k-o', ms=4,
                  label='layer-serial (Chainer), measured')
        ax.loglog(layers, [kernels[str(n)] for n in layers], 'k:.', ms=4,
                  label='layer-serial (same kernels), measured')
        sizes = sorted(launches)
        ax.loglog([launches[p]['cases'][case]['layers'] for p in sizes],
                  [launches[p]['cases'][case]['time'] for p in sizes],
                  'C0-s', ms=6, label='layer-parallel, measured '
                  '(P = {})'.format(', '.join(map(str, sizes))))
        mine = [r for r in checks if r['case'] == case]
        ax.loglog([r['layers'] for r in mine],
                  [r['model_in_situ'] for r in mine], 'C0', ls='none',
                  marker='s', mfc='none', ms=11,
                  label="model of those runs (each round's unit costs)")
        rows = [r for r in predicted if r['case'] == case]
        ax.loglog([r['layers'] for r in rows],
                  [r['parallel_model'] for r in rows], 'C1--^', ms=6,
                  label='layer-parallel, model ({})'.format(
                      per_core(at_scale)))
        for r in rows:
            # Speed-up over the faster of the two layer-serial codes.
            ax.annotate('{:.1f}x'.format(r['speedup']),
                        (r['layers'], r['parallel_model']),
                        textcoords='offset points', xytext=(0, -12),
                        ha='center', fontsize=8, color='C1')
        ax.set_xlabel(x_label(layers_per_process, at_scale))
        ax.set_ylabel('seconds per gradient')
        ax.set_title(case)
        ax.grid(True, which='both', alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle('Fig. 5: weak scaling of one gradient (drop 1e-5)')
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = _common.argument_parser(
        'experiments.layer_parallel.scaling', __doc__)
    parser.add_argument('--processes', type=_args.int_list(1),
                        default='1,2,4',
                        help='comma-separated process counts, 1 among them '
                        '(default: %(default)s)')
    parser.add_argument('--layers-per-process', type=_args.positive_int,
                        default=64, help='layers N per process of each '
                        'launch (default: %(default)s)')
    parser.add_argument('--cases', type=_args.names(list(common.CASES)),
                        default='peaks,digits',
                        help='comma-separated, of {} (default: '
                        '%(default)s)'.format(', '.join(common.CASES)))
    parser.add_argument('--repeats', type=_args.positive_int, default=5,
                        help='timed rounds of each launch (default: '
                        '%(default)s)')
    parser.add_argument('--convergence', default=os.path.join(
        common.RESULTS, 'fig4_convergence.json'),
                        help='the JSON of experiments.layer_parallel.'
                        'convergence, with every N of --at-scale (default: '
                        '%(default)s)')
    parser.add_argument('--at-scale', type=_args.int_pairs, default=AT_SCALE,
                        help='comma-separated layers:cores of the modelled '
                        'configurations (default: %(default)s)')
    parser.add_argument('--out', default=common.RESULTS,
                        help='folder of table1_scaling.json and '
                        'fig5_scaling.png (default: %(default)s, the '
                        'committed results, which a run replaces)')
    parser.add_argument('--timeout', type=_args.positive_float, default=1800,
                        help='seconds per mpiexec launch (default: '
                        '%(default)s)')
    parser.add_argument('--gpu', action='store_true',
                        help='CuPy arrays on GPU 0 (states staged through '
                             'the host between processes)')
    parser.add_argument('--worker', action='store_true',
                        help='(internal) one launch under mpiexec')
    parser.add_argument('--result', help='(internal) the worker JSON')
    parser.add_argument('--serial-layers', default='',
                        help='(internal) layer-serial N to time')
    raw = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(raw)
    common.setup_logging()
    args.serial_layers = [int(n) for n in args.serial_layers.split(',') if n]
    if args.worker:
        worker(args)
        return
    if args.gpu:
        # one line before any launch (each worker failed with Chainer's
        # traceback, then the launcher with its own)
        _common.array_module(True)
    sizes = args.processes
    if 1 not in sizes:
        parser.error('--processes must include 1 (the one-process costs)')
    if not os.path.exists(args.convergence):
        parser.error('{} is missing: run python -m '
                     'experiments.layer_parallel.convergence first'
                     .format(args.convergence))
    try:
        convergence = _args.read_json(args.convergence)
    except argparse.ArgumentTypeError as error:
        parser.error('--convergence: {}'.format(error))
    at_scale = args.at_scale
    absent, missing = missing_runs(convergence, args.cases, at_scale)
    if absent:
        parser.error(
            '--convergence {} has no runs of {}: the predictions read both '
            'weights; run python -m experiments.layer_parallel.convergence '
            '--weights {}'.format(args.convergence, ', '.join(
                '{} {}'.format(*pair) for pair in absent),
                ','.join(common.WEIGHTS)))
    if missing:
        parser.error(
            '--convergence {} has no run of N = {} ({}): give --at-scale '
            'with the layer counts it has, or run python -m experiments.'
            'layer_parallel.convergence --layers with them'.format(
                args.convergence, ', '.join(map(str, sorted(
                    {n for _, _, n in missing}))), '; '.join(
                    '{} {}'.format(case, weights)
                    for case, weights in sorted({(c, w) for c, w, _
                                                 in missing}))))
    _args.check_paths(parser, args, files=(), folders=('out',))
    cores = common.usable_cores()
    serial_layers = sorted({n for n, _ in at_scale}
                           | {args.layers_per_process * p for p in sizes})
    launches = {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            result = os.path.join(tmp, 'p{}.json'.format(size))
            common.launch(size, 'experiments.layer_parallel.scaling', [
                '--worker', '--result', result, '--cases',
                ','.join(args.cases),
                '--layers-per-process', str(args.layers_per_process),
                '--repeats', str(args.repeats),
                '--serial-layers', ','.join(map(str, serial_layers))]
                + (['--gpu'] if args.gpu else []),
                timeout=args.timeout)
            with open(result) as f:
                launches[size] = json.load(f)
    checks = model_checks(launches, cores)
    predicted = predictions(launches, convergence, at_scale)
    slow_network = predictions(launches, convergence, at_scale,
                               message_factor=10.0)
    independent = predictions(launches, convergence, at_scale,
                              weights='independent')
    payload = common.header('scaling', raw)
    payload.update(
        gpu=args.gpu, cores=cores, layers_per_process=args.layers_per_process,
        drop=DROP, launches={str(k): v for k, v in launches.items()},
        model_checks=checks, predictions=predicted,
        predictions_messages_x10=slow_network,
        predictions_independent_weights=independent,
        goals={'model_within': 0.2, 'speedup_at_2048_on_512': 10.0})
    suffix = '_gpu' if args.gpu else ''
    stem = os.path.join(args.out, 'table1_scaling' + suffix)
    common.write_json(stem + '.json', payload)
    plot(launches, checks, predicted,
         os.path.join(args.out, 'fig5_scaling{}.png'.format(suffix)),
         args.layers_per_process, at_scale)
    common.logger.info('\nmodel check (time per gradient, s):')
    for row in checks:
        common.logger.info(
            '  %-6s P=%d N=%4d%s measured %.3f | model, own costs %.3f '
            '(%+.0f%%) | one-process costs %.3f (%+.0f%%)', row['case'],
            row['processes'], row['layers'],
            ' (oversubscribed)' if row['oversubscribed'] else '',
            row['measured'], row['model_in_situ'],
            100 * row['error_in_situ'], row['model_one_process_costs'],
            100 * row['error_one_process_costs'])
    common.logger.info('\nTable 1 at the modelled scale (%s):',
                       per_core(at_scale))
    for row, slow, rough in zip(predicted, slow_network, independent):
        common.logger.info(
            '  %-6s N=%4d cores=%3d  serial %.2f s (Chainer) / %.2f s (same '
            'kernels)  parallel %.3f s (model)  speed-up over the faster '
            'serial %.1fx (messages x10: %.1fx; independent weights\' '
            'iterations: %.1fx)', row['case'], row['layers'], row['cores'],
            row['serial_measured'], row['kernels_serial_measured'],
            row['parallel_model'], row['speedup'], slow['speedup'],
            rough['speedup'])
    common.logger.info('wrote %s.json and fig5_scaling%s.png', stem, suffix)


if __name__ == '__main__':
    main()
