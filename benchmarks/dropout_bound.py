"""K-FAC's bounded step on a model with dropout before most of its layers:
Chainer's CIFAR VGG pattern trained at the README's defaults, with a
larger ``kl_clip`` and with MomentumSGD, the step scale ν, the loss and
the validation accuracy per epoch (the figures of docs/kfac.md on the
bounded step, and its warning).

    python -m benchmarks.dropout_bound [--smoke] [--epochs 3]
        [--width-divisor 8] [--images 1280] [--batch 64] [--lr 0.05]
        [--kl-clips 1e-4,1e-2] [--threads 1] [--out FILE.json]

The network is ``chainer/examples/cifar/models/VGG.py`` (conv-BN-ReLU
blocks, dropout 0.3-0.5 before most of them, a BN'd hidden Linear, the
classifier) at its widths divided by ``--width-divisor``, trained on
synthetic 32² images whose class is a bright patch at a class-dependent
place and channel (learnable, not trivial at this width), with
``WeightDecay(5e-4)`` as the example adds it, by
``KFAC(lr, momentum=0.9)`` at each ``--kl-clips`` value (the library's
defaults otherwise) and by ``MomentumSGD(lr, momentum=0.9)``, each from
the same initial weights and seed. Per run: ν at every step (the mean
and range per epoch), the training loss per epoch, the validation
accuracy after each epoch, and the warnings K-FAC logged.
"""
import logging
import sys
import time

import numpy

import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)
import chainer
import chainer.functions as F
import chainer.links as L

from benchmarks import _args
from benchmarks import _common


class _Block(chainer.Chain):
    def __init__(self, out_channels):
        super().__init__()
        with self.init_scope():
            self.conv = L.Convolution2D(None, out_channels, 3, pad=1,
                                        nobias=True)
            self.bn = L.BatchNormalization(out_channels)

    def __call__(self, x):
        return F.relu(self.bn(self.conv(x)))


class VGG(chainer.Chain):
    """Chainer's CIFAR example VGG, its widths divided by ``divisor``."""

    #: (channels, dropout after the block, or None: max pooling)
    PLAN = ((64, 0.3), (64, None), (128, 0.4), (128, None), (256, 0.4),
            (256, 0.4), (256, None), (512, 0.4), (512, 0.4), (512, None))

    def __init__(self, n_class=10, divisor=8):
        super().__init__()
        with self.init_scope():
            self.blocks = chainer.ChainList(
                *[_Block(max(c // divisor, 1)) for c, _ in self.PLAN])
            self.fc1 = L.Linear(None, max(512 // divisor, 1), nobias=True)
            self.bn_fc1 = L.BatchNormalization(max(512 // divisor, 1))
            self.fc2 = L.Linear(None, n_class, nobias=True)

    def __call__(self, x):
        h = x
        for block, (_, after) in zip(self.blocks, self.PLAN):
            h = block(h)
            h = F.max_pooling_2d(h, 2, 2) if after is None else \
                F.dropout(h, ratio=after)
        h = F.dropout(h, ratio=0.5)
        h = F.dropout(F.relu(self.bn_fc1(self.fc1(h))), ratio=0.5)
        return self.fc2(h)


def synthetic(n, seed, n_class=10):
    """``(x, t)``: noise with a bright 6×6 patch whose place and channel
    give the class."""
    rng = numpy.random.RandomState(seed)
    t = rng.randint(0, n_class, n).astype(numpy.int32)
    x = rng.randn(n, 3, 32, 32).astype(numpy.float32) * 0.5
    for i, k in enumerate(t):
        cy, cx = 4 + 8 * (k // 4), 4 + 8 * (k % 4)
        x[i, k % 3, cy - 3:cy + 3, cx - 3:cx + 3] += 2.0
    return x, t


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def train(name, make_optimizer, spec, data, initial):
    """One run; returns its record."""
    (x, t), (x_val, t_val) = data
    numpy.random.seed(spec['seed'])     # the dropout masks: as every run's
    model = L.Classifier(VGG(divisor=spec['width_divisor']))
    model(x[:2], t[:2])                  # the lazy links' shapes
    model.copyparams(initial)
    optimizer = make_optimizer()
    optimizer.setup(model)
    optimizer.add_hook(chainer.optimizer_hooks.WeightDecay(5e-4))
    caught = _Warnings()
    logging.getLogger('chainerkfac').addHandler(caught)
    rng = numpy.random.RandomState(spec['seed'])
    batch, epochs = [], []
    start = time.perf_counter()
    try:
        for epoch in range(spec['epochs']):
            order = rng.permutation(len(x))
            losses, scales = [], []
            for i in range(0, len(x) - spec['batch'] + 1, spec['batch']):
                rows = order[i:i + spec['batch']]
                optimizer.update(model, x[rows], t[rows])
                losses.append(float(model.loss.array))
                bound = getattr(optimizer, 'step_bound', None)
                if bound is not None:
                    scales.append(float(bound.scale))
            with chainer.using_config('train', False), \
                    chainer.no_backprop_mode():
                accuracy = float((model.predictor(x_val).array.argmax(1)
                                  == t_val).mean())
            record = {'epoch': epoch + 1, 'loss': float(numpy.mean(losses)),
                      'validation_accuracy': accuracy}
            if scales:
                record['step_scale'] = {
                    'mean': float(numpy.mean(scales)),
                    'min': float(numpy.min(scales)),
                    'max': float(numpy.max(scales))}
            epochs.append(record)
            batch.append(len(losses))
            print('{:>16} epoch {}: loss {:.3f}, validation {:.3f}{}'.format(
                name, epoch + 1, record['loss'], accuracy,
                '' if not scales else ', nu {:.4f} ({:.4f}-{:.4f})'.format(
                    *record['step_scale'].values())), flush=True)
    finally:
        logging.getLogger('chainerkfac').removeHandler(caught)
    return {'run': name, 'epochs': epochs, 'steps': int(sum(batch)),
            'seconds': time.perf_counter() - start,
            'warnings': [m for m in caught.messages if 'held every' in m]}


def parse_args(argv):
    parser = _common.argument_parser('benchmarks.dropout_bound', __doc__)
    parser.add_argument('--smoke', action='store_true',
                        help='seconds: 1 epoch of 128 images at width/16')
    parser.add_argument('--epochs', type=_args.positive_int, default=3,
                        help='epochs of each run (default %(default)s)')
    parser.add_argument('--width-divisor', type=_args.positive_int, default=8,
                        help="the example VGG's widths divided by this "
                        '(default %(default)s)')
    parser.add_argument('--images', type=_args.positive_int, default=1280,
                        help='training images; validation: a fifth '
                        '(default %(default)s)')
    parser.add_argument('--batch', type=_args.positive_int, default=64,
                        help='mini-batch (default %(default)s)')
    parser.add_argument('--lr', type=_args.positive_float, default=0.05,
                        help='learning rate of every run (default '
                        '%(default)s)')
    parser.add_argument('--kl-clips', type=_args.or_empty(_args.float_list),
                        default='1e-4,1e-2',
                        help="K-FAC's runs, one per kl_clip, 1e-4 the "
                        "library's (default %(default)s)")
    parser.add_argument('--seed', type=_args.nonnegative_int, default=0,
                        help='data, initial weights and dropout masks '
                        '(default %(default)s)')
    parser.add_argument('--threads', type=_args.positive_int, default=1,
                        help='BLAS threads (default %(default)s)')
    parser.add_argument('--out', default='result/dropout_bound.json',
                        help='the JSON (default %(default)s)')
    args = parser.parse_args(argv)
    _args.check_paths(parser, args)
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    _common.limit_blas_threads(args.threads)
    spec = {'epochs': 1 if args.smoke else args.epochs,
            'width_divisor': 16 if args.smoke else args.width_divisor,
            'images': 128 if args.smoke else args.images,
            'batch': 32 if args.smoke else args.batch,
            'lr': args.lr, 'seed': args.seed}
    clips = args.kl_clips
    numpy.random.seed(args.seed)
    data = (synthetic(spec['images'], args.seed),
            synthetic(max(spec['images'] // 5, 1), args.seed + 1))
    initial = L.Classifier(VGG(divisor=spec['width_divisor']))
    initial(data[0][0][:2], data[0][1][:2])
    runs = []
    for clip in clips:
        runs.append(train(
            'KFAC kl_clip={:g}'.format(clip), lambda clip=clip:
            chainerkfac.optimizers.KFAC(lr=spec['lr'], momentum=0.9,
                                        kl_clip=clip, verbose=False),
            spec, data, initial))
    runs.append(train('MomentumSGD', lambda: chainer.optimizers.MomentumSGD(
        lr=spec['lr'], momentum=0.9), spec, data, initial))
    result = _common.header('dropout_bound', argv)
    result.update({'smoke': args.smoke, 'blas_threads': args.threads,
                   'spec': spec, 'runs': runs})
    _common.write_json(args.out, result)
    print('wrote', args.out)


if __name__ == '__main__':
    main()
