"""The embedded default run (``python train_imagenet.py --demo``).

``train_imagenet.py --demo`` calls :func:`run_demo`, which trains through
:func:`harness.run.train` like any run (this module does not import the
script back).

No data set can be downloaded, so the demo writes an ImageNet-format data
set (PNG files, ``train.txt`` / ``val.txt``) from real images that ship
inside an installed package — scikit-learn's 1,797 handwritten digits — and
trains a small ResNet on it with K-FAC and with momentum SGD, under the same
harness, at a mini-batch that is large relative to the data (accumulated as
in the paper). It prints a table and writes the figures.
"""
import json
import os
import shutil
import tempfile

import numpy

from harness.mpi import raise_together
from harness.run import resolve_config, train

DEMO_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           'config', 'demo.json')
N_VAL = 297


def build_digits_dataset(cache_dir):
    """Write the digits as 8×8 RGB PNGs plus train/val lists (idempotent).

    The folder is built under a temporary name and renamed when complete,
    so an interrupted build never leaves a half-written data set behind.
    Returns ``(train_list, val_list, root)``.
    """
    from PIL import Image
    from sklearn.datasets import load_digits
    root = os.path.join(cache_dir, 'digits')
    lists = (os.path.join(root, 'train.txt'), os.path.join(root, 'val.txt'))
    if all(os.path.exists(p) for p in lists):
        return lists + (root,)
    os.makedirs(cache_dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix='digits.', dir=cache_dir)
    digits = load_digits()
    order = numpy.random.RandomState(0).permutation(len(digits.target))
    splits = {'val': order[:N_VAL], 'train': order[N_VAL:]}
    for split, indices in splits.items():
        lines = []
        for i in indices:
            label = int(digits.target[i])
            pixels = (digits.images[i] * (255.0 / 16.0)).astype(numpy.uint8)
            rel = '{}/{}/{:04d}.png'.format(split, label, i)
            os.makedirs(os.path.join(work, os.path.dirname(rel)),
                        exist_ok=True)
            Image.fromarray(pixels).convert('RGB').save(
                os.path.join(work, rel))
            lines.append('{} {}\n'.format(rel, label))
        with open(os.path.join(work, split + '.txt'), 'w') as f:
            f.writelines(lines)
    if os.path.exists(root):
        shutil.rmtree(root)
    os.replace(work, root)
    return lists + (root,)


def run_demo(args, comm):
    """K-FAC and SGD on the digits; table and figures on rank 0."""
    cache = os.environ.get('CHAINERKFAC_CACHE', os.path.join(
        os.path.dirname(os.path.abspath(__file__)), '.cache'))
    paths, error = None, None
    if comm.rank == 0:
        try:
            paths = build_digits_dataset(cache)
        except (OSError, ImportError) as e:
            error = e
    raise_together(comm, error)
    args.train, args.val, args.root = comm.mpi_comm.bcast(paths, root=0)
    out = args.out if args.out != 'result' else 'demo_out'
    args.config = args.config or DEMO_CONFIG
    args.arch, args.crop_size, args.resize = 'small', 16, 18
    args.mean = os.path.join(args.root, 'mean{}.npy'.format(args.crop_size))
    args.fisher_diff = True
    args.target_acc = args.target_acc or 0.9
    args.warmup_epochs = 1.0 if args.warmup_epochs is None else \
        min(args.warmup_epochs, 1.0)
    cfg = resolve_config(args, comm)
    if args.overwrite and comm.rank == 0:
        # an earlier demo's table and figures would otherwise stand beside
        # the runs of one interrupted now
        remove_outputs(out)
    summaries = []
    for name in ('kfac', 'sgd'):
        args.label = None
        summaries.append(train(args, comm, name, os.path.join(out, name),
                               cfg))
    if comm.rank != 0:
        return 0
    table = summary_table(summaries, args.target_acc)
    print(table)
    with open(os.path.join(out, 'summary.json'), 'w') as f:
        json.dump(summaries, f, indent=1)
    with open(os.path.join(out, 'summary.txt'), 'w') as f:
        f.write(table + '\n')
    write_figures(out, args.target_acc)
    return 0


#: What the demo writes beside its two runs.
OUTPUTS = ('summary.json', 'summary.txt', 'figure3_curves.png',
           'figure4_fim_size.png', 'figure5_fisher_diff.png')


def remove_outputs(out):
    """Remove an earlier demo's :data:`OUTPUTS` from ``out``."""
    for name in OUTPUTS:
        try:
            os.remove(os.path.join(out, name))
        except FileNotFoundError:
            pass


def summary_table(summaries, target):
    rows = ['{:<10} {:>6} {:>10} {:>9} {:>16} {:>9}'.format(
        'optimizer', 'epochs', 'final top1', 'best top1',
        'epoch to {:.0%}'.format(target), 'time [s]')]
    for s in summaries:
        reached = s['reached']
        rows.append('{:<10} {:>6} {:>10.4f} {:>9.4f} {:>16} {:>9.1f}'.format(
            s['optimizer'], s['epochs'], s['final_top1'] or 0.0,
            s['best_top1'] or 0.0,
            '{:.2f}'.format(reached['epoch']) if reached else 'not reached',
            s['elapsed_time']))
    return '\n'.join(rows)


def write_figures(out, target=0.9):
    """Figures 3, 4 and 5 for the demo runs, by the analysis scripts;
    ``target``: the top-1 accuracy Figure 3 marks (the run's
    ``--target-acc``)."""
    from analysis import curves, fim_size, fisher_diff
    runs = [os.path.join(out, name) for name in ('kfac', 'sgd')]
    curves.main(runs + ['--target', repr(float(target)), '--out',
                        os.path.join(out, 'figure3_curves.png')])
    fisher_diff.main([runs[0], '--mark', '20', '--out',
                      os.path.join(out, 'figure5_fisher_diff.png')])
    fim_size.main(['--model', 'small', '--depth', '8', '--width', '16',
                   '--n-class', '10', '--out',
                   os.path.join(out, 'figure4_fim_size.png')])
