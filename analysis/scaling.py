"""Figure 2: time per iteration vs number of processes, measured and modelled.

    python -m analysis.scaling BENCH.json [--alpha 5e-6] [--beta 12.5e9]
                               [--layer-model resnet50] [--bn-fisher full]
                               [--inverse-overhead 0] [--max-processes 2048]
                               [--out F.png]

Input (written by the distributed scaling benchmark) — one JSON object::

    {"benchmark": "dist_scaling",        # identifies the format (required)
     "model": "resnet50",                # network timed: an --arch name of
                                         #   train_imagenet.py, or free text
     "model_kwargs": {"depth": 8, "width": 16, "n_class": 10},  # optional
     "bn_fisher": "full",                # optional, "full" | "diag"
     "batch_per_process": 32,            # samples per process per step
     "device": "...",                    # optional, free text
     "results": [                        # one entry per process count
       {"processes": 1,                  # P >= 1; P = 1 is required
        "oversubscribed": false,         # more ranks than cores / GPUs
        "step_time": 0.61,               # s per K-FAC step (every factor
                                         #   refreshed), slowest rank, mean
        "stage_times": {                 # s per step, slowest rank, mean;
          "forward_backward": 0.2,       #   names of KFAC.stage_times
          "factors": 0.01, "reduce_scatter": 0.0, "inverse": 0.3,
          "precondition": 0.05, "all_gather": 0.0, "update": 0.02},
        "bytes": {                       # per step, at the wire dtype
          "reduce_scatter_v": 643000000, # the whole ReduceScatterV send
                                         #   buffer (what one rank's
                                         #   communicator.bytes_sent grows by)
          "all_gather_v": 102000000},    # the whole AllGatherV buffer (the
                                         #   sum over ranks of theirs)
        "n_kfac_layers": 107}            # blocks with factors
     ]}

The analytic model (weak scaling: the per-process batch is fixed, as in the
paper's 32 images per GPU) predicts the time of one step on P processes
from the 1-process stage times ``t_stage``::

    T(P) = t_forward_backward + t_factors + t_update        data parallel
         + t_inverse · s_inv(P) + t_precondition · s_pre(P)  model parallel
         + C(P, B_rs(P)) + C(P, B_ag)                        stages 3 and 6
    C(P, B) = (P − 1) α + (P − 1) / P · B / β   (ring reduce-scatter or
                                                 all-gather; 0 for P = 1)

* Data-parallel stages do the same work on every process whatever P.
* ``s_inv``, ``s_pre``: the slowest rank's share of the inverse and
  precondition work under the assignment the optimizer uses
  (:class:`chainerkfac.assignment.Assignment`: LPT on ``n³`` inverse costs;
  with more processes than K-FAC layers every rank owns one layer, round
  robin, heaviest first). Inverse work of a block is ``Σ n³`` over its
  factors; precondition work ``d_out² d_in + d_out d_in²`` for a Kronecker
  block, ``(2C)²`` or ``2C`` for BN. ``--inverse-overhead c0`` refines the
  inverse *time* (not the assignment): each inverted factor costs a fixed
  ``c0`` seconds (a latency-bound GPU call on a small matrix), the rest of
  ``t_inverse`` is spread in proportion to ``n³``; ``c0 = 0`` (default) is
  the optimizer's own cost model. The blocks are the benchmark's model
  (``"model"``, if it is a known name) or ``--layer-model``'s. Without a
  known model, L = ``n_kfac_layers`` equal layers: ``s = ceil(L / P) / L``,
  the work divided over ``min(P, L)`` processes.
* ``B_ag``: the measured AllGatherV volume (every block's gradient once).
  ``B_rs``: the measured ReduceScatterV volume scaled with the number of
  owners, since a block owned by k ranks fills k segments of the buffer:
  ``B_rs(P) = B_rs(P_ref) · D(P) / D(P_ref)``,
  ``D(P) = Σ_b w_b · owners_b(P)`` with ``w_b`` the block's wire elements
  (gradients + packed factors) and ``P_ref`` the largest measured P with
  byte counts. Past L processes this volume grows like P / L. The measured
  1-process communication stage times (local copies) are not used.

Defaults, an InfiniBand EDR-class network as on ABCI: ``α = 5 µs`` per ring
step (≈ 1 µs on the wire plus the software overhead of one step of a GPU
collective), ``β = 12.5 GB/s`` (one 100 Gb/s EDR link). Not modelled:
hierarchical (NVLink inside a node) collectives, overlap of communication
with computation, contention.

The shape is compared with the paper's Figure 2 (section 5.2): time per
iteration falls from 1 and from 4 GPUs to 64 (superlinear, 64 GPUs 131.1 %
faster than 1, read as T(1) / T(64) = 2.311), its minimum lies between 64
and 256 GPUs, and it rises again past 256. The fall from 1 to 64 counts
only beyond a 5 % margin, T(1) / T(64) > 1.05: the stage times the model
starts from are measured on a shared machine, and a smaller difference is
noise.
"""
import argparse
import json
import math
from typing import Dict, List, Optional, Sequence

from analysis import _io, _models
from analysis.fim_size import factor_elements
from chainerkfac.assignment import Assignment
from chainerkfac.fisher_blocks import BatchNormalizationBlock
from chainerkfac.fisher_blocks.kronecker import KroneckerBlock

BENCHMARK = 'dist_scaling'
STAGES = ('forward_backward', 'factors', 'reduce_scatter', 'inverse',
          'precondition', 'all_gather', 'update')
DATA_PARALLEL = ('forward_backward', 'factors', 'update')
DEFAULT_ALPHA = 5e-6       # s per ring step
DEFAULT_BETA = 12.5e9      # bytes / s, 100 Gb/s InfiniBand EDR
#: The paper's Figure 2: 64 GPUs are 131.1 % faster than 1.
PAPER_SPEEDUP_1_TO_64 = 2.311
#: T(1) / T(64) must exceed 1 by this much to count as a speed-up: the
#: model's inputs are stage times measured on a shared machine, whose
#: repeats differ by a few per cent, so a smaller difference is noise (the
#: paper's is 131 %).
SUPERLINEAR_MARGIN = 0.05
SUPERLINEAR = 'superlinear from 1 to 64 (T(1)/T(64) > {:g})'.format(
    1 + SUPERLINEAR_MARGIN)
#: The same margin for the fall from 4 to 64 processes.
FASTER_AT_64 = 'faster at 64 than at 4 processes (T(4)/T(64) > {:g})'.format(
    1 + SUPERLINEAR_MARGIN)
#: The checks that compare two times, and the key of their ratio.
_RATIO_OF = {SUPERLINEAR: ('T(1)/T(64)', 'speedup_1_to_64'),
             FASTER_AT_64: ('T(4)/T(64)', 'speedup_4_to_64')}


# -- input -------------------------------------------------------------------
def load_benchmark(path: str) -> Dict:
    """Read and check a ``dist_scaling`` benchmark file (schema above)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise _io.AnalysisError('{}: cannot read: {}'.format(
            path, e.strerror)) from None
    except ValueError as e:
        raise _io.AnalysisError('{}: not JSON ({})'.format(path, e)) \
            from None
    if not isinstance(data, dict) or data.get('benchmark') != BENCHMARK:
        raise _io.AnalysisError(
            '{}: not a {} benchmark output (expected "benchmark": "{}", '
            'got {!r})'.format(path, BENCHMARK, BENCHMARK,
                               data.get('benchmark') if isinstance(
                                   data, dict) else type(data).__name__))
    results = data.get('results')
    if not isinstance(results, list) or not results:
        raise _io.AnalysisError('{}: "results" must be a non-empty '
                                'list'.format(path))
    for i, result in enumerate(results):
        where = '{}: results[{}]'.format(path, i)
        if not isinstance(result, dict):
            raise _io.AnalysisError('{} is not an object'.format(where))
        p = result.get('processes')
        if not isinstance(p, int) or isinstance(p, bool) or p < 1:
            raise _io.AnalysisError('{}: "processes" must be an integer '
                                    '>= 1, got {!r}'.format(where, p))
        if not _io.is_finite_number(result.get('step_time')) or \
                not result['step_time'] > 0:
            raise _io.AnalysisError('{}: "step_time" must be a number of '
                                    'seconds > 0, got {!r}'.format(
                                        where, result.get('step_time')))
        stages = result.get('stage_times')
        if not isinstance(stages, dict):
            raise _io.AnalysisError('{}: no "stage_times" object'.format(
                where))
        for stage in STAGES:
            if not _io.is_finite_number(stages.get(stage)) or \
                    stages[stage] < 0:
                raise _io.AnalysisError(
                    '{}: stage_times["{}"] must be a number of seconds '
                    '>= 0, got {!r}'.format(where, stage, stages.get(stage)))
        counts = result.get('bytes', {})
        if not isinstance(counts, dict) or not all(
                isinstance(counts.get(k, 0), int) and counts.get(k, 0) >= 0
                for k in ('reduce_scatter_v', 'all_gather_v')):
            raise _io.AnalysisError('{}: "bytes" must hold integer '
                                    '"reduce_scatter_v" and "all_gather_v"'
                                    .format(where))
    if not any(r['processes'] == 1 for r in results):
        raise _io.AnalysisError(
            '{}: no 1-process result; the model starts from the 1-process '
            'stage times'.format(path))
    counts = [r['processes'] for r in results]
    twice = sorted({p for p in counts if counts.count(p) > 1})
    if twice:
        raise _io.AnalysisError(
            '{}: more than one result for {} process(es): one per count '
            '(merge the runs first)'.format(
                path, ', '.join(map(str, twice))))
    data['path'] = path
    return data


# -- layer structure ---------------------------------------------------------
def precondition_cost(block) -> float:
    """Multiply-adds of preconditioning one block's gradient."""
    shapes = block.factor_shapes()
    if isinstance(block, KroneckerBlock):
        n_a, n_g = shapes['A'][0], shapes['G'][0]
        return float(n_g) * n_g * n_a + float(n_g) * n_a * n_a
    if isinstance(block, BatchNormalizationBlock):
        n = shapes['F'][0]
        return float(n) * n if len(shapes['F']) == 2 else float(n)
    return float(sum(p.size for p in block.params))


class LayerModel:
    """Per-rank shares of the model-parallel stages and the growth of the
    ReduceScatterV volume, for P processes.

    From a model's Fisher blocks (``blocks``) through the optimizer's
    :class:`Assignment`, or, with ``blocks=None``, for ``n_layers`` equal
    layers.
    """

    def __init__(self, blocks: Optional[Sequence] = None,
                 n_layers: Optional[int] = None, name: str = '',
                 inverse_overhead: float = 0.0,
                 inverse_time: Optional[float] = None):
        self.blocks = list(blocks) if blocks is not None else None
        if self.blocks is not None:
            self.n_layers = sum(1 for b in self.blocks if b.factor_names)
            self.n_factors = sum(len(b.factor_names) for b in self.blocks)
            self.precondition_costs = [precondition_cost(b)
                                       for b in self.blocks]
            self.wire = [sum(p.size for p in b.params) +
                         factor_elements(b, packed=True)
                         for b in self.blocks]
            self.inverse_weights = self._inverse_weights(inverse_overhead,
                                                         inverse_time)
            self.description = 'assignment of the {} blocks of {}'.format(
                len(self.blocks), name)
            if inverse_overhead:
                self.description += ', {:g} ms per inverse'.format(
                    inverse_overhead * 1e3)
        else:
            if not n_layers or n_layers < 1:
                raise _io.AnalysisError(
                    'no layer structure: give a known model (--layer-model) '
                    'or "n_kfac_layers" in the 1-process result')
            self.n_layers = int(n_layers)
            self.description = '{} equal layers over min(P, {}) ' \
                'processes'.format(self.n_layers, self.n_layers)
        self._cache = {}

    def _inverse_weights(self, overhead: float, inverse_time):
        """Per block, its fraction of the 1-process inverse time.

        ``overhead`` seconds per inverted factor (a latency-bound kernel
        call), the rest of ``inverse_time`` in proportion to ``n³``.
        """
        cubic = [b.inverse_cost() if b.factor_names else 0.0
                 for b in self.blocks]
        fixed = [float(len(b.factor_names)) for b in self.blocks]
        share = 0.0
        if overhead:
            if not inverse_time or overhead * self.n_factors >= inverse_time:
                raise _io.AnalysisError(
                    '--inverse-overhead {:g} s x {} factors is not below the '
                    'measured 1-process inverse time {:g} s'.format(
                        overhead, self.n_factors, inverse_time or 0.0))
            share = overhead * self.n_factors / inverse_time
        return [share * f / (sum(fixed) or 1.0) +
                (1.0 - share) * c / (sum(cubic) or 1.0)
                for f, c in zip(fixed, cubic)]

    def at(self, processes: int) -> Dict[str, float]:
        """``{"inverse_share", "precondition_share", "duplication"}``: the
        slowest rank's shares of the 1-process inverse and precondition
        times, and the mean number of owners per block (weighted by wire
        size)."""
        if processes in self._cache:
            return self._cache[processes]
        if self.blocks is None:
            share = math.ceil(self.n_layers / processes) / self.n_layers
            value = {'inverse_share': share, 'precondition_share': share,
                     'duplication': max(processes, self.n_layers) /
                     self.n_layers}
        else:
            owners = Assignment.from_blocks(self.blocks, processes).owners
            value = {
                'inverse_share': _heaviest(self.inverse_weights, owners,
                                           processes),
                'precondition_share': _heaviest(
                    self.precondition_costs, owners, processes) /
                (sum(self.precondition_costs) or 1.0),
                'duplication': sum(w * len(o) for w, o in zip(
                    self.wire, owners)) / (sum(self.wire) or 1.0)}
        self._cache[processes] = value
        return value


def _heaviest(costs, owners, processes) -> float:
    """The largest per-rank sum of ``costs`` under ``owners``."""
    loads = [0.0] * processes
    for cost, ranks in zip(costs, owners):
        for rank in ranks:
            loads[rank] += cost
    return max(loads)


def layer_model_for(bench: Dict, layer_model: Optional[str],
                    bn_fisher: Optional[str],
                    inverse_overhead: float = 0.0) -> LayerModel:
    """The layer structure: ``--layer-model``, the benchmark's model if it
    is a known name, else ``n_kfac_layers`` equal layers."""
    arch = layer_model or bench.get('model')
    kwargs = {}
    if not layer_model and isinstance(bench.get('model_kwargs'), dict):
        kwargs = _models.model_kwargs(bench['model_kwargs'])
    mode = bn_fisher or bench.get('bn_fisher', 'full')
    one = next(r for r in bench['results'] if r['processes'] == 1)
    if mode not in ('full', 'diag'):
        raise _io.AnalysisError('bn_fisher must be "full" or "diag", got '
                                '{!r}'.format(mode))
    if arch in _models.ARCHS:
        model = _models.build_model(arch, **kwargs)
        return LayerModel(_models.kfac_blocks(model, mode),
                          name='{} (BN Fisher {})'.format(arch, mode),
                          inverse_overhead=inverse_overhead,
                          inverse_time=one['stage_times']['inverse'])
    if layer_model:
        _models.build_model(layer_model)   # raises: unknown name
    return LayerModel(n_layers=one.get('n_kfac_layers'))


# -- the model ---------------------------------------------------------------
def ring_time(processes: int, nbytes: float, alpha: float, beta: float
              ) -> float:
    """Ring reduce-scatter or all-gather of an ``nbytes`` buffer."""
    if processes <= 1:
        return 0.0
    return (processes - 1) * alpha + \
        (processes - 1) / processes * nbytes / beta


def reference_bytes(results: Sequence[Dict]) -> Dict:
    """Byte counts of the largest measured P that has them."""
    measured = [r for r in results if r.get('bytes', {}).get(
        'reduce_scatter_v', 0) > 0 and r['bytes'].get('all_gather_v', 0) > 0]
    if not measured:
        raise _io.AnalysisError(
            'no result has byte counts ("bytes": {"reduce_scatter_v", '
            '"all_gather_v"} > 0); the model needs the measured volumes')
    ref = max(measured, key=lambda r: r['processes'])
    return {'processes': ref['processes'],
            'reduce_scatter_v': ref['bytes']['reduce_scatter_v'],
            'all_gather_v': ref['bytes']['all_gather_v']}


def predict(bench: Dict, layers: LayerModel, processes: Sequence[int],
            alpha: float, beta: float) -> List[Dict]:
    """Modelled step time and its parts for each P in ``processes``."""
    one = next(r for r in bench['results'] if r['processes'] == 1)
    t = one['stage_times']
    data_parallel = sum(t[s] for s in DATA_PARALLEL)
    ref = reference_bytes(bench['results'])
    ref_duplication = layers.at(ref['processes'])['duplication']
    rows = []
    for p in processes:
        shares = layers.at(p)
        rs_bytes = ref['reduce_scatter_v'] * shares['duplication'] / \
            ref_duplication
        row = {'processes': p, 'data_parallel': data_parallel,
               'inverse': t['inverse'] * shares['inverse_share'],
               'precondition': t['precondition'] *
               shares['precondition_share'],
               'reduce_scatter': ring_time(p, rs_bytes, alpha, beta),
               'all_gather': ring_time(p, ref['all_gather_v'], alpha, beta),
               'reduce_scatter_bytes': rs_bytes}
        row.update(shares)
        row['total'] = sum(row[k] for k in (
            'data_parallel', 'inverse', 'precondition', 'reduce_scatter',
            'all_gather'))
        rows.append(row)
    return rows


def shape_checks(rows: Sequence[Dict]) -> Dict:
    """Compare the modelled curve with the paper's Figure 2.

    Needs P = 1, 4, 64, 256, 512, 1024, 2048 in ``rows``. The speed-ups
    from 1 and from 4 processes to 64 count only beyond
    :data:`SUPERLINEAR_MARGIN` (5 %): ``T(1) / T(64) > 1.05`` and
    ``T(4) / T(64) > 1.05``; a ratio within 5 % of 1 is noise, not shown.
    """
    total = {r['processes']: r['total'] for r in rows}
    over = [p for p in sorted(total) if p >= 4]
    fastest = min(over, key=lambda p: total[p])
    tail = [total[p] for p in (256, 512, 1024, 2048)]
    speedup = total[1] / total[64]
    speedup_4 = total[4] / total[64]
    checks = {
        FASTER_AT_64: speedup_4 > 1 + SUPERLINEAR_MARGIN,
        SUPERLINEAR: speedup > 1 + SUPERLINEAR_MARGIN,
        'fastest between 64 and 256 processes': 64 <= fastest <= 256,
        'slower past 256 (T rises from 256 to 2048)':
            all(a <= b for a, b in zip(tail, tail[1:])) and
            tail[-1] > tail[0],
    }
    return {'checks': checks, 'matches_paper': all(checks.values()),
            'fastest_processes': fastest,
            'speedup_1_to_64': speedup,
            'speedup_4_to_64': speedup_4,
            'superlinear_margin': SUPERLINEAR_MARGIN,
            'paper_speedup_1_to_64': PAPER_SPEEDUP_1_TO_64}


def analyse(bench: Dict, args) -> Dict:
    layers = layer_model_for(bench, args.layer_model, args.bn_fisher,
                             args.inverse_overhead)
    measured = sorted(bench['results'], key=lambda r: r['processes'])
    grid = sorted({2 ** k for k in range(
        int(math.log2(args.max_processes)) + 1)} |
        {1, 4, 64, 256, 512, 1024, 2048} |
        {r['processes'] for r in measured})
    rows = predict(bench, layers, grid, args.alpha, args.beta)
    by_p = {r['processes']: r for r in rows}
    return {
        'figure': 2, 'benchmark': bench['path'],
        'model_name': str(bench.get('model', 'model')),
        'device': bench.get('device'),
        'batch_per_process': bench.get('batch_per_process'),
        'parameters': {'alpha_s': args.alpha, 'beta_bytes_per_s': args.beta,
                       'layers': layers.description,
                       'inverse_overhead_s': args.inverse_overhead,
                       'n_kfac_layers': layers.n_layers,
                       'reference_bytes': reference_bytes(measured)},
        'measured': [{'processes': r['processes'],
                      'oversubscribed': bool(r.get('oversubscribed', False)),
                      'step_time': r['step_time'],
                      'model_time': by_p[r['processes']]['total']}
                     for r in measured],
        'predicted': rows,
        'shape': shape_checks(rows),
    }


# -- output ------------------------------------------------------------------
def plot(result: Dict, max_processes: int):
    figure = _io.new_figure(figsize=(8, 5))
    ax = figure.add_subplot(1, 1, 1)
    rows = [r for r in result['predicted']
            if r['processes'] <= max_processes]
    ps = [r['processes'] for r in rows]
    ax.plot(ps, [r['total'] for r in rows], color='black', linewidth=2,
            label='model: total')
    ax.plot(ps, [r['data_parallel'] for r in rows], color='tab:blue',
            linestyle=':', label='model: forward/backward + factors + update')
    ax.plot(ps, [r['inverse'] + r['precondition'] for r in rows],
            color='tab:green', linestyle='--',
            label='model: inverse + precondition (slowest rank)')
    ax.plot(ps, [r['reduce_scatter'] + r['all_gather'] for r in rows],
            color='tab:red', linestyle='-.',
            label='model: ReduceScatterV + AllGatherV')
    for oversubscribed, marker_face, text in (
            (False, 'tab:orange', 'measured'),
            (True, 'none', 'measured (oversubscribed)')):
        points = [m for m in result['measured']
                  if m['oversubscribed'] == oversubscribed]
        if points:
            ax.plot([m['processes'] for m in points],
                    [m['step_time'] for m in points], linestyle='none',
                    marker='o', markersize=8, markerfacecolor=marker_face,
                    markeredgecolor='tab:orange', label=text)
    ax.set_xscale('log', base=2)
    ax.set_xticks(ps)
    ax.set_xticklabels([str(p) for p in ps], fontsize=8)
    ax.set_xlabel('processes (GPUs)')
    ax.set_ylabel('seconds / iteration')
    params = result['parameters']
    ax.set_title('Figure 2: time per iteration vs processes, {}\n'
                 'α-β model: α = {:g} µs, β = {:g} GB/s; {}'.format(
                     result['model_name'], params['alpha_s'] * 1e6,
                     params['beta_bytes_per_s'] / 1e9, params['layers']),
                 fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    figure.tight_layout()
    return figure


def _verdict(name: str, ok: bool, shape: Dict) -> str:
    """'yes' or 'NO'; for a check that compares two times (from 1 or 4
    processes to 64), a ratio within the margin of 1 either way is said to
    be noise."""
    if ok:
        return 'yes'
    margin = shape['superlinear_margin']
    if name in _RATIO_OF:
        words, key = _RATIO_OF[name]
        if abs(shape[key] - 1) <= margin:
            return 'NO ({} = {:.3f}: within {:g} % of 1, noise)'.format(
                words, shape[key], 100 * margin)
    return 'NO'


def format_table(result: Dict) -> str:
    params = result['parameters']
    ref = params['reference_bytes']
    lines = [
        'Figure 2: time per iteration vs processes ({}, {} per process)'
        .format(result['model_name'], result['batch_per_process']),
        'model parameters: alpha = {:g} s, beta = {:g} bytes/s; layers: {}; '
        'volumes from P = {}: ReduceScatterV {} B, AllGatherV {} B'.format(
            params['alpha_s'], params['beta_bytes_per_s'], params['layers'],
            ref['processes'], ref['reduce_scatter_v'], ref['all_gather_v']),
        '{:>6} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8}'.format(
            'P', 'model [s]', 'data par', 'inverse', 'precond',
            'r-scatter', 'a-gather', 'inv sh')]
    for r in result['predicted']:
        lines.append(
            '{:>6} {:>10.4f} {:>9.4f} {:>9.4f} {:>9.4f} {:>9.4f} {:>9.4f} '
            '{:>8.3f}'.format(r['processes'], r['total'], r['data_parallel'],
                              r['inverse'], r['precondition'],
                              r['reduce_scatter'], r['all_gather'],
                              r['inverse_share']))
    lines.append('measured vs model:')
    for m in result['measured']:
        lines.append('{:>6} measured {:.4f} s, model {:.4f} s{}'.format(
            m['processes'], m['step_time'], m['model_time'],
            ' (oversubscribed)' if m['oversubscribed'] else ''))
    shape = result['shape']
    lines.append('shape vs the paper (superlinear to 64 GPUs, degradation '
                 'past 256):')
    for name, ok in shape['checks'].items():
        lines.append('  {:<54} {}'.format(name, _verdict(name, ok, shape)))
    lines.append('  fastest at P = {}; T(1)/T(64) = {:.3f} (paper {:.3f})'
                 .format(shape['fastest_processes'], shape['speedup_1_to_64'],
                         shape['paper_speedup_1_to_64']))
    lines.append('shape matches the paper: {}'.format(
        'yes' if shape['matches_paper'] else 'no'))
    return '\n'.join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog='python -m analysis.scaling',
        description='Figure 2: measured time per iteration vs processes and '
        'an alpha-beta model extrapolated to 2048 processes.')
    parser.add_argument('benchmark', help='dist_scaling benchmark JSON')
    parser.add_argument('--alpha', type=float, default=DEFAULT_ALPHA,
                        help='latency per ring step in seconds (default '
                        '%(default)g: InfiniBand EDR plus collective '
                        'overhead)')
    parser.add_argument('--beta', type=float, default=DEFAULT_BETA,
                        help='bandwidth in bytes/s (default %(default)g: '
                        '100 Gb/s EDR)')
    parser.add_argument('--layer-model', default=None,
                        help='take the layer structure (inverse / '
                        'precondition costs) from this model: one of '
                        + ', '.join(_models.ARCHS) +
                        ' (default: the benchmark\'s "model")')
    parser.add_argument('--bn-fisher', choices=('full', 'diag'),
                        default=None, help='BN Fisher of the layer model '
                        '(default: the benchmark\'s, else full)')
    parser.add_argument('--inverse-overhead', type=float, default=0.0,
                        help='fixed seconds per inverted factor (a '
                        'latency-bound GPU call); the rest of the measured '
                        'inverse time is spread in proportion to n^3 '
                        '(default 0: the optimizer\'s cost model)')
    parser.add_argument('--max-processes', type=int, default=2048,
                        help='extrapolate to this many processes (a power '
                        'of 2 >= 2048 keeps the paper\'s range; default '
                        '%(default)s)')
    parser.add_argument('--out', default='fig2_scaling.png',
                        help='PNG path; numbers go to the same name .json '
                        '(default: %(default)s, in the current directory)')
    args = parser.parse_args(argv)
    if not (0 <= args.alpha < math.inf and 0 < args.beta < math.inf and
            0 <= args.inverse_overhead < math.inf):
        # (a NaN passed every comparison: --alpha nan gave NaN rows)
        parser.error('--alpha and --inverse-overhead must be finite and >= '
                     '0, --beta finite and > 0')
    if args.max_processes < 2048:
        parser.error('--max-processes must be at least 2048 (the paper\'s '
                     'range)')
    return args


@_io.cli('scaling')
def main(argv=None):
    """Print and plot Figure 2 from a benchmark file."""
    args = parse_args(argv)
    _io.check_outputs(args.out, [args.benchmark])
    bench = load_benchmark(args.benchmark)
    result = analyse(bench, args)
    json_path = _io.save_outputs(plot(result, args.max_processes), args.out,
                                 result)
    print(format_table(result))
    print('wrote {} and {}'.format(args.out, json_path))
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
