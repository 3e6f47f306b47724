#!/usr/bin/env python
"""Train ResNet-50 on ImageNet with K-FAC (or the SGD / LARS baselines).

    mpiexec -n 1024 python train_imagenet.py train.txt val.txt \\
        --root /data/imagenet --config config/bs32k.json --gpu

One process or many (``mpiexec -n N``): rank 0 reads the lists and the mean
image, ``chainermn.scatter_dataset`` shards them, the per-process batch and
the number of accumulated micro-batches follow from the config's global
mini-batch (``processes × batch × acc_iters``). Validation top-1 is
evaluated across all ranks after every epoch. The output directory gets
``config.json`` (resolved config + run facts), ``log`` (JSON per epoch),
``fisher_diff.jsonl`` (with ``--fisher-diff``), ``time_to_accuracy.json``
(with ``--target-acc``) and per-rank snapshots ``snapshot_epoch_E.rankR``.

``--demo`` runs the embedded default: an ImageNet-format dataset built from
scikit-learn's handwritten digits, a small ResNet trained with K-FAC and
with momentum SGD side by side, a summary table and the figures.
"""
import argparse
import json
import os
import sys
import time

import chainerkfac  # before chainer: applies the NumPy-2 compatibility shims
import chainer
import chainermn
import numpy
from chainer import training
from chainer.training import extensions

import augment
import config as config_module
import models
from chainerkfac import training as kfac_training
from chainerkfac.training import FisherDiffLog, TimeToAccuracy

OPTIMIZERS = ('kfac', 'sgd', 'lars')
ARCHS = ('resnet50', 'resnet50d', 'small')


# -- the updater: augmentation, accumulation for the baselines -----------------
class AugmentedUpdater(training.updaters.StandardUpdater):
    """StandardUpdater with running mixup and random erasing on each batch.

    Mixup keeps one stream per accumulated micro-batch (the micro-batch
    ``k`` of a step mixes with micro-batch ``k`` of the previous step, as
    micro-batches stand for processes of a larger run). K-FAC accumulates
    inside the optimizer; for the first-order baselines this updater
    accumulates ``acc_iters`` backward passes, averages the gradients over
    micro-batches and processes, then updates.
    """

    def __init__(self, iterator, optimizer, acc_iters, mixups=None,
                 erasing=None, comm=None, device=None):
        super().__init__(iterator, optimizer, device=device)
        self.acc_iters = acc_iters
        self.mixups = mixups
        self.erasing = erasing
        self.comm = comm
        self.accumulates = not isinstance(
            optimizer, chainerkfac.optimizers.KFAC)

    def update_core(self):
        batch = self.get_iterator('main').next()
        x, t = self.converter(batch, self.device)
        micro = self.iteration % self.acc_iters
        if self.mixups is not None:
            x, t = self.mixups[micro](x, t)
        if self.erasing is not None:
            x = self.erasing(x)
        optimizer = self.get_optimizer('main')
        if self.get_iterator('main').is_new_epoch:
            optimizer.new_epoch(auto=True)
        model = optimizer.target
        if not self.accumulates:
            optimizer.update(model, x, t)
            return
        if micro == 0:
            model.cleargrads()
        model(x, t).backward()
        if micro == self.acc_iters - 1:
            if self.acc_iters > 1:
                for param in model.params():
                    if param.grad is not None:
                        param.grad /= self.acc_iters
            self.comm.multi_node_mean_grad(model)
            optimizer.update()


class EpochAtStepBoundary:
    """Trigger every ``period`` epochs, postponed to the end of the K-FAC
    step in progress, so that snapshots never split an accumulation."""

    def __init__(self, period, acc_iters):
        self.period = period
        self.acc_iters = acc_iters
        self.epochs_seen = 0
        self.pending = False

    def __call__(self, trainer):
        updater = trainer.updater
        if updater.is_new_epoch:
            self.epochs_seen += 1
            if self.epochs_seen % self.period == 0:
                self.pending = True
        if self.pending and updater.iteration % self.acc_iters == 0:
            self.pending = False
            return True
        return False

    def serialize(self, serializer):
        self.epochs_seen = int(serializer('epochs_seen', self.epochs_seen))
        self.pending = bool(serializer('pending', self.pending))


# -- building blocks -------------------------------------------------------------
def build_model(arch, n_class, depth=8, width=16):
    if arch == 'resnet50':
        return models.ResNet50(n_class)
    if arch == 'resnet50d':
        return models.ResNet50D(n_class)
    if arch == 'small':
        return models.SmallResNet(depth=depth, width=width, n_class=n_class)
    raise ValueError('unknown --arch {!r}; choose from {}'.format(arch, ARCHS))


def build_optimizer(name, cfg, comm, acc_iters, args):
    """The optimizer and its schedule extension."""
    if name == 'kfac':
        optimizer = chainerkfac.optimizers.KFAC(
            lr=cfg.lr, momentum=cfg.momentum, damping=cfg.damping,
            damping_target=cfg.damping_target,
            damping_warmup_steps=cfg.damping_warmup_steps,
            rho_bn=cfg.rho_bn, bn_fisher=cfg.bn_fisher, fisher=cfg.fisher,
            acc_iters=acc_iters, refresh_interval_a=cfg.refresh_interval_a,
            refresh_interval_g=cfg.refresh_interval_g,
            refresh_interval_f=cfg.refresh_interval_f,
            factor_dtype=cfg.factor_dtype,
            weight_rescale=cfg.weight_rescale,
            fisher_diff=args.fisher_diff, verbose=comm.rank == 0,
            seed=args.seed + comm.rank)
        optimizer = chainerkfac.create_multi_node_optimizer(optimizer, comm)
        schedule = kfac_training.PolynomialLRDecay(
            cfg.lr, cfg.p_decay, cfg.e_start, cfg.e_end,
            momentum_init=cfg.momentum)
        return optimizer, schedule
    # First-order baselines (Goyal et al.; LARS as in seed 002), with a
    # linear warm-up then polynomial (power 2) decay to the last epoch.
    scale = cfg.global_batch_size / 256.0
    if name == 'sgd':
        lr = args.baseline_lr or 0.1 * scale
        momentum = args.baseline_momentum or 0.9
        warmup_start = 0.1
    else:
        # MLPerf-0.6 LARS at 32K: base LR 29 with trust coefficient 1e-3
        # (Chainer's GradientLARS has none), momentum 0.929, 18 warm-up
        # epochs; scaled linearly to other batch sizes by default.
        lr = args.baseline_lr or 29.0e-3 * cfg.global_batch_size / 32768
        momentum = args.baseline_momentum or 0.929
        warmup_start = lr / 100.0
    optimizer = chainer.optimizers.MomentumSGD(lr=lr, momentum=momentum)
    schedule = kfac_training.LinearWarmupLR(
        lr, warmup_start, warmup_epochs=args.warmup_epochs,
        decay=kfac_training.polynomial_decay(
            lr, 2.0, args.warmup_epochs, cfg.epochs + 1e-6))
    return optimizer, schedule


def attach_hooks(name, optimizer, args):
    if name == 'sgd':
        optimizer.add_hook(chainer.optimizer_hooks.WeightDecay(
            args.weight_decay))
    elif name == 'lars':
        optimizer.add_hook(chainer.optimizer_hooks.GradientLARS(
            weight_decay=args.weight_decay))


def load_datasets(args, comm, crop, resize, out):
    """Rank 0 reads and checks the lists and the mean (computed into
    ``out`` when ``--mean`` is not given); shards go out."""
    if comm.rank == 0:
        train_base = augment.ImageListDataset(args.train, args.root, resize)
        val_base = augment.ImageListDataset(args.val, args.root, resize)
        mean_path = args.mean or os.path.join(out, 'mean.npy')
        if os.path.exists(mean_path):
            mean = augment.load_mean(mean_path, crop)
        else:
            print('computing the mean image over {} images -> {}'.format(
                len(train_base), mean_path), flush=True)
            mean = augment.compute_mean(train_base, crop)
            augment.save_mean(mean_path, mean)
        n_class = int(max(train_base.labels.max(), val_base.labels.max())) + 1
        payload = (mean, n_class, len(train_base), len(val_base))
    else:
        train_base = val_base = None
        payload = None
    mean, n_class, n_train, n_val = comm.mpi_comm.bcast(payload, root=0)
    train = chainermn.scatter_dataset(train_base, comm, shuffle=True,
                                      seed=args.seed)
    val = chainermn.scatter_dataset(val_base, comm)
    seed = args.seed + 1000 * comm.rank
    train = chainer.datasets.TransformDataset(
        train, augment.ImageTransform(mean, crop, train=True, seed=seed))
    val = chainer.datasets.TransformDataset(
        val, augment.ImageTransform(mean, crop, train=False))
    return train, val, n_class, n_train, n_val


def make_iterators(train, val, batch, loaderjob):
    if loaderjob > 0:
        make = lambda data, size, **kw: chainer.iterators.MultiprocessIterator(
            data, size, n_processes=loaderjob, **kw)
    else:
        make = chainer.iterators.SerialIterator
    return (make(train, batch),
            make(val, batch, repeat=False, shuffle=False))


def observers(optimizer, name, images_per_iteration):
    """Values logged per epoch besides loss and accuracy."""
    out = [extensions.observe_lr(),
           extensions.observe_value('momentum',
                                    lambda t: optimizer.momentum)]
    if name == 'kfac':
        out.append(extensions.observe_value(
            'damping', lambda t: optimizer.damping))
        for kind in ('A', 'G', 'F'):
            out.append(extensions.observe_value(
                'refresh_interval_' + kind,
                lambda t, k=kind: optimizer.refresh_intervals[k](
                    optimizer.t, optimizer.epoch)))
    def images_per_sec(trainer):
        elapsed = trainer.elapsed_time
        return (trainer.updater.iteration * images_per_iteration / elapsed
                if elapsed > 0 else 0.0)
    out.append(extensions.observe_value('images_per_sec', images_per_sec))
    return out


# -- one training run --------------------------------------------------------------
def run(args, comm, optimizer_name, out, cfg):
    """Train one model; return a summary dict (on every rank)."""
    acc_iters = cfg.acc_iters(comm.size)
    batch = cfg.batch_size_per_process
    crop, resize = args.crop_size, args.resize
    if comm.rank == 0:
        os.makedirs(out, exist_ok=True)
    comm.mpi_comm.Barrier()
    train, val, n_class, n_train, n_val = load_datasets(args, comm, crop,
                                                        resize, out)
    numpy.random.seed(args.seed)   # same initial weights on every rank
    model = models.SoftLabelClassifier(build_model(args.arch, n_class,
                                                   args.depth, args.width))
    device = chainer.get_device(
        '@cupy:{}'.format(comm.intra_rank) if args.gpu else '@numpy')
    device.use()
    model.to_device(device)
    optimizer, schedule = build_optimizer(optimizer_name, cfg, comm,
                                          acc_iters, args)
    optimizer.setup(model)
    attach_hooks(optimizer_name, optimizer, args)
    if optimizer_name != 'kfac':
        comm.bcast_data(model)

    train_iter, val_iter = make_iterators(train, val, batch, args.loaderjob)
    mixups = (augment.running_mixup_streams(
        acc_iters, cfg.alpha_mixup, n_class, seed=args.seed + comm.rank)
        if cfg.alpha_mixup > 0 and not args.no_augment else None)
    erasing = (augment.RandomErasing(seed=args.seed + 7919 * comm.rank)
               if not args.no_augment else None)
    updater = AugmentedUpdater(train_iter, optimizer, acc_iters, mixups,
                               erasing, comm, device)
    trainer = training.Trainer(updater, (cfg.epochs, 'epoch'), out=out)
    trainer.extend(schedule, trigger=(1, 'iteration'))
    # BN running statistics are per process; average them before evaluating.
    trainer.extend(chainermn.extensions.AllreducePersistent(model, comm),
                   trigger=(1, 'epoch'),
                   priority=training.extension.PRIORITY_WRITER + 1)
    evaluator = extensions.Evaluator(val_iter, model, device=device)
    trainer.extend(chainermn.create_multi_node_evaluator(evaluator, comm),
                   trigger=(1, 'epoch'))
    target = None
    if args.target_acc:
        target = TimeToAccuracy(args.target_acc, write=comm.rank == 0)
        trainer.extend(target)
    if optimizer_name == 'kfac' and args.fisher_diff:
        trainer.extend(FisherDiffLog(optimizer, comm=comm))
    snapshot_name = 'snapshot_epoch_{.updater.epoch}' + '.rank{}'.format(
        comm.rank)
    trainer.extend(extensions.snapshot(filename=snapshot_name),
                   trigger=EpochAtStepBoundary(args.snapshot_every,
                                               acc_iters))
    if comm.rank == 0:
        # Every iteration, all processes together take one micro-batch each.
        for observer in observers(optimizer, optimizer_name,
                                  batch * comm.size):
            trainer.extend(observer, trigger=(1, 'iteration'))
        trainer.extend(extensions.LogReport(trigger=(1, 'epoch')))
        trainer.extend(extensions.PrintReport(
            ['epoch', 'iteration', 'main/loss', 'main/accuracy',
             'validation/main/accuracy', 'lr', 'elapsed_time']))
        if not args.no_progress:
            trainer.extend(extensions.ProgressBar(update_interval=10))
        write_run_config(cfg, out, {
            'optimizer': optimizer_name, 'n_processes': comm.size,
            'acc_iters': acc_iters, 'batch_per_process': batch,
            'arch': args.arch, 'depth': args.depth, 'width': args.width,
            'n_train': n_train, 'n_val': n_val,
            'n_class': n_class, 'label': args.label or label_of(
                optimizer_name, cfg)})
    if args.resume:
        path = '{}.rank{}'.format(args.resume, comm.rank)
        if not os.path.exists(path):
            raise FileNotFoundError(
                'no snapshot {} for rank {} of {} (snapshots are per rank; '
                'resume with the same number of processes)'.format(
                    path, comm.rank, comm.size))
        chainer.serializers.load_npz(path, trainer)
    start = time.time()
    trainer.run()
    summary = {'optimizer': optimizer_name, 'epochs': updater.epoch,
               'elapsed_time': time.time() - start,
               'reached': target.reached if target else None}
    if comm.rank == 0:
        log = load_log(out)
        accuracies = [e.get('validation/main/accuracy') for e in log]
        summary['final_top1'] = accuracies[-1] if accuracies else None
        summary['best_top1'] = max(a for a in accuracies if a is not None) \
            if any(a is not None for a in accuracies) else None
    return summary


def label_of(optimizer_name, cfg):
    label = '{} bs{}'.format(optimizer_name.upper() if optimizer_name !=
                             'kfac' else 'K-FAC', cfg.global_batch_size)
    if optimizer_name == 'kfac':
        if cfg.bn_fisher == 'diag':
            label += ' diag'
        if any(v != 1 for v in (cfg.refresh_interval_a,
                                cfg.refresh_interval_g,
                                cfg.refresh_interval_f)):
            label += ' stale'
    return label


def write_run_config(cfg, out, run_facts):
    data = config_module.to_dict(cfg)
    data['run'] = run_facts
    path = os.path.join(out, 'config.json')
    tmp = path + '.tmp'
    with open(tmp, 'w') as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def load_log(out):
    path = os.path.join(out, 'log')
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return json.load(f)


# -- command line ------------------------------------------------------------------
def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument('train', nargs='?', help='training image list')
    parser.add_argument('val', nargs='?', help='validation image list')
    parser.add_argument('--root', default='.',
                        help='directory the list paths are relative to')
    parser.add_argument('--config', help='config/<bs>.json (Table 3)')
    parser.add_argument('--optimizer', choices=OPTIMIZERS, default='kfac')
    parser.add_argument('--communicator', default=None,
                        help="ChainerMN communicator: 'naive' (CPU, default) "
                             "or 'pure_nccl' (default with --gpu)")
    parser.add_argument('--gpu', action='store_true',
                        help='one GPU per process (intra-node rank)')
    parser.add_argument('--arch', choices=ARCHS, default='resnet50')
    parser.add_argument('--depth', type=int, default=8,
                        help='depth of --arch small')
    parser.add_argument('--width', type=int, default=16,
                        help='width of --arch small')
    parser.add_argument('--crop-size', type=int, default=224)
    parser.add_argument('--resize', type=int, default=256)
    parser.add_argument('--mean', help='mean image (.npy); computed from '
                        'the training list and saved here if missing')
    parser.add_argument('--out', default='result')
    parser.add_argument('--resume', help='snapshot prefix, e.g. '
                        'result/snapshot_epoch_3 (each rank adds .rankR)')
    parser.add_argument('--snapshot-every', type=int, default=1,
                        help='epochs between snapshots')
    parser.add_argument('--epochs', type=int,
                        help='override the config\'s epochs')
    parser.add_argument('--target-acc', type=float,
                        help='report time/epoch when val top-1 first '
                             'reaches this (e.g. 0.75)')
    parser.add_argument('--fisher-diff', action='store_true',
                        help='log Diff(t) of eq. 21 (Figure 5)')
    parser.add_argument('--loaderjob', type=int, default=0,
                        help='data loading processes per rank')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--label', help='name of the run in the figures')
    parser.add_argument('--baseline-lr', type=float,
                        help='peak LR of sgd/lars (default: scaled rule)')
    parser.add_argument('--baseline-momentum', type=float)
    parser.add_argument('--warmup-epochs', type=float, default=5.0,
                        help='LR warm-up of sgd/lars')
    parser.add_argument('--weight-decay', type=float, default=1e-4,
                        help='weight decay of sgd/lars')
    parser.add_argument('--no-augment', action='store_true',
                        help='no mixup / random erasing')
    parser.add_argument('--no-progress', action='store_true')
    parser.add_argument('--demo', action='store_true',
                        help='the embedded default: digits, K-FAC vs SGD')
    args = parser.parse_args(argv)
    if not args.demo:
        missing = [n for n in ('train', 'val', 'config')
                   if getattr(args, n) is None]
        if missing:
            parser.error('missing {} (or use --demo)'.format(
                ', '.join(missing)))
    return args


def load_config(args, comm):
    cfg = config_module.load(args.config)
    if args.epochs:
        cfg = config_module.from_dict(
            dict(config_module.to_dict(cfg), epochs=args.epochs),
            source=args.config)
    cfg.acc_iters(comm.size)   # raises with the numbers if impossible
    return cfg


def main(argv=None):
    args = parse_args(argv)
    name = args.communicator or ('pure_nccl' if args.gpu else 'naive')
    comm = chainerkfac.create_communicator(name)
    if args.demo:
        from demo import run_demo
        return run_demo(args, comm, run, load_config)
    cfg = load_config(args, comm)
    summary = run(args, comm, args.optimizer, args.out, cfg)
    if comm.rank == 0:
        print(json.dumps(summary, indent=1))
    return 0


if __name__ == '__main__':
    sys.exit(main())
