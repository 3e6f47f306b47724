"""``--cuda-graphs auto|on|off`` in the harness (harness/run.py): auto by
default, on only where chainerkfac.graphs captures the steps, ``on``
refused up front elsewhere (several processes, accumulation, no cuDNN, no
GPU), and the optimizers built so that their steps can be replayed (one
process: K-FAC's local transport, no communicator for the baselines). The
training run itself needs a GPU (tests/gpu/test_kfac_graphs_gpu.py)."""
import types

import pytest

import config as config_module
import train_imagenet
from chainerkfac.transport import LocalTransport
from harness import run

LISTS = ['train.txt', 'val.txt', '--config', 'run.json']


@pytest.mark.parametrize('gpu, size, acc, cudnn, why', [
    (True, 1, 1, True, None),
    (False, 1, 1, True, 'no --gpu'),
    (True, 3, 1, True, 'the steps of 3 processes'),
    (True, 1, 4, True, 'a step of 4 accumulated micro-batches'),
    (True, 1, 1, False, 'cuDNN does not serve Chainer'),
])
def test_auto_on_where_steps_are_captured(gpu, size, acc, cudnn, why):
    on, words = run.cuda_graphs('auto', gpu, size, acc, cudnn)
    assert on == (why is None)
    assert words.startswith('on' if on else 'off: ' + why)
    off, words = run.cuda_graphs('off', gpu, size, acc, cudnn)
    assert not off and words == 'off (--cuda-graphs off)'
    if why is None:
        assert run.cuda_graphs('on', gpu, size, acc, cudnn)[0]
    else:
        with pytest.raises(ValueError, match='--cuda-graphs: ' + why):
            run.cuda_graphs('on', gpu, size, acc, cudnn)


def test_the_option():
    assert train_imagenet.parse_args(LISTS).cuda_graphs == 'auto'
    assert train_imagenet.parse_args(
        LISTS + ['--gpu', '--cuda-graphs']).cuda_graphs == 'on'
    assert train_imagenet.parse_args(
        LISTS + ['--cuda-graphs', 'off']).cuda_graphs == 'off'


def test_replay_refresh_steps_needs_the_graphs(capsys):
    """``--replay-refresh-steps`` auto by default (wherever the graphs
    replay a K-FAC run, measured on an H100: equal to the eager run, a
    refresh step 0.19 s against 0.34 s); ``on`` (or the bare flag) with
    --gpu and CUDA graphs auto or on, refused up front without a GPU or
    with the graphs off; ``off`` keeps the refresh steps eager."""
    args = train_imagenet.parse_args(LISTS)
    assert args.replay_refresh_steps == 'auto'
    assert run.replay_refresh_steps(args)
    assert train_imagenet.parse_args(
        LISTS + ['--gpu', '--replay-refresh-steps']).replay_refresh_steps \
        == 'on'
    assert not run.replay_refresh_steps(train_imagenet.parse_args(
        LISTS + ['--replay-refresh-steps', 'off']))
    # auto asks for nothing: a CPU run or one with the graphs off is fine
    assert train_imagenet.parse_args(
        LISTS + ['--gpu', '--cuda-graphs', 'off']).cuda_graphs == 'off'
    for bad in (['--replay-refresh-steps'],
                ['--gpu', '--cuda-graphs', 'off',
                 '--replay-refresh-steps']):
        with pytest.raises(SystemExit):
            train_imagenet.parse_args(LISTS + bad)
        assert '--replay-refresh-steps' in capsys.readouterr().err


@pytest.mark.parametrize('graphs', [False, True])
def test_optimizers_built_for_replay(graphs, monkeypatch):
    args = train_imagenet.parse_args(
        LISTS + ['--gpu'] + (['--cuda-graphs'] if graphs else []))
    cfg = config_module.load(config_module.preset_path('demo'))
    comm = types.SimpleNamespace(rank=0, size=1)
    made = []
    monkeypatch.setattr(run.chainerkfac, 'create_multi_node_optimizer',
                        lambda optimizer, comm: made.append(comm) or
                        optimizer)
    kfac, _ = run.build_optimizer('kfac', cfg, comm, 1, args, graphs)
    assert isinstance(kfac.transport, LocalTransport)
    assert made == ([] if graphs else [comm])
    sgd, _ = run.build_optimizer('sgd', cfg, comm, 1, args, graphs)
    assert sgd.comm is (None if graphs else comm)


def test_cudnn_options():
    args = train_imagenet.parse_args(LISTS)
    assert (args.cudnn_workspace, args.cudnn_autotune) == ('auto', 'auto')
    args = train_imagenet.parse_args(
        LISTS + ['--gpu', '--cudnn-workspace', '256MiB', '--cudnn-autotune',
                 'off'])
    assert (args.cudnn_workspace, args.cudnn_autotune) == (256 << 20, 'off')
    for bad in (['--gpu', '--cudnn-workspace', '1.5GiB'],
                ['--cudnn-workspace', '1GiB'],       # no --gpu: no cuDNN
                ['--cudnn-autotune', 'on']):
        with pytest.raises(SystemExit):
            train_imagenet.parse_args(LISTS + bad)


def test_replay_refresh_steps_on_refused_where_the_graphs_are_off():
    """``on`` where ``--cuda-graphs auto`` turned the graphs off (here: 2
    processes) was ignored silently; ``auto`` and ``off`` pass, and so
    does a run of another optimizer."""
    use, why = run.cuda_graphs('auto', True, 2, 1, True)
    assert not use
    with pytest.raises(ValueError, match=r'--replay-refresh-steps on: CUDA '
                       r'graphs are off: the steps of 2 processes'):
        run.check_replay_refresh_steps('on', True, use, why)
    for mode in ('auto', 'off'):
        run.check_replay_refresh_steps(mode, True, use, why)
    run.check_replay_refresh_steps('on', False, use, why)
    run.check_replay_refresh_steps('on', True, True, 'on')


def test_a_warm_up_as_long_as_the_run_is_warned_about():
    """``--optimizer lars`` on the demo config: Table 1's 18-epoch
    warm-up in a 10-epoch run ended at 56 % of the peak learning rate and
    never decayed, without a word; SGD's 5 epochs fit."""
    cfg = config_module.load(config_module.preset_path('demo'))
    lars = run.baseline_settings('lars', cfg, train_imagenet.parse_args(
        LISTS + ['--optimizer', 'lars']))
    schedule = run.baseline_schedule(lars, cfg.epochs)
    last = schedule.values(cfg.epochs)['lr']
    assert last < lars['lr']
    notice = run.warmup_notice(schedule, cfg.epochs)
    assert notice == (
        "the learning rate warms up over 18 epochs, not fewer than the "
        "run's 10: it ends at {:.4g}, {:.0%} of its peak {:.4g}, and never "
        'decays; --warmup-epochs sets the warm-up'.format(
            last, last / lars['lr'], lars['lr']))
    assert '56%' in notice
    for options in (['--optimizer', 'sgd'],
                    ['--optimizer', 'lars', '--warmup-epochs', '3']):
        settings = run.baseline_settings(
            options[1], cfg, train_imagenet.parse_args(LISTS + options))
        assert run.warmup_notice(run.baseline_schedule(settings, cfg.epochs),
                                 cfg.epochs) is None


def test_a_resumed_baseline_keeps_its_own_settings():
    """A resume continues the run's settings where options are not given
    again; a run of an earlier version (no "baseline" in its config.json)
    kept the warm-up of its time: a LARS run started before Table 1's
    warm-up became the default went from 5 to 18 epochs when resumed."""
    cfg = config_module.load(config_module.preset_path('demo'))
    fresh = train_imagenet.parse_args(LISTS + ['--optimizer', 'lars'])
    assert run.baseline_settings('lars', cfg, fresh)['warmup_epochs'] == \
        run.LARS_TABLE1_WARMUP[cfg.lars_momentum]
    old_record = {'epochs': 3, 'run': {'optimizer': 'lars'}}
    assert run.baseline_settings('lars', cfg, fresh, old_record)[
        'warmup_epochs'] == run.SGD_WARMUP
    started = train_imagenet.parse_args(
        LISTS + ['--optimizer', 'lars', '--baseline-lr', '3',
                 '--warmup-epochs', '2'])
    record = {'run': {'baseline': run.baseline_settings('lars', cfg,
                                                        started)}}
    resumed = run.baseline_settings('lars', cfg, fresh, record)
    assert (resumed['lr'], resumed['warmup_epochs']) == (3.0, 2.0)
    again = train_imagenet.parse_args(
        LISTS + ['--optimizer', 'lars', '--warmup-epochs', '1'])
    assert run.baseline_settings('lars', cfg, again, record)[
        'warmup_epochs'] == 1.0              # given again: a change
    assert run.baseline_settings('kfac', cfg, fresh, record) is None


def test_running_mixup_says_what_it_holds_and_refuses_what_cannot_fit():
    """A partner batch per micro-batch slot (float32, batch × 3 × crop²),
    twice while a step may be undone: 19.3 MB per slot at 32 × 224², so
    131K on one GPU (4,096 slots) held 79 GB twice, found only by running
    out of memory."""
    import config as config_module
    assert run.mixup_memory(0, 32, 224) is None            # no mixup
    words = run.mixup_memory(16, 32, 224)
    assert words == ('16 partner batches (one per micro-batch slot of a '
                     'step), 0.31 GB in memory, 0.62 GB while a step '
                     'may be undone; snapshots hold one generation')
    assert '0.31 GB on the GPU' in run.mixup_memory(16, 32, 224, gpu=True)
    assert run.mixup_memory(1, 32, 32).startswith('1 partner batch (')
    h100 = 80 * 10 ** 9
    assert run.mixup_memory(64, 32, 224, h100) is not None  # 2.5 GB
    with pytest.raises(config_module.ConfigError,
                       match=r"4096 partner batches \(one per micro-batch "
                       r"slot of a step\), 157\.84 GB while a step may be "
                       r"undone, of the GPU's 80\.00 GB \(over 50%\): use "
                       r"more processes"):
        run.mixup_memory(4096, 32, 224, h100)
