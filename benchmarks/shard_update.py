"""Weight-update sharding against the unsharded update, under ``mpiexec``:
update time, optimizer-state memory per process and step time.

    python -m benchmarks.shard_update [--smoke] [--out FILE.json]
        [--processes 2,4] [--model resnet50|small] [--rounds N]
        [--timeout S]

For each ``P`` the benchmark launches itself under ``mpiexec -n P`` (one
BLAS thread per rank; more ranks than cores run oversubscribed and are
flagged). Every rank builds, per optimizer, two copies of the model from
the same seed — one with the update sharded (``shard_update=True``), one
without — and steps them alternately in rounds after a barrier, so both see
the same load (ratios within one launch, never across launches). The
optimizers:

* ``momentum_sgd``: ``GuardedOptimizer(MomentumSGD)`` with Chainer's
  ``WeightDecay`` hook (Goyal et al.);
* ``lars``: ``GuardedOptimizer(LARS(momentum_form='scaled'))``;
* ``kfac``: ``create_multi_node_optimizer(KFAC(...))`` at the stale steady
  state (factors refreshed at the first step only; eq. 20 on), where the
  update is the largest share of a step.

The model is ResNet-50 (25.6M parameters) on 32x32 inputs, 2 images per
process: a small per-process batch, where the seed measured the update at
~6 % of the step, and inputs small enough for a CPU. Figures (median over
rounds of the slowest rank):

* ``step``: the wall time of ``optimizer.update(model, x, t)`` (forward,
  backward, communication, update);
* ``update rules``: the update rules alone (``param.update()``, K-FAC's
  with a direction given) over the parameters the process updates — all
  of them unsharded, its own sharded — timed apart from the step after
  the rounds: no communication, no waiting for another rank;
* ``update``: the step's stage that applies the update (it includes the
  check that every process's direction is finite, a synchronisation, and
  the baselines' per-parameter hooks), ``all_gather``: the AllGatherV
  (K-FAC unsharded: of the preconditioned gradients; sharded: of the
  weights), ``mean``: the baselines' gradient average (all-reduce
  unsharded, reduce-scatter sharded; it waits for the slowest backward);
* ``state``: bytes of the optimizer state (the update rules' velocities)
  on the process holding the most, against the unsharded process's.
"""
import argparse
import gc
import sys
import time
from typing import Dict, List

from benchmarks import _args
from benchmarks import _common

OPTIMIZERS = ('momentum_sgd', 'lars', 'kfac')
VARIANTS = ('unsharded', 'sharded')
STAGES = ('mean', 'reduce_scatter', 'update', 'all_gather')
FULL = {'model': 'resnet50', 'depth': 8, 'width': 16, 'batch': 2,
        'size': 32, 'n_class': 10, 'rounds': 8, 'warmup': 1}
SMOKE = {'model': 'small', 'depth': 8, 'width': 4, 'batch': 4, 'size': 16,
         'n_class': 10, 'rounds': 2, 'warmup': 1}
STALE_INTERVAL = 100000


# -- inside the mpiexec job ---------------------------------------------------
def worker(spec: Dict, out: str) -> int:
    """One rank of the job; rank 0 writes the launch's figures to ``out``."""
    import chainerkfac  # before chainer: NumPy-2 compatibility shims
    import chainer
    import numpy

    import models
    from chainerkfac import sharding
    from chainerkfac.optimizers import KFAC, LARS, GuardedOptimizer

    comm = chainerkfac.create_communicator('naive')
    rng = numpy.random.RandomState(100 + comm.rank)
    x = rng.standard_normal((spec['batch'], 3, spec['size'], spec['size'])
                            ).astype(numpy.float32)
    t = rng.randint(0, spec['n_class'], spec['batch']).astype(numpy.int32)

    def make(name, shard):
        numpy.random.seed(0)
        model = models.SoftLabelClassifier(models.build_model(
            spec['model'], n_class=spec['n_class'], depth=spec['depth'],
            width=spec['width']))
        if name == 'kfac':
            optimizer = chainerkfac.create_multi_node_optimizer(KFAC(
                lr=1e-3, momentum=0.9, damping=1e-2, verbose=False,
                weight_rescale=True, refresh_interval_a=STALE_INTERVAL,
                refresh_interval_g=STALE_INTERVAL,
                refresh_interval_f=STALE_INTERVAL, shard_update=shard), comm)
            optimizer.setup(model)
            return model, optimizer
        actual = (chainer.optimizers.MomentumSGD(lr=1e-3, momentum=0.9)
                  if name == 'momentum_sgd' else
                  LARS(lr=0.1, momentum=0.9, weight_decay=1e-4, eta=1e-3,
                       momentum_form='scaled'))
        optimizer = GuardedOptimizer(actual, 1, comm, shard_update=shard)
        optimizer.setup(model)
        if name == 'momentum_sgd':
            optimizer.add_hook(chainer.optimizer_hooks.WeightDecay(1e-4))
        return model, optimizer

    def step(model, optimizer):
        comm.mpi_comm.Barrier()
        start = time.perf_counter()
        optimizer.update(model, x, t)
        return {'wall': time.perf_counter() - start,
                'stages': dict(optimizer.stage_times)}

    def updated_here(model, optimizer):
        """The parameters this process updates."""
        if isinstance(optimizer, KFAC):
            return [p for b in optimizer.blocks
                    if not optimizer.shard_update or
                    optimizer.transport.updates(b) for p in b.params]
        params = [p for _, p in sorted(model.namedparams())]
        if not optimizer.sharded:
            return params
        return [params[i] for i in optimizer.owners.params_of(comm.rank)]

    def update_compute(model, optimizer):
        """Seconds of the update rules alone on the parameters this
        process updates (no communication, no waiting for others)."""
        params = updated_here(model, optimizer)
        times = []
        for _ in range(spec['rounds']):
            start = time.perf_counter()
            for param in params:
                if isinstance(optimizer, KFAC):
                    param.update_rule.direction = param.grad
                param.update()
            times.append(time.perf_counter() - start)
        return _common.median(times)

    records, state, compute, n_params = {}, {}, {}, 0
    for name in OPTIMIZERS:
        pair = {v: make(name, v == 'sharded') for v in VARIANTS}
        for variant in VARIANTS:
            for _ in range(spec['warmup']):
                step(*pair[variant])
        records[name] = {v: [] for v in VARIANTS}
        for r in range(spec['rounds']):
            order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
            for variant in order:
                records[name][variant].append(step(*pair[variant]))
        state[name] = {v: sharding.state_nbytes(pair[v][0].params())
                       for v in VARIANTS}
        compute[name] = {v: update_compute(*pair[v]) for v in VARIANTS}
        n_params = sum(p.size for p in pair['sharded'][0].params())
        del pair
        gc.collect()

    gathered = comm.mpi_comm.gather((records, state, compute), root=0)
    if comm.rank == 0:
        _common.write_json(out, summarise_launch(gathered, comm.size,
                                                 n_params))
    comm.mpi_comm.Barrier()
    return 0


def summarise_launch(gathered: List, size: int, n_params: int) -> Dict:
    """Per optimizer and variant: medians over rounds of the slowest rank,
    and the state bytes of the fullest rank."""
    result = {'processes': size, 'parameters': int(n_params),
              'optimizers': {}}
    for name in OPTIMIZERS:
        entry = {}
        for variant in VARIANTS:
            per_rank = [records[name][variant] for records, _, _ in gathered]
            rounds = len(per_rank[0])

            def slowest(value):
                return _common.median([max(value(rank[i]) for rank in
                                           per_rank) for i in range(rounds)])
            figures = {'step_s': slowest(lambda r: r['wall'])}
            for stage in STAGES:
                if stage in per_rank[0][0]['stages']:
                    figures[stage + '_s'] = slowest(
                        lambda r, s=stage: r['stages'].get(s, 0.0))
            states = [state[name][variant] for _, state, _ in gathered]
            figures['state_bytes_max'] = int(max(states))
            figures['state_bytes_per_rank'] = [int(s) for s in states]
            computes = [c[name][variant] for _, _, c in gathered]
            figures['update_compute_s_max'] = max(computes)
            figures['update_compute_s_per_rank'] = computes
            entry[variant] = figures
        plain, sharded = entry['unsharded'], entry['sharded']
        entry['ratios'] = {
            'step': sharded['step_s'] / plain['step_s'],
            'update': sharded['update_s'] / plain['update_s'],
            'update_and_all_gather': (
                (sharded['update_s'] + sharded['all_gather_s']) /
                (plain['update_s'] + plain.get('all_gather_s', 0.0))),
            'update_compute': sharded['update_compute_s_max'] /
            plain['update_compute_s_max'],
            'state': sharded['state_bytes_max'] / max(
                plain['state_bytes_max'], 1)}
        result['optimizers'][name] = entry
    return result


#: The options a launch passes on to its workers (over the sizes).
OPTION_KEYS = ('rounds', 'model')


def launch(processes: int, args, timeout: float) -> Dict:
    """Run the worker under ``mpiexec -n processes``; its figures."""
    return _common.launch_worker(
        'benchmarks.shard_update', processes,
        _common.worker_options(args, OPTION_KEYS), timeout)


def tables(data: Dict) -> str:
    rows = []
    for result in data['results']:
        for name in OPTIMIZERS:
            entry = result['optimizers'][name]
            plain, sharded = entry['unsharded'], entry['sharded']
            rows.append([
                result['processes'], name, plain['step_s'],
                sharded['step_s'], entry['ratios']['step'],
                plain['update_compute_s_max'],
                sharded['update_compute_s_max'],
                entry['ratios']['update_compute'],
                plain['update_s'], sharded['update_s'],
                plain.get('all_gather_s'), sharded['all_gather_s'],
                plain['state_bytes_max'] / 2 ** 20,
                sharded['state_bytes_max'] / 2 ** 20,
                entry['ratios']['state']])
    return ('Weight-update sharding, {} ({} parameters), {} images of {}x{} '
            'per process; medians over {} rounds of the slowest rank\n{}'
            .format(data['model'], data['results'][0]['parameters'],
                    data['batch_per_process'], data['input'][1],
                    data['input'][2], data['rounds'],
                    _common.format_table(
                        ['P', 'optimizer', 'step [s]', 'sharded', 'ratio',
                         'update rules [s]', 'sharded', 'ratio',
                         'update stage [s]', 'sharded', 'all-gather [s]',
                         'sharded', 'state [MiB/proc]', 'sharded', 'ratio'],
                        rows)))


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog='python -m benchmarks.shard_update', description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--smoke', action='store_true',
                        help='tiny model and batch, 2 rounds, -n 2')
    parser.add_argument('--out', default='result/shard_update.json',
                        help='JSON output (default result/shard_update.json)')
    parser.add_argument('--processes', type=_args.int_list(2), default=None,
                        help='comma-separated process counts, each at least '
                        '2 (sharding splits the update among processes; '
                        'default 2,4; smoke 2)')
    parser.add_argument('--model', choices=('resnet50', 'small'),
                        default=None, help='default resnet50; smoke small')
    parser.add_argument('--rounds', type=_args.positive_int, default=None,
                        help='timed rounds per launch (default 8; smoke 2)')
    parser.add_argument('--timeout', type=_args.positive_float, default=1200,
                        help='seconds per mpiexec launch')
    parser.add_argument('--worker', metavar='OUT', help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.worker:
        _args.check_paths(parser, args)
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    spec = _common.spec_from(args, SMOKE, FULL, OPTION_KEYS)
    if args.worker:
        return worker(spec, args.worker)
    counts = args.processes or ([2] if args.smoke else [2, 4])
    data = _common.header('shard_update', argv)
    data.update(model=spec['model'], batch_per_process=spec['batch'],
                input=[3, spec['size'], spec['size']], rounds=spec['rounds'],
                smoke=args.smoke,
                device='{} ({} cores), naive (MPI) communicator, 1 BLAS '
                'thread per rank'.format(_common.cpu_model(),
                                         _common.usable_cores()),
                statistic='median over rounds of the slowest rank',
                results=[])
    data['failed'] = []
    for p in counts:
        try:
            data['results'].append(launch(p, args, args.timeout))
        except RuntimeError as error:
            # The other launches' figures still count.
            print(error, flush=True)
            data['failed'].append({'processes': p, 'error': str(error)})
    print(_common.describe_machine(data))
    if data['results']:
        print(tables(data))
    _common.write_json(args.out, data)
    print('wrote {}'.format(args.out))
    return 1 if data['failed'] else 0


if __name__ == '__main__':
    sys.exit(main())
