"""The training updater: uint8 batches normalised on the device, running
mixup and random erasing drawn from the data stream's positions,
accumulation, and the end of the run.

One iteration is one micro-batch per process; an optimizer step takes
``acc_iters`` iterations and begins at iterations ``k · acc_iters``. K-FAC
accumulates inside the optimizer; for the first-order baselines this
updater accumulates ``acc_iters`` backward passes, averages the gradients
over micro-batches and processes, and updates.

Augmentation streams
--------------------
Running mixup (eqs. 9-10) keeps one stream per global micro-batch slot of a
step: chunk ``j`` of the global sample stream (:mod:`augment.stream`) mixes
with chunk ``j − P·a`` (the same slot of the previous step), on any number
of processes ``P`` with ``P·a`` chunks per step. λ of chunk ``j`` and the
erasing rectangles of chunk ``j`` come from generators derived from ``(seed,
j)``, so the only augmentation state is the previous virtual batch of each
slot; it is saved with the process that owns the slot (``mixup/stream<g>``)
and, on a resume on another number of processes, read from whichever old
file holds it: the continued run mixes exactly as the uninterrupted one.

The end of the run
------------------
The iteration that reaches ``stop_epoch`` may fall inside a step. The
trailing micro-batches are then completed into a final step over those
micro-batches alone (``KFAC.flush_accumulation()``, or the same for the
baselines here), reported as ``trailing_micro_batches`` in the log and on
stdout; :attr:`finished` is then true, so that the last snapshot includes
that step.
"""
import sys

import chainer
from chainer import training
from chainer.backend import get_array_module

import augment
from augment.stream import ERASING, MIXUP, stream_rng
from chainerkfac.optimizers import KFAC


class BatchConverter(chainer.dataset.Converter):
    """``[(uint8 image, label, message), ...]`` → normalised float32 images
    on the device and int32 labels.

    Parameters
    ----------
    mean : numpy.ndarray or None
        ``(3, crop, crop)`` float32; sent to the device once.
    skip_bad : bool
        ``False``: a sample with a message (an unreadable image) raises
        :class:`OSError` with every such message of the batch.
        ``True``: training samples were already replaced by the loader
        (their messages are counted in :attr:`skipped`); with
        ``drop_bad=True`` (validation) they are dropped from the batch.
    drop_bad : bool
    labels_on_host : bool
        Leave the labels on the host (running mixup builds its one-hot
        rows from them without a device round trip).

    Attributes
    ----------
    skipped : int
        Unreadable images skipped so far (this process).
    """

    def __init__(self, mean, skip_bad=False, drop_bad=False,
                 labels_on_host=False):
        self.mean = mean
        self.skip_bad = skip_bad
        self.drop_bad = drop_bad
        self.labels_on_host = labels_on_host
        self.skipped = 0
        self._device_mean = {}

    def __call__(self, batch, device):
        messages = [m for _, _, m in batch if m]
        if messages:
            if not self.skip_bad:
                raise OSError('unreadable image{}: {} (use --skip-bad-images '
                              'to train without them)'.format(
                                  's' if len(messages) > 1 else '',
                                  '; '.join(messages)))
            for message in messages:
                print('skipping unreadable image: ' + message,
                      file=sys.stderr, flush=True)
            self.skipped += sum(m.count(' (listed in ') for m in messages)
            if self.drop_bad:
                batch = [example for example in batch if not example[2]]
        x, t = chainer.dataset.concat_examples(
            [(image, label) for image, label, _ in batch])
        key = str(device)
        if key not in self._device_mean:
            self._device_mean[key] = None if self.mean is None else \
                device.send(self.mean)
        x = augment.normalize(device.send(x), self._device_mean[key])
        return x, (t if self.labels_on_host else device.send(t))


class AugmentedUpdater(training.updaters.StandardUpdater):
    """StandardUpdater with the paper's augmentation, accumulation for the
    first-order baselines, and a complete last step.

    Parameters
    ----------
    iterator : augment.GlobalBatchIterator
    optimizer : chainerkfac.optimizers.KFAC or a Chainer optimizer
    comm : ChainerMN communicator
    acc_iters : int
        Micro-batches per step and process.
    stop_epoch : float
        The run ends at the iteration that reaches it (see
        :class:`harness.triggers.EpochLimit`).
    converter : BatchConverter
    seed : int
        Of the mixup and erasing draws.
    alpha_mixup : float
        0 disables running mixup.
    n_class : int
    erasing : bool
        Random erasing with zeros (p=0.5, the paper's ranges).
    device : chainer.backend.Device
    """

    def __init__(self, iterator, optimizer, comm, acc_iters, stop_epoch,
                 converter, seed, alpha_mixup, n_class, erasing, device):
        super().__init__(iterator, optimizer, converter=converter,
                         device=device)
        self.comm = comm
        self.acc_iters = acc_iters
        self.stop_epoch = stop_epoch
        self.seed = seed
        self.kfac = isinstance(optimizer, KFAC)
        n_slots = comm.size * acc_iters
        #: Running mixup of the slots this process feeds, by global slot.
        self.mixup = MixupStreams(
            {slot: augment.RunningMixup(alpha_mixup, n_class)
             for slot in range(comm.rank, n_slots, comm.size)}
            if alpha_mixup > 0 else {})
        self.erasing = augment.RandomErasing() if erasing else None
        #: True once the run has reached ``stop_epoch`` (last step complete).
        self.finished = False
        self._bn_state = None

    @property
    def at_step_boundary(self):
        """True after the last micro-batch of a step (and before any)."""
        return self.iteration % self.acc_iters == 0

    def update_core(self):
        iterator = self.get_iterator('main')
        chunk = iterator.chunks + self.comm.rank
        batch = iterator.next()
        x, t = self.converter(batch, self.device)
        if self.at_step_boundary:
            self.mixup.checkpoint()
        if self.mixup.streams:
            slot = chunk % (self.comm.size * self.acc_iters)
            x, t = self.mixup.streams[slot](
                x, t, rng=stream_rng(self.seed, MIXUP, chunk))
        t = self.device.send(t)
        if self.erasing is not None:
            x = self.erasing(x, rng=stream_rng(self.seed, ERASING, chunk))
        optimizer = self.get_optimizer('main')
        if iterator.is_new_epoch:
            optimizer.new_epoch(auto=True)
        if self.kfac:
            optimizer.update(optimizer.target, x, t)
            if _reported('kfac/skipped_step'):
                self.mixup.restore()
        else:
            self._accumulate(optimizer, x, t)
        self.finished = iterator.epoch_detail >= self.stop_epoch
        if self.finished and (self.iteration + 1) % self.acc_iters:
            self._flush(optimizer, (self.iteration + 1) % self.acc_iters)

    # -- the end ---------------------------------------------------------------
    def _flush(self, optimizer, pending):
        if self.kfac:
            done = optimizer.flush_accumulation()
        else:
            done = self._step(optimizer, pending)
        chainer.reporter.report({'trailing_micro_batches': float(done)})
        if self.comm.rank == 0:
            print('the run ends {} micro-batches into a step of {}: they '
                  'make a final step of their own'.format(
                      done, self.acc_iters), flush=True)

    # -- first-order baselines -------------------------------------------------
    def _accumulate(self, optimizer, x, t):
        model = optimizer.target
        if self.at_step_boundary:
            model.cleargrads()
            self._bn_state = _copy_persistents(model)
        model(x, t).backward()
        micro = self.iteration % self.acc_iters + 1
        if micro == self.acc_iters:
            self._step(optimizer, micro)

    def _step(self, optimizer, n_micro):
        """Average the gradients of ``n_micro`` micro-batches over them and
        the processes; update unless a gradient is not finite (then the
        weights and BatchNormalization's running statistics stay as they
        were before the step). Returns ``n_micro``."""
        model = optimizer.target
        if n_micro > 1:
            for param in model.params():
                if param.grad is not None:
                    param.grad /= n_micro
        self.comm.multi_node_mean_grad(model)
        finite = _grads_finite(model)
        if all(self.comm.mpi_comm.allgather(finite)):
            optimizer.update()
            skipped = 0.0
        else:
            _restore_persistents(model, self._bn_state)
            self.mixup.restore()
            skipped = 1.0
            if self.comm.rank == 0:
                print('step at iteration {}: non-finite gradient, update '
                      'skipped (weights and BatchNormalization statistics '
                      'unchanged)'.format(self.iteration + 1),
                      file=sys.stderr, flush=True)
        chainer.reporter.report({'skipped_step': skipped})
        return n_micro

    def serialize(self, serializer):
        """Chainer's (iterator, optimizer, model, iteration), the number of
        processes and the mixup streams. On load, the iteration follows
        from the iterator's global position, so a snapshot of another number
        of processes resumes at the same point of the stream."""
        super().serialize(serializer)
        serializer('n_processes', self.comm.size)
        self.converter.skipped = int(serializer('bad_images_skipped',
                                                self.converter.skipped))
        self.mixup.serialize(serializer['mixup'])
        if not isinstance(serializer, chainer.serializer.Serializer):
            self.iteration = self.get_iterator('main').position


class MixupStreams:
    """The running-mixup streams of one process, saved by global slot.

    A skipped (non-finite) step must not leave its virtual batches as the
    next step's partners (a NaN input would poison every later step of its
    slot): :meth:`restore` returns the streams to their :meth:`checkpoint`.
    """

    def __init__(self, streams):
        self.streams = streams
        self._saved = {}

    def checkpoint(self):
        self._saved = {slot: stream.state()
                       for slot, stream in self.streams.items()}

    def restore(self):
        for slot, state in self._saved.items():
            self.streams[slot].set_state(state)

    def serialize(self, serializer):
        for slot, stream in sorted(self.streams.items()):
            stream.serialize(serializer['stream{}'.format(slot)])


def _reported(key):
    """Whether ``key`` was reported as true in the current observation
    (e.g. K-FAC's ``kfac/skipped_step``)."""
    try:
        observation = chainer.reporter.get_current_reporter().observation
    except IndexError:              # no reporter (outside a Trainer)
        return False
    value = observation.get(key)
    return value is not None and bool(chainer.as_array(value))


def _grads_finite(model):
    flags = []
    for param in model.params():
        if param.grad is not None:
            xp = get_array_module(param.grad)
            flags.append(xp.isfinite(param.grad).all())
    return bool(all(bool(f) for f in flags))


#: Running statistics of BatchNormalization-like links.
_RUNNING_STATISTICS = ('avg_mean', 'avg_var', 'N')


def _copy_persistents(model):
    """Copies of the running statistics of every BatchNormalization-like
    link (any link with ``avg_mean`` and ``avg_var``)."""
    saved = {}
    for path, link in model.namedlinks():
        if hasattr(link, 'avg_mean') and hasattr(link, 'avg_var'):
            for name in _RUNNING_STATISTICS:
                value = getattr(link, name, None)
                if value is not None:
                    saved[(path, name)] = value.copy() \
                        if hasattr(value, 'copy') else value
    return saved


def _restore_persistents(model, saved):
    if not saved:
        return
    links = dict(model.namedlinks())
    for (path, name), value in saved.items():
        current = getattr(links[path], name)
        if hasattr(current, 'shape'):
            current[...] = value
        else:
            setattr(links[path], name, value)
