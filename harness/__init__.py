"""The training harness of ``train_imagenet.py`` and the demo, on top of the
``chainerkfac`` library: one run (:mod:`harness.run`), its updater
(:mod:`harness.updater`), triggers, evaluation, snapshots and resume
(:mod:`harness.snapshots`), data start-up (:mod:`harness.data`), the run
directory's files (:mod:`harness.run_dir`) and the process set-up around
MPI (:mod:`harness.mpi`).
"""
