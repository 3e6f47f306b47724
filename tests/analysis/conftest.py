"""Real run directories for the analysis tests, from short training runs.

Each run trains a small ResNet (depth 8, width 4) on 8x8 scikit-learn digits
with a Chainer Trainer, as ``train_imagenet.py`` would, and leaves its files
through the writers ``train_imagenet.py`` uses: ``config.json``
(:func:`harness.run_dir.write_run_config`), ``log`` (``LogReport``) and, for
K-FAC, ``fisher_diff.jsonl`` (``FisherDiffLog``); the optimizer is built
from the config by :func:`config.kfac_options`. A few seconds for all runs.
"""
import json
import os

import chainerkfac  # NOQA  (before chainer)
import chainer
import chainer.links as L
import numpy
import pytest
from chainer import training
from chainer.training import extensions

import config as config_module
import models
from chainerkfac import training as kfac_training
from chainerkfac.training import FisherDiffLog
from chainerkfac.optimizers import KFAC
from harness import run_dir

N_TRAIN, N_VAL, EPOCHS = 320, 96, 3
ARCH = {'arch': 'small', 'depth': 8, 'width': 4, 'n_class': 10}


def digits():
    """(train, val) TupleDatasets of 3x8x8 float images and int labels."""
    from sklearn.datasets import load_digits
    data = load_digits()
    order = numpy.random.RandomState(0).permutation(len(data.target))
    x = (data.images[order] / 16.0).astype(numpy.float32)
    x = numpy.repeat(x[:, None], 3, axis=1)
    t = data.target[order].astype(numpy.int32)
    return (chainer.datasets.TupleDataset(x[:N_TRAIN], t[:N_TRAIN]),
            chainer.datasets.TupleDataset(x[N_TRAIN:N_TRAIN + N_VAL],
                                          t[N_TRAIN:N_TRAIN + N_VAL]))


def train_run(out, optimizer_name='kfac', batch=32, bn_fisher='full',
              refresh=1):
    """Train EPOCHS epochs into ``out``; return ``out``."""
    cfg = config_module.TrainConfig(
        global_batch_size=batch, epochs=EPOCHS, alpha_mixup=0.0,
        damping=0.025, damping_target=0.00025, rho_bn=16.0,
        damping_warmup_steps=10, p_decay=3.0, e_start=1.0, e_end=4.0,
        lr=0.02 if optimizer_name == 'kfac' else 0.1, momentum=0.9,
        batch_size_per_process=batch, bn_fisher=bn_fisher,
        refresh_interval_a=refresh, refresh_interval_g=refresh,
        refresh_interval_f=refresh, n_class=ARCH['n_class'],
        description='analysis test run')
    numpy.random.seed(0)
    model = L.Classifier(models.SmallResNet(
        depth=ARCH['depth'], width=ARCH['width'], n_class=ARCH['n_class']))
    if optimizer_name == 'kfac':
        optimizer = KFAC(fisher_diff=True, verbose=False,
                         **config_module.kfac_options(cfg))
    else:
        optimizer = chainer.optimizers.MomentumSGD(cfg.lr, cfg.momentum)
    optimizer.setup(model)
    train, val = digits()
    updater = training.updaters.StandardUpdater(
        chainer.iterators.SerialIterator(train, batch), optimizer)
    trainer = training.Trainer(updater, (EPOCHS, 'epoch'), out=str(out))
    trainer.extend(kfac_training.PolynomialLRDecay(
        cfg.lr, cfg.p_decay, cfg.e_start, cfg.e_end,
        momentum_init=cfg.momentum), trigger=(1, 'iteration'))
    trainer.extend(extensions.Evaluator(
        chainer.iterators.SerialIterator(val, 48, repeat=False,
                                         shuffle=False), model))
    trainer.extend(extensions.observe_lr(), trigger=(1, 'iteration'))
    trainer.extend(extensions.observe_value(
        'momentum', lambda t: optimizer.momentum), trigger=(1, 'iteration'))
    if optimizer_name == 'kfac':
        trainer.extend(extensions.observe_value(
            'damping', lambda t: optimizer.damping),
            trigger=(1, 'iteration'))
        trainer.extend(FisherDiffLog(optimizer))
    trainer.extend(extensions.LogReport(trigger=(1, 'epoch')))
    trainer.run()
    run_dir.write_run_config(cfg, str(out), run_dir.run_facts(
        optimizer_name, n_processes=1, acc_iters=1, batch_per_process=batch,
        arch=ARCH['arch'], depth=ARCH['depth'], width=ARCH['width'],
        n_train=N_TRAIN, n_val=N_VAL, n_class=ARCH['n_class'], label=''))
    return str(out)


@pytest.fixture(scope='session')
def runs(tmp_path_factory):
    """Run directories: ``{'kfac32', 'kfac64_diag', 'sgd32'}``."""
    from threadpoolctl import threadpool_limits
    root = tmp_path_factory.mktemp('runs')
    # One BLAS thread: the factors are at most 144 x 144, and threads only
    # contend on a busy CI machine (10x slower inverses).
    with threadpool_limits(limits=1):
        return {
            'kfac32': train_run(root / 'kfac32'),
            'kfac64_diag': train_run(root / 'kfac64_diag', batch=64,
                                     bn_fisher='diag'),
            'sgd32': train_run(root / 'sgd32', optimizer_name='sgd'),
        }


def read_log(run):
    with open(os.path.join(run, 'log')) as f:
        return json.load(f)


def read_diff(run):
    with open(os.path.join(run, 'fisher_diff.jsonl')) as f:
        return [json.loads(line) for line in f if line.strip()]
