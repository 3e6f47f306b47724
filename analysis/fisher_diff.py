"""Figure 5: how fast the Fisher changes, Diff(t) of eq. (21), vs iteration.

    python -m analysis.fisher_diff RUN [RUN ...] [--mark 500] [--out F.png]

For every run directory (its ``fisher_diff.jsonl``, written by
:class:`chainerkfac.training.FisherDiffLog`) and every logged step, the
{5, 25, 50, 75, 95}th percentiles over layers of Diff(t) of the Kronecker
factors A and G of the convolutional layers (left: A above, G below) and of
the Fisher F of the BatchNormalization layers (right). One colour per run,
labelled with its mini-batch size from ``config.json``; the median is a line,
the 25-75th and 5-95th percentiles are shaded bands; log-scale y; a black
vertical line at iteration ``--mark`` (500, as in the paper) when that
iteration lies inside the logged range.

The x axis is the K-FAC step (``"step"`` of the records): one iteration of
the global mini-batch, which is the paper's iteration also when micro-batches
are accumulated (the trainer's own iteration then counts micro-batches).

Conv vs FC. The log names layers, not their types; F belongs to BN layers
only, but A and G come from convolutions *and* the fully connected layer. The
paper plots convolutions, so the layer types are taken from the network the
run trained: the model named by ``"run": {"arch", "depth", "width",
"n_class"}`` of ``config.json`` (or ``--model``/``--depth``/``--width``) is
rebuilt and its Fisher blocks (:func:`chainerkfac.fisher_blocks.build_blocks`)
give each layer's type; a log layer the model lacks is an error. Without a
known model (no ``arch``), or with ``--include-fc``, A and G are taken over
all Kronecker-factored layers (ResNet-50: 53 conv + 1 FC), and the figure
says so.
"""
import argparse
import functools
import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy

from analysis import _io, _models
from chainerkfac.fisher_blocks import Convolution2DBlock

PERCENTILES = (5, 25, 50, 75, 95)
#: Panel of each factor: which layers, and its title.
PANELS = (('A', 'conv'), ('G', 'conv'), ('F', 'BN'))


@functools.lru_cache(maxsize=8)
def layer_types(arch: str, kwargs: Tuple) -> Tuple[Tuple[str, ...],
                                                   frozenset]:
    """Names of the K-FAC layers of a model (``'/res2/a/conv1'``), and the
    subset that are Convolution2D blocks."""
    model = _models.build_model(arch, **dict(kwargs))
    blocks = [b for b in _models.kfac_blocks(model) if b.factor_names]
    return (tuple(b.name for b in blocks),
            frozenset(b.name for b in blocks
                      if isinstance(b, Convolution2DBlock)))


def layer_prefix(keys: Sequence[str], names: Sequence[str]
                 ) -> Optional[str]:
    """The path prefix that turns every logged layer name into a model layer.

    The log names layers by their path in the optimizer's target, which may
    wrap the model (``'/predictor/res2/a/conv1'`` for a classifier around a
    model whose layer is ``'/res2/a/conv1'``). One prefix must fit every
    key; the shortest such prefix is returned (``''`` for an unwrapped
    model), None if there is none.
    """
    common = None
    names = set(names)
    for key in keys:
        fits = {key[:len(key) - len(name)] for name in names
                if key.endswith(name)}
        common = fits if common is None else common & fits
        if not common:
            return None
    return min(common, key=len) if common else ''


def conv_selection(run: _io.Run, records: List[Dict], args
                   ) -> Tuple[Optional[set], str]:
    """The logged A/G layer names that are convolutions, and a description.

    Returns ``(None, 'conv+FC ...')`` when every Kronecker layer is kept.
    """
    facts = run.facts
    arch = args.model or facts.get('arch')
    if args.include_fc or not arch:
        why = 'requested' if args.include_fc else \
            'model unknown: config.json has no "run": {"arch"}'
        return None, 'conv+FC layers ({})'.format(why)
    kwargs = _models.model_kwargs(facts)
    if args.depth is not None:
        kwargs['depth'] = args.depth
    if args.width is not None:
        kwargs['width'] = args.width
    names, convs = layer_types(arch, tuple(sorted(kwargs.items())))
    keys = sorted({k for r in records for f in ('A', 'G')
                   for k in r.get(f, {})})
    prefix = layer_prefix(keys, names)
    if prefix is None:
        raise _io.AnalysisError(
            '{}: the layers of fisher_diff.jsonl ({}, ...) are not the '
            'K-FAC layers of model {!r} {}; give the run\'s model '
            '(--model/--depth/--width) or --include-fc'.format(
                run.path, ', '.join(keys[:3]), arch, kwargs or ''))
    selected = {k for k in keys if k[len(prefix):] in convs}
    return selected, 'conv layers (types from model {!r})'.format(arch)


def percentile_series(records: List[Dict], factor: str,
                      layers: Optional[set]) -> Dict:
    """Percentiles over layers of ``factor``'s Diff at each logged step.

    Returns ``{"x": [...], "p5": [...], ..., "p95": [...], "n_layers":
    [...]}``; steps where the factor was not refreshed are absent, and
    non-finite values (a zero previous factor) are left out.
    """
    series = {'x': [], 'n_layers': [], 'steps_without_a_finite_value': 0}
    series.update({'p{}'.format(q): [] for q in PERCENTILES})
    for record in records:
        chosen = [v for k, v in record.get(factor, {}).items()
                  if layers is None or k in layers]
        values = [v for v in chosen if _io.is_finite_number(v)]
        if not values:
            # refreshed, but no finite Diff (a diverged run): counted, said
            series['steps_without_a_finite_value'] += bool(chosen)
            continue
        series['x'].append(int(record.get('step', record['iteration'])))
        series['n_layers'].append(len(values))
        for q, value in zip(PERCENTILES, numpy.percentile(values,
                                                          PERCENTILES)):
            series['p{}'.format(q)].append(float(value))
    return series


def run_labels(runs: Sequence[_io.Run]) -> List[str]:
    """``BS=32K`` per run; runs of equal batch size get their full label,
    runs of equal full label their directory (:func:`_io.distinct_labels`).
    """
    short = ['BS=' + _io.format_batch_size(r.batch_size)
             if r.batch_size is not None else r.name for r in runs]
    full = [r.label() for r in runs]
    labels = [s if short.count(s) == 1 or full.count(f) > 1 else
              '{} ({})'.format(s, f) for s, f in zip(short, full)]
    return _io.distinct_labels(labels, [r.path for r in runs])


def analyse(run_dirs: Sequence[str], args) -> Dict:
    # a run killed in its first epoch has Diff records but no log yet
    runs = [_io.load_run(d, require_log=False) for d in run_dirs]
    out = {'figure': 5, 'percentiles': list(PERCENTILES), 'mark': args.mark,
           'x': 'K-FAC step (iteration of the global mini-batch)',
           'runs': []}
    for run, label in zip(runs, run_labels(runs)):
        records = _io.load_fisher_diff(run)
        convs, selection = conv_selection(run, records, args)
        series = {'A': percentile_series(records, 'A', convs),
                  'G': percentile_series(records, 'G', convs),
                  'F': percentile_series(records, 'F', None)}
        if not any(s['x'] for s in series.values()):
            raise _io.AnalysisError('{}: fisher_diff.jsonl has no finite '
                                    'Diff values'.format(run.path))
        out['runs'].append({
            'path': run.path, 'label': label, 'batch_size': run.batch_size,
            'layers': {f: max(s['n_layers'], default=0)
                       for f, s in series.items()},
            'kronecker_layers': selection, 'series': series})
    xs = [x for r in out['runs'] for s in r['series'].values()
          for x in s['x']]
    out['mark_shown'] = min(xs) <= args.mark <= max(xs)
    return out


def plot(result: Dict):
    figure = _io.new_figure(figsize=(11, 6.5))
    grid = figure.add_gridspec(2, 2)
    axes = {'A': figure.add_subplot(grid[0, 0]),
            'G': figure.add_subplot(grid[1, 0]),
            'F': figure.add_subplot(grid[:, 1])}
    colors = ['C{}'.format(i % 10) for i in range(len(result['runs']))]
    for factor, kind in PANELS:
        ax = axes[factor]
        for run, color in zip(result['runs'], colors):
            s = run['series'][factor]
            if not s['x']:
                continue
            ax.fill_between(s['x'], s['p5'], s['p95'], color=color,
                            alpha=0.12, linewidth=0)
            ax.fill_between(s['x'], s['p25'], s['p75'], color=color,
                            alpha=0.3, linewidth=0)
            ax.plot(s['x'], s['p50'], color=color, linewidth=1.5,
                    marker='.' if len(s['x']) < 30 else None,
                    label=run['label'])
        if result['mark_shown']:
            # black: red is the fourth run's colour (C3)
            ax.axvline(result['mark'], color='black', linewidth=1.2,
                       label='iteration {}'.format(result['mark']))
        ax.set_yscale('log')
        ax.set_ylabel('Diff of {}'.format(factor))
        ax.set_xlabel('iteration')
        which = 'BN layers' if kind == 'BN' else (
            'conv layers' if all(r['kronecker_layers'].startswith('conv ')
                                 for r in result['runs'])
            else 'conv+FC layers')
        ax.set_title('{} ({})'.format(factor, which), fontsize=10)
        ax.grid(True, which='major', alpha=0.3)
    handles, labels = axes['F'].get_legend_handles_labels()
    from matplotlib.patches import Patch
    handles += [Patch(color='gray', alpha=0.45), Patch(color='gray',
                                                       alpha=0.15)]
    labels += ['25-75th percentile', '5-95th percentile']
    axes['F'].legend(handles, labels, fontsize=8, title='median, by run')
    figure.suptitle('Figure 5: change of the Fisher, Diff(t) of eq. (21); '
                    '{5, 25, 50, 75, 95}th percentiles over layers',
                    fontsize=11)
    figure.tight_layout()
    return figure


def format_table(result: Dict, max_rows: int = 12) -> str:
    """Rows of the series (subsampled to ``max_rows``, the mark kept)."""
    lines = []
    head = '{:>8} {:>7}'.format('iter', 'layers') + ''.join(
        '{:>11}'.format('p{}'.format(q)) for q in PERCENTILES)
    for run in result['runs']:
        for factor, _ in PANELS:
            s = run['series'][factor]
            if not s['x']:
                if s.get('steps_without_a_finite_value'):
                    lines.append('{} [{}]: Diff of {}: no finite value in '
                                 'its {} refreshed steps'.format(
                                     run['label'], run['path'], factor,
                                     s['steps_without_a_finite_value']))
                continue
            rows = list(range(len(s['x'])))
            if len(rows) > max_rows:
                keep = set(numpy.linspace(0, len(rows) - 1, max_rows)
                           .round().astype(int))
                near = min(rows, key=lambda i: abs(s['x'][i] -
                                                   result['mark']))
                rows = sorted(keep | {near})
            lines.append('{} [{}]: Diff of {} over {} ({} steps{})'.format(
                run['label'], run['path'], factor,
                'BN layers' if factor == 'F' else run['kronecker_layers'],
                len(s['x']),
                '; {} more without a finite value, left out'.format(
                    s['steps_without_a_finite_value'])
                if s.get('steps_without_a_finite_value') else ''))
            lines.append(head)
            for i in rows:
                lines.append('{:>8} {:>7}'.format(s['x'][i],
                                                  s['n_layers'][i]) +
                             ''.join('{:>11.4g}'.format(s['p{}'.format(q)][i])
                                     for q in PERCENTILES))
    return '\n'.join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog='python -m analysis.fisher_diff',
        description='Figure 5: percentiles over layers of Diff(t) of A, G '
        '(conv) and F (BN) vs iteration, one colour per run.')
    parser.add_argument('runs', nargs='+', metavar='RUN',
                        help='run directories with fisher_diff.jsonl')
    parser.add_argument('--mark', type=int, default=500,
                        help='iteration of the black line (default 500)')
    parser.add_argument('--model', default=None,
                        help='model the runs trained, to tell conv from FC '
                        'layers (default: "arch" in config.json); one of '
                        + ', '.join(_models.ARCHS))
    parser.add_argument('--depth', type=int, default=None,
                        help='depth of --model small')
    parser.add_argument('--width', type=int, default=None,
                        help='width of --model small')
    parser.add_argument('--include-fc', action='store_true',
                        help='take A and G over all Kronecker layers')
    parser.add_argument('--out', default='fig5_fisher_diff.png',
                        help='PNG path; numbers go to the same name .json '
                        '(default: %(default)s, in the current directory)')
    return parser.parse_args(argv)


@_io.cli('fisher_diff')
def main(argv=None):
    """Print and plot Figure 5 for the run directories."""
    args = parse_args(argv)
    _io.check_outputs(args.out, _io.run_files(args.runs))
    result = analyse(args.runs, args)
    json_path = _io.save_outputs(plot(result), args.out, result)
    print(format_table(result))
    if not result['mark_shown']:
        print('iteration {} lies outside the logged steps: no black line'
              .format(args.mark))
    print('wrote {} and {} (full series)'.format(args.out, json_path))
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
