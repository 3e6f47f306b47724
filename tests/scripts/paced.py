"""``train_imagenet.py`` with every micro-batch made at least ``SECONDS``
longer: a run that lasts whatever the machine's speed, for a stand-in
scheduler whose clock must fall inside it.

    python -m tests.scripts.paced SECONDS -- ARGS...

The rest of the command line is ``train_imagenet.py``'s. The steps and
their results are the run's own (only the log's timing differs).
"""
import sys
import time

from tests.scripts.signal_at import run_patched


def patch(seconds):
    """Sleep ``seconds`` before each micro-batch of the updater."""
    from harness import updater
    update_core = updater.AugmentedUpdater.update_core

    def paced(self):
        time.sleep(seconds)
        return update_core(self)
    updater.AugmentedUpdater.update_core = paced


def main(argv):
    return run_patched(argv, lambda seconds: patch(float(seconds)))


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
