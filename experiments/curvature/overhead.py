"""The seed's Figure 6: the time of the gradient *and* each quantity over the
gradient alone.

One step of batch 64 on synthetic inputs of CIFAR shapes: 3C3D with 10
classes (CIFAR-10) and All-CNN-C with 100 classes (CIFAR-100),
float32, on the CPU (``--gpu`` on a CUDA device). "Gradient alone" is the
forward pass and ``loss.backward()`` of plain Chainer; each quantity is one
:func:`chainerkfac.curvature.extract` call (its own forward and gradient
pass included). Each quantity is timed right after a gradient alone, in
rounds over all quantities, and its ratio is the median over rounds of the
two times (quartiles beside it). Both the process's CPU time and the wall
clock are recorded; with one BLAS thread the CPU time is what the
computation costs, and it is the primary figure here because the CPU is
shared with other jobs (the load average is recorded), which stretches the
wall clock at random.

The exact quantities (``kflr``, ``diag_ggn``, ``diag_hessian``) take one
extra backward pass per class, propagated stacked, a chunk of columns at
once (:mod:`chainerkfac.curvature.columns`): on All-CNN-C (100 classes)
they are timed in ``--exact-repetitions`` rounds only (the seed too
reports them apart, in its Figure 8). KFRA propagates dense ``h × h``
matrices (``h = 64·28·28`` after 3C3D's first convolution): not defined at
these sizes (:data:`chainerkfac.curvature.kfra.MAX_FEATURES`).

``--peer`` then times BackPACK on PyTorch with the same networks, batch and
protocol in the same process (:mod:`experiments.curvature.peer_backpack`;
skipped, with the reason in the JSON, when PyTorch or BackPACK cannot be
imported; neither is a dependency) and tables and plots its ratios beside
ours. On the GPU (``--gpu``) the ratios are read on the wall clock.

Writes ``overhead.json`` and ``overhead.png`` into ``--out``::

    python -m experiments.curvature.overhead [--peer]
"""
import argparse
import os
import sys
import time

import chainerkfac  # NOQA  (before chainer: NumPy-2 compatibility shims)
import numpy

import chainer
import chainer.functions as F

from benchmarks import _args
from benchmarks import _common
from chainerkfac import curvature
from experiments.curvature import networks
from experiments.curvature import peer_backpack

CHEAP = ('batch_grad', 'batch_l2', 'sum_grad_squared', 'variance',
         'diag_ggn_mc', 'kfac')
EXACT = ('kflr', 'diag_ggn', 'diag_hessian')
NETWORKS = {
    '3c3d': (networks.ThreeCThreeD, 10),
    'allcnnc': (networks.AllCNNC, 100),
}
#: The seed's goals for 3C3D (ratio to the gradient alone).
GOALS = {'batch_l2': 1.5, 'sum_grad_squared': 1.5, 'variance': 1.5,
         'kfac': 2.0, 'diag_ggn_mc': 2.0}


def parse_args(argv):
    parser = _common.argument_parser('experiments.curvature.overhead', __doc__)
    # the peer's protocol, the same options (it runs with --peer)
    peer_backpack.add_protocol_options(parser, NETWORKS)
    parser.add_argument('--threads', type=_args.positive_int, default=1,
                        help='BLAS threads (one: steadier on a shared CPU; '
                             'default: %(default)s)')
    parser.add_argument('--gpu', action='store_true',
                        help='CuPy arrays on GPU 0')
    parser.add_argument('--peer', action='store_true',
                        help='then BackPACK on PyTorch with the same '
                             'networks and protocol, tabled and plotted '
                             'beside ours (skipped, with the reason, when '
                             'either cannot be imported)')
    parser.add_argument('--out', default=os.path.join(
        'experiments', 'results', 'curvature'),
                        help='folder of overhead.json and overhead.png '
                             '(default: %(default)s, the committed results, '
                             'which a run replaces)')
    parser.add_argument('--replot', action='store_true',
                        help='only draw the PNG again from the JSON in --out')
    args = parser.parse_args(argv)
    # --replot's earlier result, read once
    args.earlier = None
    if args.replot:
        try:
            args.earlier = _args.read_json(
                os.path.join(args.out, 'overhead.json'))
        except argparse.ArgumentTypeError as error:
            parser.error('--replot: {}'.format(error))
    _args.check_paths(parser, args, files=(), folders=('out',))
    return args


def quartiles(values):
    q1, q2, q3 = numpy.percentile(values, [25, 50, 75])
    return {'median': float(q2), 'q1': float(q1), 'q3': float(q3)}


def measure(name, args, xp, sync):
    """``{clock: {configuration: [seconds per round]}}`` on one network;
    every quantity paired with a gradient timed just before it."""
    build, classes = NETWORKS[name]
    numpy.random.seed(0)
    model = build(classes)
    if xp is not numpy:
        model.to_gpu()
    rng = numpy.random.RandomState(1)
    x = xp.asarray(rng.randn(args.batch, 3, 32, 32).astype(numpy.float32))
    t = xp.asarray(rng.randint(0, classes, args.batch).astype(numpy.int32))

    def gradient():
        model.cleargrads()
        F.softmax_cross_entropy(model(x), t).backward()

    def timed(run):
        sync()
        wall, cpu = time.perf_counter(), time.process_time()
        run()
        sync()
        return time.perf_counter() - wall, time.process_time() - cpu

    exact_rounds = args.repetitions if classes <= 10 else \
        args.exact_repetitions
    times = {'wall': {}, 'cpu': {}}
    gradient()
    label_width = len('round {0}/{0}:'.format(args.repetitions))
    for round_ in range(-1, args.repetitions):       # round -1: warm-up
        for quantity in CHEAP + EXACT:
            if quantity in EXACT and (round_ >= exact_rounds or (
                    round_ < 0 and classes > 10)):
                continue
            base = timed(gradient)
            cost = timed(lambda: curvature.extract(
                model, x, t, quantities=(quantity,), seed=0))
            if round_ >= 0:
                for clock, b, c in zip(('wall', 'cpu'), base, cost):
                    times[clock].setdefault('gradient ' + quantity,
                                            []).append(b)
                    times[clock].setdefault(quantity, []).append(c)
            label = 'warm-up' if round_ < 0 else 'round {}/{}'.format(
                round_ + 1, args.repetitions)
            print('  {} {:<{}} {:<16} {:7.3f} s CPU ({:.2f}x), '
                  'wall {:7.3f} s ({:.2f}x), load {:.1f}'.format(
                      name, label + ':', label_width, quantity, cost[1],
                      cost[1] / base[1], cost[0], cost[0] / base[0],
                      os.getloadavg()[0]), flush=True)
    return model, times


def summarize(model, classes, times):
    return summarize_times(networks.parameter_count(model), classes, times)


def summarize_times(parameters: int, classes: int, times) -> dict:
    """Quartiles of the paired ratios of ``times`` (:func:`measure`'s)."""
    out = {'parameters': parameters, 'classes': classes, 'quantities': {}}
    gradients = {clock: numpy.concatenate([
        v for k, v in times[clock].items() if k.startswith('gradient ')])
        for clock in times}
    out['gradient_seconds'] = {clock: quartiles(v)
                               for clock, v in gradients.items()}
    for quantity in CHEAP + EXACT:
        if quantity not in times['cpu']:
            continue
        entry = {'rounds': len(times['cpu'][quantity]),
                 'goal': GOALS.get(quantity) if classes == 10 else None}
        for clock in times:
            seconds = numpy.array(times[clock][quantity])
            base = numpy.array(times[clock]['gradient ' + quantity])
            entry[clock] = {'seconds': [round(v, 4) for v in seconds],
                            'gradient_seconds': [round(v, 4) for v in base],
                            'ratio': quartiles(seconds / base)}
        out['quantities'][quantity] = entry
    return out


def primary_clock(data) -> str:
    """The clock the ratios are read on: the process's CPU time on the CPU
    (one BLAS thread, a shared machine), the wall clock on the GPU."""
    return 'wall' if data['gpu'] else 'cpu'


def peer_ratio(data, name, quantity):
    """BackPACK's median ratio of ``quantity`` on ``name``, or the reason
    there is none (``'not supported'``, ``'skipped'``, None if not run)."""
    peer = data.get('peer_backpack')
    if peer is None:
        return None
    if 'skipped' in peer:
        return 'skipped'
    result = peer['networks'].get(name)
    if result is None:
        return None
    if quantity in result['unsupported']:
        return 'not supported'
    entry = result['quantities'].get(quantity)
    if entry is None:
        return None
    return entry[primary_clock(data)]['ratio']['median']


def table(data) -> str:
    """Our ratios, with BackPACK's beside them when it ran."""
    clock = primary_clock(data)
    peer = data.get('peer_backpack')
    rows = []
    for name, result in data['networks'].items():
        for quantity, entry in result['quantities'].items():
            ratio = entry[clock]['ratio']
            row = [name, quantity, ratio['median'], ratio['q1'], ratio['q3'],
                   entry['rounds'], entry['goal']]
            if peer is not None:
                theirs = peer_ratio(data, name, quantity)
                row += [theirs, ratio['median'] / theirs
                        if isinstance(theirs, float) else None]
            rows.append(row)
    headers = ['network', 'quantity', clock + ' ratio', 'q1', 'q3', 'rounds',
               'goal']
    if peer is not None:
        headers += ['BackPACK', 'ours / theirs']
    text = _common.format_table(headers, rows)
    if peer is not None and 'skipped' in peer:
        text += '\nBackPACK skipped: {}'.format(peer['skipped'])
    elif peer is not None:
        text += '\ngradient alone, {} s: {}'.format(clock, ', '.join(
            '{} ours {:.4f} / PyTorch {:.4f}'.format(
                name, data['networks'][name]['gradient_seconds'][clock][
                    'median'],
                peer['networks'][name]['gradient_seconds'][clock]['median'])
            for name in data['networks'] if name in peer['networks']))
    return text


def plot(data, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    from matplotlib import ticker
    clock = primary_clock(data)
    names = list(data['networks'])
    quantities = CHEAP + EXACT
    peer = data.get('peer_backpack')
    beside = peer is not None and 'skipped' not in peer
    width = 0.4 if beside else 0.8
    fig, axes = plt.subplots(1, len(names), figsize=(7 * len(names), 4.5),
                             squeeze=False)
    for ax, name in zip(axes[0], names):
        result = data['networks'][name]
        shown = [q for q in quantities if q in result['quantities']]
        ratios = [result['quantities'][q][clock]['ratio'] for q in shown]
        median = [r['median'] for r in ratios]
        errors = [[r['median'] - r['q1'] for r in ratios],
                  [r['q3'] - r['median'] for r in ratios]]
        colors = ['tab:blue' if q in CHEAP[:4] else
                  'tab:orange' if q in CHEAP else 'tab:red' for q in shown]
        offset = -width / 2 if beside else 0.0
        positions = [i + offset for i in range(len(shown))]
        ax.bar(positions, median, width, yerr=errors, color=colors,
               capsize=3, label='chainerkfac')
        for x, value in zip(positions, median):
            ax.text(x, value * 1.05, '{:.2f}'.format(value), ha='center',
                    fontsize=7)
        if beside:
            for i, q in enumerate(shown):
                theirs = peer_ratio(data, name, q)
                x = i + width / 2
                if isinstance(theirs, float):
                    ax.bar(x, theirs, width, color='lightgrey',
                           edgecolor='black', hatch='//',
                           label='BackPACK' if i == 0 else None)
                    ax.text(x, theirs * 1.05, '{:.2f}'.format(theirs),
                            ha='center', fontsize=7)
                elif theirs is not None:
                    ax.text(x, 1.05, theirs.replace(' ', '\n'),
                            ha='center', fontsize=6, rotation=90,
                            va='bottom')
            ax.legend(fontsize=7, loc='upper left')
        ax.axhline(1.0, color='black', linewidth=0.8)
        ax.set_yscale('log')
        ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1, 2, 5)))
        ax.yaxis.set_major_formatter(ticker.FormatStrFormatter('%g'))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xticks(range(len(shown)))
        ax.set_xticklabels(shown, rotation=40, ha='right')
        ax.set_ylabel('{} time / gradient alone'.format(
            'CPU' if clock == 'cpu' else 'wall'))
        title = '{} ({} classes), batch {}: gradient {:.3f} s'.format(
            name, result['classes'], data['batch'],
            result['gradient_seconds'][clock]['median'])
        if beside and name in peer['networks']:
            title += ' (PyTorch {:.3f} s)'.format(
                peer['networks'][name]['gradient_seconds'][clock]['median'])
        ax.set_title(title, fontsize=9)
    note = ''
    if peer is not None and 'skipped' in peer:
        note = '\nBackPACK skipped: {}'.format(peer['skipped'][:100])
    fig.suptitle('chainerkfac.curvature{}:\ngradient and one quantity over '
                 'the gradient alone ({})\nmedians and quartiles over rounds; '
                 'blue: first order, orange: sampled, red: exact{}'.format(
                     ' beside BackPACK' if beside else '',
                     'GPU, wall clock' if data['gpu'] else
                     'CPU time, {} BLAS thread, shared machine'.format(
                         data['blas_threads']), note), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.replot:
        plot(args.earlier, os.path.join(args.out, 'overhead.png'))
        print('wrote {}'.format(os.path.join(args.out, 'overhead.png')))
        return
    xp = _common.array_module(args.gpu)
    sync = _common.synchronizer(xp)
    data = _common.header('overhead', argv, gpu=args.gpu)
    data['command'] = ' '.join(['python', '-m',
                                'experiments.curvature.overhead'] + argv)
    data.update(batch=args.batch, repetitions=args.repetitions,
                gpu=args.gpu, blas_threads=args.threads,
                load_average_start=os.getloadavg(), networks={})
    print(_common.describe_machine(data), flush=True)
    names = args.networks
    with _common.limit_blas_threads(args.threads), \
            chainer.using_config('train', True):
        for name in names:
            print('{}: batch {}, {} rounds'.format(name, args.batch,
                                                   args.repetitions),
                  flush=True)
            model, times = measure(name, args, xp, sync)
            data['networks'][name] = summarize(model, NETWORKS[name][1],
                                               times)
        if args.peer:
            data['peer_backpack'] = peer_backpack.run(
                names, args.batch, args.repetitions, args.exact_repetitions,
                args.threads, args.gpu,
                log=lambda line: print(line, flush=True))
    data['load_average_end'] = os.getloadavg()
    print(table(data))
    os.makedirs(args.out, exist_ok=True)
    _common.write_json(os.path.join(args.out, 'overhead.json'), data)
    plot(data, os.path.join(args.out, 'overhead.png'))
    print('wrote {}'.format(os.path.join(args.out, 'overhead.{json,png}')))


if __name__ == '__main__':
    main()
