"""The README's GPU throughput table, from ``step_time --gpu --peer``
results.

    python -m benchmarks.gpu_table RESULT.json [RESULT.json ...]

Each result is a ``step_time`` JSON: one run (``results``, its peer at the
top) or a sweep (``sweep``, a row per batch with its peer). Rows of the
same batch are merged, the first file's figure first: a later file fills
only what the earlier ones lack (a variant timed in a run of its own).
Images per second come from the medians as ``step_time`` computes them,
with what no figure may rest on left out: a variant that failed in its
run (what it timed before may be an eager step under a replayed
variant's name) and a replayed variant that never replayed. A cell
without a figure is ``–``; the lines under the table say which file
each batch took its figures from and what was left out.
"""
import json
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from benchmarks import _args
from benchmarks import _common
from benchmarks import step_time

#: (row, our key, the peer's key): images/s keys of ``step_time``.
ROWS: Tuple[Tuple[str, str, Optional[str]], ...] = (
    ('MomentumSGD (ours replayed, PyTorch eager)', 'sgd_graph', 'sgd'),
    ('K-FAC refreshing every step, ours replayed but for the inverses '
     '(peer: inverse method)', 'kfac_every_graph', 'kfac_inverse'),
    ('the same, eager (`--replay-refresh-steps off`)', 'kfac_every', None),
    ("the same, eager, low-rank factors (`KFAC()`'s default)",
     'kfac_low_rank', None),
    ('K-FAC stale interval 20, a step that refreshes nothing (ours '
     'replayed)', 'kfac_stale_graph', 'kfac_inverse_stale'),
    ('K-FAC stale-20 amortised over its cycle (ours: its refresh step '
     'replayed but for the inverses)', step_time.REPLAYED_REFRESH,
     'kfac_inverse_stale_amortised'),
    ('MomentumSGD, eager steps (several processes)', 'sgd', None),
)


def usable_medians(row: Dict) -> Tuple[Dict[str, float], List[str]]:
    """A row's medians that a figure may rest on, and what was left out
    (with why)."""
    failed = row.get('failed') or {}
    if isinstance(failed, str):            # the whole point failed
        return {}, ['every variant ({})'.format(failed)]
    dropped = []
    medians = {}
    for key, value in (row.get('median_s') or {}).items():
        variant = step_time._variant_of(key)
        if value is None or key.endswith('_refresh'):
            continue
        if variant in failed:
            if key == variant:
                # 'variant (where): Type: message'
                dropped.append(': '.join(failed[variant].split(': ')[:2]))
            continue
        if variant in row.get('not_replayed', ()):
            dropped.append('{} (never replayed)'.format(variant))
            continue
        medians[key] = value
    return medians, dropped


def images(row: Dict, interval: int) -> Tuple[Dict[str, float], List[str]]:
    """Our images/s of a result row (as :func:`step_time.sweep` computes
    them, from :func:`usable_medians`) and what was left out."""
    medians, dropped = usable_medians(row)
    if not medians:             # a point whose process failed
        return {}, dropped
    return step_time.throughput(row, medians, medians, interval), dropped


def peer_images(peer: Optional[Dict], batch: int, interval: int
                ) -> Dict[str, float]:
    if not peer or 'skipped' in peer:
        return {}
    return step_time.images_per_second(
        peer['median_s'], batch, interval, 'kfac_inverse',
        'kfac_inverse_stale')


def rows_of(data: Dict) -> List[Tuple[Dict, Optional[Dict]]]:
    """(row, its peer) pairs of a ``step_time`` result."""
    if 'sweep' in data:
        return [(r, r.get('peer_pytorch')) for r in data['sweep']]
    return [(r, data.get('peer_pytorch')) for r in data.get('results', [])]


def merge(paths: Sequence[str]) -> Dict[int, Dict]:
    """``{batch: {'ours', 'peer', 'sources', 'dropped'}}`` over the
    files, the first file's figure first."""
    points: Dict[int, Dict] = {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        if data.get('benchmark') != 'step_time' or not data.get('gpu'):
            raise SystemExit('{}: not a step_time --gpu result'.format(path))
        interval = data.get('refresh_interval', 20)
        for row, peer in rows_of(data):
            if row.get('model', 'resnet50') != 'resnet50':
                continue
            point = points.setdefault(row['batch'], {
                'ours': {}, 'peer': {}, 'sources': [], 'dropped': []})
            ours, dropped = images(row, interval)
            theirs = peer_images(peer, row['batch'], interval)
            added = [k for k in ours if k not in point['ours']] + \
                ['peer ' + k for k in theirs if k not in point['peer']]
            for key, value in ours.items():
                point['ours'].setdefault(key, value)
            for key, value in theirs.items():
                point['peer'].setdefault(key, value)
            point['sources'].append((path, added))
            point['dropped'] += ['{} in {}'.format(d, path)
                                 for d in dropped]
    return points


def table(points: Dict[int, Dict]) -> str:
    batches = sorted(points)
    headers = ['images/s']
    for batch in batches:
        headers += ['ours, b{}'.format(batch), 'peer, b{}'.format(batch)]
    rows = []
    for label, ours, theirs in ROWS:
        row = [label]
        for batch in batches:
            point = points[batch]
            row.append(_cell(point['ours'].get(ours)))
            row.append(_cell(point['peer'].get(theirs)) if theirs else '')
        rows.append(row)
    lines = ['| ' + ' | '.join(headers) + ' |',
             '| --- |' + ' ---: |' * (len(headers) - 1)]
    lines += ['| ' + ' | '.join(r) + ' |' for r in rows]
    notes = []
    for batch in batches:
        for path, added in points[batch]['sources']:
            notes.append('b{}: {} ({})'.format(
                batch, path, ', '.join(added) if added else 'nothing new'))
        notes += ['b{}: left out: {}'.format(batch, d)
                  for d in points[batch]['dropped']]
    return '\n'.join(lines) + '\n\n' + '\n'.join(notes)


def _cell(value: Optional[float]) -> str:
    return '–' if value is None else '{:.0f}'.format(value)


def main(argv=None) -> int:
    parser = _common.argument_parser('benchmarks.gpu_table', __doc__)
    parser.add_argument('results', type=_args.json_file, nargs='+',
                        metavar='RESULT.json')
    args = parser.parse_args(argv)
    print(table(merge(args.results)))
    return 0


if __name__ == '__main__':
    sys.exit(main())
