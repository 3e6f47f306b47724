"""The benchmarks' and experiments' command lines refuse bad values in
argparse's words (exit 2, the option named) before any work: values that
hung a run (``--jobs 0``), ran something else without a word (an unknown
optimizer ran Adam, ``--epochs 0`` the default, ``mpiexec -n 0`` a process
per core), or ended in a traceback, some after minutes of measurement (an
``--out`` under a regular file). Found by running each as a stranger."""
import importlib
import json

import pytest

from benchmarks import _args


def refused(module, argv, capsys):
    """``module.main(argv)``'s exit status and what it printed on
    stderr."""
    with pytest.raises(SystemExit) as raised:
        importlib.import_module(module).main(list(argv))
    return raised.value.code, capsys.readouterr().err


BAD = [
    ('benchmarks.convergence', ['--jobs', '0'],
     "argument --jobs: expected an integer >= 1, got '0'"),
    ('benchmarks.convergence', ['--epochs', '0'], 'argument --epochs'),
    ('benchmarks.convergence', ['--seeds', 'x'], 'argument --seeds'),
    ('benchmarks.convergence', ['--target', '90'], 'argument --target'),
    ('benchmarks.lars_table1', ['--jobs', '-1'], 'argument --jobs'),
    ('benchmarks.lars_table1', ['--epochs', '0'], 'argument --epochs'),
    ('benchmarks.lars_table1', ['--replot', '/nonexistent/x.json'],
     'argument --replot: cannot read /nonexistent/x.json'),
    ('benchmarks.dist_scaling', ['--processes', '0'],
     'argument --processes: expected comma-separated integers >= 1'),
    ('benchmarks.dist_scaling', ['--processes', 'x'], 'argument --processes'),
    ('benchmarks.dist_scaling', ['--depth', '7'],
     'SmallResNet depth must be 6n+2'),
    ('benchmarks.shard_update', ['--processes', '1'],
     'argument --processes: expected comma-separated integers >= 2'),
    ('benchmarks.snapshot', ['--batch', '0'], 'argument --batch'),
    ('benchmarks.replay_host', ['--repeats', '0'], 'argument --repeats'),
    ('benchmarks.step_time', ['--rounds', '-1'], 'argument --rounds'),
    ('benchmarks.step_time', ['--interval', '1'],
     "argument --interval: expected an integer >= 2, got '1'"),
    ('benchmarks.stock_models', ['--models', 'nosuch'],
     'argument --models: unknown nosuch'),
    ('benchmarks.stock_models', ['--smoke', '--models', 'vgg16'],
     'vgg16 is not among the --smoke models'),
    ('benchmarks.stock_models', ['--part', 'timings'],
     'argument --part: unknown timings'),
    ('benchmarks.stock_models', ['--limits', 'x'], 'argument --limits'),
    ('benchmarks.stock_models', ['--kl-clip', 'x'], 'argument --kl-clip'),
    ('benchmarks.stock_models', ['--batch', '-1'], 'argument --batch'),
    ('benchmarks.stock_models', ['--merge', '/nonexistent/x.json'],
     'argument --merge: cannot read'),
    ('benchmarks.dropout_bound', ['--epochs', '0'], 'argument --epochs'),
    ('benchmarks.dropout_bound', ['--batch', '0'], 'argument --batch'),
    ('benchmarks.dropout_bound', ['--images', '0'], 'argument --images'),
    ('benchmarks.dropout_bound', ['--kl-clips', 'x'], 'argument --kl-clips'),
    ('benchmarks.data_path', ['--images', '0'], 'argument --images'),
    ('benchmarks.preemption', ['--archs', 'nosuch'],
     'argument --archs: unknown nosuch: choose from small, resnet50'),
    ('benchmarks.failure_latency', ['--repeats', '0'], 'argument --repeats'),
    ('benchmarks.gpu_table', ['/nonexistent/x.json'], 'cannot read'),
    ('benchmarks.kernel_profile', ['--resummarise', '/nonexistent/x.json'],
     'argument --resummarise: cannot read'),
    ('benchmarks.kernel_profile', ['--warmup', '-1'], 'argument --warmup'),
    ('benchmarks.inverse_precision', ['--models', 'nosuch'],
     '--models: unknown nosuch'),
    ('experiments.curvature.optimisation', ['--optimizers', 'nosuch,Adam'],
     'argument --optimizers: unknown nosuch'),
    ('experiments.curvature.optimisation', ['--optimizers', 'SGD'],
     'unknown SGD: choose from DiagGGN, DiagGGN-MC, KFAC, KFLR, Momentum, '
     'Adam'),
    ('experiments.curvature.overhead', ['--networks', 'nosuch'],
     'argument --networks: unknown nosuch'),
    ('experiments.curvature.overhead', ['--repetitions', '0'],
     'argument --repetitions'),
    ('experiments.curvature.overhead', ['--replot', '--out', '/nonexistent'],
     '--replot: cannot read /nonexistent/overhead.json'),
    ('experiments.layer_parallel.convergence', ['--cases', 'nosuch'],
     'argument --cases: unknown nosuch'),
    ('experiments.layer_parallel.convergence', ['--layers', '0'],
     'argument --layers'),
    ('experiments.layer_parallel.convergence', ['--weights', 'nosuch'],
     'argument --weights'),
    ('experiments.layer_parallel.scaling', ['--cases', 'nosuch'],
     'argument --cases'),
    ('experiments.layer_parallel.scaling', ['--at-scale', '16'],
     'argument --at-scale'),
    ('experiments.layer_parallel.training', ['--processes', '0'],
     'argument --processes'),
    ('experiments.layer_parallel.training', ['--at-scale', '16:2,32:4'],
     '--at-scale: one layers:cores pair'),
    ('experiments.layer_parallel.kfac_training', ['--cases', 'nosuch'],
     'argument --cases'),
    ('experiments.layer_parallel.kfac_training', ['--steps', '0'],
     'argument --steps'),
]


@pytest.mark.parametrize('module, argv, said', BAD,
                         ids=['{} {}'.format(m.rsplit('.', 1)[-1],
                                             ' '.join(a))
                              for m, a, _ in BAD])
def test_a_bad_value_is_refused_naming_it(module, argv, said, capsys):
    code, err = refused(module, argv, capsys)
    assert code == 2 and said in err, err
    assert 'Traceback' not in err


#: The benchmarks with a JSON --out file.
OUT_FILE = ['convergence', 'lars_table1', 'dist_scaling', 'shard_update',
            'snapshot', 'replay_host', 'step_time', 'stock_models',
            'dropout_bound', 'data_path', 'preemption', 'failure_latency',
            'kernel_profile', 'inverse_precision']
#: The experiments with an --out folder.
OUT_FOLDER = ['curvature.optimisation', 'curvature.overhead',
              'layer_parallel.convergence', 'layer_parallel.training',
              'layer_parallel.kfac_training']


@pytest.mark.parametrize('name', OUT_FILE + OUT_FOLDER)
def test_an_out_that_cannot_be_written_is_refused_before_the_work(
        name, tmp_path, capsys):
    """It was found after the measurement (FileExistsError,
    NotADirectoryError), or, in step_time, said and run on."""
    module = ('benchmarks.' if name in OUT_FILE else 'experiments.') + name
    blocker = tmp_path / 'a_file'
    blocker.write_text('')
    out = str(blocker / ('x.json' if name in OUT_FILE else 'results'))
    code, err = refused(module, ['--out', out], capsys)
    assert code == 2, err
    assert 'argument' not in err and \
        '--out {}: {} is a file, not a folder'.format(out, blocker) in err


def test_the_path_check_takes_existing_folders_and_names_dangling_links(
        tmp_path):
    """A folder holding a subfolder ``x`` was refused (the check looked at
    ``folder/x``); a link to nothing on the way passed, and the run failed
    at its end (FileExistsError)."""
    (tmp_path / 'out' / 'x').mkdir(parents=True)
    assert _args.folder_problem(str(tmp_path / 'out')) == ''
    assert _args.folder_problem(str(tmp_path / 'new' / 'deeper')) == ''
    assert _args.output_problem(str(tmp_path / 'out' / 'r.json')) == ''
    assert _args.output_problem(str(tmp_path / 'out')) == \
        '{} is a directory'.format(tmp_path / 'out')
    (tmp_path / 'dangling').symlink_to(tmp_path / 'nowhere' / 'deeper')
    for problem in (_args.output_problem(str(tmp_path / 'dangling' / 'x')),
                    _args.folder_problem(str(tmp_path / 'dangling'))):
        assert problem == '{} is a link to nothing'.format(
            tmp_path / 'dangling')


def test_a_run_folder_under_a_file_is_refused(tmp_path, capsys):
    blocker = tmp_path / 'a_file'
    blocker.write_text('')
    for module, option in (('benchmarks.convergence', '--run-dir'),
                           ('benchmarks.snapshot', '--dir')):
        code, err = refused(module, [option, str(blocker / 'runs'), '--out',
                                     str(tmp_path / 'out.json')], capsys)
        assert code == 2 and '{} {}: {} is a file, not a folder'.format(
            option, blocker / 'runs', blocker) in err, err
    assert not (tmp_path / 'out.json').exists()


class _Parsed(Exception):
    pass


def parsed(module, argv, monkeypatch):
    """The namespace ``module.main(argv)`` parses (it stops there)."""
    original = _args.argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))
    monkeypatch.setattr(_args.argparse.ArgumentParser, 'parse_args',
                        parse_and_stop)
    with pytest.raises(_Parsed) as stopped:
        importlib.import_module(module).main(list(argv))
    monkeypatch.undo()
    return stopped.value.args[0]


@pytest.mark.parametrize('module, option, attribute', [
    ('benchmarks.preemption', '--agreement-sizes', 'agreement_sizes'),
    ('benchmarks.dropout_bound', '--kl-clips', 'kl_clips'),
    ('experiments.layer_parallel.kfac_training', '--targets', 'targets')])
def test_an_empty_list_skips_its_part(module, option, attribute,
                                      monkeypatch):
    """``--agreement-sizes ''`` is documented (and made a committed
    result); ``--kl-clips ''`` runs MomentumSGD alone, ``--targets ''``
    counts no steps."""
    assert getattr(parsed(module, [option, ''], monkeypatch),
                   attribute) == []


def test_kfac_training_targets_are_fractions(capsys):
    code, err = refused('experiments.layer_parallel.kfac_training',
                        ['--targets', '0.8,90'], capsys)
    assert code == 2 and 'accuracies in [0, 1]' in err


def test_the_option_types_take_what_they_should():
    assert _args.int_list(0)('0, 3,2') == [0, 3, 2]
    assert _args.float_list('1e-4,0.5') == [1e-4, 0.5]
    assert _args.names(['a', 'b', 'c'])('c,a,c') == ['c', 'a']
    assert _args.int_pairs('16:2,32:4') == [(16, 2), (32, 4)]
    assert _args.fraction('1') == 1.0
    assert _args.or_empty(_args.int_list(2))(' ') == []
    for parse, text in ((_args.positive_int, '1.5'),
                        (_args.positive_float, 'nan'),
                        (_args.positive_float, 'inf'),
                        (_args.fraction, '0'), (_args.int_list(1), ''),
                        (_args.int_pairs, '16:2:1'),
                        (_args.names(['a']), '')):
        with pytest.raises(_args.argparse.ArgumentTypeError):
            parse(text)


def test_scaling_names_the_layer_counts_its_convergence_json_lacks(
        tmp_path, capsys):
    """Before its launches: the modelled configurations need the
    convergence experiment's runs of their N (it ended in KeyError: 256
    after every launch had been measured)."""
    runs = {'smooth': [{'layers': 16}, {'layers': 32}],
            'independent': [{'layers': 16}, {'layers': 32}]}
    path = tmp_path / 'fig4.json'
    path.write_text(json.dumps({'results': {'peaks': runs}}))
    argv = ['--processes', '1', '--cases', 'peaks', '--convergence',
            str(path), '--out', str(tmp_path / 'out')]
    code, err = refused('experiments.layer_parallel.scaling', argv, capsys)
    assert code == 2
    assert 'has no run of N = 256, 512, 1024, 2048 (peaks independent; ' \
        'peaks smooth)' in err and '--at-scale' in err, err
    from experiments.layer_parallel import scaling
    assert scaling.missing_runs(json.loads(path.read_text()), ['peaks'],
                                [(16, 2), (32, 4)]) == ([], [])
    # a run of one weights only: no --at-scale can mend that
    del runs['independent']
    path.write_text(json.dumps({'results': {'peaks': runs}}))
    code, err = refused('experiments.layer_parallel.scaling', argv + [
        '--at-scale', '16:2,32:4'], capsys)
    assert code == 2 and 'has no runs of peaks independent' in err and \
        '--weights smooth,independent' in err, err
    path.write_text('{')
    code, err = refused('experiments.layer_parallel.scaling', argv, capsys)
    assert code == 2 and '--convergence: {} is not JSON'.format(path) in err


def test_an_unknown_optimizer_is_never_adam():
    """``make_step`` ran Adam for any name it did not know."""
    from experiments.curvature import optimisation
    with pytest.raises(ValueError, match="unknown optimizer 'SGD'"):
        optimisation.make_step('SGD', None, 0.1, 0.0, 0)


def test_lars_table1_replots_a_result_moved_from_another_machine(
        tmp_path, capsys, monkeypatch):
    """The shipped result names its author's run directories: they are
    looked for by name under --run-dir; where they are in neither place
    the table is still printed and the figure's absence said (it was a
    FileNotFoundError traceback). Another benchmark's JSON is refused."""
    from benchmarks import _common
    from benchmarks import lars_table1
    monkeypatch.chdir(tmp_path)
    shipped = _common.ROOT + '/benchmarks/results/lars_table1.json'
    with open(shipped) as f:
        data = json.load(f)
    assert lars_table1.main(['--replot', shipped]) == 1
    out = capsys.readouterr()
    assert 'LARS' in out.out and 'table1.png not drawn' in out.err
    runs = tmp_path / 'runs'
    for run in data['runs']:
        folder = runs / run['dir'].rstrip('/').rsplit('/', 1)[-1]
        folder.mkdir(parents=True)
        (folder / 'log').write_text(json.dumps([
            {'epoch': e, 'validation/main/accuracy': 0.3 * e}
            for e in (1, 2, 3)]))
    argv = ['--replot', shipped, '--run-dir', str(runs)]
    assert lars_table1.main(argv) == 0
    assert 'figure: {}'.format(runs / 'table1.png') in capsys.readouterr().out
    assert (runs / 'table1.png').stat().st_size > 0
    other = tmp_path / 'other.json'
    other.write_text(json.dumps({'benchmark': 'convergence', 'runs': []}))
    assert lars_table1.main(['--replot', str(other)]) == 2
    assert 'not a result of benchmarks.lars_table1' in \
        capsys.readouterr().err
