"""What every stock-architecture test checks after 3 updates of the
one-line swap.

* every optimizer took 3 steps, none skipped;
* every K-FAC block (a block with factors) was refreshed and inverted
  exactly at the steps its refresh intervals make due (the defaults: the
  first step, the others stale), and the reporter counted every K-FAC
  block preconditioned and every other block on the plain gradient, at
  every step;
* no due factor went uncaptured (no warning);
* every parameter is finite and every parameter that had a gradient moved;
* the registration table is sane: one row per block with its kind, no full
  factor larger than ``max_factor_dim`` (each larger one is diagonal and
  says so), the summary line's counts.
"""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import logging
import re

import numpy

import chainer

#: The README's line, with the cost guard the stock tests run under.
LR = 0.01
MOMENTUM = 0.9
DAMPING = 1e-2
STEPS = 3
#: The cost guard of the tests of large models (the recommended default;
#: benchmarks/stock_models.py).
MAX_FACTOR_DIM = 2048
#: A tighter guard for the largest ones on a CPU (ResNet-101: 104
#: convolutions and 104 BN layers with factors up to 2048 at the default;
#: VGG16's convolutions at 224²).
CPU_MAX_FACTOR_DIM = 1024


def kfac(max_factor_dim=None, **kwargs):
    """The one line: ``KFAC(lr=0.01, momentum=0.9, damping=1e-2)``, with
    ``max_factor_dim`` (and the registration table not logged)."""
    kwargs.setdefault('verbose', False)
    return chainerkfac.optimizers.KFAC(lr=LR, momentum=MOMENTUM,
                                       damping=DAMPING,
                                       max_factor_dim=max_factor_dim,
                                       **kwargs)


class RecordingReporter(chainer.Reporter):
    """A reporter that keeps every ``report`` call's values apart (two
    optimizers in one iteration report the same keys)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def report(self, values, observer=None):
        if observer is None and any(k.startswith('kfac/') for k in values):
            self.calls.append({k: float(v) for k, v in values.items()
                               if k.startswith('kfac/')})
        super().report(values, observer)


def train(trainee, caplog, steps=STEPS):
    """Run ``steps`` iterations of the stock loop; return the K-FAC
    reports (one per optimizer step, in order) and the uncaptured-factor
    warnings."""
    # (Lazily sized links get their initial values at the first step.)
    before = [{n: p.array.copy() for n, p in t.namedparams()
               if p.array is not None} for t in trainee.targets]
    reporter = RecordingReporter()
    for k, target in enumerate(trainee.targets):
        reporter.add_observer('main{}'.format(k), target)
    with caplog.at_level(logging.WARNING, logger='chainerkfac'):
        for _ in range(steps):
            with reporter.scope({}):
                trainee.step()
    warnings = [r.getMessage() for r in caplog.records
                if r.name.startswith('chainerkfac')]
    return before, reporter.calls, warnings


def refresh_steps(optimizer, kind, steps=STEPS):
    """The steps (0-based) at which the refresh interval of ``kind``
    (``'A'``, ``'G'``, ``'F'``) makes a factor due, every call reaching
    the link (epoch 0)."""
    interval = optimizer.refresh_intervals[kind]
    due, last = [], -1
    for t in range(steps):
        if last < 0 or t - last >= interval(t, 0):
            due.append(t)
            last = t
    return due


def check_trained(trainee, before, reports, warnings, steps=STEPS,
                  max_factor_dim=None):
    """The checks of the module docstring; returns the optimizers'
    registration tables."""
    assert warnings == [], warnings
    optimizers = trainee.optimizers
    assert len(reports) == steps * len(optimizers)
    tables = []
    for k, optimizer in enumerate(optimizers):
        assert optimizer.t == steps
        kfac_blocks = [b for b in optimizer.blocks if b.factor_names]
        plain_blocks = [b for b in optimizer.blocks if not b.factor_names]
        assert kfac_blocks, 'no K-FAC block at all'
        due = {kind: refresh_steps(optimizer, kind, steps)
               for kind in 'AGF'}
        for block in kfac_blocks:
            assert block.has_inverses(), block.name
            for name, kind in block.factor_kinds.items():
                # Refreshed (captured, inverted) exactly when due.
                steps_due = due[kind.interval]
                assert block.last_refresh[name] == steps_due[-1], (
                    block.name, name)
                assert block.refresh_count[name] == len(steps_due), (
                    block.name, name)
                assert block.inverse_count[name] == len(steps_due), (
                    block.name, name)
        mine = reports[k::len(optimizers)]
        for t, report in enumerate(mine):
            assert report['kfac/preconditioned_blocks'] == len(kfac_blocks)
            assert report['kfac/plain_blocks'] == len(plain_blocks)
            assert report['kfac/skipped_step'] == 0
            assert report['kfac/refresh_A'] == float(t in due['A'])
            assert report['kfac/refresh_G'] == float(t in due['G'])
        tables.append(check_table(optimizer, max_factor_dim))
    for target, start in zip(trainee.targets, before):
        for name, param in target.namedparams():
            assert numpy.isfinite(param.array).all(), name
            if param.grad is not None and name in start:
                assert not numpy.array_equal(param.array, start[name]), name
    return tables


_SUMMARY = re.compile(r'^(\d+) K-FAC layers, (\d+) with the plain gradient; '
                      r'eq\. \(20\) rescales (\d+) of (\d+) ')


def check_table(optimizer, max_factor_dim=None):
    """The registration table: a row per block, factor shapes within the
    limit (larger ones diagonal, with the note), the summary's counts."""
    table = optimizer.registration_table()
    lines = table.splitlines()
    assert lines[0].split()[:3] == ['layer', 'block', 'factors']
    rows = {line.split()[0]: line for line in lines[1:-1]}
    assert len(rows) == len(optimizer.blocks)
    for block in optimizer.blocks:
        row = rows[block.name]
        assert block.kind in row, row
        for name, shape in block.factor_shapes().items():
            if max_factor_dim is not None:
                assert len(shape) == 1 or shape[0] <= max_factor_dim, (
                    block.name, name, shape)
                if len(shape) == 1 and shape[0] > max_factor_dim:
                    assert 'max_factor_dim={}'.format(max_factor_dim) in row
            text = ('{} {}x{}'.format(name, *shape) if len(shape) == 2 else
                    '{} {} (diag)'.format(name, shape[0]))
            assert text in row, (text, row)
        if not block.factor_names:
            assert block.note, 'a plain block without its reason: ' + row
    summary = _SUMMARY.match(lines[-1])
    assert summary, lines[-1]
    n_kfac = sum(1 for b in optimizer.blocks if b.factor_names)
    assert int(summary.group(1)) == n_kfac
    assert int(summary.group(2)) == len(optimizer.blocks) - n_kfac
    return table


def rows_of(table):
    """``{layer: row}`` of a registration table."""
    return {line.split()[0]: line for line in table.splitlines()[1:-1]}
