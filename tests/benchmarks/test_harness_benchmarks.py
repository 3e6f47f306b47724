"""``python -m benchmarks.snapshot --smoke``, ``benchmarks.data_path
--smoke``, ``benchmarks.failure_latency --smoke`` and
``benchmarks.preemption --smoke`` run as a user runs them and their JSON
holds the figures (finite, positive); nothing asserts a speed. Their
``--help`` and the snapshot's units."""
import json
import math
import subprocess
import sys

import pytest

from benchmarks import _common
from tests.benchmarks.help_text import assert_whole_first_paragraph
from tests.benchmarks.help_text import help_text
from tests.benchmarks.help_text import option_helps


def positive(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) and value > 0


def test_snapshot_smoke(tmp_path):
    out = str(tmp_path / 'snapshot.json')
    proc = subprocess.run(
        [sys.executable, '-m', 'benchmarks.snapshot', '--smoke', '--out',
         out], cwd=_common.ROOT, env=_common.worker_env(threads=1),
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out) as f:
        data = json.load(f)
    assert data['benchmark'] == 'snapshot'
    assert '--smoke' in data['command']
    [result] = data['results']
    for key in ('seconds', 'bytes'):
        assert positive(result['before'][key])
    for key in ('blocked_s', 'write_s', 'bytes'):
        assert positive(result['after'][key])
    assert positive(result['after']['array_bytes']['kfac_factors'])
    assert 'loop blocked s' in proc.stdout


def test_data_path_smoke(tmp_path):
    out = str(tmp_path / 'data_path.json')
    proc = subprocess.run(
        [sys.executable, '-m', 'benchmarks.data_path', '--smoke', '--out',
         out], cwd=_common.ROOT, env=_common.worker_env(threads=1),
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out) as f:
        [result] = json.load(f)['results']
    for side in ('before', 'after'):
        assert positive(result['data_path'][side]['images_per_s_per_core'])
    assert result['data_path']['after']['bytes_per_image_between_processes'] \
        * 4 == result['data_path']['before'][
            'bytes_per_image_between_processes']
    for key in ('before_ms', 'after_ms'):
        assert positive(result['mixup_labels'][key])
    for key in ('mean_serial_s_per_image', 'list_read_s',
                'old_broadcast_pickle_bytes', 'loader_list_pickle_bytes'):
        assert positive(result['startup'][key])


def test_failure_latency_smoke(tmp_path):
    out = str(tmp_path / 'failure_latency.json')
    proc = subprocess.run(
        [sys.executable, '-m', 'benchmarks.failure_latency', '--smoke',
         '--out', out], cwd=_common.ROOT, env=_common.worker_env(threads=1),
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out) as f:
        results = json.load(f)['results']
    assert [r['case'] for r in results] == ['create', 'training']
    for result in results:
        assert positive(result['abort_s'])
        [run] = result['runs']['abort']
        assert run['returncode'] not in (0, None) and run['message_seen']


@pytest.mark.parametrize('echo', [False, True])
def test_the_benchmarks_launch_again_where_mpiexec_failed_to_start(
        exec_tmp_path, tmp_path, capsys, echo):
    """Their launches (_common.run_mpiexec: launch_worker, the agreement,
    failure_latency; with ``echo``, the layer-parallel experiments', their
    output passed through) start again where Open MPI's launcher failed
    before any process ran: here the real mpiexec, first given a stale
    session directory for its process id (harness.mpi.stale_session_dirs:
    this failed a CI run in benchmarks.preemption), and never where the
    job ran and failed."""
    import socket
    from harness import mpi
    counter = tmp_path / 'launches'
    counter.write_text('0')
    script = tmp_path / 'mpiexec'
    script.write_text(
        '#!/bin/sh\nn=$(cat "{c}")\necho $((n + 1)) > "{c}"\n'
        'if [ "$n" = 0 ]; then mkdir -p "$TMPDIR/ompi.$$" && '
        'touch "$TMPDIR/ompi.$$/pmix.{host}.tool"; fi\n'
        'exec "{mpiexec}" "$@"\n'.format(
            c=counter, host=socket.gethostname(),
            mpiexec=_common.mpiexec_path()))
    script.chmod(0o755)
    env = dict(_common.worker_env(threads=1), TMPDIR=str(tmp_path))
    code = 'import sys; print("ran"); sys.exit({})'
    proc, seconds = _common.run_mpiexec(
        [str(script), '-n', '2', sys.executable, '-c', code.format(0)], env,
        timeout=120, echo=echo)
    assert proc.returncode == 0 and proc.stdout.count('ran') == 2, \
        proc.stdout + proc.stderr
    assert counter.read_text().strip() == '2' and positive(seconds)
    said = capsys.readouterr().out
    assert 'mpiexec failed to start (exit 213): launch 2 of {}'.format(
        mpi.LAUNCH_TRIES) in said
    assert said.count('ran') == (2 if echo else 0)
    counter.write_text('1')             # no stale directory: a job that fails
    proc, _ = _common.run_mpiexec(
        [str(script), '-n', '2', sys.executable, '-c', code.format(3)], env,
        timeout=120, echo=echo)
    assert proc.returncode == 3 and counter.read_text().strip() == '2'


def test_preemption_smoke(tmp_path):
    out = str(tmp_path / 'preemption.json')
    proc = subprocess.run(
        [sys.executable, '-m', 'benchmarks.preemption', '--smoke', '--out',
         out], cwd=_common.ROOT, env=_common.worker_env(threads=1),
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out) as f:
        data = json.load(f)
    [stop] = data['stops']
    assert stop['arch'] == 'small' and stop['all_status_75']
    for key in ('step_s', 'exit_s', 'write_s'):
        assert positive(stop[key]), key
    # the signal lands at a random point of a step whose length is
    # estimated from the step before: it may arrive as that step ends
    # (printed to 0.01 s, so 0.00)
    assert 0.0 <= stop['to_boundary_s'] <= stop['exit_s']
    [agreement] = data['agreement']
    assert agreement['size'] == 2 and positive(agreement['seconds'])
    assert 'signal to exit s' in proc.stdout


# -- --help: the whole first paragraph, every option's help and default ------
HELP_DEFAULTS = {
    'benchmarks.preemption': ('--out', '--repeats', '--archs',
                              '--agreement-sizes', '--timeout'),
    'benchmarks.data_path': ('--out', '--images', '--list-lines',
                             '--repeats'),
    'benchmarks.dropout_bound': ('--out', '--epochs', '--kl-clips',
                                 '--width-divisor', '--lr'),
    'benchmarks.failure_latency': ('--out', '--repeats'),
    'benchmarks.replay_host': ('--out', '--repeats'),
    'benchmarks.snapshot': ('--out', '--batch', '--threads', '--dir'),
}


@pytest.mark.parametrize('module', sorted(HELP_DEFAULTS))
def test_help_describes_in_whole_sentences_with_defaults(module, capsys):
    text = help_text(module, capsys)
    assert_whole_first_paragraph(module, text)
    helps = option_helps(text)
    for option, words in helps.items():
        assert words, '{} {} has no help'.format(module, option)
    for option in HELP_DEFAULTS[module]:
        assert 'default' in helps[option], (module, option)


def test_snapshot_sizes_are_decimal_gb_everywhere(capsys):
    """The tables and the goal's line say GB and mean 10⁹ bytes (the goal
    is 1.1 GB); the line shows the file's size to 3 digits, as the
    table."""
    from benchmarks import snapshot
    parts = {'kfac_factors': 2 * 10 ** 6, 'model': 10 ** 6}
    snapshot.print_result({
        'model': 'small', 'kfac_step_s': 0.5,
        'before': {'bytes': 1_500_000, 'seconds': 0.2,
                   'array_bytes': parts},
        'after': {'bytes': 3_000_000, 'blocked_s': 0.01, 'write_s': 0.05,
                  'array_bytes': parts},
        'blocked_fraction_of_before': 0.05,
        'goals': {'bytes_met': True, 'blocked_met': True}})
    out = capsys.readouterr().out
    assert 'GiB' not in out
    assert '| file GB |' in out and '| before GB | after GB |' in out
    assert '| after: background, uncompressed     |   0.003 |' in out
    assert '| kfac_factors         |     0.002 |    0.002 |' in out
    assert 'file 0.003 GB (goal <= 1.1 GB: met)' in out


def test_an_echoed_launch_past_its_timeout_is_killed_and_said():
    """Its output so far in the error, without waiting for processes
    the launch started that still hold its pipe (as subprocess.run)."""
    import time
    start = time.time()
    with pytest.raises(subprocess.TimeoutExpired) as raised:
        _common.run_mpiexec(['sh', '-c', 'echo started; sleep 30'],
                            _common.worker_env(threads=1), timeout=1.0,
                            echo=True)
    assert 'started' in raised.value.output
    assert time.time() - start < 20
