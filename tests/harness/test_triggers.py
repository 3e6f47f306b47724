"""When snapshots are taken (``--snapshot-every``: epochs, iterations,
minutes, always at the end of the optimizer step in progress) and when the
run stops (its last epoch, or a stop all processes agreed on)."""
import os
import signal
import subprocess
import sys

import pytest

from harness import preemption, triggers
from harness.triggers import SnapshotPeriod
from tests.harness import OneProcess
from tests.launch import REPO

#: Micro-batches per step and per epoch of the stand-in run.
ACC_ITERS, EPOCH = 4, 5


class Iterator:
    @staticmethod
    def epoch_at(position):
        return position // EPOCH


class Updater:
    """Iterations of ACC_ITERS micro-batches per step, epochs of EPOCH."""
    acc_iters = ACC_ITERS
    iteration, finished, epoch_detail = 0, False, 0.0

    @property
    def at_step_boundary(self):
        return self.iteration % self.acc_iters == 0

    @staticmethod
    def get_iterator(name):
        return Iterator


class Trainer:
    def __init__(self):
        self.updater = Updater()


def fired(trigger, last=22, stop_at=None, stop=None):
    trainer, out = Trainer(), []
    for iteration in range(1, last + 1):
        trainer.updater.iteration = iteration
        trainer.updater.finished = iteration == last
        if iteration == stop_at:
            stop.received = signal.SIGUSR1
        if trigger(trainer):
            out.append(iteration)
    return out


@pytest.mark.parametrize('text, count, unit', [
    ('1', 1, 'epoch'), ('3', 3, 'epoch'), ('2000it', 2000, 'iteration'),
    ('30min', 30.0, 'minute'), ('0.5min', 0.5, 'minute')])
def test_period_forms(text, count, unit):
    assert SnapshotPeriod.parse(text) == SnapshotPeriod(count, unit)


@pytest.mark.parametrize('text', ['0', '-1', '1.5', '0it', '2.5it', 'it',
                                  '0min', 'min', '5s', '1e3', ''])
def test_bad_periods_say_the_forms(text):
    with pytest.raises(ValueError) as info:
        SnapshotPeriod.parse(text)
    assert '2000it' in str(info.value) and '30min' in str(info.value)
    assert repr(text) in str(info.value)


def no_signals():
    return preemption.StopRequest(())


def test_epochs_wait_for_the_end_of_the_step():
    trigger = triggers.SnapshotTrigger(SnapshotPeriod(1, 'epoch'),
                                       OneProcess, no_signals())
    # Epochs end at 5, 10, 15, 20; steps end at multiples of 4; the run's
    # end (22) is saved too.
    assert fired(trigger) == [8, 12, 16, 20, 22]
    trigger = triggers.SnapshotTrigger(SnapshotPeriod(2, 'epoch'),
                                       OneProcess, no_signals())
    assert fired(trigger) == [12, 20, 22]


def test_epoch_entries_and_step_observers_at_the_end_of_steps():
    """The log and the evaluation: at the end of the step in which an
    epoch ended (epochs end at 5, 10, 15, 20; steps at multiples of 4),
    and at the run's end; the step observers after every step, the run's
    final partial one (22) included."""
    assert fired(triggers.EpochEnd()) == [8, 12, 16, 20, 22]
    assert fired(triggers.StepBoundary()) == [4, 8, 12, 16, 20, 22]


def test_iterations_wait_for_the_end_of_the_step():
    trigger = triggers.SnapshotTrigger(SnapshotPeriod(6, 'iteration'),
                                       OneProcess, no_signals())
    # Multiples of 6 crossed in the steps ending at 8, 12, 20 (18).
    assert fired(trigger) == [8, 12, 20, 22]


def test_minutes_by_the_clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(triggers.time, 'monotonic', lambda: now[0])
    trigger = triggers.SnapshotTrigger(SnapshotPeriod(1, 'minute'),
                                       OneProcess, no_signals())
    trainer = Trainer()
    out = []
    for iteration in range(1, 23):
        now[0] += 10.0          # 10 s per micro-batch: 40 s per step
        trainer.updater.iteration = iteration
        trainer.updater.finished = iteration == 22
        if trigger(trainer):
            out.append(iteration)
    # 60 s passed at iteration 6 (in the step ending at 8), then 60 s
    # after 8 at 14 (-> 16); the end.
    assert out == [8, 16, 22]


def test_stop_at_the_end_of_the_step_and_the_run_stops():
    stop = preemption.StopRequest((signal.SIGUSR1,))
    snapshot = triggers.SnapshotTrigger(SnapshotPeriod(1, 'epoch'),
                                        OneProcess, stop)
    end = triggers.StopTrigger(100, stop)
    trainer = Trainer()
    assert not end(trainer)
    # The signal during iteration 9 (inside the step 9-12): a snapshot at
    # 12, where the stop trigger then fires.
    assert fired(snapshot, stop_at=9, stop=stop) == [8, 12, 16, 20, 22]
    assert stop.stopping == signal.SIGUSR1
    assert end(trainer)


def test_signal_handler_only_records_the_first_signal():
    stop = preemption.StopRequest(preemption.parse_signals('TERM,USR1'))
    stop.install()
    try:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.received == signal.SIGUSR1
        first = stop.received_at
        os.kill(os.getpid(), signal.SIGTERM)    # a second one: no change
        assert (stop.received, stop.received_at) == (signal.SIGUSR1, first)
        assert stop.stopping is None         # decided at a step boundary
        assert preemption.agree(OneProcess, stop) == (True, False)
        assert stop.stopping == signal.SIGUSR1
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


@pytest.mark.parametrize('text, names', [
    ('TERM,USR1', ['SIGTERM', 'SIGUSR1']), ('sigusr2', ['SIGUSR2']),
    ('10', ['SIGUSR1']), ('none', []), ('', []),
    ('USR1, USR1', ['SIGUSR1'])])
def test_signal_names(text, names):
    assert [s.name for s in preemption.parse_signals(text)] == names


@pytest.mark.parametrize('text, error', [
    ('FOO', "unknown signal 'FOO'"), ('KILL', 'SIGKILL cannot be caught'),
    ('TERM,STOP', 'SIGSTOP cannot be caught')])
def test_bad_signal_names(text, error):
    with pytest.raises(ValueError, match=error):
        preemption.parse_signals(text)


_LATE_SIGNALS = '''
import os, signal, subprocess, sys, time
from harness import preemption
stop = preemption.StopRequest((signal.SIGUSR1, signal.SIGTERM)).install()
if sys.argv[1] == 'settle':
    stop.settle()
# the scheduler's clock, firing on as the process exits
subprocess.Popen(['sh', '-c',
                  'while kill -USR1 {} 2>/dev/null; do :; done'.format(
                      os.getpid())])
time.sleep(0.2)
'''


def test_a_signal_after_the_outcome_is_decided_does_not_end_the_exit(
        tmp_path):
    """A run whose outcome is decided settles its stop request: a late
    SIGUSR1 (the clock firing as the last step ends) is ignored, also
    while the process exits — where CPython has given signals with a
    Python handler their default action back and SIGUSR1 would end it
    (status 138: a job script reads a failed run; seen once in CI)."""
    script = tmp_path / 'late.py'
    script.write_text(_LATE_SIGNALS)
    env = dict(os.environ, PYTHONPATH=REPO)

    def status(mode):
        return subprocess.run([sys.executable, str(script), mode], env=env,
                              cwd=REPO, timeout=60).returncode
    assert [status('settle') for _ in range(3)] == [0, 0, 0]
    # the hazard it removes: with only the handler, an exit is killed
    # (a race: up to 30 tries, until one is; 5 missed it once, in a CI
    # run beside other work)
    assert any(status('handled') == -signal.SIGUSR1 for _ in range(30))
