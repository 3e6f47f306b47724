"""Plans: what a cuDNN call needs for one shape, built once and reused.

A plan holds the descriptors of one operation on one shape (tensors,
filter, convolution with the math type of its algorithm, pooling,
activation), and what cuDNN chose or sized for it (the convolution's
algorithm and workspace, batch normalization's workspace and reserve
sizes). The first call of a shape builds its plan (the ``cudnnCreate`` /
``Set`` / ``Get`` calls); every later call of that shape is one launch,
and the handle's ``cudnnSetStream`` only when the stream changed
(:meth:`chainerkfac.cudnn.runtime.Runtime.handle`). On a recording fake,
a ResNet-50 SGD step goes from 4,452 library calls to 365 once its plans
are built (the first step makes 1,132; ``tests/chainerkfac/
test_cudnn_plans.py``).

The cache is bounded: :data:`CAPACITY` plans, least recently used first
out. A ResNet-50 training step uses 79 (one per distinct shape and
operation; a second batch size, e.g. a shorter last batch, as many again);
a plan is a few host-side descriptors (well under a kilobyte). A plan
dropped from the cache destroys its descriptors when no call holds it any
more (``weakref.finalize``), and :meth:`PlanCache.close` destroys them all
(at exit: :func:`chainerkfac.cudnn.install` registers it). One lock guards
the cache, so threads may share it; descriptors are only read once built.
"""
import collections
import threading
import weakref
from typing import Callable, Hashable

from chainerkfac.cudnn.descriptors import Descriptors

#: Plans kept (module docstring).
CAPACITY = 1024


class Plan:
    """The descriptors and choices of one operation on one shape.

    The builders of :mod:`chainerkfac.cudnn` set the attributes they need
    (``x``, ``y``, ``w``, ``conv``, ``algo``, ``workspace``, ...); ``d`` is
    the :class:`~chainerkfac.cudnn.descriptors.Descriptors` that owns the
    descriptors, ``finalizer`` destroys them (once).
    """

    def __init__(self, d: Descriptors):
        self.d = d
        self.finalizer = None


class PlanCache:
    """Plans by key, at most ``capacity`` of them (module docstring).

    Parameters
    ----------
    lib : chainerkfac.cudnn.library.Library
    capacity : int
    """

    def __init__(self, lib, capacity: int = CAPACITY):
        if capacity < 1:
            raise ValueError('a plan cache holds at least one plan (got '
                             'capacity={})'.format(capacity))
        self._lib = lib
        self.capacity = capacity
        self._plans: 'collections.OrderedDict[Hashable, Plan]' = \
            collections.OrderedDict()
        self._lock = threading.Lock()
        #: Plans built so far (a plan rebuilt after eviction counts again).
        self.built = 0

    def __len__(self) -> int:
        return len(self._plans)

    def get(self, key: Hashable, build: Callable[..., Plan], *args) -> Plan:
        """The plan of ``key``; built by ``build(descriptors, *args)`` if
        absent.

        ``build`` makes its descriptors with the :class:`Descriptors` it is
        given; if it raises, those are destroyed and nothing is cached.
        """
        plan = self._plans.get(key)
        if plan is not None:
            # Recency is kept under the lock; a plan evicted meanwhile
            # stays valid for this call (its finalizer waits for it).
            with self._lock:
                if key in self._plans:
                    self._plans.move_to_end(key)
            return plan
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                return plan
            d = Descriptors(self._lib)
            try:
                plan = build(d, *args)
            except BaseException:
                d.close()
                raise
            plan.finalizer = weakref.finalize(plan, d.close)
            self._plans[key] = plan
            self.built += 1
            while len(self._plans) > self.capacity:
                self._plans.popitem(last=False)
            return plan

    def close(self) -> None:
        """Drop every plan and destroy its descriptors now."""
        with self._lock:
            plans, self._plans = self._plans, collections.OrderedDict()
        for plan in plans.values():
            plan.finalizer()
