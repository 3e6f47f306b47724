#!/usr/bin/env python
"""Train ResNet-50 on ImageNet with K-FAC (or the SGD / LARS baselines).

    mpiexec -n 1024 python train_imagenet.py train.txt val.txt \\
        --root /data/imagenet --config config/bs32k.json --gpu

One process or many (``mpiexec -n N``): every process reads the lists and
takes its chunks of one global sample stream (the same global mini-batches
on any number of processes); the per-process batch and the number of
accumulated micro-batches follow from the config's global mini-batch
(``processes × batch × acc_iters``). Validation top-1 is evaluated over all
processes after every epoch. The output directory gets ``config.json``
(resolved config + run facts), ``log`` (JSON per epoch), the last
``--keep-snapshots`` per-process snapshots ``snapshot_step_S.rankR``
(after optimizer step S; the final one included), ``model_final.npz`` (the
network's weights), ``fisher_diff.jsonl`` (with ``--fisher-diff``) and
``time_to_accuracy.json`` (with ``--target-acc``). ``--resume`` continues
from a snapshot, on the same or another number of processes, once every
file of it has been read whole and found to fit the model and the
optimizer; ``--init-weights-from`` starts a new run from a snapshot's
weights. One run at a time holds the directory (``run.lock``), and a
fresh run refuses an earlier run's files there unless ``--overwrite``
removes them first. A snapshot that cannot be written stops the run at
once; ``model_final.npz`` is written anyway.

A ``--preempt-signals`` signal (a batch scheduler's SIGTERM, SIGUSR1 or
SIGUSR2, received by any process or forwarded by ``mpiexec``) stops every
process at the end of the optimizer step in progress; the snapshot is
written and the job exits with status 75 (EX_TEMPFAIL): resume it with ``--resume
latest`` (docs/imagenet.md, "Running under a batch scheduler").

``--demo`` runs the embedded default: an ImageNet-format dataset built from
scikit-learn's handwritten digits, a small ResNet trained with K-FAC and
with momentum SGD side by side, a summary table and the figures.
"""
if __name__ == '__main__':
    # A scheduler's signal during the imports (seconds) waits for its
    # handler (main) instead of ending the process.
    from harness import preemption
    preemption.hold()

import argparse
import json
import math
import sys
import time

import chainerkfac  # before chainer: applies the NumPy-2 compatibility shims

import models
from models.small_resnet import check_size
from harness import mpi as harness_mpi
from harness import preemption
from harness import tuning
from harness.run import OPTIMIZERS, resolve_config, train
from harness.triggers import SnapshotPeriod


#: Largest ``--seed``: ``seed + rank`` seeds NumPy's 32-bit generators.
MAX_SEED = 2 ** 31 - 1


def integer(low, high=None):
    """An ``argparse`` type: an integer in ``[low, high]`` (no upper bound
    if ``high`` is None); the error names the range and the value."""
    what = 'an integer >= {}'.format(low) if high is None else \
        'an integer in [{}, {}]'.format(low, high)

    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and
                                            value > high):
            raise argparse.ArgumentTypeError('must be {}, got {!r}'.format(
                what, text))
        return value
    return parse


def number(what, accept):
    """An ``argparse`` type: a finite float for which ``accept(value)``
    holds; ``what`` describes the range in the error."""
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and accept(value)):
            raise argparse.ArgumentTypeError('must be {}, got {!r}'.format(
                what, text))
        return value
    return parse


def snapshot_period(text):
    """An ``argparse`` type: ``--snapshot-every`` (``1``, ``2000it``,
    ``30min``)."""
    try:
        return SnapshotPeriod.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def signals(text):
    """An ``argparse`` type: ``--preempt-signals`` (``TERM,USR1,USR2``)."""
    try:
        return preemption.parse_signals(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def small_resnet_depth(text):
    """An ``argparse`` type: a depth of ``--arch small`` (``6 n + 2``)."""
    try:
        value = int(text)
    except ValueError:
        value = text            # check_size says what a depth must be
    try:
        check_size(value, 1)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return value


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
    parser.add_argument('--cuda-graphs', nargs='?', const='on',
                        default='auto', choices=('auto', 'on', 'off'),
                        help='capture steady-state steps (K-FAC steps that '
                             'refresh no factor, the baselines\' steps) as '
                             'CUDA graphs and replay them. auto (default): '
                             'on with --gpu where they can be captured (one '
                             'process, no accumulation, cuDNN serving '
                             'Chainer), else off, the start-up line says '
                             'why; off: every step eager; on (or the bare '
                             'flag): refuse a run where they cannot. '
                             'The summary counts eager, captured and '
                             'replayed steps')
    parser.add_argument('--replay-refresh-steps', nargs='?', const='on',
                        default='auto', choices=('auto', 'on', 'off'),
                        help="with CUDA graphs, replay K-FAC's refresh "
                             'steps too but for their inverse stage (their '
                             'passes with the capture of the factors, and '
                             'stage 5 with the update, from two graphs; the '
                             'factors\' average and inverses eagerly in '
                             'between). auto (default): wherever CUDA graphs '
                             'replay a K-FAC run (ResNet-50 on an H100: a '
                             'refresh step 0.188 s against 0.336 s eager at '
                             'batch 32); off: refresh steps eager; on (or '
                             'the bare flag): refuse a run without CUDA '
                             'graphs')
    parser.add_argument('--cudnn-workspace', type=tuning.workspace_size,
                        default='auto',
                        help="cuDNN's workspace limit for a convolution "
                             '(e.g. 8MiB, 1GiB). auto (default): 1GiB where '
                             'CUDA graphs replay the steps (their GPU time '
                             "is then the step), else Chainer's 8MiB")
    parser.add_argument('--cudnn-autotune', default='auto',
                        choices=('auto', 'on', 'off'),
                        help="time cuDNN's convolution algorithms (and "
                             "K-FAC's two ways of forming a convolution's "
                             'A) on the first step of each shape and keep '
                             "the fastest (chainer.config.autotune). auto "
                             '(default): on where CUDA graphs replay the '
                             'steps')
    parser.add_argument('--arch', choices=models.ARCHS, default='resnet50')
    parser.add_argument('--depth', type=small_resnet_depth, default=8,
                        help='depth of --arch small (6n+2: 8, 14, 20, ...)')
    parser.add_argument('--width', type=integer(1), default=16,
                        help='width of --arch small')
    parser.add_argument('--n-class', type=integer(1),
                        help="number of classes (default: the config's "
                             'n_class, 1000 for ImageNet); every label of '
                             'the lists is checked against it')
    parser.add_argument('--crop-size', type=integer(1), default=224,
                        help='side of the random crop (at most --resize)')
    parser.add_argument('--resize', type=integer(1), default=256,
                        help='side every image is resized to')
    parser.add_argument('--mean', help='mean image (.npy); computed from '
                        'the training list (by all processes in parallel) '
                        'and saved here if missing (default: OUT/mean.npy)')
    parser.add_argument('--out', default='result',
                        help='the run directory (one run at a time: locked '
                             'by run.lock while the run lasts)')
    parser.add_argument('--resume', help='snapshot prefix, e.g. '
                        'result/snapshot_step_120 (files .rank0, .rank1, ... '
                        'of any number of processes), or "latest" for the '
                        'newest complete, undamaged snapshot in --out, '
                        'mid-epoch or not; it must fit the model and '
                        '--optimizer')
    parser.add_argument('--overwrite', action='store_true',
                        help="start over in an --out that holds an earlier "
                             "run's files: they are removed first (without "
                             'it such a run is refused)')
    parser.add_argument('--init-weights-from', metavar='SNAPSHOT',
                        help='start a new run (fresh optimizer, epoch 0) '
                             "from the weights of a snapshot (prefix or "
                             'file, of any --optimizer) or of a '
                             'model_final.npz')
    parser.add_argument('--snapshot-every', type=snapshot_period,
                        default='1',
                        help='N epochs (1), N iterations (2000it) or M '
                             'minutes (30min, by the clock of rank 0) '
                             'between snapshots, taken at the end of the '
                             'optimizer step in progress; the end of the '
                             'run and a stop by a signal are always saved')
    parser.add_argument('--preempt-signals', type=signals,
                        default=preemption.DEFAULT_SIGNALS,
                        help='signals that stop the run at the end of the '
                             'optimizer step in progress, snapshotted, with '
                             'exit status {} (resume with --resume latest); '
                             "'none' for none (default: %(default)s)".format(
                                 preemption.RESUME_STATUS))
    parser.add_argument('--keep-snapshots', type=integer(0), default=2,
                        help='snapshots kept per process, older ones are '
                             'removed (0: keep all)')
    parser.add_argument('--compress-snapshots', action='store_true',
                        help='zlib-compress the snapshots (smaller files, '
                             'many more CPU-seconds of the writer thread)')
    parser.add_argument('--epochs', type=integer(1),
                        help='override the config\'s epochs (K-FAC: at most '
                             'e_end, where its learning rate reaches 0)')
    parser.add_argument('--target-acc', type=number(
                            'a number in (0, 1]', lambda v: 0 < v <= 1),
                        help='report time/epoch when val top-1 first '
                             'reaches this (e.g. 0.75)')
    parser.add_argument('--fisher-diff', action='store_true',
                        help='log Diff(t) of eq. 21 (Figure 5)')
    parser.add_argument('--loaderjob', type=integer(0),
                        help='loader processes per process (default: the '
                             "node's cores shared among its ranks, minus "
                             'one; 0: decode in the training process)')
    parser.add_argument('--check-images', action='store_true',
                        help='decode every listed image before training '
                             '(in parallel) and report all unreadable ones')
    parser.add_argument('--skip-bad-images', action='store_true',
                        help='leave unreadable images out (counted in the '
                             'log) instead of stopping with their file and '
                             'line')
    parser.add_argument('--seed', type=integer(0, MAX_SEED), default=0,
                        help='of the initial weights and of every random '
                             'draw of the data stream')
    parser.add_argument('--label', help='name of the run in the figures')
    parser.add_argument('--baseline-lr', type=number(
                            'a number > 0', lambda v: v > 0),
                        help='peak LR of sgd/lars (default: scaled rule; '
                             'lars: 31.2 scaled, 29 unscaled x batch/32K)')
    parser.add_argument('--baseline-momentum', type=number(
                            'a number in [0, 1)', lambda v: 0 <= v < 1),
                        help='momentum of sgd/lars (default: 0.9; lars: '
                             '0.9 scaled, 0.929 unscaled)')
    parser.add_argument('--lars-momentum', choices=('scaled', 'unscaled'),
                        help="LARS's momentum form: Figure 5 (scaled, the "
                             'MLPerf reference) or 6 (unscaled) of the '
                             "MLPerf-0.6 paper (default: the config's "
                             'lars_momentum)')
    parser.add_argument('--shard-update', action='store_true',
                        help='weight-update sharding: each process updates '
                             'the parameters it owns (and keeps their '
                             'optimizer state), the new weights are '
                             'all-gathered')
    parser.add_argument('--warmup-epochs', type=number(
                            'a number >= 0', lambda v: v >= 0), default=None,
                        help='LR warm-up of sgd/lars (default: 5 for sgd, '
                             "Goyal et al.; Table 1's for lars: 25 scaled, "
                             '18 unscaled)')
    parser.add_argument('--weight-decay', type=number(
                            'a number >= 0', lambda v: v >= 0), default=1e-4,
                        help='weight decay of sgd/lars')
    parser.add_argument('--no-augment', action='store_true',
                        help='no mixup / random erasing')
    parser.add_argument('--no-progress', action='store_true',
                        help='plain lines, no progress bar (its terminal '
                        "escape codes fill a batch job's log file): a "
                        "'progress:' line every minute between the log's "
                        'rows')
    parser.add_argument('--demo', action='store_true',
                        help='the embedded default: digits, K-FAC vs SGD')
    args = parser.parse_args(argv)
    if not args.demo:
        missing = [n for n in ('train', 'val', 'config')
                   if getattr(args, n) is None]
        if missing:
            parser.error('missing {} (or use --demo)'.format(
                ', '.join(missing)))
    if args.lars_momentum and args.optimizer != 'lars':
        parser.error('--lars-momentum is for --optimizer lars')
    if args.resume and args.init_weights_from:
        parser.error('--resume continues a run, --init-weights-from starts '
                     'a new one: give one of them')
    if args.resume == 'latest' and args.overwrite:
        parser.error('--resume latest continues the run of --out, '
                     '--overwrite removes it: give one of them')
    if args.demo and (args.resume or args.init_weights_from):
        parser.error('--demo trains two new runs: no --resume or '
                     '--init-weights-from')
    if args.cuda_graphs == 'on' and not args.gpu:
        parser.error('--cuda-graphs replays GPU work: it needs --gpu (the '
                     'arrays would be NumPy arrays)')
    if args.replay_refresh_steps == 'on' and (not args.gpu or
                                              args.cuda_graphs == 'off'):
        parser.error('--replay-refresh-steps replays part of the steps '
                     'as CUDA graphs: it needs --gpu and CUDA graphs (not '
                     '--cuda-graphs off)')
    for name, value in (('--cudnn-workspace', args.cudnn_workspace),
                        ('--cudnn-autotune', args.cudnn_autotune)):
        if value != 'auto' and not args.gpu:
            parser.error('{} sets cuDNN, which serves only --gpu runs '
                         '(it would change nothing here)'.format(name))
    if args.crop_size > args.resize:
        parser.error('--crop-size {} is larger than --resize {}: the crop is '
                     'cut from the resized image'.format(args.crop_size,
                                                         args.resize))
    return args


def main(argv=None):
    """Returns the exit status: 0 (done), :data:`harness.preemption.
    RESUME_STATUS` (stopped by a signal, snapshotted)."""
    args = parse_args(argv)
    if args.gpu:
        missing = harness_mpi.gpu_missing()
        if missing is not None:
            # before MPI: the communicator's error named NCCL and advised
            # 'naive', which then failed in Chainer's words; said once
            if harness_mpi.launch_rank() == 0:
                print('train_imagenet.py: --gpu needs CuPy and a CUDA GPU: '
                      '{}'.format(missing), file=sys.stderr, flush=True)
            else:
                # rank 0 exits first: mpiexec ends the job at the first
                # failed process, which could kill rank 0 before its line
                time.sleep(5.0)
            return 2
    # The demo trains two runs it cannot resume: signals keep their
    # default action there.
    stop = None if args.demo else preemption.StopRequest(args.preempt_signals)
    # Before MPI is initialised: the signal handlers (a signal from now on
    # stops the run at its first step boundary), Open MPI's help files,
    # the loaders' fork server.
    args.loaderjob = harness_mpi.prepare_process(args.loaderjob, stop)
    name = args.communicator or ('pure_nccl' if args.gpu else 'naive')
    comm = chainerkfac.create_communicator(name)
    if args.demo:
        import demo
        return demo.run_demo(args, comm)
    cfg = resolve_config(args, comm)
    summary = train(args, comm, args.optimizer, args.out, cfg, stop)
    stop.settle()          # decided: a late signal must not kill the exit
    if comm.rank == 0:
        print(json.dumps(summary, indent=1))
    return preemption.RESUME_STATUS if summary.get('preempted') else 0


if __name__ == '__main__':
    sys.exit(main())
