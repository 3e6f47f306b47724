"""The seed's Figure 7 on the digits data: the damped update
``θ ← θ − α (G + λI)⁻¹ ∇L`` with DiagGGN, DiagGGN-MC, KFAC and KFLR
against momentum SGD and Adam.

The data are scikit-learn's handwritten digits (1,797 8×8 images, 10
classes, shipped inside the package: nothing is downloaded; CIFAR and
DeepOBS are not available here), split once into 1,197 training, 300
validation and 300 test images. The network is a small 2C2D-like CNN
(conv 16 → pool → conv 32 → pool → dense 64 → dense 10, ReLU, float32).

The seed's protocol (appendix C) at this scale: every optimizer's
hyperparameters are searched on the seed's grid (``α ∈ {1e-4, …, 1}``,
``λ ∈ {1e-4, …, 10}``; momentum SGD with momentum 0.9 and Adam over the
same ``α``) with one seed and ``--search-epochs`` epochs, the setting with
the best final validation accuracy is kept, and it is run again with
``--seeds`` seeds (initial weights, batch order, Monte-Carlo draws); the
figure shows the median and the quartiles over seeds of the training loss,
training accuracy and test accuracy per epoch.

Writes ``optimisation.json`` and ``optimisation.png`` into ``--out``::

    python -m experiments.curvature.optimisation
"""
import itertools
import os
import sys
import time

import chainerkfac  # NOQA  (before chainer: NumPy-2 compatibility shims)
import numpy

import chainer
import chainer.functions as F
import chainer.links as L

from benchmarks import _args
from benchmarks import _common
from experiments.curvature.damped_update import DampedCurvatureUpdate

CURVATURES = {'DiagGGN': 'diag_ggn', 'DiagGGN-MC': 'diag_ggn_mc',
              'KFAC': 'kfac', 'KFLR': 'kflr'}
BASELINES = ('Momentum', 'Adam')
OPTIMIZERS = tuple(CURVATURES) + BASELINES
LEARNING_RATES = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)
DAMPINGS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)


class SmallCNN(chainer.Chain):
    """conv 16 → max pool → conv 32 → max pool → dense 64 → dense 10."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.conv1 = L.Convolution2D(1, 16, 3, pad=1)
            self.conv2 = L.Convolution2D(16, 32, 3, pad=1)
            self.fc1 = L.Linear(32 * 2 * 2, 64)
            self.fc2 = L.Linear(64, 10)

    def forward(self, x):
        h = F.max_pooling_2d(F.relu(self.conv1(x)), 2)
        h = F.max_pooling_2d(F.relu(self.conv2(h)), 2)
        return self.fc2(F.relu(self.fc1(h)))


def digits():
    """``{'train'|'valid'|'test': (x, t)}``, pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits
    data = load_digits()
    x = (data.images / 16.0).astype(numpy.float32)[:, None]
    t = data.target.astype(numpy.int32)
    order = numpy.random.RandomState(0).permutation(len(x))
    x, t = x[order], t[order]
    return {'train': (x[:1197], t[:1197]), 'valid': (x[1197:1497],
                                                     t[1197:1497]),
            'test': (x[1497:], t[1497:])}


def evaluate(model, split):
    x, t = split
    with chainer.no_backprop_mode(), chainer.using_config('train', False):
        logits = model(x)
        loss = float(F.softmax_cross_entropy(logits, t).array)
        accuracy = float(F.accuracy(logits, t).array)
    return loss, accuracy


def make_step(name, model, lr, damping, seed):
    """A function ``step(x, t)`` doing one update of optimizer ``name``."""
    if name in CURVATURES:
        update = DampedCurvatureUpdate(model, CURVATURES[name], lr, damping,
                                       seed=seed)
        return update.update
    if name not in BASELINES:
        raise ValueError('unknown optimizer {!r}: choose from {}'.format(
            name, ', '.join(OPTIMIZERS)))
    optimizer = (chainer.optimizers.MomentumSGD(lr=lr, momentum=0.9)
                 if name == 'Momentum' else chainer.optimizers.Adam(alpha=lr))
    optimizer.setup(model)

    def step(x, t):
        model.cleargrads()
        F.softmax_cross_entropy(model(x), t).backward()
        optimizer.update()
    return step


def train(name, lr, damping, seed, data, epochs, batch):
    """Curves of one run: per epoch (0 = initial weights) training loss and
    accuracy, validation and test accuracy; stops when the loss is no
    longer finite or a damped curvature matrix is singular (diverged)."""
    numpy.random.seed(seed)
    model = SmallCNN()
    step = make_step(name, model, lr, damping, seed)
    x, t = data['train']
    order = numpy.random.RandomState(seed)
    curves = {'train_loss': [], 'train_accuracy': [], 'valid_accuracy': [],
              'test_accuracy': []}

    def record():
        loss, accuracy = evaluate(model, data['train'])
        curves['train_loss'].append(loss)
        curves['train_accuracy'].append(accuracy)
        curves['valid_accuracy'].append(evaluate(model, data['valid'])[1])
        curves['test_accuracy'].append(evaluate(model, data['test'])[1])
        return numpy.isfinite(loss)

    record()
    for _ in range(epochs):
        perm = order.permutation(len(x))
        try:
            for start in range(0, len(x) - batch + 1, batch):
                rows = perm[start:start + batch]
                step(x[rows], t[rows])
        except numpy.linalg.LinAlgError:
            break                      # a damped curvature went singular
        if not record():
            break
    return curves


def settings(name):
    if name in CURVATURES:
        return list(itertools.product(LEARNING_RATES, DAMPINGS))
    return [(lr, None) for lr in LEARNING_RATES]


def final_score(curves, epochs):
    """Final validation accuracy; a run that diverged scores -1."""
    if len(curves['valid_accuracy']) < epochs + 1:
        return -1.0
    return curves['valid_accuracy'][-1]


def parse_args(argv):
    parser = _common.argument_parser(
        'experiments.curvature.optimisation', __doc__)
    parser.add_argument('--epochs', type=_args.positive_int, default=20,
                        help='epochs of each seed\'s run at the chosen '
                        'hyperparameters (default: %(default)s)')
    parser.add_argument('--search-epochs', type=_args.positive_int,
                        default=10, help='epochs of each run of the grid '
                        'search (default: %(default)s)')
    parser.add_argument('--batch', type=_args.positive_int, default=128,
                        help='mini-batch size (default: %(default)s)')
    parser.add_argument('--seeds', type=_args.positive_int, default=5,
                        help='seeds of the final runs (default: '
                        '%(default)s)')
    parser.add_argument('--threads', type=_args.positive_int, default=1,
                        help='BLAS threads (default: %(default)s)')
    parser.add_argument('--optimizers', type=_args.names(OPTIMIZERS),
                        default=','.join(OPTIMIZERS),
                        help='comma-separated, of %(default)s (default: '
                        'all)')
    parser.add_argument('--out', default=os.path.join(
        'experiments', 'results', 'curvature'),
                        help='folder of optimisation.json and '
                        'optimisation.png (default: %(default)s, the '
                        'committed results, which a run replaces)')
    args = parser.parse_args(argv)
    _args.check_paths(parser, args, files=(), folders=('out',))
    return args


def plot(data, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    panels = (('train_loss', 'training loss', True),
              ('train_accuracy', 'training accuracy', False),
              ('test_accuracy', 'test accuracy', False))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, result in data['optimizers'].items():
        style = '--' if name in BASELINES else '-'
        for ax, (key, label, log) in zip(axes, panels):
            # A diverged run stops early: NaN after its last epoch.
            values = numpy.full((len(result['runs']), data['epochs'] + 1),
                                numpy.nan)
            for row, run in zip(values, result['runs']):
                row[:len(run[key])] = run[key]
            q1, q2, q3 = numpy.nanpercentile(values, [25, 50, 75], axis=0)
            epochs = numpy.arange(values.shape[1])
            best = result['best']
            tag = '{} (α={:g}{})'.format(name, best['lr'], '' if best[
                'damping'] is None else ', λ={:g}'.format(best['damping']))
            line, = ax.plot(epochs, q2, style, label=tag)
            ax.fill_between(epochs, q1, q3, color=line.get_color(),
                            alpha=0.2)
            ax.set_xlabel('epoch')
            ax.set_ylabel(label)
            if log:
                ax.set_yscale('log')
    axes[2].legend(fontsize=8)
    fig.suptitle('Digits, small CNN, batch {}: median and quartiles over {} '
                 'seeds of the best setting of each optimizer'.format(
                     data['batch'], data['seeds']))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    data = _common.header('optimisation', argv)
    data['command'] = ' '.join(['python', '-m',
                                'experiments.curvature.optimisation'] + argv)
    data.update(epochs=args.epochs, search_epochs=args.search_epochs,
                batch=args.batch, seeds=args.seeds,
                dataset='sklearn.datasets.load_digits: 1197 train / 300 '
                        'valid / 300 test', optimizers={})
    print(_common.describe_machine(data), flush=True)
    splits = digits()
    with _common.limit_blas_threads(args.threads):
        for name in args.optimizers:
            grid = []
            for lr, damping in settings(name):
                start = time.perf_counter()
                curves = train(name, lr, damping, 0, splits,
                               args.search_epochs, args.batch)
                score = final_score(curves, args.search_epochs)
                grid.append({'lr': lr, 'damping': damping,
                             'valid_accuracy': score,
                             'train_loss': curves['train_loss'][-1]})
                print('  {:<10} α={:<6g} λ={:<6} valid {:.3f} ({:.1f} s)'
                      .format(name, lr, '-' if damping is None else
                              '{:g}'.format(damping), score,
                              time.perf_counter() - start), flush=True)
            best = max(grid, key=lambda g: (g['valid_accuracy'],
                                            -g['train_loss']))
            runs = []
            for seed in range(args.seeds):
                runs.append(train(name, best['lr'], best['damping'], seed,
                                  splits, args.epochs, args.batch))
                print('  {:<10} best α={:g} λ={} seed {}: test {:.3f}'
                      .format(name, best['lr'], best['damping'], seed,
                              runs[-1]['test_accuracy'][-1]), flush=True)
            data['optimizers'][name] = {
                'grid': grid, 'best': {'lr': best['lr'],
                                       'damping': best['damping']},
                'runs': runs,
                'final_test_accuracy': quartiles_of(
                    [r['test_accuracy'][-1] for r in runs]),
                'final_train_loss': quartiles_of(
                    [r['train_loss'][-1] for r in runs])}
    rows = [[name, r['best']['lr'], r['best']['damping'],
             r['final_train_loss']['median'],
             r['final_test_accuracy']['median'],
             r['final_test_accuracy']['q1'], r['final_test_accuracy']['q3']]
            for name, r in data['optimizers'].items()]
    print(_common.format_table(['optimizer', 'lr', 'damping', 'train loss',
                                'test acc', 'q1', 'q3'], rows))
    os.makedirs(args.out, exist_ok=True)
    _common.write_json(os.path.join(args.out, 'optimisation.json'), data)
    plot(data, os.path.join(args.out, 'optimisation.png'))
    print('wrote {}'.format(os.path.join(args.out,
                                         'optimisation.{json,png}')))


def quartiles_of(values):
    q1, q2, q3 = numpy.percentile(values, [25, 50, 75])
    return {'median': float(q2), 'q1': float(q1), 'q3': float(q3)}


if __name__ == '__main__':
    main()
