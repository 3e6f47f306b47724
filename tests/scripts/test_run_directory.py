"""One run per output directory: a fresh run into the directory of an
earlier one is refused (nothing of it touched) unless told to continue it
(``--resume``) or to start over (``--overwrite``, which clears the earlier
run's files first, so ``fisher_diff.jsonl`` never mixes runs); a run in
progress holds ``run.lock`` (host and pid), a live holder refuses
another run, a dead one's lock is taken over with a message."""
import json
import os
import socket
import subprocess
import sys

from tests.scripts.conftest import command, read_log, run

SHORT = ('--epochs', '1', '--fisher-diff')


def files_of(out):
    """{name: bytes} of every file in ``out``."""
    out = str(out)
    result = {}
    for name in sorted(os.listdir(out)):
        with open(os.path.join(out, name), 'rb') as f:
            result[name] = f.read()
    return result


def diff_steps(out):
    with open(os.path.join(str(out), 'fisher_diff.jsonl')) as f:
        return [json.loads(line)['step'] for line in f if line.strip()]


def test_fresh_run_into_an_earlier_run_refused_or_overwritten(dataset,
                                                              tmp_path):
    out = tmp_path / 'out'
    result = run(command(dataset, out, '--epochs', '2', '--fisher-diff',
                         '--keep-snapshots', '0'))
    assert result.returncode == 0, result.stdout[-3000:]
    first = files_of(out)
    assert 'snapshot_step_6.rank0' in first and 'mean.npy' in first
    assert 'run.lock' not in first           # released at the end
    steps = diff_steps(out)
    assert steps == list(range(1, len(steps) + 1))

    result = run(command(dataset, out, *SHORT))
    assert result.returncode != 0
    assert 'holds the files of an earlier run' in result.stdout
    assert '--resume latest' in result.stdout
    assert '--overwrite' in result.stdout
    assert files_of(out) == first

    result = run(command(dataset, out, '--overwrite', *SHORT))
    assert result.returncode == 0, result.stdout[-3000:]
    assert 'cleared' in result.stdout
    left = files_of(out)
    # Only the new run's files: one epoch of Diff lines from step 1, its
    # one snapshot (after step 3, the end of epoch 1; not the earlier
    # run's, after step 6), a new log.
    assert diff_steps(out) == steps[:len(diff_steps(out))]
    assert len(diff_steps(out)) < len(steps)
    assert sorted(n for n in left if n.startswith('snapshot')) == [
        'snapshot_step_3.rank0']
    assert [e['epoch'] for e in read_log(out)] == [1]


def sleeper():
    """A live process of this host (the holder of a lock)."""
    return subprocess.Popen([sys.executable, '-c',
                             'import time; time.sleep(120)'])


def write_lock(out, host, pid):
    os.makedirs(str(out), exist_ok=True)
    with open(os.path.join(str(out), 'run.lock'), 'w') as f:
        json.dump({'host': host, 'pid': pid, 'started': 'earlier'}, f)


def test_lock_of_a_live_run_refuses_another(dataset, tmp_path):
    holder = sleeper()
    try:
        write_lock(tmp_path, socket.gethostname(), holder.pid)
        result = run(command(dataset, tmp_path, *SHORT))
        assert result.returncode != 0
        assert 'in use by process {} on host {}'.format(
            holder.pid, socket.gethostname()) in result.stdout
        assert os.listdir(str(tmp_path)) == ['run.lock']
        # Another host: its processes cannot be checked from here.
        write_lock(tmp_path, 'elsewhere.example', 4242)
        result = run(command(dataset, tmp_path, *SHORT))
        assert result.returncode != 0
        assert 'in use by process 4242 on host elsewhere.example' in \
            result.stdout
        assert 'remove {}'.format(tmp_path / 'run.lock') in result.stdout
    finally:
        holder.kill()
        holder.wait()


def test_stale_lock_of_a_dead_process_taken_over(dataset, tmp_path):
    dead = sleeper()
    dead.kill()
    dead.wait()
    write_lock(tmp_path, socket.gethostname(), dead.pid)
    result = run(command(dataset, tmp_path, *SHORT))
    assert result.returncode == 0, result.stdout[-3000:]
    assert 'taking over the stale lock of process {}'.format(dead.pid) in \
        result.stdout
    assert not os.path.exists(str(tmp_path / 'run.lock'))
