"""Time of one training step: momentum SGD vs K-FAC, and K-FAC's stages.

    python -m benchmarks.step_time [--smoke] [--out FILE.json]
        [--models small,resnet50] [--rounds N] [--resnet50-rounds N]
        [--interval 20] [--threads 1] [--profile]

For each model (the small ResNet at batch 128, 32x32; ResNet-50 at batch 8,
224x224) three optimizers train their own copy of the same network on the
same fixed batch:

* ``sgd``: :class:`chainer.optimizers.MomentumSGD` (cleargrads, forward,
  backward, update);
* ``kfac_every``: :class:`chainerkfac.optimizers.KFAC`, every factor
  refreshed (and inverted) every step;
* ``kfac_stale``: K-FAC with refresh intervals ``--interval`` (20): its
  steady state, steps that refresh nothing and reuse the stored inverses.

After warm-up steps, the variants are timed in *rounds* (one step of each,
in an order rotated every round), so that the machine's noise hits all
three alike; each ratio to SGD is the median over rounds of the ratio
within a round. The stale optimizer's refresh steps are kept apart (a
refresh step does the work of an every-step K-FAC step); the *amortised*
cost over one refresh cycle of ``k`` steps is, per round,
``(t_every + (k − 1) t_stale) / k``, then the median. Stage times
(:attr:`KFAC.stage_times`: forward_backward = stages 1-2 with factor
capture, factors, reduce_scatter, inverse, precondition, all_gather,
update) are medians over the timed steps; for SGD, forward_backward and
update.

Goals (reported, not asserted): stale ≤ 1.3x SGD; every-step ≤ 3x SGD on
the small ResNet. Timings are only comparable within one run.

BLAS threads: ``--threads`` (default 1, through threadpoolctl); the JSON
records the count in effect.
"""
import argparse
import cProfile
import gc
import io
import pstats
import sys
import time
from typing import Dict, List

import chainerkfac  # NOQA  (before chainer: NumPy-2 compatibility shims)
import chainer
import numpy

import models
from benchmarks import _common
from chainerkfac.optimizers import KFAC

VARIANTS = ('sgd', 'kfac_every', 'kfac_stale')
STAGES = ('forward_backward', 'factors', 'reduce_scatter', 'inverse',
          'precondition', 'all_gather', 'update')
GOALS = {'small': {'kfac_stale': 1.3, 'kfac_every': 3.0},
         'resnet50': {'kfac_stale': 1.3}}

#: name -> (constructor kwargs, batch, input size, rounds, warm-up steps)
FULL = {
    'small': dict(arch='small', kwargs={'depth': 8, 'width': 16,
                                        'n_class': 10},
                  batch=128, size=32, rounds=21, warmup=2),
    'resnet50': dict(arch='resnet50', kwargs={'n_class': 1000},
                     batch=8, size=224, rounds=5, warmup=1),
}
SMOKE = {
    'small': dict(arch='small', kwargs={'depth': 8, 'width': 4,
                                        'n_class': 10},
                  batch=8, size=16, rounds=2, warmup=1),
}


def build_model(arch: str, kwargs: Dict) -> chainer.Link:
    numpy.random.seed(0)   # every variant starts from the same weights
    if arch == 'resnet50':
        predictor = models.ResNet50(**kwargs)
    else:
        predictor = models.SmallResNet(**kwargs)
    return models.SoftLabelClassifier(predictor)


class SGDStep:
    """Momentum SGD, timed as forward_backward + update."""

    def __init__(self, model, lr=0.01):
        self.model = model
        self.optimizer = chainer.optimizers.MomentumSGD(lr=lr, momentum=0.9)
        self.optimizer.setup(model)
        self.stage_times = {}
        self.refreshed = False

    def __call__(self, x, t):
        start = time.perf_counter()
        self.model.cleargrads()
        self.model(x, t).backward()
        middle = time.perf_counter()
        self.optimizer.update()
        self.stage_times = {'forward_backward': middle - start,
                            'update': time.perf_counter() - middle}


class KFACStep:
    """One K-FAC step (``acc_iters = 1``) with refresh interval ``interval``."""

    def __init__(self, model, interval: int, lr=0.001):
        self.model = model
        self.optimizer = KFAC(lr=lr, momentum=0.9, damping=1e-3,
                              refresh_interval_a=interval,
                              refresh_interval_g=interval,
                              refresh_interval_f=interval, verbose=False)
        self.optimizer.setup(model)
        self.stage_times = {}
        self.refreshed = False

    def __call__(self, x, t):
        self.optimizer.update(self.model, x, t)
        self.stage_times = dict(self.optimizer.stage_times)
        last = self.optimizer.last_refresh
        self.refreshed = any(v == self.optimizer.t - 1 for v in last.values())


def measure(name: str, spec: Dict, interval: int, rounds: int,
            warmup: int, profile: bool = False) -> Dict:
    """Time the three variants on one model (see the module docstring);
    with ``profile``, then cProfile one more every-step K-FAC step."""
    rng = numpy.random.RandomState(1)
    x = rng.standard_normal((spec['batch'], 3, spec['size'], spec['size'])
                            ).astype(numpy.float32)
    n_class = spec['kwargs']['n_class']
    t = rng.randint(0, n_class, spec['batch']).astype(numpy.int32)
    steps = {'sgd': SGDStep(build_model(spec['arch'], spec['kwargs'])),
             'kfac_every': KFACStep(build_model(spec['arch'], spec['kwargs']),
                                    1),
             'kfac_stale': KFACStep(build_model(spec['arch'], spec['kwargs']),
                                    interval)}
    for variant in VARIANTS:
        for _ in range(warmup):
            steps[variant](x, t)
    samples = {v: [] for v in VARIANTS + ('kfac_stale_refresh',)}
    stages = {v: [] for v in VARIANTS + ('kfac_stale_refresh',)}
    ratios = {'kfac_every': [], 'kfac_stale': [], 'kfac_stale_amortised': []}
    for r in range(rounds):
        order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
        times = {}
        for variant in order:
            gc.collect()
            start = time.perf_counter()
            steps[variant](x, t)
            elapsed = time.perf_counter() - start
            key = variant
            if variant == 'kfac_stale' and steps[variant].refreshed:
                key = 'kfac_stale_refresh'
            times[key] = elapsed
            samples[key].append(elapsed)
            stages[key].append(steps[variant].stage_times)
        sgd = times['sgd']
        ratios['kfac_every'].append(times['kfac_every'] / sgd)
        if 'kfac_stale' in times:
            ratios['kfac_stale'].append(times['kfac_stale'] / sgd)
            ratios['kfac_stale_amortised'].append(
                (times['kfac_every'] + (interval - 1) * times['kfac_stale']) /
                interval / sgd)
    n_kfac = sum(1 for b in steps['kfac_every'].optimizer.blocks
                 if b.factor_names)
    result = {
        'model': name, 'arch': spec['arch'], 'model_kwargs': spec['kwargs'],
        'batch': spec['batch'], 'input': [3, spec['size'], spec['size']],
        'n_kfac_layers': n_kfac, 'refresh_interval': interval,
        'rounds': rounds, 'warmup_steps': warmup,
        'median_s': {k: _common.median(v) if v else None
                     for k, v in samples.items()},
        'ratio_to_sgd': {k: _common.median(v) if v else None
                         for k, v in ratios.items()},
        'stage_times_s': {k: _median_stages(v) for k, v in stages.items()
                          if v},
        'samples_s': samples,
    }
    result['extra_over_sgd'] = extra_over_sgd(result)
    if profile:
        result['profile'] = profile_step(steps['kfac_every'], x, t)
    result['goals'] = {
        variant: {'goal': goal, 'ratio': result['ratio_to_sgd'][variant],
                  'met': (result['ratio_to_sgd'][variant] is not None and
                          result['ratio_to_sgd'][variant] <= goal)}
        for variant, goal in GOALS.get(name, {}).items()}
    return result


def _median_stages(records: List[Dict]) -> Dict[str, float]:
    keys = [s for s in STAGES if any(s in r for r in records)]
    return {k: _common.median([r.get(k, 0.0) for r in records])
            for k in keys}


def extra_over_sgd(result: Dict) -> Dict[str, Dict[str, float]]:
    """Where K-FAC's extra time goes, per stage, in seconds (medians).

    ``capture`` is K-FAC's forward_backward minus SGD's (the factor-capture
    hook); the other stages have no SGD counterpart except ``update``.
    """
    sgd = result['stage_times_s']['sgd']
    out = {}
    for variant in ('kfac_every', 'kfac_stale'):
        stage = result['stage_times_s'].get(variant)
        if stage is None:
            continue
        extra = {'capture': stage['forward_backward'] -
                 sgd['forward_backward']}
        for name in STAGES[1:]:
            extra[name] = stage.get(name, 0.0) - (
                sgd['update'] if name == 'update' else 0.0)
        out[variant] = extra
    return out


def profile_step(step: KFACStep, x, t, top: int = 20) -> str:
    """cProfile of one (warm) step: the top functions by own time."""
    profiler = cProfile.Profile()
    profiler.enable()
    step(x, t)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats('tottime').print_stats(top)
    return text.getvalue()


# -- output -------------------------------------------------------------------------
def tables(data: Dict) -> str:
    rows = []
    for r in data['results']:
        med, ratio = r['median_s'], r['ratio_to_sgd']
        goals = r['goals']

        def goal(variant):
            if variant not in goals:
                return '-'
            g = goals[variant]
            return '<= {:g}: {}'.format(g['goal'], 'met' if g['met']
                                        else 'NOT met')
        rows.append([r['model'], r['batch'], med['sgd'], med['kfac_every'],
                     ratio['kfac_every'], goal('kfac_every'),
                     med['kfac_stale'], ratio['kfac_stale'], goal('kfac_stale'),
                     ratio['kfac_stale_amortised']])
    summary = _common.format_table(
        ['model', 'batch', 'SGD [s]', 'K-FAC every [s]', 'x SGD',
         'goal', 'K-FAC stale [s]', 'x SGD', 'goal',
         'amortised /{} x SGD'.format(data['refresh_interval'])], rows)
    stage_rows = []
    for r in data['results']:
        for variant in ('sgd', 'kfac_every', 'kfac_stale'):
            st = r['stage_times_s'][variant]
            stage_rows.append([r['model'], variant] +
                              [st.get(s) for s in STAGES] +
                              [sum(st.values())])
    stages = _common.format_table(
        ['model', 'variant'] + list(STAGES) + ['sum'], stage_rows)
    extra_rows = []
    for r in data['results']:
        for variant, extra in r['extra_over_sgd'].items():
            extra_rows.append([r['model'], variant, sum(extra.values())] + [
                extra[k] for k in ['capture'] + list(STAGES[1:])])
    extras = _common.format_table(
        ['model', 'variant', 'extra over SGD', 'capture (fwd+bwd)'] +
        list(STAGES[1:]), extra_rows)
    return ('Step time, medians over rounds ({} BLAS thread(s)); ratios are '
            'per-round medians\n{}\n\nStage times [s], medians\n{}\n\n'
            "Where K-FAC's extra time goes [s] (stage medians minus SGD's)\n{}"
            .format(data['blas_threads'], summary, stages, extras))


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog='python -m benchmarks.step_time', description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--smoke', action='store_true',
                        help='tiny sizes, 2 rounds: seconds (for the tests)')
    parser.add_argument('--out', default='result/step_time.json',
                        help='JSON output (default result/step_time.json)')
    parser.add_argument('--models', default=None,
                        help='comma-separated subset of {} (default: all)'
                        .format(','.join(FULL)))
    parser.add_argument('--rounds', type=int, default=None,
                        help='timed rounds of the small ResNet (default 21)')
    parser.add_argument('--resnet50-rounds', type=int, default=None,
                        help='timed rounds of ResNet-50 (default 5)')
    parser.add_argument('--interval', type=int, default=20,
                        help='refresh interval of the stale variant')
    parser.add_argument('--threads', type=int, default=1,
                        help='BLAS threads (default 1)')
    parser.add_argument('--profile', action='store_true',
                        help='also cProfile one every-step K-FAC step of '
                        'each model and print the top functions')
    args = parser.parse_args(argv)
    if args.interval < 2:
        parser.error('--interval must be >= 2 (1 is the every-step variant)')
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    specs = {k: dict(v) for k, v in (SMOKE if args.smoke else FULL).items()}
    if args.models:
        names = args.models.split(',')
        unknown = [n for n in names if n not in specs]
        if unknown:
            raise SystemExit('unknown model(s) {}; choose from {}'.format(
                ', '.join(unknown), ', '.join(specs)))
        specs = {n: specs[n] for n in names}
    if args.rounds and 'small' in specs:
        specs['small']['rounds'] = args.rounds
    if args.resnet50_rounds and 'resnet50' in specs:
        specs['resnet50']['rounds'] = args.resnet50_rounds
    data = _common.header('step_time', argv)
    data.update(smoke=args.smoke, refresh_interval=args.interval,
                threads_requested=args.threads)
    with _common.limit_blas_threads(args.threads):
        data['blas_threads'] = _common.blas_threads()
        data['results'] = []
        for name, spec in specs.items():
            print('timing {} (batch {}, {} rounds)...'.format(
                name, spec['batch'], spec['rounds']), flush=True)
            data['results'].append(measure(
                name, spec, args.interval, spec['rounds'], spec['warmup'],
                profile=args.profile))
    text = tables(data)
    print(_common.describe_machine(data))
    print(text)
    for result in data['results']:
        if 'profile' in result:
            print('cProfile, one every-step K-FAC step of {}:\n{}'.format(
                result['model'], result['profile']))
    _common.write_json(args.out, data)
    print('wrote {}'.format(args.out))
    return 0


if __name__ == '__main__':
    sys.exit(main())
