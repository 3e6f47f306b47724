"""The peer, timed in the same run: PyTorch SGD and kfac-pytorch's
``KFACPreconditioner`` on torchvision's ResNet-50, made our network.

    python -m benchmarks.peer_pytorch [--batch 32] [--size 224]
        [--rounds 11] [--warmup 3] [--interval 20] [--variants ...]
        [--arch v1|v1.5] [--exact-fp32] [--out FILE.json]

or ``python -m benchmarks.step_time --gpu --peer``, which runs it after its
own figures and records these beside them in the same JSON.

Variants (each its own model from the same seed, one step each per round,
in an order rotated every round, the GPU synchronised before and after each
step; medians over the rounds, ratios per round to the SGD step):

* ``sgd``: ``torch.optim.SGD`` (momentum 0.9): zero_grad, forward,
  cross-entropy, backward, step;
* ``kfac_inverse``: kfac-pytorch's KFACPreconditioner with
  ``compute_method=INVERSE``, factors and inverses refreshed every step,
  ``preconditioner.step()`` between backward and the SGD step;
* ``kfac_eigen``: the same with ``compute_method=EIGEN`` (kfac-pytorch's
  default);
* ``kfac_inverse_stale``: INVERSE with ``factor_update_steps`` and
  ``inv_update_steps`` = ``--interval`` (20); its refresh steps are kept
  apart as ``kfac_inverse_stale_refresh``.

The network is ours (``--arch v1``, the default): torchvision's
ResNet-50 with each downsampling bottleneck's stride moved from its 3×3
convolution to its first 1×1, as in He et al. (2016), the paper and
``models/resnet50.py`` — the same convolution shapes, so a ratio of steps
compares the frameworks, not two networks (torchvision's v1.5, ``--arch
v1.5``, does about 6 % more multiply-adds at 224²: 4.1 against 3.9 G).

float32 throughout. PyTorch's own defaults otherwise:
``torch.backends.cudnn.allow_tf32`` True (convolutions may use TF32, as
chainerkfac.cudnn's default), ``cudnn.benchmark`` False; ``--exact-fp32``
turns TF32 off. The JSON records the settings and versions.

PyTorch, torchvision and kfac-pytorch are never dependencies of this
project: when one cannot be imported, or PyTorch sees no CUDA device, the
benchmark says so and records ``{"skipped": reason}`` instead of figures.
kfac-pytorch 0.4.2 is not on the package registry reachable from the GPU
machine; carry its source (docs/GPU.md of the shared folder says how).
"""
import argparse
import gc
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

VARIANTS = ('sgd', 'kfac_inverse', 'kfac_eigen', 'kfac_inverse_stale')
DEFAULTS = dict(batch=32, size=224, rounds=11, warmup=3, interval=20,
                arch='v1')
#: ``'v1'``: a downsampling bottleneck's stride on its first 1×1
#: convolution (ours); ``'v1.5'``: on its 3×3 (torchvision's).
ARCHS = ('v1', 'v1.5')


def stride_on_first_1x1(model) -> int:
    """Move each bottleneck's stride from its 3×3 convolution (``conv2``)
    to its first 1×1 (``conv1``) in a torchvision ResNet (``layer1`` …
    ``layer4``), in place: ResNet v1, our ``models/resnet50.py``. The
    projection shortcut keeps its stride. Returns how many blocks moved
    (3 for ResNet-50)."""
    moved = 0
    for stage in (model.layer1, model.layer2, model.layer3, model.layer4):
        for block in stage:
            stride = tuple(block.conv2.stride)
            if stride != (1, 1):
                block.conv1.stride, block.conv2.stride = stride, (1, 1)
                moved += 1
    return moved


def resnet50(arch: str = DEFAULTS['arch']):
    """torchvision's ResNet-50, untrained, as ``arch`` (:data:`ARCHS`)."""
    import torchvision
    if arch not in ARCHS:
        raise ValueError('arch must be one of {}, got {!r}'.format(
            ARCHS, arch))
    model = torchvision.models.resnet50(weights=None)
    if arch == 'v1':
        stride_on_first_1x1(model)
    return model


def why_unavailable() -> Optional[str]:
    """None when the peer can run here; else why not, in words."""
    for module, package in (('torch', 'PyTorch'),
                            ('torchvision', 'torchvision'),
                            ('kfac', 'kfac-pytorch')):
        try:
            __import__(module)
        except Exception as error:   # not installed, or a broken install
            return '{} cannot be imported ({}: {})'.format(
                package, type(error).__name__, error)
    import torch
    if not torch.cuda.is_available():
        return 'PyTorch sees no CUDA device'
    return None


def time_rounds(steps: Dict[str, Callable[[], bool]], rounds: int,
                warmup: int, synchronize: Callable[[], None],
                clock: Callable[[], float] = time.perf_counter) -> Dict:
    """Time one step of each variant per round, the order rotated every
    round (so drifts of the machine hit all alike).

    Parameters
    ----------
    steps
        name -> a function running one step and returning whether it
        refreshed curvature; must contain ``'sgd'``.
    rounds, warmup
        Timed rounds; untimed steps of each variant first.

    Returns
    -------
    dict
        ``median_s``, ``ratio_to_sgd`` (median of per-round ratios) and
        ``samples_s``; a variant whose step refreshed in some rounds and not
        in others has its refresh steps under ``<name>_refresh``.
    """
    names = list(steps)
    for name in names:
        for _ in range(warmup):
            steps[name]()
    records = {name: [] for name in names}   # (seconds, refreshed, SGD's)
    for r in range(rounds):
        shift = r % len(names)
        times, refreshed = {}, {}
        for name in names[shift:] + names[:shift]:
            gc.collect()
            synchronize()
            start = clock()
            refreshed[name] = bool(steps[name]())
            synchronize()
            times[name] = clock() - start
        for name in names:
            records[name].append((times[name], refreshed[name], times['sgd']))
    samples: Dict[str, List[float]] = {}
    ratios: Dict[str, List[float]] = {}
    for name in names:
        flags = [f for _, f, _ in records[name]]
        mixed = any(flags) and not all(flags)
        for seconds, refresh, sgd in records[name]:
            key = name + '_refresh' if mixed and refresh else name
            samples.setdefault(key, []).append(seconds)
            if name != 'sgd' and key == name:
                ratios.setdefault(name, []).append(seconds / sgd)
    return {
        'median_s': {k: statistics.median(v) for k, v in samples.items()},
        'ratio_to_sgd': {k: statistics.median(v) for k, v in ratios.items()},
        'samples_s': samples,
    }


def _build_steps(variants: Sequence[str], batch: int, size: int,
                 interval: int, arch: str = DEFAULTS['arch']
                 ) -> Dict[str, Callable[[], bool]]:
    """One ResNet-50 per variant (:func:`resnet50`, same initial weights),
    on ``cuda``, and its step."""
    import torch
    from kfac.enums import ComputeMethod
    from kfac.preconditioner import KFACPreconditioner

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, size, size, generator=generator).cuda()
    t = torch.randint(0, 1000, (batch,), generator=generator).cuda()
    criterion = torch.nn.CrossEntropyLoss()
    steps = {}
    for name in variants:
        torch.manual_seed(0)
        model = resnet50(arch).cuda()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        preconditioner = None
        if name != 'sgd':
            every = 1 if name != 'kfac_inverse_stale' else interval
            preconditioner = KFACPreconditioner(
                model, factor_update_steps=every, inv_update_steps=every,
                damping=0.001, lr=0.1,
                compute_method=(ComputeMethod.EIGEN if name == 'kfac_eigen'
                                else ComputeMethod.INVERSE))
        steps[name] = _step(model, optimizer, preconditioner, criterion, x, t)
    return steps


def _step(model, optimizer, preconditioner, criterion, x, t):
    def step() -> bool:
        refresh = (preconditioner is not None and
                   preconditioner.steps % preconditioner.inv_update_steps
                   == 0)
        optimizer.zero_grad()
        criterion(model(x), t).backward()
        if preconditioner is not None:
            preconditioner.step()
        optimizer.step()
        return refresh
    return step


def run(batch: int = DEFAULTS['batch'], size: int = DEFAULTS['size'],
        rounds: int = DEFAULTS['rounds'], warmup: int = DEFAULTS['warmup'],
        interval: int = DEFAULTS['interval'],
        variants: Sequence[str] = VARIANTS, exact_fp32: bool = False,
        arch: str = DEFAULTS['arch']) -> Dict:
    """The peer's figures (module docstring), or ``{'skipped': reason}``."""
    reason = why_unavailable()
    if reason is not None:
        return {'skipped': reason}
    import kfac
    import torch
    import torchvision
    cupy = sys.modules.get('cupy')
    if cupy is not None:   # the Chainer run's cached blocks, for PyTorch
        cupy.get_default_memory_pool().free_all_blocks()
    if exact_fp32:
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    result = {
        'peer': 'pytorch', 'model': 'torchvision resnet50', 'arch': arch,
        'batch': batch,
        'input': [3, size, size], 'dtype': 'float32', 'rounds': rounds,
        'warmup_steps': warmup, 'refresh_interval': interval,
        'variants': list(variants),
        'versions': {'torch': torch.__version__,
                     'torchvision': torchvision.__version__,
                     'kfac': getattr(kfac, '__version__', 'unknown'),
                     'cudnn': torch.backends.cudnn.version()},
        'device': torch.cuda.get_device_name(0),
        'settings': {
            'cudnn.allow_tf32': torch.backends.cudnn.allow_tf32,
            'cuda.matmul.allow_tf32': torch.backends.cuda.matmul.allow_tf32,
            'cudnn.benchmark': torch.backends.cudnn.benchmark},
    }
    steps = _build_steps(variants, batch, size, interval, arch)
    result.update(time_rounds(steps, rounds, warmup, torch.cuda.synchronize))
    del steps   # PyTorch's cached blocks back, for the sweep's next point
    gc.collect()
    torch.cuda.empty_cache()
    return result


def table(peer: Dict, ours: Optional[Dict] = None) -> str:
    """The peer's figures as text; with ``ours`` (a ResNet-50 result of
    :mod:`benchmarks.step_time`), ours beside them."""
    if 'skipped' in peer:
        return 'Peer (PyTorch, kfac-pytorch): skipped: {}'.format(
            peer['skipped'])
    from benchmarks import _common
    med, ratio = peer['median_s'], peer['ratio_to_sgd']
    rows = [[name, med.get(name), ratio.get(name)] for name in
            list(peer['variants']) + ['kfac_inverse_stale_refresh']
            if name in med]
    text = ('Peer in the same run: {} on {}, batch {}, {}x{}, fp32 (TF32 '
            'convolutions {}), medians of {} rounds\n{}'.format(
                peer['model'], peer['device'], peer['batch'],
                peer['input'][1], peer['input'][2],
                'allowed' if peer['settings']['cudnn.allow_tf32'] else 'off',
                peer['rounds'], _common.format_table(
                    ['variant', 's/step', 'x SGD'], rows)))
    if ours is not None:
        mine = ours['median_s']
        # (figure, ours, theirs, replayed): a replayed row only where
        # that variant was run
        rows = [('SGD step', 'sgd', 'sgd', False),
                ('SGD step, replayed', 'sgd_graph', 'sgd', True),
                ('K-FAC every step (theirs: inverse)', 'kfac_every',
                 'kfac_inverse', False),
                ('K-FAC stale step', 'kfac_stale', 'kfac_inverse_stale',
                 False),
                ('K-FAC stale step, replayed', 'kfac_stale_graph',
                 'kfac_inverse_stale', True)]
        pairs = [(what, mine.get(key), med.get(peer_key))
                 for what, key, peer_key, replayed in rows
                 if not replayed or mine.get(key) is not None]
        text += '\n\nOurs beside the peer ({} batch {})\n{}'.format(
            ours['model'], ours['batch'], _common.format_table(
                ['figure', 'chainerkfac [s]', 'peer [s]', 'ours / theirs'],
                [[what, a, b, a / b if a and b else None]
                 for what, a, b in pairs]))
    return text


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog='python -m benchmarks.peer_pytorch', description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--batch', type=int, default=DEFAULTS['batch'])
    parser.add_argument('--size', type=int, default=DEFAULTS['size'])
    parser.add_argument('--rounds', type=int, default=DEFAULTS['rounds'])
    parser.add_argument('--warmup', type=int, default=DEFAULTS['warmup'])
    parser.add_argument('--interval', type=int, default=DEFAULTS['interval'],
                        help='refresh interval of kfac_inverse_stale')
    parser.add_argument('--variants', default=','.join(VARIANTS),
                        help='comma-separated subset of {}, with sgd'.format(
                            ','.join(VARIANTS)))
    parser.add_argument('--arch', choices=ARCHS, default=DEFAULTS['arch'],
                        help="v1: our network (the stride on the first "
                        "1x1); v1.5: torchvision's (on the 3x3)")
    parser.add_argument('--exact-fp32', action='store_true',
                        help='turn TF32 off in PyTorch (cuDNN and matmul)')
    parser.add_argument('--out', default='result/peer_pytorch.json',
                        help='JSON output (default: %(default)s)')
    args = parser.parse_args(argv)
    from benchmarks import _args       # the script stands alone otherwise
    _args.check_paths(parser, args)
    variants = args.variants.split(',')
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or 'sgd' not in variants:
        parser.error('--variants: sgd and any of {} (got {})'.format(
            ', '.join(VARIANTS[1:]), args.variants))
    args.variants = tuple(v for v in VARIANTS if v in variants)
    for name in ('batch', 'size', 'rounds', 'interval'):
        if getattr(args, name) < 1:
            parser.error('--{} must be at least 1'.format(name))
    if args.warmup < 0:
        parser.error('--warmup must be at least 0')
    return args


def main(argv=None):
    from benchmarks import _common
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    data = _common.header('peer_pytorch', argv, gpu=False)
    data['peer_pytorch'] = run(args.batch, args.size, args.rounds,
                               args.warmup, args.interval, args.variants,
                               args.exact_fp32, args.arch)
    print(table(data['peer_pytorch']))
    _common.write_json(args.out, data)
    print('wrote {}'.format(args.out))
    return 0


if __name__ == '__main__':
    sys.exit(main())
