"""Distributed K-FAC step under ``mpiexec -n 1, 2, 4``: stage times per
rank and bytes on the wire.

    python -m benchmarks.dist_scaling [--smoke] [--out FILE.json]
        [--processes 1,2,4] [--rounds N] [--depth 8] [--width 16]
        [--timeout S]

The benchmark launches itself under ``mpiexec -n P`` for each ``P`` (with a
timeout; more ranks than cores is run oversubscribed and flagged as such),
one BLAS thread per rank. Each rank trains the small ResNet (depth 8,
width 16, 32x32 inputs, 128 images per process: weak scaling, as the
paper's 32 images per GPU) with
``create_multi_node_optimizer(KFAC(...), comm)`` over the ``naive`` (MPI)
communicator, every factor refreshed every step (the step of Figure 2).

**Same-run reference.** In a launch with ``P > 1`` each rank also holds a
1-process K-FAC (the same optimizer over a ``MPI.COMM_SELF``
communicator, so the same code path as ``-n 1``) on its own copy of the
model, and the two are stepped alternately in rounds, after a barrier. All
ranks run the reference at once, so it sees the same load on the cores as
the distributed step; the ratio ``inverse + precondition`` of the slowest
rank over the reference's is the model-parallel speed-up measured in one
run (goal at 2 ranks: ≤ 0.6). The cost model's bound for the same
assignment (the heaviest rank's share of the summed ``n³``) is printed
beside it. Across launches (``-n 2`` vs ``-n 1``) the same ratio is given
too, with the usual caveat that timings of different runs do not compare
well on a shared machine.

**Bytes.** Three more optimizers per launch, each stepped twice (a
refresh step then a stale one; refresh interval 1000), over communicators
that differ only on the wire: packed fp32 (symmetric factors as upper
triangles, the default), packed fp16 (``wire_dtype='float16'``), and
unpacked fp32 (every factor sent as its full ``N x N`` matrix; a
benchmark-only subclass that drops the symmetric flags — the same
collective, really sent, really counted). Counts follow
``communicator.bytes_sent``: ``reduce_scatter_v`` is the whole send buffer
of one rank, ``all_gather_v`` is summed over ranks (every block's
direction once). Goals: packed fp32 ≤ 0.51x and packed fp16 ≤ 0.26x of
unpacked fp32.

The output is the input of ``python -m analysis.scaling`` (its schema: one
result per ``P`` with ``step_time``, ``stage_times``, ``bytes`` and
``n_kfac_layers``; the slowest rank, *median* over steps rather than the
mean) plus this benchmark's own fields.
"""
import argparse
import sys
import time
from typing import Dict, List

from benchmarks import _args
from benchmarks import _common

STAGES = ('forward_backward', 'factors', 'reduce_scatter', 'inverse',
          'precondition', 'all_gather', 'update')
WIRES = ('packed_fp32', 'packed_fp16', 'unpacked_fp32')
GOAL_MODEL_PARALLEL = 0.6
GOAL_BYTES = {'packed_fp32': 0.51, 'packed_fp16': 0.26}
FULL = {'depth': 8, 'width': 16, 'n_class': 10, 'batch': 128, 'size': 32,
        'rounds': 15, 'warmup': 1}
SMOKE = {'depth': 8, 'width': 4, 'n_class': 10, 'batch': 8, 'size': 16,
         'rounds': 2, 'warmup': 1}
STALE_INTERVAL = 1000


# -- inside the mpiexec job -----------------------------------------------------------
def _unpacked_communicator_class():
    from chainerkfac.communicators.naive import KfacNaiveCommunicator

    class UnpackedCommunicator(KfacNaiveCommunicator):
        """Sends symmetric factors as full matrices (what packing saves)."""

        def reduce_scatter_v(self, arrays, owners, symmetric=None):
            return super().reduce_scatter_v(arrays, owners, None)

    return UnpackedCommunicator


def worker(spec: Dict, out: str) -> int:
    """One rank of the job; rank 0 writes the launch's figures to ``out``."""
    import chainerkfac  # before chainer: NumPy-2 compatibility shims
    import numpy
    from mpi4py import MPI

    import models
    from chainerkfac.optimizers import KFAC

    comm = chainerkfac.create_communicator('naive')
    rank, size = comm.rank, comm.size
    rng = numpy.random.RandomState(100 + rank)
    x = rng.standard_normal((spec['batch'], 3, spec['size'], spec['size'])
                            ).astype(numpy.float32)
    t = rng.randint(0, spec['n_class'], spec['batch']).astype(numpy.int32)

    def make(communicator, interval=1):
        numpy.random.seed(0)
        model = models.SoftLabelClassifier(models.build_model(
            'small', n_class=spec['n_class'], depth=spec['depth'],
            width=spec['width']))
        optimizer = chainerkfac.create_multi_node_optimizer(KFAC(
            lr=0.001, momentum=0.9, damping=1e-3, verbose=False,
            max_factor_dim=None, refresh_interval_a=interval,
            refresh_interval_g=interval, refresh_interval_f=interval),
            communicator)
        optimizer.setup(model)
        return model, optimizer

    variants = {'distributed': make(comm)}
    if size > 1:
        variants['reference'] = make(chainerkfac.create_communicator(
            'naive', mpi_comm=MPI.COMM_SELF))

    def step(name):
        model, optimizer = variants[name]
        comm.mpi_comm.Barrier()
        start = time.perf_counter()
        optimizer.update(model, x, t)
        return {'wall': time.perf_counter() - start,
                'stages': dict(optimizer.stage_times)}

    for name in variants:
        for _ in range(spec['warmup']):
            step(name)
    records = {name: [] for name in variants}
    names = list(variants)
    for r in range(spec['rounds']):
        for name in names[r % len(names):] + names[:r % len(names)]:
            records[name].append(step(name))

    wire_bytes = {}
    unpacked = _unpacked_communicator_class()
    communicators = {
        'packed_fp32': chainerkfac.create_communicator('naive'),
        'packed_fp16': chainerkfac.create_communicator(
            'naive', wire_dtype='float16'),
        'unpacked_fp32': unpacked(MPI.COMM_WORLD, wire_dtype='float32')}
    for wire in WIRES:
        communicator = communicators[wire]
        model, optimizer = make(communicator, STALE_INTERVAL)
        wire_bytes[wire] = {}
        for kind in ('refresh', 'stale'):
            communicator.reset_byte_counts()
            optimizer.update(model, x, t)
            sent = communicator.bytes_sent
            wire_bytes[wire][kind] = {
                'reduce_scatter_v': int(sent['reduce_scatter_v']),
                'all_gather_v': int(comm.mpi_comm.allreduce(
                    int(sent['all_gather_v'])))}

    optimizer = variants['distributed'][1]
    assignment = optimizer.transport.assignment
    gathered = comm.mpi_comm.gather(records, root=0)
    if rank == 0:
        result = summarise_launch(gathered, size)
        result.update(
            bytes=wire_bytes['packed_fp32']['refresh'],
            bytes_by_wire=wire_bytes,
            n_kfac_layers=sum(1 for b in optimizer.blocks if b.factor_names),
            cost_model_share=max(assignment.loads) / (
                sum(assignment.costs) or 1.0),
            assignment=assignment.describe())
        _common.write_json(out, result)
    comm.mpi_comm.Barrier()
    return 0


def summarise_launch(gathered: List[Dict], size: int) -> Dict:
    """Medians over steps of the slowest rank, and per-rank figures."""
    def slowest(records_by_rank, key):
        n = len(records_by_rank[0])
        return [max(key(records_by_rank[r][i]) for r in range(size))
                for i in range(n)]

    def model_parallel(record):
        return record['stages'].get('inverse', 0.0) + \
            record['stages'].get('precondition', 0.0)

    out = {'processes': size}
    for name in gathered[0]:
        by_rank = [g[name] for g in gathered]
        figures = {
            'step_time': _common.median(slowest(by_rank,
                                                lambda r: r['wall'])),
            'stage_times': {s: _common.median(slowest(
                by_rank, lambda r, s=s: r['stages'].get(s, 0.0)))
                for s in STAGES},
            'inverse_precondition': _common.median(slowest(
                by_rank, model_parallel)),
            'per_rank': [{
                'rank': r,
                'step_time': _common.median([x['wall'] for x in by_rank[r]]),
                'inverse_precondition': _common.median(
                    [model_parallel(x) for x in by_rank[r]]),
                'stage_times': {s: _common.median(
                    [x['stages'].get(s, 0.0) for x in by_rank[r]])
                    for s in STAGES}} for r in range(size)],
            'steps': len(by_rank[0])}
        if name == 'distributed':
            out.update(figures)
        else:
            out['reference_1_process'] = figures
    if 'reference_1_process' in out:
        dist = [g['distributed'] for g in gathered]
        ref = [g['reference'] for g in gathered]
        ratios = [a / b for a, b in zip(slowest(dist, model_parallel),
                                        slowest(ref, model_parallel))]
        out['inverse_precondition_ratio'] = _common.median(ratios)
        out['step_time_ratio'] = _common.median(
            [a / b for a, b in zip(slowest(dist, lambda r: r['wall']),
                                   slowest(ref, lambda r: r['wall']))])
    else:
        out['inverse_precondition_ratio'] = 1.0
        out['step_time_ratio'] = 1.0
    return out


# -- the launcher ----------------------------------------------------------------------
#: The options a launch passes on to its workers (over the sizes).
OPTION_KEYS = ('rounds', 'depth', 'width')


def launch(processes: int, args, timeout: float) -> Dict:
    """Run the worker under ``mpiexec -n processes``; its figures."""
    return _common.launch_worker(
        'benchmarks.dist_scaling', processes,
        _common.worker_options(args, OPTION_KEYS), timeout)


def byte_ratios(result: Dict) -> Dict:
    """Packed over unpacked, per refresh step: whole step, ReduceScatterV
    alone, and its factor part (refresh minus stale ReduceScatterV)."""
    wires = result['bytes_by_wire']

    def parts(wire):
        refresh, stale = wires[wire]['refresh'], wires[wire]['stale']
        return {'step': refresh['reduce_scatter_v'] + refresh['all_gather_v'],
                'reduce_scatter_v': refresh['reduce_scatter_v'],
                'factors': refresh['reduce_scatter_v'] -
                stale['reduce_scatter_v']}
    base = parts('unpacked_fp32')
    return {wire: {k: v / base[k] if base[k] else None
                   for k, v in parts(wire).items()}
            for wire in ('packed_fp32', 'packed_fp16')}


def tables(data: Dict) -> str:
    results = data['results']
    one = next((r for r in results if r['processes'] == 1), None)
    rows = []
    for r in results:
        across = (r['inverse_precondition'] / one['inverse_precondition']
                  if one and one['inverse_precondition'] > 0 else None)
        goal = '-'
        if r['processes'] == 2:
            goal = '<= {:g}: {}'.format(
                GOAL_MODEL_PARALLEL, 'met' if r['inverse_precondition_ratio']
                <= GOAL_MODEL_PARALLEL else 'NOT met')
        rows.append([r['processes'], r['oversubscribed'], r['step_time'],
                     r['inverse_precondition'],
                     ' / '.join('{:.3g}'.format(p['inverse_precondition'])
                                for p in r['per_rank']),
                     r['inverse_precondition_ratio'], r['cost_model_share'],
                     goal, across, r['step_time_ratio']])
    timing = _common.format_table(
        ['P', 'oversubscribed', 'step [s]', 'inv+prec slowest [s]',
         'inv+prec per rank [s]', 'inv+prec / 1-proc (same run)',
         'cost-model bound', 'goal', 'inv+prec / -n 1 launch',
         'step / 1-proc (same run)'], rows)
    stage_rows = [[r['processes']] + [r['stage_times'][s] for s in STAGES]
                  for r in results]
    stages = _common.format_table(['P'] + list(STAGES), stage_rows)
    byte_rows = []
    for r in results:
        ratios = byte_ratios(r)
        for wire in WIRES:
            w = r['bytes_by_wire'][wire]
            row = [r['processes'], wire,
                   w['refresh']['reduce_scatter_v'],
                   w['refresh']['all_gather_v'],
                   w['stale']['reduce_scatter_v'],
                   w['stale']['all_gather_v']]
            if wire in ratios:
                q = ratios[wire]
                row += [q['step'], q['reduce_scatter_v'], q['factors'],
                        '<= {:g}: {}'.format(
                            GOAL_BYTES[wire],
                            'met' if q['step'] <= GOAL_BYTES[wire] else
                            'NOT met (step); {} (factors)'.format(
                                'met' if q['factors'] <= GOAL_BYTES[wire]
                                else 'NOT met'))]
            else:
                row += [1.0, 1.0, 1.0, '-']
            byte_rows.append(row)
    wire = _common.format_table(
        ['P', 'wire', 'refresh RS [B]', 'refresh AG [B]', 'stale RS [B]',
         'stale AG [B]', 'step / unpacked', 'RS / unpacked',
         'factors / unpacked', 'goal'], byte_rows)
    kwargs = data['model_kwargs']
    return ('Distributed K-FAC step, small ResNet (depth {}, width {}, {} '
            'K-FAC layers), {} images per process; slowest rank, medians '
            'over steps (1 BLAS thread per rank)\n{}\n\n'
            'Stage times [s], slowest rank, medians\n{}\n\n'
            'Bytes per step (RS: ReduceScatterV send buffer of one rank; '
            'AG: AllGatherV summed over ranks)\n{}'.format(
                kwargs['depth'], kwargs['width'],
                results[0]['n_kfac_layers'], data['batch_per_process'],
                timing, stages, wire))


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog='python -m benchmarks.dist_scaling', description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--smoke', action='store_true',
                        help='tiny model and batch, 2 rounds, -n 1,2')
    parser.add_argument('--out', default='result/dist_scaling.json',
                        help='JSON output (default result/dist_scaling.json)')
    parser.add_argument('--processes', type=_args.int_list(1), default=None,
                        help='comma-separated process counts (default 1,2,4; '
                        'smoke 1,2); 1 is always included')
    parser.add_argument('--rounds', type=_args.positive_int, default=None,
                        help='timed rounds per launch (default 15; smoke 2)')
    parser.add_argument('--depth', type=_args.positive_int, default=None,
                        help='depth of the small ResNet, 6n+2 (default 8)')
    parser.add_argument('--width', type=_args.positive_int, default=None,
                        help='width of the small ResNet (default 16; smoke 4)')
    parser.add_argument('--timeout', type=_args.positive_float, default=600,
                        help='seconds per mpiexec launch')
    parser.add_argument('--worker', metavar='OUT', help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.worker:
        import chainerkfac  # NOQA  (before chainer: NumPy-2 shims)
        from models.small_resnet import check_size
        spec = _common.spec_from(args, SMOKE, FULL, OPTION_KEYS)
        try:
            check_size(spec['depth'], spec['width'])
        except ValueError as error:
            parser.error(str(error))
        _args.check_paths(parser, args)
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    spec = _common.spec_from(args, SMOKE, FULL, OPTION_KEYS)
    if args.worker:
        return worker(spec, args.worker)
    counts = sorted({1} | set(args.processes or (
        [1, 2] if args.smoke else [1, 2, 4])))
    data = _common.header('dist_scaling', argv)
    data.update(model='small', model_kwargs={
        k: spec[k] for k in ('depth', 'width', 'n_class')},
        bn_fisher='full', batch_per_process=spec['batch'],
        input=[3, spec['size'], spec['size']], smoke=args.smoke,
        device='{} ({} cores), naive (MPI) communicator, 1 BLAS thread per '
        'rank'.format(_common.cpu_model(), _common.usable_cores()),
        statistic='median over steps of the slowest rank', results=[])
    for p in counts:
        data['results'].append(launch(p, args, args.timeout))
    for r in data['results']:
        r['byte_ratios'] = byte_ratios(r)
    print(_common.describe_machine(data))
    print(tables(data))
    _common.write_json(args.out, data)
    print('wrote {}'.format(args.out))
    return 0


if __name__ == '__main__':
    sys.exit(main())
