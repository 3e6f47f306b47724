"""How long a job takes to end when one rank fails: the figures the tests
used to assert as time limits (they now assert the behaviour, and a hang
fails them by their launcher's timeout).

    python -m benchmarks.failure_latency [--smoke] [--out FILE.json]
        [--repeats 3]

Each case is an ``mpiexec -n 2`` job timed from launch to ``mpiexec``'s
exit (wall seconds, median of ``--repeats``):

* ``create``: rank 1 raises right after
  :func:`chainerkfac.create_communicator` while rank 0 waits in a barrier
  (ChainerMN's except hook, installed by ``create_communicator``, aborts
  the job; without it rank 0 would wait forever);
* ``training``: rank 1 raises in its loss function at the third step of a
  distributed K-FAC loop while rank 0 waits in the step's collectives.

Each runs once failing (rank 1 raises) and, without ``--smoke``, once
clean (the same script to its end, no failure): ``abort_s - clean_s`` is
what the failure costs beyond starting and running the job. The snapshot
writer's blocking of the training loop, the other figure a test asserted,
is ``blocked_s`` of ``python -m benchmarks.snapshot``.
"""
import os
import subprocess
import sys
import tempfile
from typing import Dict

from benchmarks import _args
from benchmarks import _common

#: The scripts of the cases; ``FAIL`` is 1 for the failing run.
SCRIPTS = {
    'create': '''
from chainerkfac.communicators import create_communicator
comm = create_communicator('naive')
if comm.rank == 1 and FAIL:
    raise RuntimeError('deliberate failure on rank 1')
comm.mpi_comm.Barrier()
''',
    'training': '''
import chainerkfac
import chainer
import chainer.links as L
import numpy
from chainerkfac.communicators import create_communicator
comm = create_communicator('naive')
numpy.random.seed(0)
model = L.Classifier(chainer.Sequential(L.Linear(8, 16), L.Linear(16, 3)))
optimizer = chainerkfac.create_multi_node_optimizer(
    chainerkfac.optimizers.KFAC(verbose=False), comm)
optimizer.setup(model)
rng = numpy.random.RandomState(comm.rank)


def loss(x, t):
    if comm.rank == 1 and optimizer.t == 2 and FAIL:
        raise RuntimeError('deliberate failure on rank 1')
    return model(x, t)


for step in range(4):
    x = rng.rand(4, 8).astype(numpy.float32)
    t = rng.randint(0, 3, 4).astype(numpy.int32)
    optimizer.update(loss, x, t)
''',
}
#: A job past this is killed and reported as hung.
TIMEOUT_S = 120


def launch(script: str, fail: bool, directory: str) -> Dict:
    """One ``mpiexec -n 2`` job of ``script``: wall seconds, exit status,
    whether rank 1's message reached the output."""
    path = os.path.join(directory, 'job.py')
    with open(path, 'w') as f:
        f.write('FAIL = {}\n'.format(int(fail)) + script)
    try:
        proc, seconds = _common.run_mpiexec(
            [_common.mpiexec_path(), '-n', '2', sys.executable, path],
            _common.worker_env(threads=1), timeout=TIMEOUT_S)
        returncode, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired:
        seconds, returncode, output = TIMEOUT_S, None, ''
    return {'seconds': seconds,
            'returncode': returncode,
            'message_seen': 'deliberate failure on rank 1' in output}


def measure(case: str, repeats: int, clean: bool, directory: str) -> Dict:
    runs = {'abort': [launch(SCRIPTS[case], True, directory)
                      for _ in range(repeats)]}
    if clean:
        runs['clean'] = [launch(SCRIPTS[case], False, directory)
                         for _ in range(repeats)]
    out = {'case': case, 'runs': runs}
    for kind, results in runs.items():
        out[kind + '_s'] = _common.median([r['seconds'] for r in results])
    return out


def main(argv=None):
    parser = _common.argument_parser('benchmarks.failure_latency', __doc__)
    parser.add_argument('--smoke', action='store_true',
                        help='one failing run of each case, no clean runs '
                             '(overrides --repeats)')
    parser.add_argument('--out', default='result/failure_latency.json',
                        help='JSON output (default: %(default)s)')
    parser.add_argument('--repeats', type=_args.positive_int, default=3,
                        help='failing and clean jobs per case; the times '
                             'are their medians (default: %(default)s)')
    args = parser.parse_args(argv)
    _args.check_paths(parser, args)
    repeats = 1 if args.smoke else args.repeats
    data = _common.header('failure_latency', sys.argv[1:] if argv is None
                          else argv)
    with tempfile.TemporaryDirectory(prefix='failure_latency.') as directory:
        data['results'] = [measure(case, repeats, not args.smoke, directory)
                           for case in SCRIPTS]
    print(_common.describe_machine(data))
    print(_common.format_table(
        ['case', 'abort s', 'clean s', 'all aborts failed with the message'],
        [[r['case'], r['abort_s'], r.get('clean_s'),
          all(a['returncode'] not in (0, None) and a['message_seen']
              for a in r['runs']['abort'])] for r in data['results']]))
    _common.write_json(args.out, data)
    print('wrote', args.out)
    return 0


if __name__ == '__main__':
    sys.exit(main())
