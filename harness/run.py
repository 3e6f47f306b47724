"""One training run of ``train_imagenet.py`` (and of each run of the demo).

:func:`train` builds the model, the optimizer and its schedule, the data
stream, the Chainer trainer with its extensions, resumes if asked, trains,
and leaves the run directory: ``config.json``, ``log``, snapshots (the last
``--keep-snapshots`` per process, the final one included),
``model_final.npz`` (the bare network's weights and BatchNormalization
statistics: ``chainer.serializers.load_npz(path, models.ResNet50(1000))``),
``fisher_diff.jsonl`` and ``time_to_accuracy.json`` when asked for. A run
stopped by a scheduler's signal (:mod:`harness.preemption`) leaves the
snapshot of the step where all processes stopped instead of
``model_final.npz``, and its summary says ``'preempted': True``.
"""
import functools
import math
import os
import sys
import time

import chainerkfac  # NOQA  (before chainer: NumPy-2 compatibility shims)
import chainer
import chainermn
import numpy
from chainer import training
from chainer.training import extensions

import augment
import config as config_module
import models
from chainerkfac import graphs
from chainerkfac import training as kfac_training
from chainerkfac.training import FisherDiffLog, TimeToAccuracy
from harness import data as data_module
from harness import evaluation, preemption, resume, run_dir, snapshots
from harness import triggers
from harness.tuning import cudnn_tuning
from harness.mpi import raise_together
from harness.updater import AugmentedUpdater, BatchConverter

OPTIMIZERS = ('kfac', 'sgd', 'lars')
#: LARS's base learning rate and momentum at a batch of 32K per momentum
#: form (seed 002, Table 1: 72.8 epochs scaled, 64 unscaled).
LARS_TABLE1 = {'scaled': (31.2, 0.9), 'unscaled': (29.0, 0.929)}
#: Their warm-up epochs (Table 1: 25 with m = 0.9, 18 in the record row).
LARS_TABLE1_WARMUP = {'scaled': 25.0, 'unscaled': 18.0}
#: Goyal et al.'s warm-up of momentum SGD, in epochs.
SGD_WARMUP = 5.0


def build_optimizer(name, cfg, comm, acc_iters, args, use_graphs=False,
                    previous=None):
    """The optimizer and its learning-rate schedule extension. With CUDA
    graphs (``use_graphs``: one process, :func:`cuda_graphs`) K-FAC keeps its
    local transport and the baselines get no communicator, so that their
    steps can be replayed (:mod:`chainerkfac.graphs`). ``previous``: the
    ``config.json`` of the run a resume continues (:func:`baseline_settings`).
    """
    distributed = not use_graphs
    if name == 'kfac':
        optimizer = chainerkfac.optimizers.KFAC(
            acc_iters=acc_iters, fisher_diff=args.fisher_diff,
            verbose=comm.rank == 0, seed=args.seed + comm.rank,
            shard_update=args.shard_update,
            **config_module.kfac_options(cfg))
        if distributed:
            optimizer = chainerkfac.create_multi_node_optimizer(optimizer,
                                                                comm)
        schedule = kfac_training.PolynomialLRDecay(
            cfg.lr, cfg.p_decay, cfg.e_start, cfg.e_end,
            momentum_init=cfg.momentum)
        return optimizer, schedule
    settings = baseline_settings(name, cfg, args, previous)
    lr, momentum = settings['lr'], settings['momentum']
    if name == 'sgd':
        # Chainer's MomentumSGD, its update in multi-tensor kernels on the
        # GPU (the same steps; on the CPU bit for bit)
        actual = chainerkfac.optimizers.FusedMomentumSGD(lr=lr,
                                                         momentum=momentum)
    else:
        actual = chainerkfac.optimizers.LARS(
            lr=lr, momentum=momentum, weight_decay=settings['weight_decay'],
            eta=settings['eta'], momentum_form=settings['momentum_form'])
    # Driven like K-FAC: accumulation, averaging over processes (or the
    # sharded update) and the skipped-step guard are the optimizer's.
    optimizer = chainerkfac.optimizers.GuardedOptimizer(
        actual, acc_iters, comm if distributed else None,
        shard_update=args.shard_update)
    return optimizer, baseline_schedule(settings, cfg.epochs)


def baseline_schedule(settings, epochs):
    """A baseline's learning rate (:func:`baseline_settings`): a linear
    warm-up, then polynomial (power 2) decay to 0 at the run's end."""
    warmup = settings['warmup_epochs']
    # (a warm-up as long as the run never reaches the decay: warned about,
    # :func:`warmup_notice`)
    return kfac_training.LinearWarmupLR(
        settings['lr'], settings['warmup_start_lr'], warmup_epochs=warmup,
        decay=kfac_training.polynomial_decay(
            settings['lr'], 2.0, warmup, max(epochs, warmup) + 1e-6))


#: The share of the device's memory running mixup's partners may take
#: (both generations, :func:`mixup_memory`).
MIXUP_MEMORY_SHARE = 0.5


def mixup_memory(slots: int, batch: int, crop: int, device_bytes=None,
                 gpu: bool = False):
    """What running mixup holds, in words for the start-up line, or None
    without mixup (``slots`` 0). Each micro-batch slot of a step keeps its
    previous virtual batch (float32, ``batch × 3 × crop²``) — as the
    ``acc_iters`` times larger machine the accumulation mimics would, one
    per GPU — and while a step may still be undone (a skipped step) the
    generation before it too. Refused where both would take more than
    :data:`MIXUP_MEMORY_SHARE` of ``device_bytes`` (the GPU's memory): at
    131K on one H100 they were 79 GB, twice, found only by running out of
    memory."""
    if not slots:
        return None
    nbytes = slots * batch * 3 * crop * crop * 4
    words = ('{} partner batch{} (one per micro-batch slot of a step), {} '
             '{}, {} while a step may be undone; snapshots hold one '
             'generation'.format(
                 slots, '' if slots == 1 else 'es', _gigabytes(nbytes),
                 'on the GPU' if gpu else 'in memory',
                 _gigabytes(2 * nbytes)))
    if device_bytes and 2 * nbytes > MIXUP_MEMORY_SHARE * device_bytes:
        raise config_module.ConfigError(
            'alpha_mixup', 'running mixup would keep {} partner batches (one '
            'per micro-batch slot of a step), {} while a step may be undone, '
            'of the GPU\'s {} (over {:.0%}): use more processes (fewer '
            'micro-batches each), or --no-augment'.format(
                slots, _gigabytes(2 * nbytes), _gigabytes(device_bytes),
                MIXUP_MEMORY_SHARE), '<the run>')
    return words


def _gigabytes(nbytes: int) -> str:
    return '{:.2f} GB'.format(nbytes / 1e9) if nbytes >= 1e8 else \
        '{:.1f} MB'.format(nbytes / 1e6)


def _device_bytes(args):
    """The GPU's memory (``--gpu``), or None."""
    if not args.gpu:
        return None
    try:
        return int(chainer.backends.cuda.cupy.cuda.Device().mem_info[1])
    except Exception:                  # no device to ask: not checked
        return None


def warmup_notice(schedule, epochs: float):
    """A warning where a baseline's warm-up is not shorter than the run
    (Table 1's 18 or 25 epochs of LARS, made for 32K over 64-73 epochs,
    on a short run): its learning rate never reaches the peak and never
    decays. None where it does."""
    warmup = getattr(schedule, 'warmup_epochs', 0)
    if not warmup or warmup < epochs:
        return None
    last = schedule.values(epochs)['lr']
    return ('the learning rate warms up over {:g} epochs, not fewer than '
            "the run's {:g}: it ends at {:.4g}, {:.0%} of its peak {:.4g}, "
            'and never decays; --warmup-epochs sets the warm-up'.format(
                warmup, epochs, last, last / schedule.lr, schedule.lr))


def baseline_settings(name, cfg, args, previous=None):
    """The settings of a first-order baseline as the run resolves them
    from the config and the options (recorded under ``"run"`` in
    ``config.json``, where a resume compares them): Goyal et al.'s SGD, or
    LARS as in seed 002, with a linear warm-up then polynomial (power 2)
    decay to the last epoch. None for K-FAC (its settings are the
    config's).

    A resumed run continues with its own: ``previous`` (the run's
    ``config.json``) gives ``--baseline-lr``, ``--baseline-momentum`` and
    ``--warmup-epochs`` where they are not given again; a run of an earlier
    version, which recorded none, kept the defaults of its time (LARS warmed
    up over 5 epochs then, not Table 1's 25 or 18)."""
    if name == 'kfac':
        return None
    recorded = _recorded_baseline(previous)
    scale = cfg.global_batch_size / 256.0
    given = {'lr': args.baseline_lr, 'momentum': args.baseline_momentum,
             'warmup_epochs': args.warmup_epochs}
    if recorded:
        numbers = _numbers_only(recorded)
        given = {k: _given(v, numbers.get(k)) for k, v in given.items()}
    if name == 'sgd':
        lr = _given(given['lr'], 0.1 * scale)
        settings = {
            'lr': lr, 'momentum': _given(given['momentum'], 0.9),
            # Goyal et al.: from the learning rate of a batch of 256 (0.1
            # for the default) up to the scaled one; never down.
            'warmup_start_lr': lr / max(scale, 1.0),
            # a WeightDecay hook (attach_hooks)
            'weight_decay': args.weight_decay}
    else:
        # MLPerf-0.6 LARS at 32K (seed 002, Table 1), trust coefficient
        # 1e-3: scaled momentum with base LR 31.2 and momentum 0.9, unscaled
        # with 29.0 and 0.929; scaled linearly to other batch sizes.
        form = cfg.lars_momentum     # --lars-momentum applied already
        base_lr, base_momentum = LARS_TABLE1[form]
        lr = _given(given['lr'], base_lr * cfg.global_batch_size / 32768)
        settings = {
            'lr': lr, 'momentum': _given(given['momentum'], base_momentum),
            'warmup_start_lr': lr / 100.0,
            'weight_decay': args.weight_decay, 'eta': 1e-3,
            'momentum_form': form}
    old_version = previous is not None and recorded is None
    settings['warmup_epochs'] = _given(
        given['warmup_epochs'],
        SGD_WARMUP if name == 'sgd' or old_version else
        LARS_TABLE1_WARMUP[form])
    return settings


def _recorded_baseline(previous):
    """The ``"run"`` → ``"baseline"`` settings of a ``config.json`` (a
    dict), or None."""
    facts = previous.get('run') if isinstance(previous, dict) else None
    recorded = facts.get('baseline') if isinstance(facts, dict) else None
    return recorded if isinstance(recorded, dict) else None


def _numbers_only(recorded):
    return {k: v for k, v in recorded.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _given(value, default):
    """An option's value, or ``default`` if it was not given (0 is a value:
    ``--baseline-momentum 0`` is plain SGD)."""
    return default if value is None else value


def cuda_graphs(mode, gpu, n_processes, acc_iters, cudnn_serves):
    """Whether the steps are replayed as CUDA graphs, and why (the
    start-up line). ``mode`` is ``--cuda-graphs``: ``'auto'`` turns them on
    where :mod:`chainerkfac.graphs` captures the whole step (``--gpu``, one
    process, no accumulation, convolutions on cuDNN: Chainer's own im2col
    path calls CuPy's cuBLAS, which CuPy refuses during a capture),
    ``'off'`` never, ``'on'`` or refuses.

    Raises
    ------
    ValueError
        With ``mode='on'`` where the steps cannot be captured, saying why.
    """
    if mode == 'off':
        return False, 'off (--cuda-graphs off)'
    why_not = None
    if not gpu:
        why_not = 'no --gpu'
    elif n_processes > 1:
        why_not = ('the steps of {} processes are not captured yet (their '
                   'collectives and the agreement on a skipped step)'
                   .format(n_processes))
    elif acc_iters > 1:
        why_not = ('a step of {} accumulated micro-batches is not captured '
                   'yet'.format(acc_iters))
    elif not cudnn_serves:
        why_not = ("cuDNN does not serve Chainer (see the cuDNN line), and "
                   "Chainer's im2col convolutions call CuPy's cuBLAS, "
                   'which a capture refuses')
    if why_not is None:
        return True, 'on (steady-state steps replayed; --cuda-graphs off ' \
                     'for eager steps)'
    if mode == 'on':
        raise ValueError('--cuda-graphs: ' + why_not + '; use '
                         '--cuda-graphs auto or off')
    return False, 'off: ' + why_not


def attach_hooks(name, optimizer, args):
    """Weight decay of the SGD baseline (LARS has its own: it enters the
    trust ratio and leaves out biases and BN)."""
    if name == 'sgd':
        optimizer.add_hook(chainer.optimizer_hooks.WeightDecay(
            args.weight_decay))


def observers(optimizer, name, images_per_iteration):
    """Values logged per epoch besides loss and accuracy, with their
    triggers: the optimizer's values after each step (an epoch's entry,
    written at the end of the step in which the epoch ended
    (:class:`harness.triggers.EpochEnd`), is their mean over the steps
    since the last entry, the same for any number of processes), the
    throughput every iteration."""
    at_steps = triggers.StepBoundary()
    out = [(extensions.observe_lr(), at_steps),
           (extensions.observe_value('momentum',
                                     lambda t: optimizer.momentum), at_steps)]
    if name == 'kfac':
        # the values the step took (after it, the optimizer holds the next
        # step's: eq. 16's damping, eqs. 22-23's intervals)
        out.append((extensions.observe_value(
            'damping', lambda t: optimizer.last_step['damping']), at_steps))
        for kind in ('A', 'G', 'F'):
            out.append((extensions.observe_value(
                'refresh_interval_' + kind,
                lambda t, k=kind: optimizer.last_step[k]), at_steps))

    def images_per_sec(trainer):
        elapsed = trainer.elapsed_time
        return (trainer.updater.iteration * images_per_iteration / elapsed
                if elapsed > 0 else 0.0)
    out.append((extensions.observe_value('images_per_sec', images_per_sec),
                triggers.every_iteration))
    return out


def _save_final_model(out, network, stopped=None):
    """``model_final.npz`` (rank 0), whole or not at all. ``stopped``: the
    failure that ended the run early; the weights are saved anyway (the
    file is small and may fit where a snapshot did not)."""
    path = os.path.join(out, run_dir.MODEL_FINAL_FILE)
    try:
        snapshots.save_npz_atomic(path, network)
    except OSError as error:
        if stopped is None:
            raise
        print('could not write {} either: {}'.format(path, error),
              file=sys.stderr, flush=True)
        return
    print('wrote {}{}'.format(path, '' if stopped is None else (
        ' (the weights where the run stopped: {})'.format(stopped))),
        flush=True)


def _report_stop(stop, out, updater):
    """Rank 0's account of a run stopped by a signal, its snapshot
    written (times from this process's clock)."""
    now = time.monotonic()
    timing = 'the snapshot written {:.2f} s after the step boundary'.format(
        now - stop.stopped_at)
    if stop.received is not None:
        timing = '{:.2f} s from the signal to the step boundary, {}'.format(
            stop.stopped_at - stop.received_at, timing)
    print('stopped by {}{} at the end of step {} (iteration {}, epoch '
          '{:.4f}): {} written; {}. Exit status {}: continue with --resume '
          'latest'.format(
              stop.stopping.name, '' if stop.received is not None else
              ' (received by another process)', updater.steps,
              updater.iteration, updater.epoch_detail,
              os.path.join(out, snapshots.SNAPSHOT_PREFIX.format(
                  step=updater.steps)), timing, preemption.RESUME_STATUS),
          flush=True)


def train(args, comm, optimizer_name, out, cfg, stop=None):
    """Train one model; return a summary dict (on every process).

    The model and the optimizer are built first, and a snapshot to resume
    from (or weights to start from) is checked against them before
    anything in ``out`` is written; then ``out`` is locked for the run
    (see :mod:`harness.run_lock`) and an earlier run's files there are
    refused or, with ``--overwrite``, removed.

    Parameters
    ----------
    args : argparse.Namespace
        ``train_imagenet.py``'s options.
    comm : ChainerMN communicator
    optimizer_name : str
        ``'kfac'``, ``'sgd'`` or ``'lars'``.
    out : str
        The run directory.
    cfg : config.TrainConfig
    stop : harness.preemption.StopRequest or None
        Installed for the signals that stop the run at the next step
        boundary, snapshotted (see :mod:`harness.preemption`); the summary
        then has ``'preempted': True``.
    """
    acc_iters = cfg.acc_iters(comm.size)
    n_class = args.n_class or cfg.n_class
    kfac = optimizer_name == 'kfac'
    use_graphs, graphs_why = cuda_graphs(
        args.cuda_graphs, args.gpu, comm.size, acc_iters,
        args.gpu and chainer.backends.cuda.cudnn_enabled)
    check_replay_refresh_steps(args.replay_refresh_steps, kfac, use_graphs,
                               graphs_why)
    workspace, timed, tuning_words = cudnn_tuning(
        args.cudnn_workspace, args.cudnn_autotune, use_graphs)
    if args.gpu:
        if workspace is not None:
            chainer.backends.cuda.set_max_workspace_size(workspace)
        chainer.global_config.autotune = timed
    if kfac:
        config_module.check_epochs(
            cfg, args.config, None if args.epochs is None else '--epochs')
    numpy.random.seed(args.seed)   # same initial weights on every rank
    model = models.SoftLabelClassifier(models.build_model(
        args.arch, n_class, args.depth, args.width))
    device = chainer.get_device(
        '@cupy:{}'.format(comm.intra_rank) if args.gpu else '@numpy')
    device.use()
    # before the data are read (the device's own memory: after use())
    mixup_words = mixup_memory(
        acc_iters if cfg.alpha_mixup and not args.no_augment else 0,
        cfg.batch_size_per_process, args.crop_size, _device_bytes(args),
        args.gpu)
    model.to_device(device)
    # the run a resume continues: its settings where not given again, and
    # what the resume changes of them (said later)
    previous = run_dir.read_config(
        resume.snapshot_directory(args.resume, out)) if args.resume else None
    optimizer, schedule = build_optimizer(optimizer_name, cfg, comm,
                                          acc_iters, args, use_graphs,
                                          previous)
    optimizer.setup(model)
    attach_hooks(optimizer_name, optimizer, args)
    notice = None if kfac else warmup_notice(schedule, cfg.epochs)
    if notice and comm.rank == 0:
        resume.warn(notice)
    resumed = resume.starting_point(
        comm, out, model, optimizer, optimizer_name, args.resume,
        args.init_weights_from, lars_momentum=cfg.lars_momentum
        if optimizer_name == 'lars' else None)
    if comm.rank == 0:
        print('cuDNN: {}'.format(chainerkfac.cudnn.describe()), flush=True)
        if use_graphs and kfac:
            graphs_why += (
                "; K-FAC's refresh steps replayed too but for their "
                'inverse stage (--replay-refresh-steps {})'.format(
                    args.replay_refresh_steps)
                if replay_refresh_steps(args) else
                "; K-FAC's refresh steps eager (--replay-refresh-steps "
                'off)')
        print('CUDA graphs: {}'.format(graphs_why), flush=True)
        if mixup_words:
            print('running mixup: {}'.format(mixup_words), flush=True)
        if args.gpu:
            print('cuDNN convolutions: {}'.format(tuning_words), flush=True)
    if not kfac:
        comm.bcast_data(model)
    lock = run_dir.claim(
        comm, out, args.overwrite, mean_is_output=args.mean is None,
        source=resumed[1][0] if resumed else args.init_weights_from,
        continues=bool(resumed))
    try:
        return _train(args, comm, optimizer_name, out, cfg, acc_iters, model,
                      device, optimizer, schedule, resumed,
                      stop or preemption.StopRequest(()), use_graphs,
                      previous)
    finally:
        if lock is not None:
            lock.release()


def _say_config_changes(cfg, previous, prefix, facts, optimizer_name):
    """Print what a resume changes of the settings of the run it continues
    (``previous``: the ``config.json`` beside the snapshot ``prefix``;
    this run's is then written into ``--out``): a resume with ``--epochs
    120`` of a 90-epoch SGD run moves its learning-rate decay's end."""
    changed = run_dir.config_changes(cfg, previous, facts)
    if not changed:
        return
    print('resuming with settings other than those of {}:\n  {}'.format(
        os.path.join(os.path.dirname(os.path.abspath(prefix)),
                     run_dir.CONFIG_FILE), '\n  '.join(changed)),
        flush=True)
    if optimizer_name != 'kfac' and any(
            line.startswith('epochs:') for line in changed):
        print('  (the learning rate decays to 0 at the run\'s last epoch: '
              'from here on it follows the decay to epoch {})'.format(
                  cfg.epochs), flush=True)


def check_resumed_epochs(iterator, epochs: int, source=None,
                         from_option: bool = False) -> None:
    """Refuse to resume a run past its end: a snapshot at epoch 1.52
    resumed with ``--epochs 1`` "finished" at once, wrote the weights of
    epoch 1.52 as the final model of a 1-epoch run and rewrote the run's
    config. A run ends at the first step boundary at or past ``epochs``
    (its last step may straddle it): refused where the step before the
    snapshot's had reached ``epochs`` already.

    Parameters
    ----------
    iterator : augment.GlobalBatchIterator
        At the snapshot's position.

    Raises
    ------
    config.ConfigError
        With both numbers.
    """
    before = augment.epochs_at(
        max(iterator.chunks - iterator.chunks_per_step, 0),
        iterator.batch_size, iterator.n_examples)
    if before >= epochs:
        raise config_module.ConfigError(
            'epochs', 'the snapshot resumed is at epoch {:.4f}, past the '
            "run's end at epoch {}{}: resume with at least {} epochs, or "
            'start a new run in another --out'.format(
                iterator.epoch_detail, epochs,
                ' (--epochs on the command line)' if from_option else '',
                math.floor(before) + 1),
            source or '<TrainConfig>')


def check_replay_refresh_steps(mode: str, kfac: bool, use_graphs: bool,
                               graphs_why: str) -> None:
    """Refuse ``--replay-refresh-steps on`` for a K-FAC run that CUDA
    graphs do not replay (``--cuda-graphs auto`` turned them off: several
    processes, accumulation, no cuDNN), as ``--cuda-graphs on`` refuses;
    ``auto`` says nothing (the start-up line says why the graphs are
    off).

    Raises
    ------
    ValueError
        Saying why the graphs are off.
    """
    if mode == 'on' and kfac and not use_graphs:
        raise ValueError('--replay-refresh-steps on: CUDA graphs are {}; use '
                         '--replay-refresh-steps auto or off'.format(
                             graphs_why))


def replay_refresh_steps(args) -> bool:
    """Whether a K-FAC run that CUDA graphs replay replays its refresh
    steps too but for their inverse stage (``--replay-refresh-steps auto``
    or ``on``)."""
    return args.replay_refresh_steps != 'off'


def _train(args, comm, optimizer_name, out, cfg, acc_iters, model, device,
           optimizer, schedule, resumed, stop, use_graphs, previous=None):
    """The rest of :func:`train`, in the claimed run directory
    (``previous``: the ``config.json`` of the run resumed)."""
    batch = cfg.batch_size_per_process
    n_class = args.n_class or cfg.n_class
    kfac = optimizer_name == 'kfac'
    loaderjob = args.loaderjob
    data = data_module.prepare(args, comm, out, n_class, loaderjob)
    stream = augment.TrainStream(
        data.train, args.resize, args.crop_size, args.seed, comm.size,
        comm.rank, batch, skip_bad=args.skip_bad_images)
    train_iter = augment.GlobalBatchIterator(
        stream, cfg.global_batch_size // batch, loaderjob)
    val_view = augment.EvalView(
        data.val, augment.share(len(data.val), comm.size, comm.rank),
        args.resize, args.crop_size)
    val_iter = augment.stream.make_loader(val_view, batch, loaderjob,
                                          repeat=False)
    augmenting = not args.no_augment
    converter = BatchConverter(data.mean, args.skip_bad_images,
                               labels_on_host=True)
    stepper = optimizer
    if use_graphs:
        # Only the updater steps through the graphs; snapshots, schedules
        # and observers see the optimizer itself.
        stepper = graphs.graphed(
            optimizer, refresh_steps=kfac and replay_refresh_steps(args))
    updater = AugmentedUpdater(
        train_iter, stepper, comm, acc_iters, cfg.epochs, converter,
        args.seed, cfg.alpha_mixup if augmenting else 0.0, n_class,
        augmenting, device)
    trainer = training.Trainer(updater, triggers.StopTrigger(cfg.epochs, stop),
                               out=out)
    trainer.extend(schedule, trigger=triggers.StepBoundary())
    # An epoch's evaluation and log entry come at the end of the step in
    # which it ended (the same weights on any number of processes).
    epoch_end = triggers.EpochEnd()
    # BN running statistics are per process; average them before evaluating.
    trainer.extend(chainermn.extensions.AllreducePersistent(model, comm),
                   trigger=epoch_end,
                   priority=training.extension.PRIORITY_WRITER + 1)
    trainer.extend(evaluation.GlobalMeanEvaluator(
        val_iter, model, comm, BatchConverter(
            data.mean, args.skip_bad_images, drop_bad=True), device),
        trigger=epoch_end)
    target = None
    if args.target_acc is not None:
        target = TimeToAccuracy(args.target_acc, write=comm.rank == 0,
                                trigger=epoch_end)
        trainer.extend(target)
    if kfac and args.fisher_diff:
        trainer.extend(FisherDiffLog(optimizer, comm=comm))
    elif args.fisher_diff and comm.rank == 0 and not args.demo:
        # one command line for several optimizers is fine; say so once
        print("--fisher-diff: Diff(t) of eq. (21) is K-FAC's; this "
              '--optimizer {} run writes no fisher_diff.jsonl'.format(
                  optimizer_name), flush=True)
    writer = snapshots.AtomicThreadWriter(
        args.compress_snapshots, facts=dict({
            'optimizer': optimizer_name,
            'shard_update': int(args.shard_update),
            # which run and rank wrote each file (resume.check_one_run)
            'id': resume.run_id(comm, resumed), 'rank': comm.rank}, **(
                {'lars_momentum': cfg.lars_momentum}
                if optimizer_name == 'lars' else {})))
    snapshots.extend_trainer(
        trainer, comm, writer, comm.rank, args.keep_snapshots,
        trigger=triggers.SnapshotTrigger(args.snapshot_every, comm, stop),
        name=snapshots.STEP_NAME)
    # Every process runs the observers and the LogReport (which averages
    # the training values over processes); rank 0 writes and prints.
    for observer, trigger in observers(optimizer, optimizer_name,
                                       batch * comm.size):
        trainer.extend(observer, trigger=trigger)
    trainer.extend(evaluation.log_report(
        comm, trigger=epoch_end,
        totals=lambda: {'bad_images_skipped': converter.skipped},
        micro_batches=updater.take_micro_batches))
    label = args.label or run_dir.label_of(optimizer_name, cfg)
    if comm.rank == 0:
        trainer.extend(evaluation.print_report(
            ['epoch', 'iteration', 'main/loss', 'main/accuracy',
             'validation/main/accuracy', 'lr', 'elapsed_time'],
            progress_bar=not args.no_progress), trigger=epoch_end)
        if not args.no_progress:
            trainer.extend(extensions.ProgressBar(update_interval=10))
        else:
            trainer.extend(evaluation.PlainProgress(cfg.epochs,
                                                    batch * comm.size))
    if resumed:
        # before config.json is rewritten: a refused resume leaves the
        # run's record as it was
        resume.load(comm, trainer, optimizer, updater, out, *resumed,
                    sharded=args.shard_update,
                    check=functools.partial(
                        check_resumed_epochs, epochs=cfg.epochs,
                        source=args.config,
                        from_option=args.epochs is not None))
    if comm.rank == 0:
        facts = run_dir.run_facts(
            optimizer_name, comm.size, acc_iters, batch, args.arch,
            args.depth, args.width, len(data.train), len(data.val), n_class,
            label, stream={'seed': args.seed, 'crop_size': args.crop_size,
                           'resize': args.resize,
                           'augment': not args.no_augment})
        settings = baseline_settings(optimizer_name, cfg, args, previous)
        if settings is not None:
            # the baseline's own (the config's lr and momentum are K-FAC's)
            facts['baseline'] = settings
        if resumed:
            _say_config_changes(cfg, previous, resumed[0], facts,
                                optimizer_name)
        run_dir.write_run_config(cfg, out, facts)
    start = time.time()
    try:
        trainer.run()
        snapshots.finish(comm, writer)
    except snapshots.SnapshotWriteError:
        # Rank 0 raises it (the others wait for the job's end).
        _save_final_model(out, model.predictor, stopped='epoch {:.4f}, '
                          'iteration {}'.format(updater.epoch_detail,
                                                updater.iteration))
        raise
    if stop.stopping is not None and not updater.finished:
        if comm.rank == 0:
            _report_stop(stop, out, updater)
        return {'optimizer': optimizer_name, 'preempted': True,
                'epoch_detail': updater.epoch_detail,
                'iteration': updater.iteration,
                'elapsed_time': time.time() - start}
    if comm.rank == 0:
        _save_final_model(out, model.predictor)
    comm.mpi_comm.Barrier()
    summary = {'optimizer': optimizer_name, 'epochs': updater.epoch,
               'elapsed_time': time.time() - start,
               'reached': target.reached if target else None}
    if use_graphs:
        # eager / captured / replayed steps, and why a step ran eagerly
        summary['cuda_graphs'] = dict(stepper.stats)
        stepper.close()     # the graph's memory, for a next run (the demo)
    if comm.rank == 0:
        log = run_dir.load_log(out)
        accuracies = [e.get('validation/main/accuracy') for e in log]
        measured = [a for a in accuracies if a is not None]
        summary['final_top1'] = accuracies[-1] if accuracies else None
        summary['best_top1'] = max(measured) if measured else None
    sys.stdout.flush()
    return summary


def resolve_config(args, comm):
    """The config of ``--config`` with ``--epochs`` and ``--lars-momentum``
    applied (the run's ``config.json`` says what it used), checked against
    the number of processes (every error raised once, naming the key)."""
    cfg, error = None, None
    try:
        cfg = config_module.load(args.config)
        overrides = {key: value for key, value in (
            ('epochs', args.epochs), ('lars_momentum', args.lars_momentum))
            if value is not None}
        if overrides:
            cfg = config_module.from_dict(
                dict(config_module.to_dict(cfg), **overrides),
                source=args.config)
        cfg.acc_iters(comm.size)   # raises with the numbers if impossible
        if args.gpu and cfg.inverse_method == 'cholesky_solve':
            raise ValueError(
                "{}: inverse_method 'cholesky_solve' runs on the CPU only; "
                "with --gpu use 'cholesky' or 'newton_schulz'".format(
                    args.config))
    except (OSError, ValueError) as e:
        error = e
    raise_together(comm, error)
    return cfg
