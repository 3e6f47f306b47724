"""chainerkfac/stage_timer.py: the stage split of a step, and the device
time of a piece of work between two CUDA events (a stand-in device)."""
import types

import numpy

from chainerkfac import stage_timer


def test_stages_add_up_and_start_forgets_the_last_step(monkeypatch):
    clock = iter([0.0, 1.0, 3.0, 3.5, 10.0, 12.0])
    monkeypatch.setattr(stage_timer.time, 'perf_counter', lambda: next(clock))
    timer = stage_timer.StageTimer()          # 0.0
    timer.start()                             # 1.0
    timer.mark('forward_backward')            # 3.0
    timer.mark('forward_backward')            # 3.5: marked twice, adds up
    assert timer.times == {'forward_backward': 2.5}
    timer.start()                             # 10.0
    timer.mark('update')                      # 12.0
    assert timer.times == {'update': 2.0}


def test_device_time_is_between_two_events_after_the_work():
    log = []
    names = iter(['start', 'stop'])

    class Event:
        def __init__(self):
            self.name = next(names)

        def record(self):
            log.append(('record', self.name))

        def synchronize(self):
            log.append(('synchronize', self.name))

    def elapsed(start, stop):
        log.append(('elapsed', start.name, stop.name))
        return 250.0                          # milliseconds, as CUDA's

    xp = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Event=Event, get_elapsed_time=elapsed))
    result, seconds = stage_timer.device_timed(
        xp, lambda: log.append(('work',)) or numpy.ones(2))
    numpy.testing.assert_array_equal(result, numpy.ones(2))
    assert seconds == 0.25
    assert log == [('record', 'start'), ('work',), ('record', 'stop'),
                   ('synchronize', 'stop'), ('elapsed', 'start', 'stop')]
