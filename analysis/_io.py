"""Reading run directories and writing figures, shared by the scripts.

Nothing here knows about a particular figure: :func:`load_run` and
:func:`load_fisher_diff` validate the files ``train_imagenet.py`` writes,
:func:`save_outputs` writes a PNG and its JSON atomically, and :func:`cli`
turns :class:`AnalysisError` into a one-line message and exit status 2.
"""
import dataclasses
import functools
import json
import math
import os
import sys
from typing import Dict, List, Optional, Sequence

#: Exit status of a script given bad input (as argparse uses for bad usage).
EXIT_BAD_INPUT = 2


class AnalysisError(ValueError):
    """Input a script cannot use; the message says which file and why."""


@dataclasses.dataclass
class Run:
    """One training run's directory, validated.

    Attributes
    ----------
    path : str
        The directory.
    log : list of dict
        Chainer ``LogReport`` entries, one per epoch, in order.
    config : dict
        ``config.json`` (``{}`` when the directory has none).
    """

    path: str
    log: List[Dict]
    config: Dict

    @property
    def facts(self) -> Dict:
        """The ``"run"`` entry of ``config.json`` (``{}`` if absent)."""
        facts = self.config.get('run')
        return facts if isinstance(facts, dict) else {}

    @property
    def name(self) -> str:
        return os.path.basename(os.path.normpath(self.path))

    @property
    def batch_size(self) -> Optional[int]:
        value = self.config.get('global_batch_size')
        return int(value) if isinstance(value, (int, float)) else None

    @property
    def optimizer(self) -> str:
        return str(self.facts.get('optimizer', 'kfac'))

    def variant(self) -> str:
        """``''``, ``'diag'``, ``'stale'`` or ``'stale diag'`` (Figure 6).

        Only K-FAC runs have variants: ``bn_fisher == 'diag'`` is *diag*, any
        refresh interval other than 1 (a number or a preset such as
        ``'eq23'``) is *stale*.
        """
        if self.optimizer != 'kfac':
            return ''
        words = []
        if any(self.config.get(key, 1) != 1 for key in (
                'refresh_interval_a', 'refresh_interval_g',
                'refresh_interval_f')):
            words.append('stale')
        if self.config.get('bn_fisher') == 'diag':
            words.append('diag')
        return ' '.join(words)

    def label(self) -> str:
        """Legend label: the run's own ``label`` if it has one, else
        optimizer, batch size and variant from its config, else the
        directory name."""
        given = self.facts.get('label')
        if isinstance(given, str) and given.strip():
            return given.strip()
        if self.batch_size is None:
            return self.name
        parts = [OPTIMIZER_NAMES.get(self.optimizer, self.optimizer.upper()),
                 'BS=' + format_batch_size(self.batch_size)]
        if self.variant():
            parts.append(self.variant())
        return ' '.join(parts)


def distinct_labels(labels: Sequence[str],
                    paths: Sequence[str]) -> List[str]:
    """``labels`` (one per run directory of ``paths``), each one that
    several runs share followed by what tells them apart: ``'K-FAC BS=32
    (seed1)'``, the directory's name, or as many of its last path
    components as needed (``'a/run'``, ``'b/run'``). Unique labels stay as
    they are."""
    result = list(labels)
    for label in set(labels):
        same = [i for i, other in enumerate(labels) if other == label]
        if len(same) < 2:
            continue
        parts = [os.path.abspath(paths[i]).split(os.sep) for i in same]
        for n in range(1, max(map(len, parts)) + 1):
            tails = ['/'.join(p[-n:]) for p in parts]
            if len(set(tails)) == len(tails):
                break
        for i, tail in zip(same, tails):
            result[i] = '{} ({})'.format(label, tail)
    return result


#: Legend names of the optimizers ``train_imagenet.py --optimizer`` knows.
OPTIMIZER_NAMES = {'kfac': 'K-FAC', 'sgd': 'SGD', 'lars': 'LARS'}


def format_batch_size(batch_size: int) -> str:
    """The paper's shorthand: 4096 → ``'4K'``, 65536 → ``'65K'``, 131072 →
    ``'131K'`` (thousands, rounded down, for multiples of 1024); other sizes
    as digits."""
    if batch_size >= 1024 and batch_size % 1024 == 0:
        return '{}K'.format(batch_size // 1000)
    return str(batch_size)


def _read_json(path, what):
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as e:
        raise AnalysisError('{}: not a {} (invalid JSON: {})'.format(
            path, what, e)) from None
    except OSError as e:
        raise AnalysisError('{}: cannot read {}: {}'.format(
            path, what, e.strerror)) from None


#: Files of a run directory the scripts read.
RUN_FILES = ('log', 'config.json', 'fisher_diff.jsonl')
#: Files a run or the demo writes besides (``--out`` there replaced the
#: run's ``time_to_accuracy.json``, the demo's ``summary.json``).
RUN_OUTPUTS = RUN_FILES + ('time_to_accuracy.json', 'summary.json',
                           'bad_images.txt')


def run_files(run_dirs: Sequence[str]) -> List[str]:
    """The input files of run directories, for :func:`check_outputs`."""
    return [os.path.join(d, name) for d in run_dirs for name in RUN_FILES]


def load_run(path: str, require_log: bool = True) -> Run:
    """Read and check a run directory. With ``require_log=False`` a run
    without a ``log`` yet (one stopped in its first epoch) is read with an
    empty one (Figure 5 needs only ``fisher_diff.jsonl``).

    Raises
    ------
    AnalysisError
        if ``path`` is not a directory, has no ``log`` (where required), or
        its ``log`` or ``config.json`` is not in the expected format.
    """
    if not os.path.isdir(path):
        raise AnalysisError('{}: not a run directory'.format(path))
    log_path = os.path.join(path, 'log')
    if not os.path.isfile(log_path) and not require_log:
        return Run(path=path, log=[], config=_run_config(path))
    if not os.path.isfile(log_path):
        raise AnalysisError(
            '{}: no Chainer LogReport file "log" in this directory (is it a '
            'train_imagenet.py output directory?)'.format(path))
    log = _read_json(log_path, 'Chainer LogReport log')
    if not isinstance(log, list) or not all(
            isinstance(e, dict) and 'epoch' in e and 'iteration' in e
            for e in log):
        raise AnalysisError(
            '{}: not a Chainer LogReport log (expected a JSON list of '
            'per-epoch entries with "epoch" and "iteration")'.format(log_path))
    if not log and require_log:
        raise AnalysisError('{}: the log has no entries yet'.format(log_path))
    for number, entry in enumerate(log, 1):
        for key, value in entry.items():
            if not is_number(value) and not (value is None and key not in (
                    'epoch', 'iteration')):
                raise AnalysisError(
                    '{}: entry {} (epoch {!r}): {} is {!r}, not a number'
                    .format(log_path, number, entry.get('epoch'), key, value))
    return Run(path=path, log=log, config=_run_config(path))


def is_number(value) -> bool:
    """An int or float (a bool is neither here): what a LogReport
    writes."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_finite_number(value) -> bool:
    """:func:`is_number`, and finite."""
    return is_number(value) and math.isfinite(value)


def _run_config(path: str) -> Dict:
    """``config.json`` of a run directory, ``{}`` where it has none."""
    config_path = os.path.join(path, 'config.json')
    config = {}
    if os.path.isfile(config_path):
        config = _read_json(config_path, 'run config')
        if not isinstance(config, dict):
            raise AnalysisError('{}: not a run config (expected a JSON '
                                'object)'.format(config_path))
    return config


def load_fisher_diff(run: Run) -> List[Dict]:
    """The records of ``fisher_diff.jsonl`` of ``run``, in file order.

    Each record is ``{"iteration": int, "step": int, "epoch": int,
    "A": {layer: Diff}, "G": {...}, "F": {...}}``; factors not refreshed at
    that step are absent.

    Raises
    ------
    AnalysisError
        if the file is missing, or a line is not such a record.
    """
    path = os.path.join(run.path, 'fisher_diff.jsonl')
    if not os.path.isfile(path) and run.optimizer != 'kfac':
        raise AnalysisError(
            '{}: a {} run: Diff(t) of eq. (21) exists for K-FAC runs only'
            .format(run.path, run.optimizer))
    if not os.path.isfile(path):
        raise AnalysisError(
            '{}: no fisher_diff.jsonl (train with Diff logging on: '
            'train_imagenet.py --fisher-diff, i.e. KFAC(fisher_diff=True) '
            'and chainerkfac.training.FisherDiffLog)'.format(run.path))
    records = []
    with open(path, 'rb') as f:
        lines = f.read().split(b'\n')
    last = max((i for i, line in enumerate(lines) if line.strip()),
               default=-1)
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode('utf-8'))
        except ValueError:      # also UnicodeDecodeError
            record = None
        if record is None and number - 1 == last and \
                number == len(lines):
            # no newline after it: a run killed while writing it (the
            # trainer drops it on resuming)
            print('{}:{}: an unfinished last line, left out (a run killed '
                  'while writing it)'.format(path, number), file=sys.stderr)
            continue
        why = _fisher_diff_record_error(record)
        if why is not None:
            raise AnalysisError(
                '{}:{}: not a FisherDiffLog record ({}; expected a JSON '
                'object with integer "iteration", "step" and "epoch" and '
                'per-layer "A"/"G"/"F" maps of numbers)'.format(
                    path, number, why))
        records.append(record)
    if not records:
        raise AnalysisError('{}: no records'.format(path))
    return records


def _fisher_diff_record_error(record) -> Optional[str]:
    """What is wrong with a line of ``fisher_diff.jsonl``, or None."""
    if not isinstance(record, dict):
        return 'not a JSON object'
    if 'iteration' not in record:
        return 'no "iteration"'
    for key in ('iteration', 'step', 'epoch'):
        if key in record and not (isinstance(record[key], int) and
                                  not isinstance(record[key], bool)):
            return '{} is {!r}'.format(key, record[key])
    for kind in ('A', 'G', 'F'):
        diffs = record.get(kind, {})
        if not isinstance(diffs, dict):
            return '{} is not a map'.format(kind)
        for layer, value in diffs.items():
            if not (is_number(value) or value is None):
                return '{} of {} is {!r}'.format(kind, layer, value)
    return None


def json_path_for(png_path: str) -> str:
    """The JSON file written beside a PNG: same name, ``.json``."""
    root, _ = os.path.splitext(png_path)
    return root + '.json'


def check_outputs(png_path: str, inputs: Sequence[str]) -> None:
    """Refuse, before any work, a PNG path whose PNG or JSON would
    overwrite an input file or a directory, or whose folder is a file."""
    if not png_path.lower().endswith('.png'):
        raise AnalysisError('--out {}: the picture is written as PNG; give a '
                            'path ending in .png'.format(png_path))
    for path in (png_path, json_path_for(png_path)):
        if os.path.isdir(path):
            raise AnalysisError('--out {}: {} is a directory'.format(
                png_path, path))
    folder = os.path.dirname(os.path.abspath(png_path))
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise AnalysisError('--out {}: {} is a file, not a folder'.format(
            png_path, folder))
    for path in (png_path, json_path_for(png_path)):
        if os.path.basename(path) in RUN_OUTPUTS and os.path.exists(path):
            raise AnalysisError(
                '--out {} would overwrite {}, a file a run wrote; give '
                'another name'.format(png_path, path))
    targets = {os.path.realpath(png_path),
               os.path.realpath(json_path_for(png_path))}
    for path in inputs:
        if os.path.realpath(path) in targets:
            raise AnalysisError(
                '--out {} would overwrite the input {}'.format(png_path,
                                                               path))


def save_outputs(figure, png_path: str, data: Dict) -> str:
    """Write ``figure`` as PNG and ``data`` as JSON beside it.

    Both go through a temporary file and a rename, so an interrupted script
    leaves no half-written picture, and a write that fails (a folder that
    cannot be made or written, a full disk) leaves no temporary file and
    is reported as :class:`AnalysisError`. Returns the JSON path. Call
    :func:`check_outputs` first, before any work.
    """
    directory = os.path.dirname(os.path.abspath(png_path))
    json_path = json_path_for(png_path)
    # hidden, and not *.png: a script killed while writing leaves nothing
    # that a glob of the pictures picks up
    tmp_json = os.path.join(directory, '.{}.tmp'.format(
        os.path.basename(json_path)))
    tmp_png = os.path.join(directory, '.{}.tmp'.format(
        os.path.basename(png_path)))
    try:
        os.makedirs(directory, exist_ok=True)
        with open(tmp_json, 'w') as f:
            # a non-finite value as null: NaN is not JSON (jq takes it,
            # JavaScript's JSON.parse does not)
            json.dump(_finite_or_null(data), f, indent=1, allow_nan=False)
            f.write('\n')
        figure.savefig(tmp_png, dpi=120, format='png')
        os.replace(tmp_png, png_path)
        os.replace(tmp_json, json_path)
    except OSError as error:
        raise AnalysisError('--out {}: cannot write: {}'.format(
            png_path, error.strerror or error)) from None
    finally:
        for tmp in (tmp_json, tmp_png):
            if os.path.lexists(tmp):
                try:
                    os.remove(tmp)
                except OSError:
                    pass
    return json_path


def _finite_or_null(value):
    """``value`` with every non-finite float as None (JSON's null)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(v) for v in value]
    return value


def new_figure(**kwargs):
    """A matplotlib Figure on the Agg canvas (no pyplot, no display)."""
    from matplotlib.figure import Figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    figure = Figure(**kwargs)
    FigureCanvasAgg(figure)
    return figure


def cli(name: str):
    """Decorate ``main(argv) -> int`` of ``analysis.<name>`` so that bad
    input returns exit status 2 with a one-line message on stderr (no
    traceback, no picture)."""
    prog = 'python -m analysis.' + name

    def decorate(main):
        @functools.wraps(main)
        def wrapped(argv=None):
            try:
                return main(argv)
            except AnalysisError as e:
                print('{}: error: {}'.format(prog, e), file=sys.stderr)
                return EXIT_BAD_INPUT
        return wrapped
    return decorate
