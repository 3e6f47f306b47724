"""The one-line swap on Chainer's stock architectures: K-FAC's step time
over the stock optimizer's, and accuracy against MomentumSGD at equal
epochs on the digits — the measurements behind KFAC's defaults (issues 16
and 28).

    python -m benchmarks.stock_models [--smoke]
        [--part timing,accuracy,stability]
        [--models ptb,mnist_mlp,...] [--limits None,4096,2048,1024,512]
        [--cycles 3] [--seeds 5] [--epochs 5] [--batch 64] [--threads 1]
        [--dampings 1e-3,1e-2,3e-2] [--intervals 1,5,20,eq22]
        [--kl-clip 1e-4|none] [--low-rank on|off]
        [--merge EARLIER.json ...] [--out FILE.json]

**Timing** (``--part timing``). The architectures are those of the stock
tests (:mod:`tests.chainerkfac.stock.nets`, one entry per stock example,
at the sizes listed in the table), each trained by its example's loop
with its stock optimizer (Adam for the MLP, the VAE, PTB and DCGAN,
``MomentumSGD(lr=0.01, momentum=0.9)`` for the CNNs) and, on its own copy
of the same initial model, with ``KFAC(momentum=0.9, damping=1e-2)`` (its
bounded step, and its low-rank factors unless ``--low-rank off``) at
each ``max_factor_dim`` of ``--limits``, at ``lr = 0`` (a step's cost does
not depend on the learning rate; at the README's lr = 0.01 some of these
models diverge within a few steps, whose steps are then skipped: see
:func:`time_limit`). A limit whose blocks are the same as an earlier one's
(same factor shapes, full or diagonal) is not timed again; one that keeps
a factor larger than :data:`MAX_TIMED_FULL` full is not run (its n³
inverse and n² memory are what the guard is for).

K-FAC's step cost depends only on which factors a step refreshes, not on
the interval that made it do so: a step refreshes everything (*every*),
only the output-gradient factors G and the BN Fisher F (*G only*, the
input factors A stale), or nothing (*stale*: the stored inverses
precondition). So the K-FAC optimizer here runs a cycle of three steps,
every / G only / stale (refresh-interval callables of the step), and the
cost of any refresh interval is the amortised mix: intervals (a, g) with
a a multiple of g make, every a steps, 1 *every* step, a/g − 1 *G only*
steps and a − a/g *stale* steps. Intervals 1 are the *every* step alone;
the defaults' (:data:`chainerkfac.optimizers.kfac.DEFAULT_REFRESH_INTERVAL`
for A, G and F) are the column *defaults*.

The stock step and the K-FAC step alternate, in an order swapped every
round (one round = one step of each); a cycle is three rounds, one of
each K-FAC step kind. Per cycle, the ratio of each interval setting is
its amortised K-FAC time over the median of the cycle's three stock steps;
the figure is the median over cycles, with the spread (min-max). One
warm-up cycle is not timed (lazy initialisation, the first update's
graph analysis). Stage times (:attr:`KFAC.stage_times`, summed over
DCGAN's two optimizers) are medians over the timed steps of each kind;
``loop`` is the step's wall time minus K-FAC's stages: the user's forward
and backward in a hand-written loop (PTB, DCGAN's forward), with the
factor capture that runs inside that backward. ``precondition_gflop``
counts the products of stage 5 per step, whatever the interval:
``2·d_out·d_in·(d_out + d_in)`` for a Kronecker block with both factors
full (a diagonal factor contributes 1 instead of its size), ``2·(2C)²``
for a full BN Fisher.

**Accuracy** (``--part accuracy``). Two nets on scikit-learn's digits
(8×8 images, 1797 samples; a fixed split of 1437 to train and 360 to
validate): a small conv + BN net (conv 16 → BN → relu → conv 32 → BN →
relu → 2×2 max pooling → Linear 10) and Chainer's MNIST MLP with the 784
inputs replaced by the 64 pixels (64-1000-1000-10). Each trains
``--epochs`` epochs (5) at batch ``--batch`` (64) with
``MomentumSGD(lr=0.01, momentum=0.9)``, with Adam (the MLP's stock
optimizer, for reference), and with ``KFAC(lr=0.01, momentum=0.9, ...)``
over the grid damping × refresh intervals × ``max_factor_dim`` (limits
that give the same blocks on a net are run once), with the bounded step
``kl_clip`` of ``--kl-clip`` (the library's default; ``none``: unbounded),
each for ``--seeds`` seeds (initial weights and shuffling; the split is
fixed). The intervals are :data:`ACCURACY_INTERVALS`: fixed ones and
``eq22``, the paper's schedule of eq. (22) (1 before epoch 5: within 5
epochs, the same as 1). Reported: the validation accuracy after the last
epoch, mean ± standard deviation over seeds, min and max, the difference
to MomentumSGD with its standard error (√(s₁²/n + s₂²/n)), skipped steps,
and the smallest ν of the bounded step.

**Stability** (``--part stability``). The step's squared length in the
metric of the curvature that preconditions it, ``lr² Σ_blocks ⟨∇E,
(F + γI)⁻¹ ∇E⟩`` before the bound (``kfac/step_metric``), and ν, at each
step of the first epoch of the digits MLP, at each damping of the grid
with intervals 1 and 5 (:func:`metric_step_sizes`): a stale Fisher does not
hold the new gradient, and at small damping the metric grows by orders of
magnitude; the bound keeps the step taken at ``kl_clip``.

**Candidates.** The last table joins both parts for every setting:
accuracy on both digits nets and the step-time ratios of the MNIST MLP
and the CIFAR VGG (issue 28's goals: ≤ 2× the stock optimizer for every
architecture; accuracy no worse than MomentumSGD beyond seed noise).
``--merge`` reads an earlier run's JSON: the parts, the timing of the
models and the accuracy settings that this run does not redo are kept
(each timing entry is a ratio within its own run; the seeds, epochs and
batch must be the same).

Timings are only comparable within one run; the machine is shared, so
the JSON records the load average before and after. BLAS threads:
``--threads`` (default 1, through threadpoolctl).
"""
import chainerkfac  # NOQA  (before chainer: NumPy-2 compatibility shims)

import argparse
import gc
import itertools
import json
import math
import os
import sys
import time
from typing import Dict, List, Optional, Sequence

import numpy

import chainer
import chainer.functions as F
import chainer.links as L

from benchmarks import _args
from benchmarks import _common
from chainerkfac import fisher_blocks
from chainerkfac.optimizers import KFAC
from chainerkfac.optimizers import kfac as kfac_module
from tests.chainerkfac.stock import nets

LR = 0.01
MOMENTUM = 0.9
#: The README's line.
README_DAMPING = 1e-2
LIMITS = (None, 4096, 2048, 1024, 512)
DAMPINGS = (1e-3, 1e-2, 3e-2)
#: Refresh intervals (A, G = F) by name, timed as amortised mixes.
INTERVALS = {'1': (1, 1), '5': (5, 5), '10': (10, 10), '20': (20, 20),
             'A20/G5': (20, 5)}
#: The defaults' intervals among them.
DEFAULTS = str(kfac_module.DEFAULT_REFRESH_INTERVAL)
#: The accuracy grid's intervals: the timed ones and the paper's eq. (22).
ACCURACY_INTERVALS = dict(INTERVALS, eq22=('eq22', 'eq22'))
ACCURACY_DEFAULT_INTERVALS = ('1', '5', '20', 'eq22')
#: Full factors larger than this are not timed.
MAX_TIMED_FULL = 8192
STAGES = ('forward_backward', 'factors', 'reduce_scatter', 'inverse',
          'precondition', 'all_gather', 'update')
PHASES = ('every', 'g_only', 'stale')
NEVER = 10 ** 9
GOAL_RATIO = 2.0
GOAL_MODELS = ('mnist_mlp', 'cifar_vgg')

#: The timing's architectures at the sizes of :data:`nets.STOCK`, but
#: PTB with the example's 10000 words, and ResNet-101 at 224² too.
TIMED = dict(nets.STOCK)
TIMED['ptb'] = nets.Stock('ptb', nets.adam, nets.ptb(n_vocab=10000),
                          'PTB RNNLM: EmbedID(10000) + 2 LSTM(650) + '
                          'Linear, BPTT 35, batch 20, clip 5')
# ResNet-101 at the ImageNet input size: how the ratio falls with the work
# per step (the 32² entry is the stock test's size).
TIMED['resnet101_224'] = nets.Stock(
    'resnet101_224', nets.momentum_sgd,
    nets.image_classifier(nets.resnet101_layers, 8, 224),
    'L.ResNet101Layers, 224², batch 8')
#: What ``--part`` may name ('none': only --merge's earlier runs).
PARTS = ('timing', 'accuracy', 'stability', 'none')

SMOKE_TIMED = {
    'ptb': nets.Stock('ptb', nets.adam,
                      nets.ptb(n_vocab=30, n_units=8, batch=2, bprop_len=3),
                      'PTB RNNLM, tiny'),
    'mnist_mlp': nets.Stock('mnist_mlp', nets.adam,
                            nets.mnist_mlp(batch=8, n_in=20, n_units=16),
                            'MNIST MLP, tiny'),
    'dcgan': nets.Stock('dcgan', nets.adam, nets.dcgan(batch=2, ch=16,
                                                       n_hidden=4),
                        'DCGAN, tiny'),
}


# -- which step kind K-FAC takes ----------------------------------------------
def _interval_a(iteration, epoch):
    """A refreshed at steps 0, 3, 6, ... (the *every* steps)."""
    return 1 if iteration % 3 == 0 else NEVER


def _interval_gf(iteration, epoch):
    """G and F refreshed at every step but 2, 5, 8, ... (*stale*)."""
    return 1 if iteration % 3 != 2 else NEVER


def amortised(times: Dict[str, float], intervals) -> float:
    """Mean step time of refresh intervals (a, g) from the step times of
    the three kinds (a a multiple of g)."""
    a, g = intervals
    if a % g:
        raise ValueError('A refreshed every {} steps, G every {}: A must be '
                         'a multiple of G'.format(a, g))
    g_only = a // g - 1
    stale = a - a // g
    return (times['every'] + g_only * times['g_only'] +
            stale * times['stale']) / a


# -- what a limit does to a model's blocks ------------------------------------
def block_signature(targets, limit) -> tuple:
    """The factor shapes of every block under ``max_factor_dim=limit``
    (lazily sized links must have their parameters)."""
    options = fisher_blocks.BlockOptions(max_factor_dim=limit)
    out = []
    for target in targets:
        for block in fisher_blocks.build_blocks(target, options):
            shapes = block.factor_shapes()
            out.append((block.name, block.kind,
                        tuple(sorted(shapes.items()))))
    return tuple(out)


def describe_blocks(signature) -> Dict:
    """Counts, the largest full factor and the preconditioning products
    per step (GFLOP, see the module docstring)."""
    kfac = plain = diagonal = 0
    largest = 0
    flops = 0.0
    for _, kind, shapes in signature:
        shapes = dict(shapes)
        if not shapes:
            plain += 1
            continue
        kfac += 1
        for shape in shapes.values():
            if len(shape) == 1:
                diagonal += 1
            else:
                largest = max(largest, shape[0])
        if 'A' in shapes:
            d_in, d_out = shapes['A'][0], shapes['G'][0]
            flops += 2.0 * d_out * d_in * (
                (d_out if len(shapes['G']) == 2 else 1) +
                (d_in if len(shapes['A']) == 2 else 1))
        elif len(shapes['F']) == 2:
            flops += 2.0 * shapes['F'][0] ** 2
    return {'kfac_blocks': kfac, 'plain_blocks': plain,
            'diagonal_factors': diagonal, 'largest_full_factor': largest,
            'precondition_gflop': flops / 1e9}


# -- timing -------------------------------------------------------------------
def _kfac_for_cycle(limit, low_rank=True):
    """K-FAC taking the cycle's step kinds, at ``lr = 0`` (see
    :func:`time_limit`), otherwise at its defaults (the bounded step)."""
    def make():
        return KFAC(lr=0.0, momentum=MOMENTUM, damping=README_DAMPING,
                    max_factor_dim=limit, refresh_interval_a=_interval_a,
                    refresh_interval_g=_interval_gf,
                    refresh_interval_f=_interval_gf, low_rank=low_rank,
                    verbose=False)
    return make


class _Counts(chainer.Reporter):
    """Sums K-FAC's reports of inverse retries and skipped steps over
    every optimizer of a step, and keeps the most low-rank factors one
    optimizer held."""

    def __init__(self):
        super().__init__()
        self.retries = 0
        self.skipped = 0
        self.low_rank = 0

    def report(self, values, observer=None):
        if observer is None:
            self.retries += int(values.get('kfac/inverse_retries', 0))
            self.skipped += int(values.get('kfac/skipped_step', 0))
            self.low_rank = max(self.low_rank, int(values.get(
                'kfac/low_rank_factors', 0)))
        super().report(values, observer)


def _reporter_for(trainee, reporter=None):
    """A reporter that knows the trainee's models (the VAE and GoogLeNet
    report their losses as observers)."""
    reporter = reporter if reporter is not None else chainer.Reporter()
    for k, target in enumerate(trainee.targets):
        reporter.add_observer('main{}'.format(k), target)
    return reporter


def _timed_step(trainee, reporter=None) -> float:
    reporter = reporter or _reporter_for(trainee)
    with reporter.scope({}):
        start = time.perf_counter()
        trainee.step()
        return time.perf_counter() - start


def _stages(trainee, wall: float) -> Dict[str, float]:
    total = {s: 0.0 for s in STAGES}
    for optimizer in trainee.optimizers:
        for stage, seconds in optimizer.stage_times.items():
            total[stage] = total.get(stage, 0.0) + seconds
    total['loop'] = max(0.0, wall - sum(total.values()))
    return total


def _spread(values: Sequence[float]) -> Dict[str, float]:
    return {'median': _common.median(values), 'min': float(min(values)),
            'max': float(max(values))}


def time_limit(stock, base, limit, cycles: int, low_rank: bool = True
               ) -> Dict:
    """One K-FAC copy at ``limit`` against the stock trainee ``base``
    (see the module docstring).

    K-FAC runs at ``lr = 0``: a step costs the same whatever the learning
    rate (every stage runs, the update applies a zero step), and the model
    stays where it is. With the README's lr some of these models diverge
    within the cycle (NiN at batch 2 does even refreshing every step), and
    a diverged model's steps are skipped and its inverses retried, which is
    not the cost of training. Inverse retries and skipped steps of the
    timed steps are recorded all the same.
    """
    kfac = stock.build().setup(_kfac_for_cycle(limit, low_rank))
    for _ in range(3):                       # warm-up cycle
        _timed_step(kfac)
        _timed_step(base)
    counts = _reporter_for(kfac, _Counts())
    stock_times: List[List[float]] = []
    kfac_times = {p: [] for p in PHASES}
    stages = {p: [] for p in PHASES}
    round_index = 0
    for _ in range(cycles):
        cycle_stock = []
        for phase in PHASES:
            assert kfac.optimizers[0].t % 3 == PHASES.index(phase)
            order = ('stock', 'kfac') if round_index % 2 == 0 else \
                ('kfac', 'stock')
            round_index += 1
            for who in order:
                if who == 'stock':
                    cycle_stock.append(_timed_step(base))
                else:
                    wall = _timed_step(kfac, counts)
                    kfac_times[phase].append(wall)
                    stages[phase].append(_stages(kfac, wall))
        stock_times.append(cycle_stock)
    ratios = {name: [] for name in ('every', 'stale') + tuple(INTERVALS)}
    for c in range(cycles):
        reference = _common.median(stock_times[c])
        times = {p: kfac_times[p][c] for p in PHASES}
        ratios['every'].append(times['every'] / reference)
        ratios['stale'].append(times['stale'] / reference)
        for name, intervals in INTERVALS.items():
            ratios[name].append(amortised(times, intervals) / reference)
    result = {
        'stock_s': _spread([t for c in stock_times for t in c]),
        'kfac_s': {p: _spread(kfac_times[p]) for p in PHASES},
        'ratio': {name: _spread(values) for name, values in ratios.items()},
        'stages_s': {p: {s: _common.median([st[s] for st in stages[p]])
                         for s in stages[p][0]} for p in PHASES},
        'samples': {'stock_s': stock_times, 'kfac_s': kfac_times},
        'inverse_retries': counts.retries,
        'skipped_steps': counts.skipped,
        'low_rank_factors': counts.low_rank,
    }
    del kfac
    gc.collect()
    return result


def time_model(name: str, stock, limits, cycles: int, low_rank: bool = True
               ) -> List[Dict]:
    """Every limit of ``limits`` on one architecture."""
    numpy.random.seed(0)
    base = stock.build().setup(stock.stock_optimizer)
    base.step()                           # lazily sized links get shapes
    results = []
    seen = {}
    for limit in limits:
        signature = block_signature(base.targets, limit)
        entry = {'model': name, 'description': stock.description,
                 'stock_optimizer': type(base.optimizers[0]).__name__,
                 'limit': limit}
        entry.update(describe_blocks(signature))
        if signature in seen:
            entry['same_as'] = seen[signature]['limit']
            for key in ('stock_s', 'kfac_s', 'ratio', 'stages_s',
                        'skipped', 'inverse_retries', 'skipped_steps',
                        'low_rank_factors'):
                if key in seen[signature]:
                    entry[key] = seen[signature][key]
        elif entry['largest_full_factor'] > MAX_TIMED_FULL:
            entry['skipped'] = (
                'a full {0}x{0} factor (> {1}): not run'.format(
                    entry['largest_full_factor'], MAX_TIMED_FULL))
            seen[signature] = entry
        else:
            start = time.time()
            try:
                entry.update(time_limit(stock, base, limit, cycles,
                                        low_rank))
            except MemoryError as error:     # report, go on
                entry['skipped'] = 'MemoryError: {}'.format(error)
            entry['seconds'] = time.time() - start
            seen[signature] = entry
        print(_timing_line(entry), flush=True)
        results.append(entry)
    del base
    gc.collect()
    return results


def _timing_line(entry) -> str:
    head = '{} limit={}: '.format(entry['model'], entry['limit'])
    if 'ratio' not in entry:
        return head + entry.get('skipped', '?')
    r = entry['ratio']
    names = ['every', '5', '10', '20', 'stale']
    return head + 'stock {:.3g} s; K-FAC/stock {}{}'.format(
        entry['stock_s']['median'], ', '.join(
            '{}{} {:.3g}'.format(n, ' (defaults)' if n == DEFAULTS else '',
                                 r[n]['median']) for n in names),
        ' (same as {})'.format(entry['same_as']) if 'same_as' in entry
        else '')


# -- accuracy on the digits ---------------------------------------------------
DIGITS_NETS = {
    'digits_conv_bn': (nets.DigitsConvBN, (1, 8, 8)),
    'digits_mlp': (lambda: nets.MLP(1000, 10), (64,)),
}
SMOKE_DIGITS_NETS = {
    'digits_conv_bn': (nets.DigitsConvBN, (1, 8, 8)),
    'digits_mlp': (lambda: nets.MLP(16, 10), (64,)),
}
N_TRAIN = 1437


def digits(limit_samples: Optional[int] = None):
    """(x_train, t_train, x_val, t_val): pixels / 16 as float32, a fixed
    split."""
    from sklearn.datasets import load_digits
    data = load_digits()
    x = (data.data / 16.0).astype(numpy.float32)
    t = data.target.astype(numpy.int32)
    order = numpy.random.RandomState(0).permutation(len(x))
    x, t = x[order], t[order]
    n_train = N_TRAIN
    if limit_samples is not None:
        x, t = x[:limit_samples], t[:limit_samples]
        n_train = limit_samples * 4 // 5
    return x[:n_train], t[:n_train], x[n_train:], t[n_train:]


def train_digits(make_net, shape, make_optimizer, data, seed: int,
                 epochs: int, batch: int) -> Dict:
    """Validation accuracy and loss after ``epochs`` epochs."""
    x_train, t_train, x_val, t_val = data
    numpy.random.seed(seed)
    model = L.Classifier(make_net())
    optimizer = make_optimizer()
    optimizer.setup(model)
    rng = numpy.random.RandomState(seed)
    start = time.perf_counter()
    x_train = x_train.reshape((-1,) + shape)
    scales = _Scales()
    scales.add_observer('main', model)
    for _ in range(epochs):
        order = rng.permutation(len(x_train))
        for i in range(0, len(order), batch):
            chunk = order[i:i + batch]
            with scales.scope({}):
                optimizer.update(model, x_train[chunk], t_train[chunk])
        optimizer.new_epoch()
    seconds = time.perf_counter() - start
    with chainer.using_config('train', False), chainer.no_backprop_mode():
        y = model.predictor(x_val.reshape((-1,) + shape))
        loss = float(F.softmax_cross_entropy(y, t_val).array)
        accuracy = float(F.accuracy(y, t_val).array)
    return {'accuracy': accuracy, 'loss': loss, 'seconds': seconds,
            'skipped_steps': int(getattr(
                getattr(optimizer, 'guard', None), 'skipped_steps', 0)),
            'min_step_scale': min(scales.scales) if scales.scales else None}


class _Scales(chainer.Reporter):
    """The ν of every bounded step (``kfac/step_scale``)."""

    def __init__(self):
        super().__init__()
        self.scales = []
        self.metrics = []

    def report(self, values, observer=None):
        if observer is None and 'kfac/step_scale' in values:
            self.scales.append(float(values['kfac/step_scale']))
            self.metrics.append(float(values['kfac/step_metric']))
        super().report(values, observer)


def _summary(runs: List[Dict]) -> Dict:
    acc = [r['accuracy'] for r in runs]
    return {'accuracy_mean': float(numpy.mean(acc)),
            'accuracy_std': float(numpy.std(acc, ddof=1)) if len(acc) > 1
            else 0.0,
            'accuracy_min': float(min(acc)), 'accuracy_max': float(max(acc)),
            'loss_mean': float(numpy.mean([r['loss'] for r in runs])),
            'seconds_mean': float(numpy.mean([r['seconds'] for r in runs])),
            'skipped_steps': int(sum(r['skipped_steps'] for r in runs)),
            'min_step_scale': min((r['min_step_scale'] for r in runs
                                   if r.get('min_step_scale') is not None),
                                  default=None)}


def accuracy_grid(digits_nets, dampings, intervals, limits, seeds,
                  epochs, batch, limit_samples=None,
                  kl_clip=kfac_module.DEFAULT_KL_CLIP) -> List[Dict]:
    data = digits(limit_samples)
    results = []
    for net_name, (make_net, shape) in digits_nets.items():
        # Which limits give different blocks on this net.
        numpy.random.seed(0)
        probe = L.Classifier(make_net())
        with chainer.no_backprop_mode():
            probe(data[0][:2].reshape((-1,) + shape), data[1][:2])
        distinct = {}
        for limit in limits:
            distinct.setdefault(block_signature([probe], limit), limit)
        same = {limit: distinct[block_signature([probe], limit)]
                for limit in limits}
        runs = [('MomentumSGD', {}, lambda: chainer.optimizers.MomentumSGD(
            lr=LR, momentum=MOMENTUM))]
        if net_name == 'digits_mlp':
            runs.append(('Adam', {}, chainer.optimizers.Adam))
        for damping in dampings:
            for name in intervals:
                a, g = ACCURACY_INTERVALS[name]
                for limit in sorted(set(same.values()),
                                    key=lambda v: -(v or 1e9)):
                    settings = {'damping': damping, 'intervals': name,
                                'limit': limit, 'kl_clip': kl_clip,
                                'limits': [v for v in limits
                                           if same[v] == limit]}
                    runs.append(('KFAC', settings, _kfac_maker(
                        damping, a, g, limit, kl_clip)))
        for optimizer_name, settings, make in runs:
            per_seed = [train_digits(make_net, shape, make, data, seed,
                                     epochs, batch) for seed in seeds]
            entry = {'net': net_name, 'optimizer': optimizer_name,
                     'seeds': list(seeds), 'runs': per_seed}
            entry.update(settings)
            entry.update(_summary(per_seed))
            results.append(entry)
            print(_accuracy_line(entry), flush=True)
    _compare_to_sgd(results)
    return results


def _stability_key(entry) -> tuple:
    return (entry['damping'], entry['intervals'], entry.get('kl_clip'))


def _accuracy_key(entry) -> tuple:
    return (entry['net'], entry['optimizer'], entry.get('damping'),
            entry.get('intervals'), entry.get('limit'),
            entry.get('kl_clip'))


def _kfac_maker(damping, a, g, limit, kl_clip=kfac_module.DEFAULT_KL_CLIP):
    def make():
        return KFAC(lr=LR, momentum=MOMENTUM, damping=damping,
                    refresh_interval_a=a, refresh_interval_g=g,
                    refresh_interval_f=g, max_factor_dim=limit,
                    kl_clip=kl_clip, verbose=False)
    return make


def _compare_to_sgd(results) -> None:
    """Difference of mean accuracy to MomentumSGD's on the same net, and
    its standard error."""
    sgd = {r['net']: r for r in results if r['optimizer'] == 'MomentumSGD'}
    for entry in results:
        ref = sgd.get(entry['net'])
        if ref is None:
            continue
        n1, n2 = len(entry['runs']), len(ref['runs'])
        entry['vs_sgd'] = entry['accuracy_mean'] - ref['accuracy_mean']
        entry['vs_sgd_se'] = math.sqrt(entry['accuracy_std'] ** 2 / n1 +
                                       ref['accuracy_std'] ** 2 / n2)


def _accuracy_line(entry) -> str:
    setting = '' if entry['optimizer'] != 'KFAC' else \
        ' damping={} intervals={} limit={} kl_clip={}'.format(
            entry['damping'], entry['intervals'], entry['limit'],
            entry.get('kl_clip'))
    return '{} {}{}: {:.4f} ± {:.4f} ({:.1f} s/run)'.format(
        entry['net'], entry['optimizer'], setting, entry['accuracy_mean'],
        entry['accuracy_std'], entry['seconds_mean'])


# -- the step size in the Fisher metric ---------------------------------------
def metric_step_sizes(damping: float, intervals, steps: int, batch: int,
                      seed: int = 0, n_units: int = 1000,
                      kl_clip=kfac_module.DEFAULT_KL_CLIP):
    """``(metrics, scales)``: ``kfac/step_metric`` — ``lr² Σ_blocks ⟨∇E,
    (F + γI)⁻¹ ∇E⟩``, the squared length of the unbounded step in the
    metric of the curvature that preconditions it — and ν at each of the
    first ``steps`` K-FAC steps of the digits MLP.

    With the empirical Fisher refreshed from the very batch whose gradient
    it preconditions, ``F ⪰ ḡ ḡᵀ`` (the mean of the per-sample outer
    products bounds that of the mean), so the metric stays bounded
    whatever γ (for one exact block ``⟨∇E, (F + γI)⁻¹ ∇E⟩`` is below 1); a
    stale F has no such bound: only γ, and the bounded step, limit it.
    """
    a, g = intervals
    x_train, t_train, _, _ = digits()
    numpy.random.seed(seed)
    model = L.Classifier(nets.MLP(n_units, 10))
    # Unbounded (kl_clip None): measured with a bound too large to act.
    optimizer = _kfac_maker(damping, a, g, None, kl_clip or 1e300)()
    optimizer.setup(model)
    reporter = _Scales()
    reporter.add_observer('main', model)
    order = numpy.random.RandomState(seed).permutation(len(x_train))
    for s in range(steps):
        chunk = order[(s * batch) % len(order):][:batch]
        with reporter.scope({}):
            optimizer.update(model, x_train[chunk], t_train[chunk])
    return reporter.metrics, reporter.scales


def stability(dampings, interval_names, steps, batch, n_units=1000,
              kl_clip=kfac_module.DEFAULT_KL_CLIP) -> List[Dict]:
    out = []
    for damping in dampings:
        for name in interval_names:
            sizes, scales = metric_step_sizes(
                damping, INTERVALS[name], steps, batch, n_units=n_units,
                kl_clip=kl_clip)
            finite = [v for v in sizes if math.isfinite(v)]
            entry = {'damping': damping, 'intervals': name, 'steps': steps,
                     'kl_clip': kl_clip, 'sizes': sizes, 'scales': scales,
                     'median': _common.median(finite) if finite else None,
                     'max': max(finite) if finite else None,
                     'min_scale': min(scales) if scales else None,
                     'non_finite': len(sizes) - len(finite)}
            print('digits_mlp damping={} intervals={}: step in the Fisher '
                  'metric median {:.3g}, max {:.3g}, smallest ν {:.3g}'
                  .format(damping, name, entry['median'] or float('nan'),
                          entry['max'] or float('nan'),
                          entry['min_scale'] or float('nan')), flush=True)
            out.append(entry)
    return out


# -- tables -------------------------------------------------------------------
def _fmt_limit(limit) -> str:
    return 'None' if limit is None else str(limit)


def timing_table(timing: List[Dict]) -> str:
    headers = ['model', 'stock', 'max_factor_dim', 'stock s', 'every',
               '5', '10', '20', 'A20/G5', 'stale', 'diag', 'low rank',
               'largest full', 'dense precond GFLOP', 'retries', 'skipped',
               'cycles']
    rows = []
    for e in timing:
        r = e.get('ratio')
        ratio = (lambda k: r[k]['median']) if r else (lambda k: None)
        rows.append([e['model'], e['stock_optimizer'], _fmt_limit(e['limit'])
                     + (' (= {})'.format(_fmt_limit(e['same_as']))
                        if 'same_as' in e else ''),
                     e['stock_s']['median'] if r else None,
                     ratio('every'), ratio('5'), ratio('10'), ratio('20'),
                     ratio('A20/G5'), ratio('stale'),
                     e['diagonal_factors'], e.get('low_rank_factors'),
                     e['largest_full_factor'],
                     e['precondition_gflop'], e.get('inverse_retries'),
                     e.get('skipped_steps'),
                     len(e['samples']['stock_s']) if 'samples' in e
                     else None])
    return _common.format_table(headers, rows)


def stage_table(timing: List[Dict]) -> str:
    headers = ['model', 'max_factor_dim', 'step', 'wall s', 'loop',
               'fwd+bwd', 'inverse', 'precondition', 'update', 'other']
    rows = []
    for e in timing:
        if 'stages_s' not in e or 'same_as' in e:
            continue
        for phase in ('every', 'stale'):
            s = e['stages_s'][phase]
            other = s['factors'] + s['reduce_scatter'] + s['all_gather']
            rows.append([e['model'], _fmt_limit(e['limit']), phase,
                         e['kfac_s'][phase]['median'], s['loop'],
                         s['forward_backward'], s['inverse'],
                         s['precondition'], s['update'], other])
    return _common.format_table(headers, rows)


def accuracy_table(accuracy: List[Dict]) -> str:
    headers = ['net', 'optimizer', 'damping', 'intervals', 'max_factor_dim',
               'kl_clip', 'val acc mean', 'std', 'min', 'max', 'vs SGD',
               '± SE', 'min ν', 'skipped']
    rows = []
    for e in accuracy:
        rows.append([e['net'], e['optimizer'], e.get('damping'),
                     e.get('intervals'),
                     '/'.join(_fmt_limit(v) for v in e['limits'])
                     if 'limits' in e else None, e.get('kl_clip'),
                     e['accuracy_mean'], e['accuracy_std'],
                     e['accuracy_min'], e['accuracy_max'], e.get('vs_sgd'),
                     e.get('vs_sgd_se'), e.get('min_step_scale'),
                     e.get('skipped_steps')])
    return _common.format_table(headers, rows)


def candidates(timing: List[Dict], accuracy: List[Dict]) -> List[Dict]:
    """Every K-FAC setting with both nets' accuracy and the goal models'
    step-time ratios."""
    acc = {}
    for e in accuracy:
        if e['optimizer'] != 'KFAC':
            continue
        for limit in e['limits']:
            acc[(e['net'], e['damping'], e['intervals'], limit,
                 e.get('kl_clip'))] = e
    ratio = {(e['model'], e['limit']): e['ratio'] for e in timing
             if 'ratio' in e}
    limits = sorted({k[3] for k in acc} | {k[1] for k in ratio},
                    key=lambda v: -(v or 1e9))
    dampings = sorted({k[1] for k in acc})
    clips = sorted({k[4] for k in acc}, key=lambda v: v or 0)
    out = []
    for damping, name, limit, clip in itertools.product(
            dampings, ACCURACY_INTERVALS, limits, clips):
        row = {'damping': damping, 'intervals': name,
               'limit': limit, 'kl_clip': clip}
        for net in DIGITS_NETS:
            e = acc.get((net, damping, name, limit, clip))
            if e is not None:
                row[net] = (e['accuracy_mean'], e['accuracy_std'],
                            e.get('vs_sgd'), e.get('vs_sgd_se'))
        if not any(net in row for net in DIGITS_NETS):
            continue
        for model in GOAL_MODELS:
            r = ratio.get((model, limit))
            if r is not None and name in r:
                row[model] = r[name]['median']
        out.append(row)
    return out


def candidates_table(rows: List[Dict]) -> str:
    headers = ['damping', 'intervals', 'max_factor_dim', 'kl_clip']
    for net in DIGITS_NETS:
        headers += [net, 'vs SGD']
    headers += ['{} x'.format(m) for m in GOAL_MODELS]
    out = []
    for row in rows:
        line = [row['damping'], row['intervals'], _fmt_limit(row['limit']),
                row.get('kl_clip')]
        for net in DIGITS_NETS:
            value = row.get(net)
            line += (['{:.4f} ± {:.4f}'.format(*value[:2]),
                      '{:+.4f} ± {:.4f}'.format(*value[2:])]
                     if value is not None and value[2] is not None
                     else [None, None])
        line += [row.get(m) for m in GOAL_MODELS]
        out.append(line)
    return _common.format_table(headers, out)


def print_tables(data: Dict) -> None:
    print(_common.describe_machine(data))
    print('load average before / after: {} / {}'.format(
        data.get('load_before'), data.get('load_after')))
    for source in data.get('merged_from', []):
        print('merged: {} ({}; load {} / {})'.format(
            source['file'], source['date'], source.get('load_before'),
            source.get('load_after')))
    if data.get('timing'):
        print('\nK-FAC step time / stock optimizer step time (median over '
              'cycles), by refresh interval')
        print(timing_table(data['timing']))
        print('\nK-FAC stage seconds (medians; loop = the user\'s forward '
              '+ backward with capture outside update)')
        print(stage_table(data['timing']))
    if data.get('accuracy'):
        print('\nValidation accuracy on the digits after {} epochs, batch {}, '
              '{} seeds'.format(data['epochs'], data['batch'],
                                len(data['seeds'])))
        print(accuracy_table(data['accuracy']))
    if data.get('stability'):
        print('\nThe step in the Fisher metric, lr² Σ ⟨∇E, (F + γI)⁻¹ ∇E⟩ '
              'before the bound, and ν, digits MLP, first {} steps'.format(
                  data['stability'][0]['steps']))
        print(_common.format_table(
            ['damping', 'intervals', 'kl_clip', 'median', 'max',
             'smallest ν', 'non-finite'],
            [[e['damping'], e['intervals'], e.get('kl_clip'), e['median'],
              e['max'], e.get('min_scale'), e['non_finite']]
             for e in data['stability']]))
    if data.get('candidates'):
        print('\nCandidates: digits accuracy (mean ± std; difference to '
              'MomentumSGD ± SE) and step-time ratio of the goal models')
        print(candidates_table(data['candidates']))


# -- main ---------------------------------------------------------------------
def merge_into(data: Dict, path: str) -> None:
    """The parts of an earlier run's JSON into ``data``: its timing
    entries of models that ``data`` lacks replace nothing; its accuracy
    settings and stability rows are added unless ``data`` has them."""
    with open(path) as f:
        earlier = json.load(f)
    for key in ('epochs', 'batch', 'seeds', 'cycles', 'limits'):
        if key in earlier and key not in data:
            data[key] = earlier[key]
    if earlier.get('accuracy') and data.get('accuracy') and (
            data['epochs'], data['batch'], data['seeds']) != (
            earlier['epochs'], earlier['batch'], earlier['seeds']):
        raise SystemExit('--merge {}: other epochs, batch or seeds'.format(
            path))
    mine = {e['model'] for e in data.get('timing', [])}
    data['timing'] = data.get('timing', []) + [
        e for e in earlier.get('timing', []) if e['model'] not in mine]
    keys = {_accuracy_key(e) for e in data.get('accuracy', [])}
    data['accuracy'] = data.get('accuracy', []) + [
        e for e in earlier.get('accuracy', [])
        if _accuracy_key(e) not in keys]
    rows = {_stability_key(e) for e in data.get('stability', [])}
    data['stability'] = data.get('stability', []) + [
        e for e in earlier.get('stability', [])
        if _stability_key(e) not in rows]
    data['merged_from'].append({
        'file': path, 'date': earlier.get('date'),
        'git_commit': earlier.get('git_commit'),
        'command': earlier.get('command'),
        'load_before': earlier.get('load_before'),
        'load_after': earlier.get('load_after')})


def _limits(text: str):
    """``--limits``: comma-separated ``max_factor_dim`` values, each an
    integer >= 1 or None."""
    try:
        return tuple(None if v.strip() in ('None', 'none') else
                     _args.positive_int(v.strip()) for v in text.split(','))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            "expected comma-separated integers >= 1 or 'None', got "
            '{!r}'.format(text)) from None


def _kl_clip(text: str):
    """``--kl-clip``: a number > 0, or 'none'."""
    return None if text.lower() == 'none' else _args.positive_float(text)


def parse_args(argv):
    parser = _common.argument_parser('benchmarks.stock_models', __doc__)
    parser.add_argument('--smoke', action='store_true',
                        help='tiny models, one seed, seconds')
    parser.add_argument('--part', type=_args.names(PARTS),
                        default='timing,accuracy,stability',
                        help="comma-separated; 'none' runs nothing: with "
                             '--merge, joins earlier runs and prints '
                             '(default: %(default)s)')
    parser.add_argument('--models', type=_args.names(list(TIMED) + [
        n for n in SMOKE_TIMED if n not in TIMED]), default=None,
                        help='comma-separated; default all ({})'.format(
                            ','.join(TIMED)))
    parser.add_argument('--limits', type=_limits,
                        default='None,4096,2048,1024,512',
                        help="comma-separated max_factor_dim values of the "
                             "timing and accuracy runs ('None': no limit) "
                             '(default: %(default)s)')
    parser.add_argument('--cycles', type=_args.positive_int, default=3,
                        help='timed cycles of three K-FAC step kinds per '
                             'model and limit, after one warm-up cycle '
                             '(default: %(default)s; smoke 1)')
    parser.add_argument('--seeds', type=_args.positive_int, default=5,
                        help='seeds of each accuracy setting (default: '
                             '%(default)s; smoke 1)')
    parser.add_argument('--epochs', type=_args.positive_int, default=5,
                        help='epochs of each accuracy run (default: '
                             '%(default)s; smoke 1)')
    parser.add_argument('--batch', type=_args.positive_int, default=64,
                        help='batch of the accuracy and stability runs '
                             '(default: %(default)s)')
    parser.add_argument('--dampings', type=_args.float_list,
                        default=','.join(map(str, DAMPINGS)),
                        help='comma-separated K-FAC dampings of the '
                             'accuracy and stability grids (default: '
                             '%(default)s; smoke: the accuracy grid takes '
                             'the first)')
    parser.add_argument('--intervals', type=_args.names(ACCURACY_INTERVALS),
                        default=','.join(ACCURACY_DEFAULT_INTERVALS),
                        help='accuracy grid, of {} (default: %(default)s; '
                             'smoke: the first two)'.format(
                                 ','.join(ACCURACY_INTERVALS)))
    parser.add_argument('--kl-clip', type=_kl_clip, default=str(
        kfac_module.DEFAULT_KL_CLIP),
                        help="the accuracy and stability runs' bounded "
                             "step ('none': unbounded) (default: "
                             '%(default)s)')
    parser.add_argument('--low-rank', choices=('on', 'off'), default='on',
                        help="the timed K-FAC's low-rank factors (default: "
                             '%(default)s)')
    parser.add_argument('--threads', type=_args.positive_int, default=1,
                        help='BLAS threads, through threadpoolctl '
                             '(default: %(default)s)')
    parser.add_argument('--merge', action='append', default=[],
                        type=_args.json_file,
                        help='JSON of an earlier run (repeatable): its '
                             'model timings, accuracy settings and '
                             'stability rows not redone here are kept')
    parser.add_argument('--out', default='result/stock_models.json',
                        help='JSON output, also written after each timed '
                             'model (default: %(default)s)')
    args = parser.parse_args(argv)
    timed = SMOKE_TIMED if args.smoke else TIMED
    unknown = [name for name in args.models or () if name not in timed]
    if unknown:
        parser.error('--models: {} {} not among the {}models ({})'.format(
            ', '.join(unknown), 'is' if len(unknown) == 1 else 'are',
            '--smoke ' if args.smoke else '', ', '.join(timed)))
    _args.check_paths(parser, args)
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    parts = set(args.part)
    limits, kl_clip = args.limits, args.kl_clip
    data = _common.header('stock_models', argv)
    data['merged_from'] = []
    for path in args.merge:
        merge_into(data, path)
    data['load_before'] = list(os.getloadavg())
    data['smoke'] = args.smoke
    timed = SMOKE_TIMED if args.smoke else TIMED
    with _common.limit_blas_threads(args.threads):
        data['blas_threads'] = _common.blas_threads()
        if 'timing' in parts:
            names = args.models or list(timed)
            cycles = 1 if args.smoke else args.cycles
            data['cycles'] = cycles
            data['limits'] = [_fmt_limit(v) for v in limits]
            data['low_rank'] = args.low_rank == 'on'
            # An earlier run's entries of other models are kept (--merge).
            data['timing'] = [e for e in data.get('timing', [])
                              if e['model'] not in names]
            for name in names:
                for entry in time_model(name, timed[name], limits, cycles,
                                        args.low_rank == 'on'):
                    entry['measured'] = data['date']
                    data['timing'].append(entry)
                _common.write_json(args.out, data)   # so far (long runs)
        if 'accuracy' in parts:
            seeds = list(range(1 if args.smoke else args.seeds))
            epochs = 1 if args.smoke else args.epochs
            dampings, intervals = args.dampings, args.intervals
            if args.smoke:
                dampings, intervals = dampings[:1], intervals[:2]
            if data.get('accuracy') and (
                    data['epochs'], data['batch'], data['seeds']) != (
                    epochs, args.batch, seeds):
                raise SystemExit('--merge: the earlier accuracy runs used '
                                 'other epochs, batch or seeds')
            data.update(epochs=epochs, batch=args.batch, seeds=seeds)
            fresh = accuracy_grid(
                SMOKE_DIGITS_NETS if args.smoke else DIGITS_NETS, dampings,
                intervals, limits, seeds, epochs, args.batch,
                limit_samples=200 if args.smoke else None, kl_clip=kl_clip)
            # An earlier run's settings not redone here are kept (--merge).
            redone = {_accuracy_key(e) for e in fresh}
            data['accuracy'] = [e for e in data.get('accuracy', [])
                                if _accuracy_key(e) not in redone] + fresh
            _compare_to_sgd(data['accuracy'])
        if 'stability' in parts:
            fresh = stability(
                args.dampings,
                ['1', '5'], 3 if args.smoke else 22, args.batch,
                n_units=16 if args.smoke else 1000, kl_clip=kl_clip)
            redone = {_stability_key(e) for e in fresh}
            data['stability'] = [
                e for e in data.get('stability', [])
                if _stability_key(e) not in redone] + fresh
    data['load_after'] = list(os.getloadavg())
    order = list(TIMED) + list(SMOKE_TIMED)
    data['timing'] = sorted(data.get('timing', []), key=lambda e: (
        order.index(e['model']) if e['model'] in order else len(order)))
    if data.get('timing') and data.get('accuracy'):
        data['candidates'] = candidates(data['timing'], data['accuracy'])
    _common.write_json(args.out, data)
    print()
    print_tables(data)
    print('\nwritten to', args.out)


if __name__ == '__main__':
    main()
