"""``train_imagenet.py`` with a signal sent to this process at a chosen
point of the run: the stand-in for a scheduler's signal that arrives
during a given phase, on some processes only.

    python -m tests.scripts.signal_at PHASE:N:RANKS:SIGNAL -- ARGS...

``PHASE`` is where the ``N``-th (from 1, counted in this process since it
started) occurrence sends it, before the work of that occurrence (``N+``:
that one and every later one):

* ``micro``: a micro-batch of the updater (its ``N``-th
  ``update_core``; inside an accumulation unless it starts a step);
* ``refresh``: K-FAC's refresh of the factors due (stage 4 of its step);
* ``evaluate``: the validation pass;
* ``write``: a snapshot write, from the writer thread (the signal arrives
  while the file is written, and the write takes 0.2 s longer).

``RANKS``: comma-separated ranks that send it to themselves (the others
get none), or ``all``. ``SIGNAL``: e.g. ``USR1``. A line on stderr says
when it was sent. The rest of the command line is ``train_imagenet.py``'s.
"""
import os
import signal
import sys
import time

from tests.launch import REPO

TRAIN_IMAGENET = os.path.join(REPO, 'train_imagenet.py')


def _rank():
    return int(os.environ.get('OMPI_COMM_WORLD_RANK', '0'))


class Sender:
    """Counts the occurrences of one phase; sends at the chosen one."""

    def __init__(self, spec):
        phase, n, ranks, name = spec.split(':')
        self.phase = phase
        self.repeat = n.endswith('+')
        self.n = int(n.rstrip('+'))
        self.active = ranks == 'all' or _rank() in {
            int(r) for r in ranks.split(',')}
        self.signal = signal.Signals['SIG' + name]
        self.seen = 0

    def __call__(self, phase, where=''):
        if phase != self.phase:
            return False
        self.seen += 1
        if not (self.active and (self.seen == self.n or
                                 self.repeat and self.seen > self.n)):
            return False
        print('signal_at: rank {} sends itself {} in {} #{}{}'.format(
            _rank(), self.signal.name, phase, self.seen, where),
            file=sys.stderr, flush=True)
        os.kill(os.getpid(), self.signal)
        return True


def patch(sender):
    """Wrap the methods of the phases (in this process only)."""
    from chainerkfac.optimizers import kfac
    from harness import evaluation, snapshots, updater

    update_core = updater.AugmentedUpdater.update_core

    def micro(self):
        sender('micro', ' (iteration {})'.format(self.iteration + 1))
        return update_core(self)
    updater.AugmentedUpdater.update_core = micro

    refresh = kfac.KFAC._refresh

    def refreshing(self, factors, counts):
        sender('refresh', ' (step {})'.format(self.t))
        return refresh(self, factors, counts)
    kfac.KFAC._refresh = refreshing

    evaluate = evaluation.GlobalMeanEvaluator.evaluate

    def evaluating(self):
        sender('evaluate')
        return evaluate(self)
    evaluation.GlobalMeanEvaluator.evaluate = evaluating

    save = snapshots.AtomicThreadWriter.save

    def saving(self, filename, *args, **kwds):
        if sender('write', ' ({})'.format(filename)):
            time.sleep(0.2)
        return save(self, filename, *args, **kwds)
    snapshots.AtomicThreadWriter.save = saving


def run_patched(argv, patching):
    """``argv``: ``OPTION -- ARGS``: ``patching(OPTION)``, then
    ``train_imagenet.py ARGS`` in this process; returns its exit status.
    (The wrappers of the tests: this module and :mod:`.paced`.)"""
    # As train_imagenet.py run as a script does first: a scheduler's signal
    # during the imports waits for the run's handler. Imported as a module
    # (below) it does not, and a job script's clock at 2 s killed a rank
    # still importing Chainer on a loaded machine (signal 10, 1 run in 5).
    from harness import preemption
    preemption.hold()
    split = argv.index('--')
    [option] = argv[:split]
    patching(option)
    sys.argv = [TRAIN_IMAGENET] + argv[split + 1:]
    import train_imagenet
    return train_imagenet.main()


def main(argv):
    return run_patched(argv, lambda spec: patch(Sender(spec)))


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
