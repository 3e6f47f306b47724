"""The peer, timed with the same protocol: BackPACK on PyTorch, with 3C3D and
All-CNN-C built as in :mod:`experiments.curvature.networks`.

    python -m experiments.curvature.peer_backpack [--networks 3c3d,allcnnc]
        [--batch 64] [--repetitions 7] [--exact-repetitions 1]
        [--threads 1] [--gpu] [--out FILE.json]

or ``python -m experiments.curvature.overhead --peer``, which runs it after
its own figures and tables the two side by side.

The protocol is :mod:`experiments.curvature.overhead`'s: one step of batch
64 on synthetic inputs of CIFAR shapes, float32; "gradient alone" is
``zero_grad``, forward, cross-entropy and ``backward()`` of plain PyTorch;
each quantity is the same step inside ``with backpack(extension)`` on the
``extend``-ed model and loss, timed right after a gradient alone, in rounds
over all quantities; its ratio is the median over rounds of the paired
ratios, with the process's CPU time (primary here, one BLAS / intra-op
thread) and the wall clock. The exact quantities on All-CNN-C (100
classes) are timed in ``--exact-repetitions`` rounds, as ours.

A quantity BackPACK does not support on a network (its KFAC and KFLR on
All-CNN-C's average pooling, for example) is recorded with the error it
raised instead of figures. PyTorch and BackPACK are never dependencies of
this project: when either cannot be imported the benchmark says so and
records ``{"skipped": reason}``.
"""
import argparse
import os
import sys
import time
from typing import Dict, Optional, Sequence

#: Our quantity names and BackPACK's extension class for each.
EXTENSIONS = {
    'batch_grad': 'BatchGrad', 'batch_l2': 'BatchL2Grad',
    'sum_grad_squared': 'SumGradSquared', 'variance': 'Variance',
    'diag_ggn_mc': 'DiagGGNMC', 'kfac': 'KFAC', 'kflr': 'KFLR',
    'diag_ggn': 'DiagGGNExact', 'diag_hessian': 'DiagHessian',
}
CHEAP = ('batch_grad', 'batch_l2', 'sum_grad_squared', 'variance',
         'diag_ggn_mc', 'kfac')
EXACT = ('kflr', 'diag_ggn', 'diag_hessian')
CLASSES = {'3c3d': 10, 'allcnnc': 100}


def why_unavailable(gpu: bool = False) -> Optional[str]:
    """None when the peer can run here; else why not, in words."""
    for module, package in (('torch', 'PyTorch'),
                            ('backpack', 'BackPACK (backpack-for-pytorch)')):
        try:
            __import__(module)
        except Exception as error:   # not installed, or a broken install
            return '{} cannot be imported ({}: {})'.format(
                package, type(error).__name__, error)
    import torch
    if gpu and not torch.cuda.is_available():
        return 'PyTorch sees no CUDA device'
    return None


def build(name: str, classes: int):
    """3C3D or All-CNN-C as a ``torch.nn.Sequential`` with the layers of
    :mod:`experiments.curvature.networks` (Chainer's ``cover_all`` max
    pooling is PyTorch's ``ceil_mode``; the global mean is an average
    pooling over the 6 × 6 map)."""
    from torch import nn
    if name == '3c3d':
        return nn.Sequential(
            nn.Conv2d(3, 64, 5), nn.ReLU(),
            nn.MaxPool2d(3, 2, ceil_mode=True),
            nn.Conv2d(64, 96, 3), nn.ReLU(),
            nn.MaxPool2d(3, 2, ceil_mode=True),
            nn.Conv2d(96, 128, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(3, 2, ceil_mode=True),
            nn.Flatten(), nn.Linear(3 * 3 * 128, 512), nn.ReLU(),
            nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, classes))
    if name == 'allcnnc':
        layers = []
        specs = [(3, 96, 3, 1, 1), (96, 96, 3, 1, 1), (96, 96, 3, 2, 1),
                 (96, 192, 3, 1, 1), (192, 192, 3, 1, 1),
                 (192, 192, 3, 2, 1), (192, 192, 3, 1, 0),
                 (192, 192, 1, 1, 0), (192, classes, 1, 1, 0)]
        for c_in, c_out, k, stride, pad in specs:
            layers += [nn.Conv2d(c_in, c_out, k, stride, pad), nn.ReLU()]
        layers += [nn.AvgPool2d(6), nn.Flatten()]
        return nn.Sequential(*layers)
    raise ValueError('unknown network {!r}; known: {}'.format(
        name, ', '.join(CLASSES)))


def _measure(name: str, batch: int, repetitions: int,
             exact_repetitions: int, device: str, log) -> Dict:
    import torch
    import backpack
    from backpack import extensions
    classes = CLASSES[name]
    torch.manual_seed(0)
    model = backpack.extend(build(name, classes).to(device))
    lossfun = backpack.extend(torch.nn.CrossEntropyLoss())
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, 32, 32, generator=generator).to(device)
    t = torch.randint(0, classes, (batch,), generator=generator).to(device)
    sync = torch.cuda.synchronize if device == 'cuda' else (lambda: None)

    def gradient():
        model.zero_grad()
        lossfun(model(x), t).backward()

    def quantity(name):
        extension = getattr(extensions, EXTENSIONS[name])()

        def run():
            model.zero_grad()
            loss = lossfun(model(x), t)
            with backpack.backpack(extension):
                loss.backward()
        return run

    def timed(run):
        sync()
        wall, cpu = time.perf_counter(), time.process_time()
        run()
        sync()
        return time.perf_counter() - wall, time.process_time() - cpu

    exact_rounds = repetitions if classes <= 10 else exact_repetitions
    times = {'wall': {}, 'cpu': {}}
    errors = {}
    gradient()
    for round_ in range(-1, repetitions):          # round -1: warm-up
        for name_q in CHEAP + EXACT:
            if name_q in errors:
                continue
            if name_q in EXACT and (round_ >= exact_rounds or (
                    round_ < 0 and classes > 10)):
                continue
            base = timed(gradient)
            try:
                cost = timed(quantity(name_q))
            except Exception as error:   # BackPACK's "not supported"
                errors[name_q] = '{}: {}'.format(type(error).__name__,
                                                 str(error)[:300])
                log('  peer {}: {} not supported ({})'.format(
                    name, name_q, errors[name_q]))
                continue
            if round_ >= 0:
                for clock, b, c in zip(('wall', 'cpu'), base, cost):
                    times[clock].setdefault('gradient ' + name_q,
                                            []).append(b)
                    times[clock].setdefault(name_q, []).append(c)
            log('  peer {} round {}/{}: {:<16} {:7.3f} s CPU ({:.2f}x), '
                'wall {:7.3f} s ({:.2f}x)'.format(
                    name, round_ + 1, repetitions, name_q, cost[1],
                    cost[1] / base[1], cost[0], cost[0] / base[0]))
    return {'times': times, 'errors': errors, 'classes': classes,
            'parameters': sum(p.numel() for p in model.parameters())}


def run(networks: Sequence[str] = ('3c3d', 'allcnnc'), batch: int = 64,
        repetitions: int = 7, exact_repetitions: int = 1, threads: int = 1,
        gpu: bool = False, log=print) -> Dict:
    """The peer's figures per network, or ``{'skipped': reason}``.

    Returns
    -------
    dict
        ``versions``, ``device``, ``threads`` and ``networks``: for each,
        ``summary`` as :func:`experiments.curvature.overhead.summarize`
        makes it and ``unsupported`` (``{quantity: error}``).
    """
    reason = why_unavailable(gpu)
    if reason is not None:
        return {'skipped': reason}
    import torch
    import backpack
    from experiments.curvature import overhead
    torch.set_num_threads(threads)
    device = 'cuda' if gpu else 'cpu'
    result = {
        'peer': 'backpack',
        'versions': {'torch': torch.__version__,
                     'backpack': _version('backpack-for-pytorch',
                                          backpack)},
        'device': torch.cuda.get_device_name(0) if gpu else 'cpu',
        'threads': torch.get_num_threads(), 'batch': batch,
        'repetitions': repetitions, 'dtype': 'float32', 'networks': {}}
    for name in networks:
        log('peer {}: batch {}, {} rounds'.format(name, batch, repetitions))
        measured = _measure(name, batch, repetitions, exact_repetitions,
                            device, log)
        summary = overhead.summarize_times(
            measured['parameters'], measured['classes'], measured['times'])
        result['networks'][name] = dict(summary,
                                        unsupported=measured['errors'])
    return result


def _version(distribution: str, module) -> str:
    try:
        from importlib import metadata
        return metadata.version(distribution)
    except Exception:    # an unusual install: the module's own, if any
        return getattr(module, '__version__', 'unknown')


def add_protocol_options(parser, networks: Sequence[str]) -> None:
    """The options of the protocol this peer shares with
    :mod:`experiments.curvature.overhead` (which runs it with
    ``--peer``): the networks (of ``networks``), the batch and the timed
    rounds."""
    from benchmarks import _args
    parser.add_argument('--networks', type=_args.names(list(networks)),
                        default='3c3d,allcnnc',
                        help='comma-separated, of {} (default: '
                        '%(default)s)'.format(', '.join(networks)))
    parser.add_argument('--batch', type=_args.positive_int, default=64,
                        help='mini-batch size (default: %(default)s)')
    parser.add_argument('--repetitions', type=_args.positive_int, default=7,
                        help='timed rounds per network, after one warm-up '
                        '(default: %(default)s)')
    parser.add_argument('--exact-repetitions', type=_args.positive_int,
                        default=1, help='rounds of the exact quantities on '
                        'networks with more than 10 classes (default: '
                        '%(default)s)')


def main(argv=None):
    from benchmarks import _args
    from benchmarks import _common
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog='python -m experiments.curvature.peer_backpack',
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_protocol_options(parser, CLASSES)
    parser.add_argument('--threads', type=_args.positive_int, default=1,
                        help='BLAS threads (default: %(default)s)')
    parser.add_argument('--gpu', action='store_true',
                        help="PyTorch on GPU 0")
    parser.add_argument('--out', default=os.path.join(
        'experiments', 'results', 'curvature', 'peer_backpack.json'),
                        help='JSON output (default: %(default)s)')
    args = parser.parse_args(argv)
    _args.check_paths(parser, args)
    data = _common.header('peer_backpack', argv, gpu=args.gpu)
    data['command'] = ' '.join(
        ['python', '-m', 'experiments.curvature.peer_backpack'] + argv)
    data['peer_backpack'] = peer = run(
        args.networks, args.batch, args.repetitions,
        args.exact_repetitions, args.threads, args.gpu)
    if 'skipped' in peer:
        print('peer skipped: {}'.format(peer['skipped']))
    _common.write_json(args.out, data)
    print('wrote {}'.format(args.out))
    return 0


if __name__ == '__main__':
    sys.exit(main())
