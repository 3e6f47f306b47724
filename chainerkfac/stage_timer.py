"""Wall time of each stage of a K-FAC step (Algorithm 1's six stages),
and the device time of one piece of GPU work."""
import time
from typing import Callable, Dict, Tuple

import numpy

from chainer.backend import get_array_module


class StageTimer:
    """Seconds per stage of the last step, marked stage by stage.

    Attributes
    ----------
    times : dict
        ``{stage: seconds}`` of the last step (a stage marked twice adds
        up).
    synchronize : bool
        Synchronise the device before each mark (benchmarks on a GPU).
    """

    def __init__(self):
        self.times: Dict[str, float] = {}
        self.synchronize = False
        self._last = time.perf_counter()

    def start(self, like=None) -> None:
        """Begin a step (forget the last one's times)."""
        self._sync(like)
        self.times = {}
        self._last = time.perf_counter()

    def mark(self, stage: str, like=None) -> None:
        """The time since the last mark belongs to ``stage``."""
        self._sync(like)
        now = time.perf_counter()
        self.times[stage] = self.times.get(stage, 0.0) + now - self._last
        self._last = now

    def _sync(self, like) -> None:
        if self.synchronize and like is not None:
            xp = get_array_module(like)
            if xp is not numpy:
                xp.cuda.Device().synchronize()


def device_timed(xp, run: Callable[[], object]) -> Tuple[object, float]:
    """``(run(), seconds)`` on the device: between two CUDA events on the
    current stream (``xp``: CuPy), waiting for the second. For the timed
    choices made under ``chainer.config.autotune``."""
    start, stop = xp.cuda.Event(), xp.cuda.Event()
    start.record()
    result = run()
    stop.record()
    stop.synchronize()
    return result, xp.cuda.get_elapsed_time(start, stop) / 1000.0
