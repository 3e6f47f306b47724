"""Table 1 of the MLPerf-0.6 seed at small scale: LARS with scaled and
unscaled momentum, and K-FAC, in epochs and time to a target top-1.

    python -m benchmarks.lars_table1 [--smoke] [--out FILE.json]
        [--run-dir DIR] [--target 0.8] [--epochs 20] [--seeds 0,1,2]
        [--jobs 2]

The seed's Table 1 (ResNet-50, batch 32K, 2048 TPU cores) compares LARS
with the MLPerf reference's scaled momentum (Figure 5: 72.8 epochs at
momentum 0.9) against the unscaled momentum of You et al. (Figure 6: 70.6
epochs at 0.9, 64 epochs at 0.929). Here the same three rows, plus K-FAC,
train the small ResNet on the demo data (scikit-learn's digits as an
ImageNet-format list, 1,500 training and 297 validation images, 16x16
crops) at a global batch of 1,024 — two thirds of the data per step, the
largest power-of-two multiple of the 32-image micro-batch below the
training set (32 x 32 accumulated on one process) — with
``train_imagenet.py --optimizer lars --lars-momentum ...`` and
``--optimizer kfac`` (``config/demo.json`` at this batch: the paper's
schemes, running mixup and random erasing). Every run is one process, one
BLAS thread; ``--jobs`` runs go side by side.

**Learning rates and warm-up, as Table 1 sets them.** The seed gives
each row one base learning rate and warm-up (31.2 and 25 epochs for both
0.9 rows, 29.0 and 18 for the 0.929 row); here each row keeps those
ratios around one pilot-chosen pair: ``lr = 8 · base / 31.2`` and
``warm-up = 5 epochs · warm-up / 25`` (:data:`LARS_LR`,
:data:`WARMUP_EPOCHS`; 8 and 7.44, 5 and 3.6 epochs), then polynomial
(power 2) decay to the last epoch; trust coefficient 1e-3, weight decay
1e-4, biases and BN excluded (the MLPerf reference). The pilots at this
batch (seed 0, scaled momentum, 20 epochs): ``lr`` 8 reached 0.85 top-1
at epoch 16, 16 reached 0.78, 2 (over 30 epochs) 0.68 at epoch 18.
K-FAC, the reference rather than a row of the seed's table, runs at the
demo's learning rate and damping warm-up, with eq. (17)'s decay ending at
1.5 times the epochs (:data:`K_FAC_DECAY`; 31 for 20 epochs): the pilot's
schedule (0.81 top-1 at epoch 10, 0.9 at 17). Ending at the last epoch,
as the demo's and the LARS rows' do, K-FAC's learning rate falls too soon
for the 29 steps of 20 epochs at this batch: it reached at most 0.78
(seed 0).

**Figures.** The default target, 0.8 top-1, is one the pilots' LARS
reached with epochs to spare (at 1,024 images a step, 20 epochs are 29
steps). Per row: epochs to target (each seed's, the median), wall time
to target, best top-1; the table is printed and written to the JSON.
``RUN_DIR/table1.png`` shows per row the validation top-1 against epochs
(median over the seeds, their range shaded) and the epochs to target
(each seed, the median); ``analysis.curves`` plots every run into
``RUN_DIR/curves.png``. ``--replot FILE.json`` redraws the table and
``table1.png`` from an earlier run's JSON and run directories. Wall times
compare within one run only, and only where the machine's load held: the
runs of a row do not run side by side with the same others.
"""
import argparse
import json
import os
import sys
import time
from typing import Dict, List, Optional

from benchmarks import _args
from benchmarks import _common
from benchmarks import convergence

#: Table 1 of the seed: base LR, warm-up epochs, momentum, epochs, s.
SEED_TABLE1 = {'lars_scaled_m0.9': (31.2, 25, 0.9, 72.8, 76.9),
               'lars_unscaled_m0.9': (31.2, 25, 0.9, 70.6, 72.4),
               'lars_unscaled_m0.929': (29.0, 18, 0.929, 64.0, 67.1)}
#: The learning rate and warm-up of the rows with Table 1's 31.2 and 25.
LARS_LR = 8.0
WARMUP_EPOCHS = 5.0
K_FAC_LR = 0.02
#: Where K-FAC's eq. (17) decay ends, in units of the run's epochs.
K_FAC_DECAY = 1.5
#: The rows: Table 1's three LARS settings, then K-FAC.
SETTINGS = {
    'lars_scaled_m0.9': {'optimizer': 'lars', 'form': 'scaled',
                         'label': 'LARS scaled, m=0.9 (Fig. 5)'},
    'lars_unscaled_m0.9': {'optimizer': 'lars', 'form': 'unscaled',
                           'label': 'LARS unscaled, m=0.9 (Fig. 6)'},
    'lars_unscaled_m0.929': {'optimizer': 'lars', 'form': 'unscaled',
                             'label': 'LARS unscaled, m=0.929 (Fig. 6)'},
    'kfac': {'optimizer': 'kfac', 'label': 'K-FAC'},
}
for _name, (_lr, _warmup, _momentum, _, _) in SEED_TABLE1.items():
    SETTINGS[_name].update(momentum=_momentum,
                           warmup_epochs=WARMUP_EPOCHS * _warmup / 25)
LR_GRID = {name: ((round(LARS_LR * SEED_TABLE1[name][0] / 31.2, 3),)
                  if name in SEED_TABLE1 else (K_FAC_LR,))
           for name in SETTINGS}
GLOBAL_BATCH = 1024
EPOCHS = 20
RUN_TIMEOUT_S = 3600
SMOKE = dict(convergence.SMOKE, global_batch_size=64)


def write_configs(run_dir: str, grid: Dict, epochs: int,
                  smoke: bool) -> Dict:
    """One config per K-FAC learning rate and one for LARS, from
    ``config/demo.json`` at this batch (K-FAC's eq. 17 decay ending at
    :data:`K_FAC_DECAY` times the epochs, plus one as the demo's)."""
    import chainerkfac  # NOQA  (before chainer)
    import config as config_module
    base = config_module.to_dict(config_module.load(
        os.path.join(_common.ROOT, 'config', 'demo.json')))
    base.update(global_batch_size=SMOKE['global_batch_size'] if smoke
                else GLOBAL_BATCH, epochs=epochs,
                e_end=K_FAC_DECAY * epochs + 1.0)
    os.makedirs(os.path.join(run_dir, 'configs'), exist_ok=True)
    paths = {}
    for name, setting in SETTINGS.items():
        for lr in grid[name]:
            if setting['optimizer'] == 'kfac':
                paths[name, lr] = convergence._save_config(
                    config_module, dict(base, lr=lr), run_dir,
                    'kfac_lr{:g}'.format(lr))
            else:
                paths[name, lr] = convergence._save_config(
                    config_module, base, run_dir, 'lars')
    return paths


def job(name: str, lr: float, seed: int, cfg: str, data: Dict,
        run_dir: str, epochs: int, target: float, smoke: bool) -> Dict:
    setting = SETTINGS[name]
    directory = os.path.join(run_dir, '{}_lr{:g}_seed{}'.format(
        name, lr, seed))
    cmd = convergence.command(setting['optimizer'], lr, seed, cfg, data,
                              directory, epochs, target, smoke)
    # Later options win: the row's label, form, momentum and warm-up.
    cmd += ['--label', '{} lr={:g} seed {}'.format(setting['label'], lr,
                                                    seed)]
    if setting['optimizer'] == 'lars':
        cmd += ['--lars-momentum', setting['form'], '--baseline-momentum',
                str(setting['momentum']), '--warmup-epochs',
                str(min(setting['warmup_epochs'], epochs))]
    return {'name': os.path.basename(directory), 'optimizer': name,
            'lr': lr, 'seed': seed, 'dir': directory, 'command': cmd}


def tables(data: Dict) -> str:
    rows = []
    for name in SETTINGS:
        summary = data['summary'][name]
        best = summary['best']
        seed_epochs, seed_time = SEED_TABLE1.get(name, (None,) * 5)[3:]
        warmup = SETTINGS[name].get('warmup_epochs')
        rows.append([
            SETTINGS[name]['label'], best['lr'],
            # as job() passes it: at most the run's epochs
            None if warmup is None else min(warmup, data['epochs']),
            ' / '.join('-' if e is None else '{:.2f}'.format(e)
                       for e in best['epochs_to_target']),
            best['median_epochs_to_target'],
            best['median_time_to_target_s'], best['median_best_top1'],
            '{}/{}'.format(best['reached'], len(best['seeds'])),
            seed_epochs, seed_time])
    return ('Table 1 at small scale: epochs to top-1 {:g} on the digits, '
            'global batch {} (1 process x {} x {} accumulated), at most {} '
            'epochs, seeds {}\n{}'.format(
                data['target'], data['global_batch_size'],
                data['batch_per_process'], data['acc_iters'],
                data['epochs'], ','.join(map(str, data['seeds'])),
                _common.format_table(
                    ['setting', 'lr', 'warm-up epochs',
                     'epochs to target per seed', 'median epochs',
                     'median time to target [s]', 'median best top-1',
                     'reached', 'seed: epochs (32K)', 'seed: benchmark [s]'],
                    rows)))


def write_figure(data: Dict, path: str) -> str:
    """``table1.png``: per row, top-1 against epochs (median over seeds,
    their range shaded) and the epochs to target (seeds and median)."""
    import numpy
    from analysis import _io
    figure = _io.new_figure(figsize=(12, 4.8))
    curves, bars = figure.subplots(1, 2, gridspec_kw={'width_ratios':
                                                      (3, 2)})
    names = list(SETTINGS)
    for row, name in enumerate(names):
        series = []
        for run in data['runs']:
            if run['optimizer'] != name:
                continue
            with open(os.path.join(run['dir'], 'log')) as f:
                log = json.load(f)
            series.append([(e['epoch'], 100 * e['validation/main/accuracy'])
                           for e in log if 'validation/main/accuracy' in e])
        length = min(len(s) for s in series)
        epochs = [e for e, _ in series[0][:length]]
        values = numpy.array([[a for _, a in s[:length]] for s in series])
        color = 'C{}'.format(row)
        curves.plot(epochs, numpy.median(values, axis=0), color=color,
                    label=SETTINGS[name]['label'])
        curves.fill_between(epochs, values.min(axis=0), values.max(axis=0),
                            color=color, alpha=0.15)
        best = data['summary'][name]['best']
        reached = [e for e in best['epochs_to_target'] if e is not None]
        bars.scatter(reached, [row] * len(reached), color=color, zorder=3)
        if best['median_epochs_to_target'] is not None:
            bars.barh(row, best['median_epochs_to_target'], color=color,
                      alpha=0.35)
        if name in SEED_TABLE1:
            bars.annotate('seed 002, 32K: {:g} epochs'.format(
                SEED_TABLE1[name][3]), (0.3, row + 0.3), fontsize=8)
    curves.axhline(100 * data['target'], color='gray', linestyle='--',
                   linewidth=1)
    curves.set_xlabel('epoch')
    curves.set_ylabel('validation top-1 [%] (median, range of {} seeds)'
                      .format(len(data['seeds'])))
    curves.legend(loc='lower right', fontsize=8)
    curves.grid(alpha=0.3)
    bars.set_yticks(range(len(names)))
    bars.set_yticklabels([SETTINGS[n]['label'] for n in names], fontsize=8)
    bars.invert_yaxis()
    bars.set_xlabel('epochs to {:g} % top-1 (dots: seeds, bar: median)'
                    .format(100 * data['target']))
    bars.grid(axis='x', alpha=0.3)
    figure.suptitle('Table 1 of the MLPerf-0.6 seed at small scale: digits, '
                    'global batch {}'.format(data['global_batch_size']))
    figure.tight_layout()
    tmp = path + '.tmp.png'
    figure.savefig(tmp, dpi=110)
    os.replace(tmp, path)
    return path


def _found_runs(data: Dict, run_dir: str) -> Optional[List[str]]:
    """The run directories of ``data``'s runs with their logs: where the
    JSON says, else by name under ``run_dir`` (a result moved or copied
    from another machine); ``None`` if some are in neither place."""
    found = []
    for run in data['runs']:
        for folder in (run['dir'], os.path.join(
                run_dir, os.path.basename(run['dir'].rstrip('/')))):
            if os.path.isfile(os.path.join(folder, 'log')):
                found.append(folder)
                break
        else:
            return None
    return found


def replot(path: str, run_dir: str) -> int:
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or data.get('benchmark') != 'lars_table1' \
            or not all(key in data for key in ('runs', 'summary', 'target')):
        print('--replot {}: not a result of benchmarks.lars_table1'.format(
            path), file=sys.stderr)
        return 2
    print(tables(data))
    found = _found_runs(data, run_dir)
    if found is None:
        print('table1.png not drawn: the run directories (with their logs) '
              'are neither where {} says ({}) nor under --run-dir {}'.format(
                  path, data.get('run_dir', '?'), run_dir), file=sys.stderr)
        return 1
    data = dict(data, runs=[dict(run, dir=folder) for run, folder
                            in zip(data['runs'], found)])
    png = write_figure(data, os.path.join(os.path.dirname(found[0]),
                                          'table1.png'))
    print('figure: {}'.format(png))
    return 0


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog='python -m benchmarks.lars_table1', description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--smoke', action='store_true',
                        help='a slice of the data, 1 epoch, 1 LR, 1 seed')
    parser.add_argument('--out', default='result/lars_table1.json',
                        help='JSON output (default result/lars_table1.json)')
    parser.add_argument('--run-dir', default='result/lars_table1_runs',
                        help='where the run directories go (default '
                        'result/lars_table1_runs); with --replot, where '
                        'they are if not where the JSON says')
    parser.add_argument('--target', type=_args.fraction, default=0.8,
                        help='target validation top-1 (fraction in (0, 1]; '
                        'default 0.8)')
    parser.add_argument('--epochs', type=_args.positive_int, default=None,
                        help='epochs per run (default {}; smoke 1)'.format(
                            EPOCHS))
    parser.add_argument('--seeds', type=_args.int_list(0), default=None,
                        help='comma-separated seeds (default 0,1,2; smoke 0)')
    parser.add_argument('--jobs', type=_args.positive_int, default=2,
                        help='runs side by side (default 2)')
    parser.add_argument('--replot', metavar='JSON', type=_args.json_file,
                        help="redraw the table and table1.png from an "
                        "earlier run's JSON (its run directories)")
    args = parser.parse_args(argv)
    if not args.replot:
        _args.check_paths(parser, args, files=('out',),
                          folders=('run_dir',))
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.replot:
        return replot(args.replot, os.path.abspath(args.run_dir))
    epochs = args.epochs or (SMOKE['epochs'] if args.smoke else EPOCHS)
    seeds = args.seeds or ([0] if args.smoke else [0, 1, 2])
    grid = LR_GRID
    run_dir = os.path.abspath(args.run_dir)
    os.makedirs(run_dir, exist_ok=True)
    data_paths = convergence.prepare_data(run_dir, args.smoke)
    configs = write_configs(run_dir, grid, epochs, args.smoke)
    with open(configs['kfac', grid['kfac'][0]]) as f:
        cfg = json.load(f)
    jobs = [job(name, lr, seed, configs[name, lr], data_paths, run_dir,
                epochs, args.target, args.smoke)
            for seed in seeds for name in SETTINGS for lr in grid[name]]
    print('{} runs, {} at a time, in {}'.format(len(jobs), args.jobs,
                                                run_dir), flush=True)
    start = time.time()
    convergence.run_all(jobs, args.jobs, RUN_TIMEOUT_S)
    runs = [convergence.read_run(j) for j in jobs]
    failed = [r['dir'] for r in runs if r['returncode'] != 0]
    data = _common.header('lars_table1', argv)
    data.update(
        smoke=args.smoke, target=args.target, epochs=epochs, seeds=seeds,
        settings=SETTINGS, seed_table1=SEED_TABLE1,
        warmup_epochs=min(WARMUP_EPOCHS, epochs),
        global_batch_size=cfg['global_batch_size'],
        batch_per_process=cfg['batch_size_per_process'], processes=1,
        acc_iters=cfg['global_batch_size'] // cfg['batch_size_per_process'],
        lr_grid={k: list(v) for k, v in grid.items()}, jobs=args.jobs,
        run_dir=run_dir, total_wall_s=time.time() - start, runs=runs,
        failed=failed)
    data['summary'] = convergence.summarise(runs, grid)
    data['curves'] = convergence.write_curves(runs, data['summary'],
                                              run_dir, args.target)
    data['figure'] = None if failed else write_figure(
        data, os.path.join(run_dir, 'table1.png'))
    print(_common.describe_machine(data))
    print(tables(data))
    if data['curves']:
        print('curves: {}'.format(data['curves']))
    if data['figure']:
        print('figure: {}'.format(data['figure']))
    if failed:
        print('FAILED runs (see stdout.txt inside): {}'.format(
            ', '.join(failed)))
    _common.write_json(args.out, data)
    print('wrote {}'.format(args.out))
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
