"""What the layer-parallel experiments share: the seed's two networks and
their data, the results folder, the run header, JSON output, progress
logging and ``mpiexec`` launches of a script's worker."""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import datetime
import logging
import os
import platform
import subprocess
import sys
from typing import Dict, List, Sequence

import numpy

import chainer

from benchmarks import _args
from benchmarks import _common
from chainerkfac import layer_parallel as lp
from chainerkfac.layer_parallel import data

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, 'experiments', 'results', 'layer_parallel')

#: The seed's test cases that exist here. Peaks: its network (width 8,
#: smoothed ReLU, dense K_n, T = 5) and its s = 5000 points. Digits stand
#: in for MNIST (no download here): its network (8 channels, 3 × 3
#: convolutions, tanh, T = 5) on 8 × 8 images; 100 images, not 500, so
#: that 2048 layers of states fit in memory here.
CASES = {
    'peaks': dict(net=dict(n_in=2, width=8, n_out=5, t_final=5.0,
                           activation='smooth_relu', layer='dense'),
                  batch=5000),
    'digits': dict(net=dict(n_in=1, width=8, n_out=10, t_final=5.0,
                            activation='tanh', layer='conv', image_size=8),
                   batch=50),
}

#: The weights of :func:`make_net`: smooth in the layer index, or drawn
#: per layer.
WEIGHTS = ('smooth', 'independent')

logger = logging.getLogger('experiments.layer_parallel')


def make_net(case: str, n_layers: int, weights: str = 'smooth',
             seed: int = 0) -> lp.ResidualODE:
    """The case's network, float64, weights drawn from ``seed``:
    ``'smooth'`` in the layer index (the seed's regularised regime) or
    ``'independent'`` per layer (see :class:`ResidualODE`)."""
    numpy.random.seed(seed)
    with chainer.using_config('dtype', numpy.float64):
        return lp.ResidualODE(n_layers=n_layers, weights=weights,
                              **CASES[case]['net'])


def add_training_options(parser, outputs: str) -> None:
    """The options the two training experiments share: MGRIT's iterations
    per solve, the validation interval, ``--out`` (the folder of
    ``outputs``) and the launch's timeout."""
    parser.add_argument('--m1', type=_args.positive_int, default=2,
                        help='MGRIT iterations of each forward solve '
                        '(default: %(default)s)')
    parser.add_argument('--m2', type=_args.positive_int, default=2,
                        help='MGRIT iterations of each adjoint solve '
                        '(default: %(default)s)')
    parser.add_argument('--eval-every', type=_args.positive_int, default=10,
                        help='steps between validations (default: '
                        '%(default)s)')
    parser.add_argument('--out', default=RESULTS,
                        help='folder of {} (default: %(default)s, the '
                        'committed results, which a run replaces)'.format(
                            outputs))
    parser.add_argument('--timeout', type=_args.positive_float, default=3600,
                        help='seconds of the mpiexec launch (default: '
                        '%(default)s)')


def device(gpu: bool):
    """Chainer's device for the runs: the CPU, or GPU 0 (every process of
    an mpiexec launch on one GPU machine shares it)."""
    return chainer.get_device('@cupy:0' if gpu else '@numpy')


def make_batch(case: str, size: int = None, seed: int = 0):
    """``size`` (default: the case's) training inputs and labels."""
    size = size or CASES[case]['batch']
    if case == 'peaks':
        if size % data.PEAKS_CLASSES:
            raise ValueError('a Peaks batch is 5 equal classes, not {}'
                             .format(size))
        return data.peaks_dataset(size // data.PEAKS_CLASSES, seed=seed)
    (x, t), _ = data.digits_dataset(seed=seed)
    return x[:size], t[:size]


def iterations_to(history: Sequence[float], drop: float):
    """V-cycles after which the residual is at most ``drop`` times the
    first one (``history[k]`` is measured in iteration k + 1, after its
    relaxation), or None if never."""
    for k, value in enumerate(history):
        if value <= drop * history[0]:
            return k
    return None


def setup_logging() -> None:
    """Progress lines of the experiments on stdout (their own logger only:
    a script imported by a test leaves the root logger alone)."""
    if not logger.handlers:
        handler = _StdoutHandler()
        handler.setFormatter(logging.Formatter('%(message)s'))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


class _StdoutHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stdout`` is when a line is logged."""

    stream = property(lambda self: sys.stdout, lambda self, value: None)


def header(script: str, argv: Sequence[str]) -> Dict:
    """Command, date, versions, machine and commit of a run."""
    import mpi4py
    return {
        'experiment': script,
        'command': ' '.join(['python', '-m', 'experiments.layer_parallel.'
                             + script] + list(argv)),
        'date': datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec='seconds'),
        'versions': {'python': platform.python_version(),
                     'chainer': chainer.__version__,
                     'numpy': numpy.__version__,
                     'mpi4py': mpi4py.__version__},
        'machine': {'cpu': _common.cpu_model(),
                    'cores': _common.usable_cores(),
                    'gpus': _common.gpu_names()},
        'git_commit': _common.git_commit(),
    }


usable_cores = _common.usable_cores
write_json = _common.write_json


def launch(n_procs: int, module: str, args: List[str],
           timeout: float) -> None:
    """Run ``python -m module args`` under ``mpiexec -n n_procs`` (one BLAS
    thread per process; Open MPI's container switches, as the Makefile),
    its output passed through; raise if it fails or times out."""
    mpiexec = _common.mpiexec_path()
    env = _common.worker_env(threads=1)
    # A waiting rank gives its core away instead of spinning: the cores
    # here are shared with more processes than them.
    env['OMPI_MCA_mpi_yield_when_idle'] = '1'
    env.setdefault('OPAL_PREFIX',
                   os.path.dirname(os.path.dirname(os.path.realpath(mpiexec))))
    command = [mpiexec, '-n', str(n_procs), sys.executable, '-m', module]
    command += args
    logger.info('$ mpiexec -n %d python -m %s %s', n_procs, module,
                ' '.join(args))
    # its output passed through as it comes; started again where the
    # launcher itself failed to start (harness.mpi.launcher_failed)
    done, _ = _common.run_mpiexec(command, env, timeout, cwd=ROOT, echo=True)
    if done.returncode:
        raise subprocess.CalledProcessError(done.returncode, command)
