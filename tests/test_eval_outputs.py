"""The evaluation outputs of `lucid validate`, `test` and `fit` (issue 40): the per-class table and the speed line in
the terminal, `val_metrics.jsonl` with per-class rows and speed, and the curves and confusion matrix in the run folder."""
import json, os, subprocess

import pytest
from PIL import Image

from lucid_nb.draw import VAL_PLOTS

from helpers import LUCID, TINY

HEADER = ['Class', 'Images', 'Instances', 'Box(P', 'R', 'mAP50', 'mAP50-95)', 'Mask(P', 'R', 'mAP50', 'mAP50-95)']


def _lucid(*args, cwd):
    return subprocess.run([str(LUCID), *args], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS='1'))


def _table(stdout: str) -> list:
    "The rows (split into words) of the one per-class table in `stdout`; the header must occur once."
    lines = stdout.splitlines()
    heads = [i for i, l in enumerate(lines) if l.split() == HEADER]
    assert len(heads) == 1, stdout[-3000:]
    rows = []
    for l in lines[heads[0] + 1:]:
        w = l.rsplit(None, 10)
        if len(w) != 11 or not all(x.replace('.', '').isdigit() for x in w[1:]): break
        rows.append(w)
    return rows


def _check_run(run, rows, speed_line):
    lines = [json.loads(l) for l in (run / 'val_metrics.jsonl').read_text().splitlines()]   # every line whole JSON
    last = lines[-1]
    assert [r['cls'] for r in last['classes']] == [r[0].strip() for r in rows] and rows[0][0].strip() == 'all'
    assert last['classes'][0]['box']['mAP50-95'] == last['bbox/mAP50-95'] and last['classes'][0]['mask']['mAP50'] == last['segm/mAP50']
    assert last['classes'][0]['instances'] == sum(r['instances'] for r in last['classes'][1:]) > 0
    for r, words in zip(last['classes'], rows):   # the terminal shows what the file holds
        assert [int(words[1]), int(words[2])] == [r['images'], r['instances']]
        assert [float(x) for x in words[3:]] == [round(r[t][k], 3) for t in ('box', 'mask') for k in ('P', 'R', 'mAP50', 'mAP50-95')]
    assert set(last['speed']) == {'preprocess', 'inference', 'postprocess'} and all(v > 0 for v in last['speed'].values())
    assert speed_line == (f"Speed: {last['speed']['preprocess']:.1f}ms preprocess, {last['speed']['inference']:.1f}ms inference, "
                          f"{last['speed']['postprocess']:.1f}ms postprocess per image")
    for f in VAL_PLOTS:
        with Image.open(run / f) as im: assert im.format == 'PNG' and im.size[0] > 300, f
    assert not list(run.glob('*.tmp'))
    return lines


def _speed(stdout): return [l for l in stdout.splitlines() if l.startswith('Speed: ')]


@pytest.fixture(scope='module')
def fitted(tmp_path_factory):
    d = tmp_path_factory.mktemp('fit')
    r = _lucid('fit', *TINY, '--trainer.max_epochs', '2', '--data.val_count', '4', cwd=d)
    assert r.returncode == 0, r.stderr[-3000:]
    return d, r


def test_fit_prints_the_table_once_and_writes_the_outputs(fitted):
    "Per epoch the one-line summary only; at the end of fit the last validation's table, its speed, and its plots in the run folder."
    d, r = fitted
    rows, speed = _table(r.stdout), _speed(r.stdout)
    assert len(speed) == 1
    lines = _check_run(d / 'runs' / 'lucid' / 'version_0', rows, speed[0])
    assert [l['epoch'] for l in lines] == [0, 1] and all('classes' in l and 'speed' in l for l in lines)


@pytest.mark.parametrize('sub', ['validate', 'test'])
def test_validate_and_test_print_the_table_and_write_the_outputs(fitted, sub):
    d, _ = fitted
    ckpt = d / 'runs' / 'lucid' / 'version_0' / 'checkpoints' / 'last.ckpt'
    r = _lucid(sub, '--trainer.accelerator', 'cpu', '--trainer.enable_progress_bar', 'false', '--data.val_count', '4',
               '--ckpt_path', str(ckpt), cwd=d)
    assert r.returncode == 0, r.stderr[-3000:]
    rows, speed = _table(r.stdout), _speed(r.stdout)
    assert len(rows) > 2 and len(speed) == 1
    run = max((d / 'runs' / 'lucid').iterdir(), key=lambda p: int(p.name.split('_')[1]))
    assert run.name != 'version_0'
    lines = _check_run(run, rows, speed[0])
    assert len(lines) == 1 and 'predictions_sha256' in lines[0]
