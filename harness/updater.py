"""The training updater: uint8 batches normalised on the device, running
mixup and random erasing drawn from the data stream's positions,
accumulation, and the end of the run.

One iteration is one micro-batch per process; an optimizer step takes
``acc_iters`` iterations and begins at iterations ``k · acc_iters``. Every
optimizer is driven through one path: ``optimizer.update(model, x, t)`` per
micro-batch, the optimizer accumulating, averaging over micro-batches and
processes, and skipping a non-finite step itself (K-FAC, and the
first-order baselines through :class:`chainerkfac.optimizers.
GuardedOptimizer`); the updater reads ``acc_iters``,
``pending_micro_batches`` and ``last_step_skipped`` from it.

Augmentation streams
--------------------
Running mixup (eqs. 9-10) keeps one stream per global micro-batch slot of a
step: chunk ``j`` of the global sample stream (:mod:`augment.stream`) mixes
with chunk ``j − P·a`` (the same slot of the previous step), on any number
of processes ``P`` with ``P·a`` chunks per step. λ of chunk ``j``, the
erasing rectangles of chunk ``j`` and, for K-FAC's Monte-Carlo Fisher, the
labels drawn for chunk ``j`` come from generators derived from ``(seed,
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
import re
import sys

import chainer
from chainer import training

import augment
from augment.stream import ERASING, MC_LABELS, MIXUP, stream_rng
from harness.evaluation import EmptyBatch

#: One unreadable image in a sample's message (a training sample's message
#: joins those of every image skipped for it with ``'; '``).
_BAD_IMAGE = re.compile(r'(.*?\(listed in .*?, line \d+\))(?:; |$)')


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
        (their messages are counted in :attr:`skipped`, and each image is
        reported on stderr the first time only, not every epoch); with
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
        self._reported = set()
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
                for image in _BAD_IMAGE.findall(message) or [message]:
                    if image not in self._reported:
                        self._reported.add(image)
                        print('skipping unreadable image: ' + image,
                              file=sys.stderr, flush=True)
            self.skipped += sum(m.count(' (listed in ') for m in messages)
            if self.drop_bad:
                batch = [example for example in batch if not example[2]]
                if not batch:
                    # Chainer's concat_examples: "batch is empty", an
                    # epoch's training lost to the last validation batch
                    raise EmptyBatch('every image of the batch is '
                                     'unreadable: ' + '; '.join(messages))
        x, t = chainer.dataset.concat_examples(
            [(image, label) for image, label, _ in batch])
        key = str(device)
        if key not in self._device_mean:
            self._device_mean[key] = None if self.mean is None else \
                device.send(self.mean)
        x = augment.normalize(device.send(x), self._device_mean[key])
        return x, (t if self.labels_on_host else device.send(t))


class AugmentedUpdater(training.updaters.StandardUpdater):
    """StandardUpdater with the paper's augmentation and a complete last
    step.

    Parameters
    ----------
    iterator : augment.GlobalBatchIterator
    optimizer : chainerkfac.optimizers.KFAC or GuardedOptimizer
        Anything with ``update(lossfun, *args)``, ``acc_iters``,
        ``pending_micro_batches``, ``last_step_skipped`` and
        ``flush_accumulation()``; on several processes whose run ends
        inside a micro-iteration, also ``flush_accumulation(n)`` and
        ``global_micro_batches`` (the step's micro-batches over all of
        them, as :meth:`KFAC.flush_accumulation
        <chainerkfac.optimizers.KFAC.flush_accumulation>`).
    comm : ChainerMN communicator
    acc_iters : int
        Micro-batches per step and process, as the run derived them; must
        be the optimizer's.
    stop_epoch : float
        The run ends at the iteration that reaches it (see
        :class:`harness.triggers.EpochLimit`).
    converter : BatchConverter
    seed : int
        Of the mixup, erasing and Monte-Carlo label draws.
    alpha_mixup : float
        0 disables running mixup.
    n_class : int
    erasing : bool
        Random erasing with zeros (p=0.5, the paper's ranges).
    device : chainer.backend.Device
    """

    def __init__(self, iterator, optimizer, comm, acc_iters, stop_epoch,
                 converter, seed, alpha_mixup, n_class, erasing, device):
        if optimizer.acc_iters != acc_iters:
            raise ValueError(
                'the optimizer accumulates {} micro-batches per step, the '
                'run {}: build it with acc_iters={}'.format(
                    optimizer.acc_iters, acc_iters, acc_iters))
        super().__init__(iterator, optimizer, converter=converter,
                         device=device)
        self.comm = comm
        self.acc_iters = acc_iters
        self.stop_epoch = stop_epoch
        main = self.get_iterator('main')
        self._end_chunk = augment.end_chunk(main.n_examples,
                                            main.batch_size, stop_epoch)
        self._micro_batches = 0     # this process's, since the last log
        self.seed = seed
        #: K-FAC's Monte-Carlo label sampler (draws from the stream), if
        #: the optimizer has one.
        self.labels = getattr(optimizer, 'label_sampler', None)
        n_slots = comm.size * acc_iters
        #: Running mixup of the slots this process feeds, by global slot.
        self.mixup = MixupStreams(
            {slot: augment.RunningMixup(alpha_mixup, n_class)
             for slot in range(comm.rank, n_slots, comm.size)}
            if alpha_mixup > 0 else {})
        self.erasing = augment.RandomErasing() if erasing else None
        #: True once the run has reached ``stop_epoch`` (last step complete).
        self.finished = False
        #: The iteration of a step whose skip flag is still to be read
        #: (:meth:`_after_step`), or None.
        self._unread = None

    @property
    def at_step_boundary(self):
        """True after the last micro-batch of a step (and before any)."""
        return self.iteration % self.acc_iters == 0

    @property
    def steps(self):
        """Optimizer steps taken, a final partial one included: global
        mini-batches, the same on any number of processes (snapshots are
        named by it)."""
        return -(-self.iteration // self.acc_iters)

    def update_core(self):
        iterator = self.get_iterator('main')
        first = iterator.chunks         # the micro-iteration's first chunk
        chunk = first + self.comm.rank
        batch = iterator.next()
        # The run ends at the chunk one process ends at: in the last
        # micro-iteration the processes past it take no micro-batch, and
        # the step averages over the others' (the step of one process
        # accumulating them all)
        mine = chunk < self._end_chunk
        if mine:
            x, t = self.converter(batch, self.device)
        if self.at_step_boundary:
            self.mixup.checkpoint()
        if mine:
            x, t = self._augmented(x, t, chunk)
        optimizer = self.get_optimizer('main')
        self._read_skipped()
        finished = iterator.epoch_detail >= self.stop_epoch
        pending = optimizer.pending_micro_batches
        total = None
        if finished and first + self.comm.size > self._end_chunk:
            total = self.comm.size * pending + (self._end_chunk - first)
        stepped = False
        if mine:
            self._micro_batches += 1
            stepped = pending + 1 == self.acc_iters
            if stepped and total is not None:
                optimizer.global_micro_batches = total
            optimizer.update(optimizer.target, x, t)
        if iterator.is_new_epoch:
            # after the update, as Chainer's StandardUpdater: a step decides
            # its refreshes (eqs. 22-23) at the epoch it starts in, as its
            # learning rate, however the global batch is split
            optimizer.new_epoch(auto=True)
        self._after_step(optimizer)
        self.finished = finished
        if finished and not stepped and (
                optimizer.pending_micro_batches or total):
            self._flush(optimizer, total)
        if self.finished:
            self._read_skipped()

    def take_micro_batches(self) -> int:
        """This process's micro-batches since the last call (the log's
        weight of its training loss and accuracy:
        :func:`harness.evaluation.average_over_processes`)."""
        count, self._micro_batches = self._micro_batches, 0
        return count

    def _augmented(self, x, t, chunk):
        """``(x, t)`` of this process's ``chunk``, converted: mixed,
        erased; K-FAC's Monte-Carlo labels drawn from its stream."""
        if self.mixup.streams:
            slot = chunk % (self.comm.size * self.acc_iters)
            x, t = self.mixup.streams[slot](
                x, t, rng=stream_rng(self.seed, MIXUP, chunk))
        t = self.device.send(t)
        if self.erasing is not None:
            x = self.erasing(x, rng=stream_rng(self.seed, ERASING, chunk))
        if self.labels is not None:
            self.labels.source = stream_rng(self.seed, MC_LABELS, chunk)
        return x, t

    def _after_step(self, optimizer):
        """Whether the step just taken was skipped: a skipped step must not
        leave its virtual batches as the next step's mixup partners, and
        it is reported. On the GPU the flag is on the device, and reading
        it waits for the step: without running mixup it is read before
        the next step instead (:meth:`_read_skipped`), once the next batch
        has been loaded and converted while the device ran this step."""
        if optimizer.pending_micro_batches:
            return
        self._unread = self.iteration + 1
        if self.mixup.streams:
            self._read_skipped()

    def _read_skipped(self):
        """Read the skip flag of the step :meth:`_after_step` left unread,
        if any."""
        if self._unread is None:
            return
        iteration, self._unread = self._unread, None
        if self.get_optimizer('main').last_step_skipped:
            self.mixup.restore()
            if self.comm.rank == 0:
                print('step at iteration {}: non-finite gradient, update '
                      'skipped (weights and BatchNormalization statistics '
                      'unchanged)'.format(iteration),
                      file=sys.stderr, flush=True)

    # -- the end ---------------------------------------------------------------
    def _flush(self, optimizer, total=None):
        """The final step of the micro-batches pending (``total``: over
        all processes, where they differ)."""
        done = optimizer.flush_accumulation() if total is None else \
            optimizer.flush_accumulation(total)
        self._after_step(optimizer)
        chainer.reporter.report({'trailing_micro_batches': float(done)})
        if self.comm.rank == 0:
            print('the run ends {} micro-batch{} into a step of {}{}: {} '
                  'a final step of {} own'.format(
                      done, '' if done == 1 else 'es', self.acc_iters,
                      '' if total is None else
                      ' on this process ({} over all {})'.format(
                          total, self.comm.size),
                      'it makes' if done == 1 else 'they make',
                      'its' if done == 1 else 'their'), flush=True)

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
