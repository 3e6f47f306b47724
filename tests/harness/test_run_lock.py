"""The lock of an output directory: created with its holder's host and
pid, refused while held by a live process or another host's, taken over
from a dead process of this host (also one whose pid was reused)."""
import json
import os
import socket
import subprocess
import sys
import traceback

import pytest

from harness import run_lock


def holder_file(out):
    with open(os.path.join(str(out), run_lock.LOCK_FILE)) as f:
        return json.load(f)


def write(out, **holder):
    with open(os.path.join(str(out), run_lock.LOCK_FILE), 'w') as f:
        json.dump(holder, f)


def test_lock_names_its_holder_and_is_released(tmp_path):
    lock = run_lock.RunLock.acquire(str(tmp_path))
    holder = holder_file(tmp_path)
    assert holder['host'] == socket.gethostname()
    assert holder['pid'] == os.getpid()
    with pytest.raises(run_lock.RunDirectoryInUse) as info:
        run_lock.RunLock.acquire(str(tmp_path))
    assert 'in use by process {} on host {}'.format(
        os.getpid(), socket.gethostname()) in str(info.value)
    assert 'still running' in str(info.value)
    lock.release()
    assert os.listdir(str(tmp_path)) == []
    run_lock.RunLock.acquire(str(tmp_path)).release()


def dead_pid():
    process = subprocess.Popen([sys.executable, '-c', 'pass'])
    process.wait()
    return process.pid


def test_lock_of_a_dead_process_taken_over(tmp_path):
    pid = dead_pid()
    write(tmp_path, host=socket.gethostname(), pid=pid, started='then')
    said = []
    lock = run_lock.RunLock.acquire(str(tmp_path), say=said.append)
    [message] = said
    assert 'taking over the stale lock of process {}'.format(pid) in message
    assert holder_file(tmp_path)['pid'] == os.getpid()
    lock.release()


def test_reused_pid_is_not_the_holder(tmp_path):
    """The pid lives, but started at another time than the holder."""
    me = run_lock._process_start(os.getpid())
    if me is None:
        pytest.skip('no /proc here')
    write(tmp_path, host=socket.gethostname(), pid=os.getpid(),
          process_start=me - 1, started='then')
    said = []
    run_lock.RunLock.acquire(str(tmp_path), say=said.append).release()
    assert said and 'stale' in said[0]


def test_lock_of_another_host_refused(tmp_path):
    write(tmp_path, host='node17.example', pid=dead_pid(), started='then')
    with pytest.raises(run_lock.RunDirectoryInUse) as info:
        run_lock.RunLock.acquire(str(tmp_path))
    message = str(info.value)
    assert 'on host node17.example' in message
    assert 'another host' in message
    assert 'remove {}'.format(tmp_path / run_lock.LOCK_FILE) in message


@pytest.mark.parametrize('theirs, mine, taken', [
    ({'id': '4242', 'restart': 0}, ('4242', '1'), True),   # requeued
    ({'id': '4242', 'restart': 0}, ('4242', ' 1 '), True),  # spaced
    ({'id': '4242', 'restart': 0}, ('4242', '\u00b2'), False),  # not ASCII
    ({'id': '4242', 'restart': 1}, ('4242', '1'), False),  # the same run
    ({'id': '4242', 'restart': 0}, ('999', '1'), False),   # another job
    ({'id': '4242', 'restart': 0}, (None, None), False),   # not in Slurm
    (None, ('4242', '1'), False),                          # no job recorded
])
def test_lock_of_an_earlier_run_of_this_slurm_job_taken_over(
        tmp_path, monkeypatch, theirs, mine, taken):
    """A Slurm job requeued after a node failure runs on other nodes with
    the same SLURM_JOB_ID and a higher SLURM_RESTART_COUNT: the lock its
    killed run left (another host's) stopped the requeue chain."""
    for name, value in zip(('SLURM_JOB_ID', 'SLURM_RESTART_COUNT'), mine):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    write(tmp_path, host='node-b.example', pid=123, started='then',
          job=None if theirs is None else dict(theirs, scheduler='slurm'))
    said = []
    if not taken:
        with pytest.raises(run_lock.RunDirectoryInUse, match='another host'):
            run_lock.RunLock.acquire(str(tmp_path), say=said.append)
        return
    lock = run_lock.RunLock.acquire(str(tmp_path), say=said.append)
    [message] = said
    assert 'taking over the stale lock of process 123 on host ' \
        'node-b.example' in message
    assert 'restart 0 of this Slurm job 4242, this is restart 1' in message
    assert holder_file(tmp_path)['job'] == {'scheduler': 'slurm',
                                            'id': '4242', 'restart': 1}
    lock.release()


def test_refusal_shown_alone(tmp_path):
    """The traceback of a refusal is the RunDirectoryInUse, not a
    FileExistsError of run.lock followed by "During handling of the above
    exception"."""
    lock = run_lock.RunLock.acquire(str(tmp_path))
    with pytest.raises(run_lock.RunDirectoryInUse) as info:
        run_lock.RunLock.acquire(str(tmp_path))
    lock.release()
    shown = ''.join(traceback.format_exception(
        info.type, info.value, info.tb))
    assert 'FileExistsError' not in shown and 'During handling' not in shown
    assert 'is in use by process {}'.format(os.getpid()) in shown
