"""Epochs and wall time to a target top-1: K-FAC vs momentum SGD vs LARS.

    python -m benchmarks.convergence [--smoke] [--out FILE.json]
        [--run-dir DIR] [--target 0.9] [--epochs 10] [--seeds 0,1]
        [--jobs 2]

The demo data (scikit-learn digits as an ImageNet-format list data set,
``demo.build_digits_dataset``; 1,500 training and 297 validation images,
16x16 crops) at the demo's large mini-batch: 256 images per step, about a
sixth of the data, made of one process x 32 images x 8 accumulated
micro-batches as in the paper (``config/demo.json``: K-FAC with the paper's
schemes — damping warm-up, eq. 17 polynomial LR decay, eq. 18 momentum,
eq. 20 weight rescaling, running mixup, random erasing). Every run is one
``train_imagenet.py`` process (the same harness, no second training
loop); the baselines use its ``--optimizer sgd`` (Goyal et al.: momentum
0.9, weight decay 1e-4) and ``--optimizer lars`` (the configs' unscaled
momentum, 0.929, trust coefficient 1e-3, weight decay 1e-4, biases and BN
excluded: :class:`chainerkfac.optimizers.LARS`), with a 1-epoch linear
warm-up as in ``--demo``.

**Learning-rate search, equal budget.** Each optimizer gets the same
number of learning rates (a factor-2 grid, :data:`LR_GRID`) times the same
seeds. The grid centres come from pilot runs: the demo config's 0.02 for
K-FAC; for SGD and LARS, single pilot runs at their harness defaults (0.1
and 2.3e-4) were far too slow and pilots at 0.2 / 0.8 (SGD) and 0.01 / 0.05
(LARS) set the centres — extra tuning that only favours the baselines.
Those LARS pilots (and ``results/convergence.json``) ran the earlier
``--optimizer lars``, MomentumSGD with Chainer's ``GradientLARS`` hook,
whose learning rate is η·ε and which excludes nothing; the LARS grid of
:class:`~chainerkfac.optimizers.LARS` (η, with ε = 1e-3 inside) is
centred on ``benchmarks.lars_table1``'s pilots at a batch of 1,024 (8)
and not re-piloted at this batch. The
best learning rate of an optimizer has the fewest median epochs to target
over the seeds (a run that never reaches it counts as infinite; ties go to
the higher median best top-1).

**Figures.** Per optimizer at its best learning rate: epochs to target
(median over seeds, each seed's value), wall time to target, best top-1.
Goal (reported, not asserted): K-FAC needs ≤ 0.6x the epochs of the better
baseline. Wall times are comparable within this run only: ``--jobs`` runs
go side by side (one BLAS thread each), so every run shares the machine
with another run alike.

Run directories (``RUN_DIR/<optimizer>_lr<lr>_seed<seed>/``: ``log``,
``config.json``, and ``time_to_accuracy.json`` once the target is
reached) are what ``python -m analysis.curves`` plots; the benchmark
calls it on the best-LR runs and writes ``RUN_DIR/curves.png``.
"""
import argparse
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import time
from typing import Dict, List, Optional

from benchmarks import _args
from benchmarks import _common

OPTIMIZERS = ('kfac', 'sgd', 'lars')
LR_GRID = {'kfac': (0.01, 0.02, 0.04), 'sgd': (0.4, 0.8, 1.6),
           'lars': (4.0, 8.0, 16.0)}
SMOKE_LR_GRID = {'kfac': (0.02,), 'sgd': (0.8,), 'lars': (8.0,)}
GOAL_EPOCH_RATIO = 0.6
CROP, RESIZE = 16, 18
RUN_TIMEOUT_S = 900
#: Smoke mode: a slice of the data and a narrow network, one short epoch.
SMOKE = {'n_train': 256, 'n_val': 64, 'width': 4, 'global_batch_size': 64,
         'epochs': 1}


# -- data and configs ---------------------------------------------------------------
def prepare_data(run_dir: str, smoke: bool) -> Dict[str, str]:
    """The digits lists (a slice of them in smoke mode) and the mean image
    (computed once here, so parallel runs never race to write it)."""
    import chainerkfac  # NOQA  (before chainer, which augment imports)
    import augment
    from demo import build_digits_dataset
    cache = os.environ.get('CHAINERKFAC_CACHE',
                           os.path.join(_common.ROOT, '.cache'))
    train, val, root = build_digits_dataset(cache)
    mean = os.path.join(root, 'mean{}.npy'.format(CROP))
    if not os.path.exists(mean):
        dataset = augment.ImageListDataset(train, root, RESIZE)
        tmp = mean + '.tmp.npy'
        augment.save_mean(tmp, augment.compute_mean(dataset, CROP))
        os.replace(tmp, mean)
    if smoke:
        train = _head(train, os.path.join(run_dir, 'train_smoke.txt'),
                      SMOKE['n_train'])
        val = _head(val, os.path.join(run_dir, 'val_smoke.txt'),
                    SMOKE['n_val'])
    return {'train': train, 'val': val, 'root': root, 'mean': mean}


def _head(src: str, dst: str, n: int) -> str:
    with open(src) as f:
        lines = f.readlines()[:n]
    with open(dst, 'w') as f:
        f.writelines(lines)
    return dst


def write_configs(run_dir: str, grid: Dict, smoke: bool) -> Dict[str, str]:
    """One config file per K-FAC learning rate (K-FAC takes its LR from the
    config) plus the one the baselines read; all from config/demo.json."""
    import chainerkfac  # NOQA
    import config as config_module
    base = config_module.to_dict(config_module.load(
        os.path.join(_common.ROOT, 'config', 'demo.json')))
    if smoke:
        base.update(global_batch_size=SMOKE['global_batch_size'],
                    epochs=SMOKE['epochs'])
    paths = {}
    os.makedirs(os.path.join(run_dir, 'configs'), exist_ok=True)
    for lr in grid['kfac']:
        paths[('kfac', lr)] = _save_config(
            config_module, dict(base, lr=lr), run_dir, 'kfac_lr{:g}'.format(
                lr))
    baseline = _save_config(config_module, base, run_dir, 'baselines')
    for name in OPTIMIZERS[1:]:
        for lr in grid[name]:
            paths[(name, lr)] = baseline
    return paths


def _save_config(config_module, data: Dict, run_dir: str, name: str) -> str:
    path = os.path.join(run_dir, 'configs', name + '.json')
    config_module.save(config_module.from_dict(data, source=name), path)
    return path


# -- runs ---------------------------------------------------------------------------
def run_name(optimizer: str, lr: float, seed: int) -> str:
    return '{}_lr{:g}_seed{}'.format(optimizer, lr, seed)


def command(optimizer: str, lr: float, seed: int, cfg: str, data: Dict,
            out: str, epochs: int, target: float, smoke: bool) -> List[str]:
    cmd = [sys.executable, os.path.join(_common.ROOT, 'train_imagenet.py'),
           data['train'], data['val'], '--root', data['root'],
           '--mean', data['mean'], '--config', cfg, '--optimizer', optimizer,
           '--arch', 'small', '--crop-size', str(CROP), '--resize',
           str(RESIZE), '--epochs', str(epochs), '--target-acc', str(target),
           '--seed', str(seed), '--out', out, '--no-progress',
           '--snapshot-every', str(epochs), '--label',
           '{} lr={:g} seed {}'.format(
               {'kfac': 'K-FAC', 'sgd': 'SGD', 'lars': 'LARS'}[optimizer],
               lr, seed)]
    if optimizer != 'kfac':
        cmd += ['--baseline-lr', str(lr), '--warmup-epochs', '1']
    if smoke:
        cmd += ['--width', str(SMOKE['width'])]
    return cmd


def run_all(jobs: List[Dict], parallel: int, timeout: float) -> None:
    """Run the jobs ``parallel`` at a time; each gets ``returncode`` and
    ``wall_s`` (a job past ``timeout`` is killed, returncode 124)."""
    env = _common.worker_env(threads=1)
    pending, running = list(jobs), []
    while pending or running:
        while pending and len(running) < parallel:
            job = pending.pop(0)
            # A previous run's files (time_to_accuracy.json above all)
            # must not be read as this run's.
            shutil.rmtree(job['dir'], ignore_errors=True)
            os.makedirs(job['dir'])
            job['stdout'] = open(os.path.join(job['dir'], 'stdout.txt'), 'w')
            job['process'] = subprocess.Popen(
                job['command'], stdout=job['stdout'],
                stderr=subprocess.STDOUT, env=env, cwd=_common.ROOT)
            job['start'] = time.time()
            running.append(job)
            print('  started {}'.format(job['name']), flush=True)
        time.sleep(0.2)
        for job in list(running):
            process = job['process']
            if process.poll() is None and \
                    time.time() - job['start'] > timeout:
                process.kill()
                process.wait()
                job['returncode'] = 124
            elif process.poll() is not None:
                job['returncode'] = process.returncode
            else:
                continue
            job['wall_s'] = time.time() - job['start']
            job['stdout'].close()
            running.remove(job)
            del job['process'], job['stdout']
            print('  finished {} (exit {}, {:.0f} s)'.format(
                job['name'], job['returncode'], job['wall_s']), flush=True)


def read_run(job: Dict) -> Dict:
    """The figures of one finished run, from its directory."""
    out = {'optimizer': job['optimizer'], 'lr': job['lr'],
           'seed': job['seed'], 'dir': job['dir'],
           'returncode': job['returncode'], 'process_wall_s': job['wall_s'],
           'epochs_to_target': None, 'time_to_target_s': None,
           'final_top1': None, 'best_top1': None, 'epochs_run': 0,
           'train_time_s': None}
    log_path = os.path.join(job['dir'], 'log')
    if os.path.exists(log_path):
        with open(log_path) as f:
            log = json.load(f)
        accuracy = [e['validation/main/accuracy'] for e in log
                    if 'validation/main/accuracy' in e]
        if accuracy:
            out['final_top1'] = float(accuracy[-1])
            out['best_top1'] = float(max(accuracy))
        if log:
            out['epochs_run'] = int(log[-1]['epoch'])
            out['train_time_s'] = float(log[-1]['elapsed_time'])
    reached = os.path.join(job['dir'], 'time_to_accuracy.json')
    if os.path.exists(reached):
        with open(reached) as f:
            record = json.load(f)
        out['epochs_to_target'] = float(record['epoch'])
        out['time_to_target_s'] = float(record['elapsed_time'])
    return out


# -- figures ------------------------------------------------------------------------
def _median_or_inf(values: List[Optional[float]]) -> float:
    return _common.median([math.inf if v is None else v for v in values])


def summarise(runs: List[Dict], grid: Dict) -> Dict:
    """Per optimizer (each key of ``grid``, matched against the runs'
    ``optimizer``): every LR's medians, the best LR and its figures."""
    out = {}
    for name in grid:
        per_lr = []
        for lr in grid[name]:
            mine = [r for r in runs if r['optimizer'] == name and
                    r['lr'] == lr]
            epochs = _median_or_inf([r['epochs_to_target'] for r in mine])
            per_lr.append({
                'lr': lr, 'seeds': [r['seed'] for r in mine],
                'epochs_to_target': [r['epochs_to_target'] for r in mine],
                'median_epochs_to_target': None if math.isinf(epochs)
                else epochs,
                'time_to_target_s': [r['time_to_target_s'] for r in mine],
                'median_time_to_target_s': _finite(_median_or_inf(
                    [r['time_to_target_s'] for r in mine])),
                'median_best_top1': _common.median(
                    [r['best_top1'] or 0.0 for r in mine]),
                'median_train_time_s': _common.median(
                    [r['train_time_s'] or 0.0 for r in mine]),
                'reached': sum(r['epochs_to_target'] is not None
                               for r in mine),
                '_key': (epochs, -_common.median(
                    [r['best_top1'] or 0.0 for r in mine]))})
        best = min(per_lr, key=lambda e: e['_key'])
        for entry in per_lr:
            del entry['_key']
        out[name] = {'lrs': per_lr, 'best': best}
    return out


def _finite(value: float) -> Optional[float]:
    return None if math.isinf(value) else value


def compare(summary: Dict) -> Dict:
    """K-FAC's median epochs to target over the better baseline's."""
    baselines = {n: summary[n]['best']['median_epochs_to_target']
                 for n in OPTIMIZERS[1:]}
    reached = {n: e for n, e in baselines.items() if e is not None}
    kfac = summary['kfac']['best']['median_epochs_to_target']
    result = {'goal': GOAL_EPOCH_RATIO, 'kfac_epochs': kfac,
              'best_baseline': None, 'baseline_epochs': None, 'ratio': None,
              'met': False, 'note': ''}
    if not reached:
        result['note'] = 'no baseline reached the target'
        result['met'] = kfac is not None
        return result
    name = min(reached, key=reached.get)
    result.update(best_baseline=name, baseline_epochs=reached[name])
    if kfac is None:
        result['note'] = 'K-FAC did not reach the target'
        return result
    result['ratio'] = kfac / reached[name]
    result['met'] = result['ratio'] <= GOAL_EPOCH_RATIO
    return result


def write_curves(runs: List[Dict], summary: Dict, run_dir: str,
                 target: float) -> Optional[str]:
    """``analysis.curves`` on the best-LR runs; the PNG path or None."""
    dirs = [r['dir'] for r in runs
            if r['lr'] == summary[r['optimizer']]['best']['lr'] and
            os.path.exists(os.path.join(r['dir'], 'log'))]
    if not dirs:
        return None
    png = os.path.join(run_dir, 'curves.png')
    if importlib.util.find_spec('analysis') is None or \
            importlib.util.find_spec('analysis.curves') is None:
        print('analysis.curves not available: no figure', flush=True)
        return None
    result = subprocess.run(
        [sys.executable, '-m', 'analysis.curves'] + dirs +
        ['--target', str(target), '--out', png],
        cwd=_common.ROOT, env=_common.worker_env(), capture_output=True,
        text=True, timeout=300)
    if result.returncode != 0:
        print('analysis.curves failed ({}): {}'.format(
            result.returncode, result.stderr.strip()[-500:]), flush=True)
        return None
    return png


def tables(data: Dict) -> str:
    rows = []
    for name in OPTIMIZERS:
        for entry in data['summary'][name]['lrs']:
            best = entry['lr'] == data['summary'][name]['best']['lr']
            rows.append([name, entry['lr'], best,
                         ' / '.join('-' if e is None else '{:.2f}'.format(e)
                                    for e in entry['epochs_to_target']),
                         entry['median_epochs_to_target'],
                         entry['median_time_to_target_s'],
                         entry['median_best_top1'],
                         entry['median_train_time_s']])
    runs = _common.format_table(
        ['optimizer', 'lr', 'best', 'epochs to {:g} per seed'.format(
            data['target']), 'median epochs', 'median time to target [s]',
         'median best top-1', 'median train time [s]'], rows)
    c = data['comparison']
    head = ('K-FAC {} epochs vs {} {} epochs: ratio {} (goal <= {:g}: {})'
            .format(_fmt(c['kfac_epochs']), c['best_baseline'] or 'baseline',
                    _fmt(c['baseline_epochs']), _fmt(c['ratio']), c['goal'],
                    'met' if c['met'] else 'NOT met') +
            (' - ' + c['note'] if c['note'] else ''))
    return ('Epochs to top-1 {:g} on the digits, global batch {} (1 process '
            'x {} x {} accumulated), {} epochs, seeds {}\n{}\n\n{}'.format(
                data['target'], data['global_batch_size'],
                data['batch_per_process'], data['acc_iters'], data['epochs'],
                ','.join(map(str, data['seeds'])), runs, head))


def _fmt(value) -> str:
    return '-' if value is None else '{:.3g}'.format(value)


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog='python -m benchmarks.convergence', description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--smoke', action='store_true',
                        help='a slice of the data, 1 epoch, 1 LR, 1 seed')
    parser.add_argument('--out', default='result/convergence.json',
                        help='JSON output (default result/convergence.json)')
    parser.add_argument('--run-dir', default='result/convergence_runs',
                        help='where the run directories go (default '
                        'result/convergence_runs)')
    parser.add_argument('--target', type=_args.fraction, default=0.9,
                        help='target validation top-1 (fraction in (0, 1]; '
                        'default 0.9)')
    parser.add_argument('--epochs', type=_args.positive_int, default=None,
                        help='epochs per run (default 10; smoke 1)')
    parser.add_argument('--seeds', type=_args.int_list(0), default=None,
                        help='comma-separated seeds (default 0,1; smoke 0)')
    parser.add_argument('--jobs', type=_args.positive_int, default=2,
                        help='runs side by side (default 2)')
    args = parser.parse_args(argv)
    _args.check_paths(parser, args, files=('out',), folders=('run_dir',))
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    epochs = args.epochs or (SMOKE['epochs'] if args.smoke else 10)
    seeds = args.seeds or ([0] if args.smoke else [0, 1])
    grid = SMOKE_LR_GRID if args.smoke else LR_GRID
    run_dir = os.path.abspath(args.run_dir)
    os.makedirs(run_dir, exist_ok=True)
    data_paths = prepare_data(run_dir, args.smoke)
    configs = write_configs(run_dir, grid, args.smoke)
    with open(configs[('sgd', grid['sgd'][0])]) as f:
        cfg = json.load(f)
    jobs = []
    for seed in seeds:
        for i in range(max(len(v) for v in grid.values())):
            for name in OPTIMIZERS:
                if i >= len(grid[name]):
                    continue
                lr = grid[name][i]
                job_dir = os.path.join(run_dir, run_name(name, lr, seed))
                jobs.append({'name': run_name(name, lr, seed),
                             'optimizer': name, 'lr': lr, 'seed': seed,
                             'dir': job_dir, 'command': command(
                                 name, lr, seed, configs[(name, lr)],
                                 data_paths, job_dir, epochs, args.target,
                                 args.smoke)})
    print('{} runs, {} at a time, in {}'.format(len(jobs), args.jobs,
                                                run_dir), flush=True)
    start = time.time()
    run_all(jobs, args.jobs, RUN_TIMEOUT_S)
    runs = [read_run(job) for job in jobs]
    failed = [r['dir'] for r in runs if r['returncode'] != 0]
    data = _common.header('convergence', argv)
    data.update(
        smoke=args.smoke, target=args.target, epochs=epochs, seeds=seeds,
        dataset='scikit-learn digits as ImageNet lists ({} train / {} val '
        'lines), {}x{} crops'.format(_count(data_paths['train']),
                                     _count(data_paths['val']), CROP, CROP),
        global_batch_size=cfg['global_batch_size'],
        batch_per_process=cfg['batch_size_per_process'], processes=1,
        acc_iters=cfg['global_batch_size'] // cfg['batch_size_per_process'],
        lr_grid={k: list(v) for k, v in grid.items()}, jobs=args.jobs,
        total_wall_s=time.time() - start, runs=runs, failed=failed)
    data['summary'] = summarise(runs, grid)
    data['comparison'] = compare(data['summary'])
    data['curves'] = write_curves(runs, data['summary'], run_dir,
                                  args.target)
    print(_common.describe_machine(data))
    print(tables(data))
    if data['curves']:
        print('curves: {}'.format(data['curves']))
    if failed:
        print('FAILED runs (see stdout.txt inside): {}'.format(
            ', '.join(failed)))
    _common.write_json(args.out, data)
    print('wrote {}'.format(args.out))
    return 1 if failed else 0


def _count(path: str) -> int:
    with open(path) as f:
        return sum(1 for line in f if line.strip())


if __name__ == '__main__':
    sys.exit(main())
