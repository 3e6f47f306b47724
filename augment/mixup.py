"""Running mixup, eqs. (9)-(10) of the paper (section 4.1).

Each step mixes the raw batch with the *virtual* batch of the previous step,
not with another raw batch::

    x̃(t) = λ x(t) + (1 − λ) x̃(t−1)
    ỹ(t) = λ y(t) + (1 − λ) ỹ(t−1),      λ ~ Beta(α_mixup, α_mixup)

Sample ``i`` of a batch is mixed with sample ``i`` of the previous virtual
batch; one λ is drawn per step. The first batch has no partner and is
returned unmixed.

The partner is state of one *data stream*: make one :class:`RunningMixup`
per process and per accumulation micro-batch slot
(:func:`running_mixup_streams`), so that micro-batch ``j`` of a step mixes
with micro-batch ``j`` of the previous step, as it would on the
``acc_iters`` times larger machine the accumulation mimics.
"""
import numpy as np
from chainer import backend

from augment.random_state import ProcessLocalRNG


class RunningMixup:
    """Running mixup of one data stream.

    Parameters
    ----------
    alpha : float
        ``α_mixup > 0``: λ is drawn from ``Beta(alpha, alpha)``.
    n_class : int
        Number of classes of the one-hot / soft labels.
    seed : int, numpy.random.SeedSequence or None
        Seed of the λ draws (see
        :class:`augment.random_state.ProcessLocalRNG`). Give each process
        (rank) its own seed.

    Attributes
    ----------
    last_lambda : float or None
        λ of the last call (1.0 for an unmixed first batch), ``None`` before
        the first call or after :meth:`reset`.
    """

    def __init__(self, alpha, n_class, seed=None):
        if not alpha > 0:
            raise ValueError('alpha of running mixup must be positive, got {}'
                             .format(alpha))
        if int(n_class) != n_class or n_class < 1:
            raise ValueError('n_class must be a positive int, got {}'
                             .format(n_class))
        self.alpha = float(alpha)
        self.n_class = int(n_class)
        self._rng = ProcessLocalRNG(seed)
        self.reset()

    def reset(self):
        """Forget the previous virtual batch: the next batch is unmixed."""
        self._partner_x = None
        self._partner_y = None
        self.last_lambda = None

    def __call__(self, x, t, rng=None):
        """Mix a batch with the previous virtual batch.

        Parameters
        ----------
        x : numpy.ndarray or cupy.ndarray, shape ``(N, C, H, W)``
            Raw inputs; not modified.
        t : array, shape ``(N,)`` int or ``(N, n_class)`` float
            Integer labels, or label distributions. Integer labels on the
            host (NumPy) are range-checked there; on a device they are not
            (that would wait for the device; check labels when they are
            read, as ``train_imagenet.py`` does). One-hot rows are built on
            ``x``'s device without host-device synchronisation.
        rng : numpy.random.Generator or None
            Draw λ from this generator (e.g. one derived from the batch's
            position in the data stream, for runs that resume exactly)
            instead of the stream's own.

        Returns
        -------
        x_mixed : array, shape and dtype of ``x``
            The virtual batch x̃(t), a new array.
        t_mixed : array, shape ``(N, n_class)``, float32
            The virtual labels ỹ(t), a new array.

        The stored partner for the next step is a private copy, so later
        augmentation of the returned arrays (e.g. in-place random erasing)
        cannot change it.
        """
        xp = backend.get_array_module(x)
        y = self._labels_as_distributions(xp, t, len(x))
        if self._partner_x is not None and \
                backend.get_array_module(self._partner_x) is not xp:
            # Restored from a snapshot (host arrays) into a device run.
            self._partner_x = xp.asarray(self._partner_x)
            self._partner_y = xp.asarray(self._partner_y)
        if self._partner_x is None:
            lam = 1.0
            x_mixed = x.copy()
            y_mixed = y
        else:
            if self._partner_x.shape != x.shape:
                raise ValueError(
                    'running mixup needs batches of one shape: the previous '
                    'virtual batch has shape {}, this batch {}; use '
                    'reset() to start a new stream'.format(
                        self._partner_x.shape, x.shape))
            rng = self._rng() if rng is None else rng
            lam = float(rng.beta(self.alpha, self.alpha))
            x_mixed = (lam * x + (1 - lam) * self._partner_x).astype(
                x.dtype, copy=False)
            y_mixed = lam * y + (1 - lam) * self._partner_y
        self._partner_x = x_mixed.copy()
        self._partner_y = y_mixed.copy()
        self.last_lambda = lam
        return x_mixed, y_mixed.astype(np.float32, copy=False)

    def _labels_as_distributions(self, xp, t, batch_size):
        if t.ndim == 1 and t.dtype.kind in 'iu':
            # Range-checked only on the host: on a device the check would
            # wait for the device (the old cost, 71 ms per batch on a GPU).
            if isinstance(t, np.ndarray) and t.size and (
                    t.min() < 0 or t.max() >= self.n_class):
                raise ValueError('labels must lie in [0, {}), got min {} max '
                                 '{}'.format(self.n_class, int(t.min()),
                                             int(t.max())))
            y = xp.zeros((batch_size, self.n_class), dtype=np.float32)
            y[xp.arange(batch_size), xp.asarray(t)] = 1
            return y
        if t.shape == (batch_size, self.n_class):
            return xp.asarray(t).astype(np.float32)
        raise ValueError('labels must be ints of shape ({0},) or '
                         'distributions of shape ({0}, {1}), got {2} {3}'
                         .format(batch_size, self.n_class, t.dtype, t.shape))

    def state(self):
        """The stream's state (references, not copies: the stream replaces
        its partner arrays and never writes into them), for
        :meth:`set_state`."""
        return self._partner_x, self._partner_y, self.last_lambda

    def set_state(self, state):
        """Return to a :meth:`state` (e.g. when the step that used the
        stream was skipped)."""
        self._partner_x, self._partner_y, self.last_lambda = state

    def serialize(self, serializer):
        """The previous virtual batch (the stream's state; λ draws come from
        the caller's ``rng`` in resumable runs). Absent keys (a stream not
        in a snapshot) leave the stream as it is."""
        x = serializer('partner_x', self._partner_x)
        y = serializer('partner_y', self._partner_y)
        if x is None or y is None:
            self._partner_x = self._partner_y = None
        else:
            self._partner_x, self._partner_y = x, y


def running_mixup_streams(n_streams, alpha, n_class, seed=None):
    """Independent :class:`RunningMixup` streams, e.g. one per micro-batch.

    Parameters
    ----------
    n_streams : int
        Number of streams (``acc_iters`` for gradient accumulation).
    alpha, n_class
        As for :class:`RunningMixup`.
    seed : int or None
        Parent seed; each stream gets an independent child seed.

    Returns
    -------
    list of RunningMixup
    """
    children = np.random.SeedSequence(seed).spawn(n_streams)
    return [RunningMixup(alpha, n_class, child) for child in children]
