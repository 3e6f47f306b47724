"""``train_imagenet.py``'s command line: every numeric option is checked
when it is parsed, and the error names the option (no epoch trained before
a ``ZeroDivisionError``, no value silently replaced by a default)."""
import pytest

import train_imagenet

LISTS = ['train.txt', 'val.txt', '--config', 'run.json']


def refused(capsys, *options):
    with pytest.raises(SystemExit) as info:
        train_imagenet.parse_args(LISTS + list(options))
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize('option, value, message', [
    ('--snapshot-every', '0', 'N epochs (an integer >= 1'),
    ('--snapshot-every', '-2', 'N epochs (an integer >= 1'),
    ('--snapshot-every', '1.5', 'N epochs (an integer >= 1'),
    ('--snapshot-every', '0it', '(e.g. 2000it)'),
    ('--snapshot-every', '0min', '(e.g. 30min)'),
    ('--preempt-signals', 'FOO', "unknown signal 'FOO'"),
    ('--preempt-signals', 'KILL', 'SIGKILL cannot be caught'),
    ('--epochs', '0', 'an integer >= 1'),
    ('--keep-snapshots', '-1', 'an integer >= 0'),
    ('--depth', '0', '6n+2'),
    ('--depth', '9', '6n+2'),
    ('--width', '0', 'width'),
    ('--n-class', '0', 'an integer >= 1'),
    ('--crop-size', '0', 'an integer >= 1'),
    ('--resize', '0', 'an integer >= 1'),
    ('--loaderjob', '-1', 'an integer >= 0'),
    ('--seed', '-1', 'an integer in [0, 2147483647]'),
    ('--seed', str(2 ** 32), 'an integer in [0, 2147483647]'),
    ('--target-acc', '0', 'a number in (0, 1]'),
    ('--target-acc', '1.5', 'a number in (0, 1]'),
    ('--target-acc', 'nan', 'a number in (0, 1]'),
    ('--baseline-lr', '0', 'a number > 0'),
    ('--baseline-lr', 'inf', 'a number > 0'),
    ('--baseline-momentum', '1', 'a number in [0, 1)'),
    ('--baseline-momentum', '-0.1', 'a number in [0, 1)'),
    ('--warmup-epochs', '-1', 'a number >= 0'),
    ('--warmup-epochs', 'nan', 'a number >= 0'),
    ('--weight-decay', '-0.0001', 'a number >= 0'),
    ('--weight-decay', 'x', 'a number >= 0'),
])
def test_out_of_range_value_refused_naming_the_option(capsys, option, value,
                                                      message):
    err = refused(capsys, option, value)
    assert 'argument {}'.format(option) in err
    assert message in err
    assert value in err


def test_snapshot_periods_and_signals():
    args = train_imagenet.parse_args(LISTS)
    assert (args.snapshot_every.count, args.snapshot_every.unit) == \
        (1, 'epoch')
    assert [s.name for s in args.preempt_signals] == ['SIGTERM', 'SIGUSR1',
                                                      'SIGUSR2']
    # every signal held back at start-up is handled once the run starts:
    # SIGUSR2 was held, then killed every process with its default action
    from harness import preemption
    assert set(preemption.HELD_AT_START) <= set(args.preempt_signals)
    args = train_imagenet.parse_args(LISTS + [
        '--snapshot-every', '2000it', '--preempt-signals', 'USR2'])
    assert (args.snapshot_every.count, args.snapshot_every.unit) == \
        (2000, 'iteration')
    assert [s.name for s in args.preempt_signals] == ['SIGUSR2']
    args = train_imagenet.parse_args(LISTS + [
        '--snapshot-every', '30min', '--preempt-signals', 'none'])
    assert (args.snapshot_every.count, args.snapshot_every.unit) == \
        (30.0, 'minute')
    assert args.preempt_signals == ()


def test_crop_larger_than_the_resized_image_refused(capsys):
    err = refused(capsys, '--crop-size', '32', '--resize', '30')
    assert '--crop-size 32' in err and '--resize 30' in err


def test_exclusive_options_refused(capsys):
    err = refused(capsys, '--resume', 'latest', '--init-weights-from', 'x')
    assert '--init-weights-from' in err and '--resume' in err
    err = refused(capsys, '--resume', 'latest', '--overwrite')
    assert '--overwrite' in err and '--resume latest' in err
    err = refused(capsys, '--demo', '--resume', 'latest')
    assert '--demo' in err
    err = refused(capsys, '--lars-momentum', 'scaled')
    assert '--lars-momentum is for --optimizer lars' in err
    err = refused(capsys, '--optimizer', 'lars', '--lars-momentum', 'x')
    assert 'argument --lars-momentum' in err


def test_values_at_the_edges_are_kept():
    args = train_imagenet.parse_args(LISTS + [
        '--snapshot-every', '1', '--epochs', '1', '--keep-snapshots', '0',
        '--baseline-momentum', '0', '--warmup-epochs', '0',
        '--weight-decay', '0', '--target-acc', '1', '--seed', '0',
        '--depth', '14', '--width', '1', '--crop-size', '30', '--resize',
        '30'])
    assert (args.snapshot_every.count, args.snapshot_every.unit,
            args.epochs, args.keep_snapshots) == (1, 'epoch', 1, 0)
    assert args.baseline_momentum == 0.0 and args.warmup_epochs == 0.0
    assert args.target_acc == 1.0 and args.depth == 14


def test_cuda_graphs_need_the_gpu(capsys):
    err = refused(capsys, '--cuda-graphs')
    assert '--cuda-graphs' in err and '--gpu' in err
    assert train_imagenet.parse_args(LISTS + ['--gpu', '--cuda-graphs'])\
        .cuda_graphs == 'on'
    assert train_imagenet.parse_args(LISTS).cuda_graphs == 'auto'


def test_the_demo_marks_its_target_in_figure_3(monkeypatch, tmp_path):
    import demo
    from analysis import curves, fim_size, fisher_diff
    seen = {}
    monkeypatch.setattr(curves, 'main', lambda argv: seen.update(
        curves=argv) or 0)
    monkeypatch.setattr(fisher_diff, 'main', lambda argv: 0)
    monkeypatch.setattr(fim_size, 'main', lambda argv: 0)
    demo.write_figures(str(tmp_path), 0.8)
    at = seen['curves'].index('--target')
    assert curves.target_percent(float(seen['curves'][at + 1])) == 80.0


@pytest.mark.parametrize('overwrite', [True, False])
def test_an_interrupted_demo_leaves_no_earlier_table_beside_it(
        monkeypatch, tmp_path, overwrite):
    """``make demo`` (``--overwrite``) interrupted in its first run left
    the earlier demo's summary and figures beside the new partial runs.
    Now they go before it trains; without ``--overwrite`` (the runs are
    then refused as they exist) nothing is removed."""
    import types
    import demo
    out = tmp_path / 'demo_out'
    out.mkdir()
    for name in demo.OUTPUTS + ('notes.txt',):
        (out / name).write_text('earlier')
    monkeypatch.setattr(demo, 'build_digits_dataset',
                        lambda cache: ('t', 'v', 'r'))
    monkeypatch.setattr(demo, 'resolve_config', lambda args, comm: None)

    def interrupted(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(demo, 'train', interrupted)
    comm = types.SimpleNamespace(rank=0, mpi_comm=types.SimpleNamespace(
        allgather=lambda value: [value], bcast=lambda value, root: value))
    args = train_imagenet.parse_args(['--demo', '--out', str(out)] +
                                     ['--overwrite'] * overwrite)
    with pytest.raises(KeyboardInterrupt):
        demo.run_demo(args, comm)
    left = sorted(p.name for p in out.iterdir())
    assert left == (['notes.txt'] if overwrite else
                    sorted(demo.OUTPUTS + ('notes.txt',)))


@pytest.mark.parametrize('nproc', [1, 2])
def test_gpu_without_a_gpu_stack_is_said_once_before_mpi(nproc, tmp_path):
    """``--gpu`` where CuPy cannot be imported: one line, before MPI (the
    communicator's error advised ``--communicator naive``, which then
    failed in Chainer's words, once per process)."""
    from tests import launch
    env = dict(launch.mpi_env(), PYTHONPATH=str(tmp_path))
    # a CuPy that cannot be imported, whatever this machine has
    (tmp_path / 'cupy.py').write_text('raise ImportError("no CuPy here")\n')
    result, _ = launch.run_mpi(
        [launch.REPO + '/train_imagenet.py', '--demo', '--gpu', '--out',
         str(tmp_path / 'out')], nproc, timeout=120, env=env,
        cwd=str(tmp_path))
    assert result.returncode != 0
    said = result.stdout + result.stderr
    assert said.count('--gpu needs CuPy and a CUDA GPU: ImportError: no '
                      'CuPy here') == 1, said
    assert not (tmp_path / 'out').exists()


def test_a_cpu_only_inverse_method_is_refused_with_gpu(tmp_path):
    """``inverse_method: "cholesky_solve"`` runs on the CPU only: with
    ``--gpu`` the config is refused before any data is read, naming the
    file (the optimizer would refuse it only at its first step)."""
    import json
    import pathlib
    import types
    from harness import run
    demo = pathlib.Path(__file__).parents[2] / 'config' / 'demo.json'
    data = json.loads(demo.read_text())
    data['inverse_method'] = 'cholesky_solve'
    path = tmp_path / 'run.json'
    path.write_text(json.dumps(data))
    comm = types.SimpleNamespace(
        rank=0, size=1, mpi_comm=types.SimpleNamespace(
            allgather=lambda value: [value]))
    args = types.SimpleNamespace(config=str(path), epochs=None,
                                 lars_momentum=None, gpu=True)
    with pytest.raises(ValueError, match=r"run.json: inverse_method "
                       r"'cholesky_solve' runs on the CPU only"):
        run.resolve_config(args, comm)
    args.gpu = False
    assert run.resolve_config(args, comm).inverse_method == 'cholesky_solve'
