"""Scripts that regenerate the paper's Figures 2-6 (Osawa et al., CVPR 2019).

Each is runnable as ``python -m analysis.<name> ...``, writes a PNG and a
JSON file of the plotted numbers beside it, and prints those numbers:

* :mod:`analysis.scaling` — Figure 2, from a benchmark JSON (schema in its
  docstring);
* :mod:`analysis.curves` — Figures 3 and 6, from run directories;
* :mod:`analysis.fim_size` — Figure 4, from a model name (``resnet50``, ...);
* :mod:`analysis.fisher_diff` — Figure 5, from run directories with
  ``fisher_diff.jsonl``.

A run directory is what ``train_imagenet.py`` writes: ``config.json`` (the
resolved config plus ``"run": {"optimizer", "n_processes", "acc_iters",
"label", "arch", ...}``), ``log`` (Chainer's ``LogReport``, one entry per
epoch) and, with Diff logging on, ``fisher_diff.jsonl``
(:class:`chainerkfac.training.FisherDiffLog`).

Bad input (a directory without a log, a file of another format, an unknown
model) stops a script with a one-line error and exit status 2, before any
picture is written.
"""
