"""Figures 3 and 6: top-1 validation accuracy (and learning rate) vs epoch.

    python -m analysis.curves RUN [RUN ...] [--target 75] [--figure 3|6]
                              [--out F.png]

For every run directory, ``validation/main/accuracy`` of its ``log`` (one
entry per epoch, in percent) against ``epoch``; ``--figure 3`` (default)
adds the learning-rate panel (``lr`` of the log: ``train_imagenet.py``
logs its mean over the epoch's steps; a K-FAC log without ``lr`` falls
back to eq. (17) from the run's config, averaged over each epoch the same
way, and says so; other optimizers' configs do not hold their rate, so
theirs is left out), ``--figure 6`` is the accuracy panel alone, for the
diag / stale variants of one mini-batch size. A dashed line marks the
target accuracy; the first epoch reaching it is printed per run (epochs
whose accuracy is not a finite number are drawn as gaps and do not
count).

Legend labels come from the runs: the ``"run": {"label"}`` that
``train_imagenet.py`` writes (optimizer, mini-batch size, variant), else
optimizer, ``BS=…`` and diag/stale from the config, else the directory name;
runs that would share a label get their directory's name added.
"""
import argparse
import math
import os
from typing import Dict, List, Optional, Sequence

from analysis import _io
from chainerkfac import equations

ACCURACY_KEY = 'validation/main/accuracy'
FIGURE_TITLES = {
    3: 'Figure 3: top-1 validation accuracy and learning rate schedules',
    6: 'Figure 6: top-1 validation accuracy of the K-FAC variants\n'
       '(no approx / diag / stale / stale diag)',
}
#: Points per epoch of eq. (17)'s mean (the fallback of a log without lr).
LR_SAMPLES = 64


def target_percent(target: float) -> float:
    """``--target`` in percent (a value of at most 1 is a fraction)."""
    return target * 100.0 if target <= 1.0 else target


def lr_series(run: _io.Run, epochs: List[float]) -> Dict:
    """The learning rate per epoch: from the log, or eq. (17) of the config.

    Returns ``{"epoch": [...], "lr": [...], "source": "log" | "config
    (eq. 17)" | "none"}``.
    """
    logged = [(e['epoch'], e['lr']) for e in run.log if 'lr' in e]
    if logged:
        return {'epoch': [e for e, _ in logged],
                'lr': [float(v) for _, v in logged], 'source': 'log'}
    config = run.config
    # eq. (17) is K-FAC's schedule: an SGD or LARS config's lr is not the
    # rate its run took
    if run.optimizer == 'kfac' and all(
            isinstance(config.get(k), (int, float))
            for k in ('lr', 'p_decay', 'e_start', 'e_end')) and \
            config['e_end'] > config['e_start']:
        def mean_over(epoch):
            # the epoch's mean, as train_imagenet.py logs lr
            points = [epoch - 1 + (k + 0.5) / LR_SAMPLES
                      for k in range(LR_SAMPLES)]
            return sum(equations.polynomial_lr(
                x, config['lr'], config['p_decay'], config['e_start'],
                config['e_end']) for x in points) / LR_SAMPLES
        return {'epoch': list(epochs), 'lr': [mean_over(e) for e in epochs],
                'source': 'config (eq. 17)'}
    return {'epoch': [], 'lr': [], 'source': 'none'}


def epochs_to_target(epochs: Sequence[float], accuracy: Sequence[float],
                     target: float) -> Optional[float]:
    """First epoch whose accuracy (percent) reaches ``target`` (percent);
    a value that is not finite reaches nothing."""
    for epoch, value in zip(epochs, accuracy):
        if math.isfinite(value) and value >= target:
            return epoch
    return None


def analyse(run_dirs: Sequence[str], target: float, figure: int,
            labels: Optional[Sequence[str]] = None) -> Dict:
    runs = [_io.load_run(d) for d in run_dirs]
    if labels is not None and len(labels) != len(runs):
        raise _io.AnalysisError('{} labels for {} runs'.format(
            len(labels), len(runs)))
    if labels is None:
        labels = _io.distinct_labels([run.label() for run in runs],
                                     run_dirs)
    result = {'figure': figure, 'target_percent': target, 'runs': []}
    for i, run in enumerate(runs):
        entries = [e for e in run.log if e.get(ACCURACY_KEY) is not None]
        if not entries:
            raise _io.AnalysisError(
                '{}: the log has no "{}" (train with a validation '
                'Evaluator)'.format(run.path, ACCURACY_KEY))
        epochs = [e['epoch'] for e in entries]
        accuracy = [100.0 * float(e[ACCURACY_KEY]) for e in entries]
        log_path = os.path.join(run.path, 'log')
        if any(b <= a for a, b in zip(epochs, epochs[1:])):
            raise _io.AnalysisError(
                '{}: the epochs are not increasing ({}): a log edited or '
                'joined by hand?'.format(log_path, ', '.join(
                    '{:g}'.format(e) for e in epochs[:8])))
        outside = [(e, a) for e, a in zip(epochs, accuracy)
                   if math.isfinite(a) and not 0.0 <= a <= 100.0]
        if outside:
            raise _io.AnalysisError(
                '{}: "{}" at epoch {:g} is {:g}, not a fraction in [0, 1] '
                '(a percentage?)'.format(log_path, ACCURACY_KEY,
                                         outside[0][0],
                                         outside[0][1] / 100.0))
        finite = [a for a in accuracy if math.isfinite(a)]
        if not finite:
            raise _io.AnalysisError(
                '{}: no epoch of the log has a finite "{}"'.format(
                    run.path, ACCURACY_KEY))
        result['runs'].append({
            'path': run.path,
            'label': labels[i],
            'optimizer': run.optimizer, 'batch_size': run.batch_size,
            'variant': run.variant(),
            'epoch': epochs, 'val_accuracy_percent': accuracy,
            'best_percent': max(finite),
            'non_finite_epochs': [e for e, a in zip(epochs, accuracy)
                                  if not math.isfinite(a)],
            'epochs_to_target': epochs_to_target(epochs, accuracy, target),
            'lr': lr_series(run, epochs) if figure == 3 else None})
    return result


def plot(result: Dict):
    with_lr = result['figure'] == 3
    figure = _io.new_figure(figsize=(11 if with_lr else 6.5, 4.6))
    acc_ax = figure.add_subplot(1, 2 if with_lr else 1, 1)
    for i, run in enumerate(result['runs']):
        color = 'C{}'.format(i % 10)
        acc_ax.plot(run['epoch'], run['val_accuracy_percent'], color=color,
                    marker='.' if len(run['epoch']) < 30 else None,
                    label=run['label'])
    acc_ax.axhline(result['target_percent'], color='gray', linestyle='--',
                   linewidth=1, label='target {:g}%'.format(
                       result['target_percent']))
    acc_ax.set_xlabel('epoch')
    acc_ax.set_ylabel('top-1 validation accuracy [%]')
    acc_ax.set_title('validation accuracy', fontsize=10)
    acc_ax.grid(True, alpha=0.3)
    acc_ax.legend(fontsize=8)
    if with_lr:
        lr_ax = figure.add_subplot(1, 2, 2)
        for i, run in enumerate(result['runs']):
            lr = run['lr']
            if lr['epoch']:
                suffix = '' if lr['source'] == 'log' else ' (from config)'
                # a marker where there are few points: a run killed in its
                # second epoch has one, which a bare line does not show
                lr_ax.plot(lr['epoch'], lr['lr'], color='C{}'.format(i % 10),
                           marker='.' if len(lr['epoch']) < 30 else None,
                           label=run['label'] + suffix)
        lr_ax.set_xlabel('epoch')
        lr_ax.set_ylabel('learning rate')
        lr_ax.set_title('learning rate schedule', fontsize=10)
        lr_ax.grid(True, alpha=0.3)
        lr_ax.legend(fontsize=8)
    figure.suptitle(FIGURE_TITLES[result['figure']], fontsize=11)
    figure.tight_layout()
    return figure


def format_table(result: Dict) -> str:
    lines = []
    target = result['target_percent']
    for run in result['runs']:
        reached = run['epochs_to_target']
        lines.append('{} [{}]: best {:.2f}%, {:g}% {}{}'.format(
            run['label'], run['path'], run['best_percent'], target,
            'reached at epoch {:g}'.format(reached) if reached is not None
            else 'not reached', '; not finite at epoch(s) {}'.format(
                ', '.join('{:g}'.format(e)
                          for e in run['non_finite_epochs']))
            if run.get('non_finite_epochs') else ''))
        lr = {}
        if run['lr'] is not None:
            lr = dict(zip(run['lr']['epoch'], run['lr']['lr']))
            lines.append('{:>8} {:>12} {:>14}'.format(
                'epoch', 'top-1 [%]', 'lr ({})'.format(run['lr']['source'])))
        else:
            lines.append('{:>8} {:>12}'.format('epoch', 'top-1 [%]'))
        for epoch, value in zip(run['epoch'], run['val_accuracy_percent']):
            row = '{:>8g} {:>12.2f}'.format(epoch, value)
            if run['lr'] is not None:
                row += ' {:>14}'.format('{:.6g}'.format(lr[epoch])
                                        if epoch in lr else '-')
            lines.append(row)
    return '\n'.join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog='python -m analysis.curves',
        description='Figures 3 and 6: top-1 validation accuracy and the '
        'learning-rate schedule vs epoch for several runs.')
    parser.add_argument('runs', nargs='+', metavar='RUN',
                        help='run directories (train_imagenet.py --out)')
    parser.add_argument('--target', type=float, default=75.0,
                        help='target top-1 accuracy in percent (a value '
                        '<= 1 is a fraction); default 75')
    parser.add_argument('--figure', type=int, choices=(3, 6), default=3,
                        help='3: accuracy and learning rate (default); '
                        '6: accuracy only')
    parser.add_argument('--labels', nargs='+', default=None,
                        help='legend labels, one per run (default: from '
                        'the runs)')
    parser.add_argument('--out', default=None,
                        help='PNG path (default fig3_curves.png or '
                        'fig6_curves.png); numbers go to the same name .json')
    return parser.parse_args(argv)


@_io.cli('curves')
def main(argv=None):
    """Print and plot Figure 3 or 6 for the run directories."""
    args = parse_args(argv)
    out = args.out or 'fig{}_curves.png'.format(args.figure)
    _io.check_outputs(out, _io.run_files(args.runs))
    target = target_percent(args.target)
    if not (math.isfinite(args.target) and 0 < target <= 100):
        raise _io.AnalysisError('--target {:g}: a top-1 accuracy in (0, '
                                '100] percent, or a fraction in (0, 1]'
                                .format(args.target))
    result = analyse(args.runs, target, args.figure, args.labels)
    json_path = _io.save_outputs(plot(result), out, result)
    print(FIGURE_TITLES[args.figure])
    print(format_table(result))
    print('wrote {} and {}'.format(out, json_path))
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
