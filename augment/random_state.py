"""Random generators that stay independent across forked worker processes.

Chainer's ``MultiprocessIterator`` runs dataset transforms in worker
processes that inherit (fork) or unpickle (spawn) a copy of the transform,
random state included: without care every worker draws the same crops and
flips. :class:`ProcessLocalRNG` re-seeds itself when it finds itself in a new
process.
"""
import os

import numpy as np


class ProcessLocalRNG:
    """A ``numpy.random.Generator`` per process, derived from one seed.

    Parameters
    ----------
    seed : int, numpy.random.SeedSequence or None
        Seed of the generator in the creating process. ``None`` draws
        entropy from the OS. In another process (a forked or spawned
        worker) the generator is re-seeded from the same seed and the
        process id, so workers differ from each other and from the parent.
        Draws are reproducible for a given seed within the creating process.
    """

    def __init__(self, seed=None):
        if isinstance(seed, np.random.SeedSequence):
            self._seed_sequence = seed
        else:
            self._seed_sequence = np.random.SeedSequence(seed)
        self._pid = os.getpid()
        self._generator = np.random.default_rng(self._seed_sequence)

    def __call__(self):
        """Return this process's generator."""
        pid = os.getpid()
        if pid != self._pid:
            seed = np.random.SeedSequence(
                self._seed_sequence.entropy,
                spawn_key=self._seed_sequence.spawn_key + (pid,))
            self._generator = np.random.default_rng(seed)
            self._pid = pid
        return self._generator
