"""The training data as one global sample stream, the same on any number of
processes.

Why not ``chainermn.scatter_dataset``
-------------------------------------
``scatter_dataset`` gives every process a fixed shard (pickled and sent by
rank 0) that it shuffles on its own. The global mini-batches then depend on
the number of processes: a run cannot resume on another number of
processes and continue the same trajectory, and a 2-process run is not the
1-process run with twice the accumulation. Here instead:

* the stream is the concatenation of one seeded permutation of the whole
  list per epoch, ``π_0, π_1, ...``, cut into *chunks* of the per-process
  batch ``b`` (an epoch boundary may fall inside a chunk, as it falls inside
  a batch of Chainer's iterators);
* at its micro-iteration ``m``, rank ``r`` of ``P`` takes chunk ``m·P + r``;
  a K-FAC step of ``acc_iters = a`` micro-iterations covers chunks
  ``s·P·a ... (s+1)·P·a − 1``: the same global batch for every ``P`` with
  ``P·a`` fixed (the config's global batch);
* every random draw that shapes a sample is a function of its position in
  the stream (:func:`stream_rng`): the crop and flip of sample ``q``, the
  mixup λ and the erasing rectangles of chunk ``j`` — nothing to save, the
  same in loader processes and after a resume, on any ``P``.

Each process reads the list file itself (no pickled broadcast) and decodes
only its own chunks. The pieces extend Chainer's iterators rather than
replace them: :class:`TrainStream` is a dataset view (rank ``r``'s chunks in
order) that :class:`chainer.iterators.SerialIterator` or
:class:`~chainer.iterators.MultiprocessIterator` walks as usual; the thin
:class:`GlobalBatchIterator` around it counts epochs in samples of the global
stream and saves the position as a global chunk count, which any number of
processes can resume from.
"""
import os

import chainer
import numpy as np

from augment.image_list import load_image
from augment.transforms import crop_flip

#: Tags of the random streams derived from (seed, tag, position);
#: MC_LABELS: K-FAC's Monte-Carlo labels of a chunk.
PERMUTATION, CROP_FLIP, MIXUP, ERASING, MC_LABELS = 0, 1, 2, 3, 4
#: Length of the endless stream view (positions; nothing is allocated).
STREAM_LENGTH = 2 ** 50


def stream_rng(seed, tag, position):
    """The generator of one position of the stream.

    Parameters
    ----------
    seed : int
        The run's seed.
    tag : int
        :data:`PERMUTATION` (position = epoch), :data:`CROP_FLIP` (position
        = sample), :data:`MIXUP`, :data:`ERASING` or :data:`MC_LABELS`
        (position = chunk).
    position : int

    Returns
    -------
    numpy.random.Generator
    """
    return np.random.default_rng([int(seed), int(tag), int(position)])


def unbind_from_single_core():
    """Let a loader process run on every core if it inherited a binding to
    one core (``mpiexec`` binds each rank to a core by default when there
    are at most 2 ranks per node); a rank bound to several cores keeps
    them for its loaders."""
    try:
        if len(os.sched_getaffinity(0)) == 1 and (os.cpu_count() or 1) > 1:
            os.sched_setaffinity(0, range(os.cpu_count()))
    except (AttributeError, OSError):   # not Linux, or not permitted
        pass


class _LoaderView(chainer.dataset.DatasetMixin):
    """Decode images of an :class:`~augment.ImageList`; never raise in a
    loader process (a worker that raises leaves ``MultiprocessIterator``
    waiting forever): an unreadable image comes back as a message.
    """

    def __init__(self, images, resize):
        self.images = images
        self.resize = resize
        self._pid = os.getpid()

    @property
    def example_bytes(self):
        """Bytes of the arrays of one example (a uint8 crop), for the
        loaders' shared memory (given, the first batch need not be decoded
        in this process to measure it)."""
        return 3 * self.crop_size * self.crop_size

    def _decode(self, i):
        """``(uint8 image or None, message)`` of list entry ``i``."""
        if os.getpid() != self._pid:       # first call in a loader process
            self._pid = os.getpid()
            unbind_from_single_core()
        try:
            return load_image(self.images.path(i), self.resize), ''
        except OSError as error:
            return None, '{} (listed in {}, line {})'.format(
                error, self.images.list_path, int(self.images.lines[i]))


class IndexedView(_LoaderView):
    """The list entries ``indices``, decoded and cut to ``crop_size``
    (subclasses say how)."""

    def __init__(self, images, indices, resize, crop_size):
        super().__init__(images, resize)
        self.indices = np.asarray(indices, dtype=np.int64)
        self.crop_size = crop_size

    def __len__(self):
        return len(self.indices)


class TrainStream(_LoaderView):
    """Rank ``rank``'s share of the global sample stream, as a dataset view.

    ``view[k]`` is the ``k % b``-th sample of the rank's ``offset + k // b``-th
    micro-batch, i.e. of chunk ``j = (offset + k // b)·P + rank``, stream
    position ``q = j·b + k % b``: image ``π_e[q mod N]`` of epoch
    ``e = q // N``, cropped and flipped by ``stream_rng(seed, CROP_FLIP,
    q)``.

    Parameters
    ----------
    images : augment.ImageList
        The whole training list (every process holds it).
    resize, crop_size : int
        Resize (ignoring aspect) then crop, as in section 4.1.
    seed : int
    n_processes, rank : int
    batch_size : int
        Samples per process per micro-batch (``b``).
    skip_bad : bool
        An unreadable image is replaced by the next readable image of the
        epoch's permutation (the batch keeps its size; the message says
        what was skipped) instead of being reported as an error.

    Notes
    -----
    Examples are ``(image, label, message)``: uint8 ``(3, crop, crop)``,
    int32, and ``''`` or the error (``skip_bad=False``: the image is zeros
    and the converter raises) or skip notice (``skip_bad=True``).
    """

    def __init__(self, images, resize, crop_size, seed, n_processes, rank,
                 batch_size, skip_bad=False):
        super().__init__(images, resize)
        if len(images) == 0:
            raise ValueError('the training list {} is empty'.format(
                images.list_path))
        self.crop_size = crop_size
        self.seed = seed
        self.n_processes = n_processes
        self.rank = rank
        self.batch_size = batch_size
        self.skip_bad = skip_bad
        #: Micro-iterations of this rank before ``view[0]``.
        self.offset = 0
        self._permutations = {}

    def __len__(self):
        return STREAM_LENGTH

    def permutation(self, epoch):
        """π_epoch (cached for the two latest epochs)."""
        if epoch not in self._permutations:
            if len(self._permutations) >= 2:
                del self._permutations[min(self._permutations)]
            self._permutations[epoch] = stream_rng(
                self.seed, PERMUTATION, epoch).permutation(len(self.images))
        return self._permutations[epoch]

    def stream_position(self, k):
        """Stream position ``q`` of ``view[k]``."""
        micro, i = divmod(k, self.batch_size)
        chunk = (self.offset + micro) * self.n_processes + self.rank
        return chunk * self.batch_size + i

    def get_example(self, k):
        q = self.stream_position(k)
        epoch, pos = divmod(q, len(self.images))
        order = self.permutation(epoch)
        index = int(order[pos])
        image, message = self._decode(index)
        skipped = []
        while image is None and self.skip_bad:
            skipped.append(message)
            if len(skipped) == len(order):
                raise OSError('no readable image in {}'.format(
                    self.images.list_path))
            pos = (pos + 1) % len(order)
            index = int(order[pos])
            image, message = self._decode(index)
        if image is None:
            image = np.zeros((3, self.crop_size, self.crop_size), np.uint8)
        else:
            image = crop_flip(image, self.crop_size,
                              stream_rng(self.seed, CROP_FLIP, q))
            message = '; '.join(skipped)
        return image, self.images.labels[index], message


class EvalView(IndexedView):
    """Centre crops of the entries ``indices`` of a list (a process's share
    of the validation list).

    Examples are ``(image, label, message)`` as for :class:`TrainStream`;
    an unreadable image is zeros with its error as the message (the
    converter raises, or drops it with ``--skip-bad-images``).
    """

    def get_example(self, k):
        index = int(self.indices[k])
        image, message = self._decode(index)
        if image is None:
            image = np.zeros((3, self.crop_size, self.crop_size), np.uint8)
        else:
            image = crop_flip(image, self.crop_size)
        return image, self.images.labels[index], message


def make_loader(dataset, batch_size, loaderjob, repeat=True):
    """Chainer's iterator over a view, in order: serial (``loaderjob`` 0) or
    with ``loaderjob`` loader processes."""
    if loaderjob > 0:
        return chainer.iterators.MultiprocessIterator(
            dataset, batch_size, repeat=repeat, shuffle=False,
            n_processes=loaderjob,
            shared_mem=getattr(dataset, 'example_bytes', None))
    return chainer.iterators.SerialIterator(dataset, batch_size,
                                            repeat=repeat, shuffle=False)


def epochs_at(chunks: int, batch_size: int, n_examples: int) -> float:
    """Epochs of the global stream after ``chunks`` chunks (all
    processes' together) of ``batch_size`` samples."""
    return chunks * batch_size / n_examples


def end_chunk(n_examples: int, batch_size: int, stop_epoch: float) -> int:
    """The global chunk count at which a run of ``stop_epoch`` epochs ends
    on one process: the first ``c`` whose :func:`epochs_at` reaches it
    (the epoch count :class:`GlobalBatchIterator` reports)."""
    c = max(int(stop_epoch * n_examples / batch_size) - 2, 0)
    while epochs_at(c, batch_size, n_examples) < stop_epoch:
        c += 1
    return c


class GlobalBatchIterator(chainer.dataset.Iterator):
    """The training iterator of one process: its chunks of the global stream,
    epochs counted in samples of the whole stream.

    Parameters
    ----------
    stream : TrainStream
    chunks_per_step : int
        Chunks per optimizer step over all processes (global batch / b):
        snapshots lie at step boundaries, and a resumed position is rounded
        up to one.
    loaderjob : int
        Loader processes (0: decode in this process).

    Notes
    -----
    Every process sees the same ``epoch``, ``epoch_detail`` and
    ``is_new_epoch`` after its ``m``-th batch: those of the ``m·P·b``
    samples all processes have taken together. An epoch ends at the
    micro-iteration that reaches its last sample. The state is the global
    chunk count (``'chunks'``), so a snapshot resumes on any number of
    processes that divides the step.
    """

    def __init__(self, stream, chunks_per_step, loaderjob=0):
        self.stream = stream
        self.chunks_per_step = chunks_per_step
        self.loaderjob = loaderjob
        self.batch_size = stream.batch_size
        self.n_examples = len(stream.images)
        #: Micro-iterations this process has taken.
        self.position = 0
        #: Chunks skipped by the rounding of a resumed position (reported).
        self.skipped_chunks = 0
        self._digests = None
        self._loader = None
        self._restart(0)

    def _restart(self, position):
        if self._loader is not None:
            self._loader.finalize()
        self.position = position
        self.stream.offset = position
        self._loader = make_loader(self.stream, self.batch_size,
                                   self.loaderjob)

    def __next__(self):
        batch = self._loader.next()
        self.position += 1
        return batch

    next = __next__

    @property
    def chunks(self):
        """Chunks all processes have taken together."""
        return self.position * self.stream.n_processes

    def _samples(self, position):
        return position * self.stream.n_processes * self.batch_size

    @property
    def epoch(self):
        return self.epoch_at(self.position)

    def epoch_at(self, position):
        """The epoch count after this process's ``position``-th batch."""
        return self._samples(position) // self.n_examples

    @property
    def epoch_detail(self):
        return epochs_at(self.chunks, self.batch_size, self.n_examples)

    @property
    def previous_epoch_detail(self):
        return self._samples(max(self.position - 1, 0)) / self.n_examples

    @property
    def is_new_epoch(self):
        return self.position > 0 and self.epoch > \
            self._samples(self.position - 1) // self.n_examples

    def reset(self):
        self._restart(0)

    def finalize(self):
        if self._loader is not None:
            self._loader.finalize()

    def serialize(self, serializer):
        chunks = int(serializer('chunks', self.chunks))
        batch = int(serializer('batch_size', self.batch_size))
        per_step = int(serializer('chunks_per_step', self.chunks_per_step))
        n_examples = int(serializer('n_examples', self.n_examples))
        # Absent from snapshots of earlier versions (then this run's own).
        if self._digests is None:
            self._digests = self.stream.images.digests()
        digests = self._digests
        stored = tuple(str(serializer(key, value)) for key, value in
                       zip(('list_paths_sha256', 'list_labels_sha256'),
                           digests))
        if isinstance(serializer, chainer.serializer.Serializer):
            return
        if (batch, per_step, n_examples) != (
                self.batch_size, self.chunks_per_step, self.n_examples):
            # (the global batch, the config's global_batch_size, is
            # chunks per step × samples per chunk)
            raise ValueError(
                'the snapshot was taken with {} samples per process per '
                'micro-batch, {} chunks per step (global_batch_size {}) and '
                '{} training images; this run has {}, {} (global_batch_size '
                '{}) and {}: resume with the same config (its '
                'global_batch_size and batch_size_per_process) and list'
                .format(batch, per_step, batch * per_step, n_examples,
                        self.batch_size, self.chunks_per_step,
                        self.batch_size * self.chunks_per_step,
                        self.n_examples))
        if stored != digests:
            changed = ' and '.join(what for what, old, new in zip(
                ('the paths or their order', 'the labels'), stored, digests)
                if old != new)
            raise ValueError(
                'the training list {} has the snapshot\'s {} images, but {} '
                'differ from the list the snapshot was trained on: the '
                'position resumed would not be the same images; resume with '
                'the same list, or start a new run from these weights with '
                '--init-weights-from'.format(self.stream.images.list_path,
                                             n_examples, changed))
        # A run that ended with a flushed partial step stopped between step
        # boundaries: continue at the next one (the chunks of the rest of
        # that step are skipped).
        rounded = -(-chunks // per_step) * per_step
        self.skipped_chunks = rounded - chunks
        self._restart(rounded // self.stream.n_processes)
