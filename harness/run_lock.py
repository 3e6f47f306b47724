"""One run at a time in an output directory: ``OUT/run.lock``.

The lock file names its holder (host, process id, the process's start
time, when and how it was started). It is created atomically
(``O_CREAT | O_EXCL``) by rank 0 at the start of a run and removed at its
end, also when the run fails; a run killed with SIGKILL leaves it behind.
A later run then finds a *stale* lock: its holder on this host is gone
(no such process, or a process of that id started at another time), and
the lock is taken over with a message. A lock of a process that is alive,
or of another host (whose processes cannot be checked from here), refuses
the run naming the holder; remove the file if that run is known to be
dead — except the lock of an earlier run of this very Slurm job: a job
requeued (``--requeue``, after a node failure or ``scontrol requeue``)
keeps its ``SLURM_JOB_ID`` and counts ``SLURM_RESTART_COUNT`` up, and its
earlier run ended with its allocation, on whatever host it ran.
"""
import datetime
import json
import os
import re
import socket
import sys

#: The lock file in the output directory.
LOCK_FILE = 'run.lock'


class RunDirectoryInUse(OSError):
    """Another run holds the output directory; the message names it."""


def _process_start(pid):
    """The start time of process ``pid`` in clock ticks since boot (Linux
    ``/proc``), or ``None`` where that cannot be read."""
    try:
        with open('/proc/{}/stat'.format(pid)) as f:
            # Field 22; the command name (field 2) may hold spaces.
            return int(f.read().rsplit(')', 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _alive(holder):
    """Whether the holder of a lock of this host still runs."""
    pid = holder.get('pid')
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:         # another user's process
        pass
    started = holder.get('process_start')
    # The same id, reused by a process started since.
    return started is None or _process_start(pid) in (None, started)


def _job():
    """This process's batch job, as the lock records it: Slurm's job id
    and restart count, or None outside Slurm."""
    job = os.environ.get('SLURM_JOB_ID')
    if not job:
        return None
    restart = os.environ.get('SLURM_RESTART_COUNT', '0').strip()
    return {'scheduler': 'slurm', 'id': job.strip(),
            'restart': int(restart) if re.fullmatch('[0-9]+', restart)
            else 0}


def _earlier_run_of_this_job(holder, job):
    """Whether ``holder`` ran in an earlier allocation of this Slurm job
    (``job``, :func:`_job`): the same id, a lower restart count."""
    theirs = holder.get('job')
    return (job is not None and isinstance(theirs, dict) and
            theirs.get('scheduler') == job['scheduler'] and
            theirs.get('id') == job['id'] and
            isinstance(theirs.get('restart'), int) and
            theirs['restart'] < job['restart'])


def _read(path):
    try:
        with open(path) as f:
            holder = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}                   # unreadable: a holder we cannot name
    return holder if isinstance(holder, dict) else {}


class RunLock:
    """The lock of one output directory, held by this process.

    Use :meth:`acquire`; :meth:`release` removes the file.
    """

    def __init__(self, path):
        self.path = path

    @classmethod
    def acquire(cls, out, say=print):
        """Lock ``out`` (an existing directory) for this process.

        Parameters
        ----------
        out : str
        say : callable
            Told when a stale lock is taken over.

        Returns
        -------
        RunLock

        Raises
        ------
        RunDirectoryInUse
            A live process of this host or a process of another host
            holds it (named, with the lock file).
        """
        path = os.path.join(out, LOCK_FILE)
        me = {'host': socket.gethostname(), 'pid': os.getpid(),
              'process_start': _process_start(os.getpid()),
              'started': datetime.datetime.now().isoformat(
                  timespec='seconds'),
              'command': ' '.join(sys.argv), 'job': _job()}
        while True:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                             0o666)
            except FileExistsError:
                holder = _read(path)
                if holder is None:      # released meanwhile
                    continue
                try:
                    _take_over_if_stale(path, holder, me['host'], say,
                                        me['job'])
                except RunDirectoryInUse as error:
                    # Shown alone, not after the FileExistsError it handles.
                    raise error from None
                continue
            with os.fdopen(fd, 'w') as f:
                json.dump(me, f, indent=1)
                f.write('\n')
            return cls(path)

    def release(self):
        """Remove the lock file (if it is still there)."""
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass


def _take_over_if_stale(path, holder, host, say, job=None):
    """Remove the lock at ``path`` if its holder is a dead process of this
    host or ran in an earlier allocation of this Slurm job (``job``), else
    raise :class:`RunDirectoryInUse`."""
    who = 'process {} on host {}'.format(holder.get('pid', '?'),
                                         holder.get('host', '?'))
    earlier = _earlier_run_of_this_job(holder, job)
    if earlier or (holder.get('host') == host and not _alive(holder)):
        say('{}: taking over the stale lock of {} (started {}; {})'.format(
            os.path.dirname(path), who, holder.get('started', '?'),
            'it ran in restart {} of this Slurm job {}, this is restart {}'
            .format(holder['job']['restart'], job['id'], job['restart'])
            if earlier else 'that process no longer runs'))
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        return
    where = 'a process of another host cannot be checked from here' \
        if holder.get('host') != host else 'it is still running'
    raise RunDirectoryInUse(
        '{} is in use by {} (since {}; {}): wait for that run to end or '
        'choose another --out; if it is known to be dead, remove {}'.format(
            os.path.dirname(path), who, holder.get('started', '?'), where,
            path))
