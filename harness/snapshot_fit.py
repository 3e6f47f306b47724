"""Whether a snapshot fits the run about to load it, read from the file's
keys and shapes before anything is loaded.

Chainer loads a snapshot leniently (``strict=False``: with the lean K-FAC
state a file lacks the factors of blocks its process did not own) and
copies arrays of any shape into state that has none yet, so a snapshot of
another model or optimizer fails late and obscurely (``triu_unpack: 36
elements do not make the upper triangle of a 16x16 matrix``) or, worse,
loads: momentum of an SGD run into K-FAC. Here the run's freshly built
model and optimizer say what they would read — Chainer's
``DictionarySerializer`` on them gives every key and shape, and each
parameter's optimizer state (momentum ``v``, ...) has the parameter's
shape, and each K-FAC factor the shape its block gives — and the
snapshot's member headers say what it holds (:func:`stored_shapes`, no
array data read). :func:`check` refuses a snapshot of another model
(naming the layers and both shapes) or of another optimizer (naming both);
:func:`load_weights` starts a new optimizer from a snapshot's (or a
``model_final.npz``'s) weights on purpose (``--init-weights-from``).
"""
import zipfile

import numpy
from chainer.serializers import npz

from chainerkfac import serializers

#: Where a trainer snapshot keeps the model and the optimizer.
MODEL_PREFIX = 'updater/model:main/'
OPTIMIZER_PREFIX = 'updater/optimizer:main/'
#: Key of the ``--optimizer`` that wrote a snapshot
#: (:class:`harness.snapshots.AtomicThreadWriter`'s facts).
OPTIMIZER_KEY = 'run/optimizer'
#: LARS's momentum form (Figure 5 or 6): its velocity means another thing.
LARS_FORM_KEY = 'run/lars_momentum'
#: Where K-FAC keeps its per-block state within the optimizer's
#: (:meth:`chainerkfac.optimizers.KFAC.serialize`).
KFAC_STATE = OPTIMIZER_PREFIX + 'kfac/'
#: How the optimizers of ``train_imagenet.py`` are named in messages.
OPTIMIZER_NAMES = {'kfac': 'K-FAC', 'sgd': 'momentum SGD', 'lars': 'LARS'}
#: Differences listed in a message (the rest are counted).
_SHOWN = 5


class SnapshotMismatchError(ValueError):
    """A snapshot that does not fit the run; the message names the file,
    the layers or state and what differs."""


def stored_shapes(path):
    """``{key: shape}`` of the arrays of an ``.npz`` file, read from the
    members' headers (no array data is read)."""
    shapes = {}
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            with archive.open(info) as member:
                shape = serializers.member_header(member)[0]
            key = info.filename
            shapes[key[:-4] if key.endswith('.npy') else key] = tuple(shape)
    return shapes


def _serialized_shapes(link, path=''):
    """``{key: shape}`` Chainer's ``DictionarySerializer`` gives ``link``
    under ``path`` (values it saves as ``None`` are left out: their shape is
    not known yet)."""
    target = {}
    serializer = npz.DictionarySerializer(target, path)
    link.serialize(serializer)
    return {key: numpy.shape(value) for key, value in target.items()
            if not (isinstance(value, numpy.ndarray) and
                    value.dtype == object)}


def expected_shapes(model, optimizer):
    """``{key: shape}`` the run's model and optimizer read from a trainer
    snapshot, besides the optimizer state they do not hold yet (see
    :func:`_state_shapes`)."""
    shapes = _serialized_shapes(model, MODEL_PREFIX)
    shapes.update(_serialized_shapes(optimizer, OPTIMIZER_PREFIX))
    return shapes


def _state_shapes(model, optimizer, stored):
    """``{key: (stored shape, shapes the run accepts)}`` of the optimizer
    state in a snapshot that a fresh optimizer does not have yet: every
    parameter's state entries (shaped like the parameter) and K-FAC's
    factors (a symmetric one stored as its packed upper triangle, a
    low-rank one as its d × k columns, k < d)."""
    out = {}
    params = dict(model.namedparams())
    for key, shape in stored.items():
        if not key.startswith(OPTIMIZER_PREFIX):
            continue
        name, _, entry = key[len(OPTIMIZER_PREFIX):].rpartition('/')
        param = params.get('/' + name)
        if param is not None and entry != 't' and param.array is not None:
            out[key] = (shape, [tuple(param.shape)])
    for block in getattr(optimizer, 'blocks', ()):
        path = KFAC_STATE + (block.name.strip('/') or '_root') + '/'
        for factor, shape in block.factor_shapes().items():
            if path + factor in stored:
                accepted = [tuple(shape)]
                kept = stored[path + factor]
                if len(shape) == 2:
                    accepted.insert(0, (shape[0] * (shape[0] + 1) // 2,))
                    if len(kept) == 2 and kept[0] == shape[0] and \
                            kept[1] < shape[0]:
                        accepted.append(tuple(kept))
                out[path + factor] = (kept, accepted)
    return out


def _written_by(path, stored):
    """The ``--optimizer`` that wrote a snapshot: its record, or for a
    snapshot without one, ``'kfac'`` or ``None`` (a first-order optimizer:
    sgd or lars) from its keys."""
    if OPTIMIZER_KEY in stored:
        with serializers.open_npz(path) as data:
            return str(data[OPTIMIZER_KEY])
    if any(key.startswith(KFAC_STATE) for key in stored):
        return 'kfac'
    return None


def check(path, model, optimizer, optimizer_name, lars_momentum=None):
    """Refuse a snapshot file that does not fit the run.

    Parameters
    ----------
    path : str
        One process's file of a trainer snapshot.
    model : chainer.Link
        The run's model as the updater holds it (``updater/model:main``).
    optimizer : chainer.Optimizer
        The run's optimizer, set up with ``model``, before any update.
    optimizer_name : str
        Its ``--optimizer`` (``'kfac'``, ``'sgd'``, ``'lars'``).
    lars_momentum : str, optional
        The run's LARS momentum form (``--optimizer lars``).

    Raises
    ------
    SnapshotMismatchError
        Written by another optimizer (both named), by LARS with the other
        momentum form, or keys and shapes of the model or the optimizer
        state that differ (named with both shapes).
    """
    stored = stored_shapes(path)
    written = _written_by(path, stored)
    if written != optimizer_name and (
            written is not None or optimizer_name == 'kfac'):
        what = 'a first-order optimizer (--optimizer sgd or lars)' \
            if written is None else 'a {} optimizer (--optimizer {})'.format(
                OPTIMIZER_NAMES.get(written, written), written)
        raise SnapshotMismatchError(
            'snapshot {} holds the state of {}; this run is --optimizer {}: '
            'resume it with the optimizer that wrote it, or start a new {} '
            'run from its weights with --init-weights-from {}'.format(
                path, what, optimizer_name, optimizer_name, path))
    if lars_momentum is not None and LARS_FORM_KEY in stored:
        with serializers.open_npz(path) as data:
            written_form = str(data[LARS_FORM_KEY])
        if written_form != lars_momentum:
            raise SnapshotMismatchError(
                'snapshot {} holds the velocity of LARS with {} momentum; '
                'this run has --lars-momentum {}: the velocity means '
                'another thing there (raw gradients against steps already '
                'scaled by the trust ratio), resume with --lars-momentum {} '
                'or start a new run from its weights with '
                '--init-weights-from {}'.format(
                    path, written_form, lars_momentum, written_form, path))
    expected = expected_shapes(model, optimizer)
    differences = _model_differences(
        stored, {k: v for k, v in expected.items()
                 if k.startswith(MODEL_PREFIX)}, MODEL_PREFIX)
    for key, shape in expected.items():
        if key.startswith(OPTIMIZER_PREFIX) and key in stored and \
                stored[key] != shape:
            differences.append(_shapes(key, stored[key], [shape]))
    for key, (shape, accepted) in _state_shapes(model, optimizer,
                                                stored).items():
        if shape not in accepted:
            differences.append(_shapes(key, shape, accepted))
    _refuse(path, differences)


def _model_differences(stored, expected, prefix):
    differences = []
    for key in sorted(set(expected) | set(k for k in stored
                                          if k.startswith(prefix))):
        name = key[len(prefix):]
        if key not in stored:
            differences.append('{}: not in the snapshot'.format(name))
        elif key not in expected:
            differences.append("{}: not in this run's model".format(name))
        elif stored[key] != expected[key]:
            differences.append(_shapes(key, stored[key], [expected[key]]))
    return differences


def _shapes(key, stored, accepted):
    for prefix in (MODEL_PREFIX, OPTIMIZER_PREFIX):
        if key.startswith(prefix):
            key = key[len(prefix):]
    return '{}: snapshot {}, this run {}'.format(
        key, stored, ' or '.join(map(str, accepted)))


def _refuse(path, differences):
    if differences:
        raise SnapshotMismatchError(
            'snapshot {} does not fit this run (another --arch, --depth, '
            '--width, n_class / --n-class or bn_fisher?): {} difference(s): '
            '{}{}'.format(path, len(differences),
                          '; '.join(differences[:_SHOWN]),
                          '; ...' if len(differences) > _SHOWN else ''))


def load_weights(path, network):
    """Load the weights (and running statistics) of a snapshot file or of
    a ``model_final.npz`` into ``network``, after checking that they fit.

    Parameters
    ----------
    path : str
        A file of a trainer snapshot (its ``updater/model:main/predictor``)
        or a bare network's ``.npz``.
    network : chainer.Link
        The bare network (``model.predictor``).

    Raises
    ------
    SnapshotMismatchError
        Layers that differ, named with both shapes.
    chainerkfac.serializers.PickledArrayError
        The file holds an object array (nothing is loaded).
    """
    serializers.check_no_pickle(path)
    stored = stored_shapes(path)
    prefix = MODEL_PREFIX + 'predictor/'
    if not any(key.startswith(prefix) for key in stored):
        prefix = ''                     # a bare network's file
    expected = _serialized_shapes(network, prefix)
    _refuse(path, _model_differences(
        {k: v for k, v in stored.items() if k.startswith(prefix)},
        expected, prefix))
    serializers.load_npz(path, network, path=prefix)
