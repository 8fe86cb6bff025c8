"""What a new user meets first: the defaults of `lucid fit`, where runs go, file modes, and `--help`."""
import subprocess, sys
from pathlib import Path

import pytest

from lucid_nb.command import cli_main

from helpers import TINY, lucid_main

LUCID = Path(sys.executable).parent / 'lucid'


def test_fit_defaults(tmp_path, monkeypatch):
    "No --config: the nano model on the embedded data, 10 epochs, runs under ./runs/lucid."
    monkeypatch.chdir(tmp_path)
    cli = cli_main([], run=False)
    assert cli.trainer.max_epochs == 10 and cli.model.hparams.size == 'n'
    assert cli.datamodule.hparams.train_images is None and cli.model.hparams.num_classes == 80   # the embedded coco128
    assert Path(cli.trainer.log_dir) == Path('runs') / 'lucid' / 'version_0'


def test_default_root_dir_decides_without_a_logger(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = cli_main(['--trainer.default_root_dir', 'elsewhere'], run=False)
    assert Path(cli.trainer.log_dir) == Path('elsewhere') / 'lucid' / 'version_0'
    cli = cli_main(['--trainer.default_root_dir', 'elsewhere', '--trainer.logger.init_args.save_dir', 'mine'], run=False)
    assert Path(cli.trainer.log_dir).parts[0] == 'mine'    # a logger given wins


def test_fast_dev_run_writes_only_into_default_root_dir(tmp_path):
    r = subprocess.run([str(LUCID), 'fit', *TINY, '--trainer.fast_dev_run', 'true', '--trainer.default_root_dir', 'fdr'],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert [p.name for p in tmp_path.iterdir()] == ['fdr']


def test_files_get_the_umask_mode(tmp_path):
    "Atomic writes go through mkstemp (0600); the files they leave have the mode open() gives (0666 less the umask)."
    code = ("import os; os.umask(0o027); from pathlib import Path; from lucid_nb.core import atomic_write; "
            f"p = atomic_write(Path({str(tmp_path)!r}) / 'x.json', b'1'); print(oct(p.stat().st_mode & 0o777))")
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == '0o640'


def test_help_shows_the_defaults():
    r = subprocess.run([str(LUCID), 'fit', '--help'], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0
    flat = ' '.join(r.stdout.split())
    assert 'for 10 epochs (--trainer.max_epochs)' in flat
    i = flat.index('--trainer.max_epochs MAX_EPOCHS Stop training')
    assert 'default: 10)' in flat[i:i + 400]


def undocumented_options(help_text: str) -> list:
    "Options of an argparse `--help` whose entry is only its type and default."
    import re
    opts = help_text[help_text.index('\noptions:'):]
    bad = []
    for block in re.split(r'\n(?=  -)', opts)[1:]:
        head, *rest = block.split('\n')
        m = re.match(r'  (-\S+(?:, -\S+)?(?: \S+)?)(?:\s{2,}(.*))?$', head)
        desc = (((m.group(2) or '') if m else '') + ' '.join(l.strip() for l in rest)).strip()
        if not desc or desc.startswith(('(type:', '(required, type:')): bad.append(head.strip())
    return bad


def test_every_option_has_help():
    r = subprocess.run([str(LUCID), 'fit', '--help'], capture_output=True, text=True, timeout=120)
    assert undocumented_options(r.stdout) == []
    assert undocumented_options('\noptions:\n  --model.box BOX       (type: float, default: 7.5)\n') == ['--model.box BOX       (type: float, default: 7.5)']
    for choices in ('--model.size {n,s,m}', '--model.optimizer {sgd,adamw,musgd,auto}', '--data.cache {none,ram,disk}',
                    '--data.on_bad_input {skip,error}'):
        assert choices in r.stdout


def test_python_api_keeps_its_messages():
    "The Literal types list the choices in --help; the checks behind them still explain a bad value from Python."
    from lucid_nb.data import YoloData
    from lucid_nb.trainer import LitYolo
    with pytest.raises(ValueError, match='allowed values: n, s, m'): LitYolo(size='x')
    with pytest.raises(ValueError, match="use one of 'none', 'ram', 'disk'"): YoloData(cache='bogus')
    with pytest.raises(ValueError, match="use 'skip' or 'error'"): YoloData(on_bad_input='maybe')


@pytest.mark.parametrize('args, says', [
    (['--data.cache', 'bogus'], 'data.cache'), (['--model.size', 'x'], 'model.size'), (['--nope', '1'], '--nope'),
    (['--data.imgsz', '33'], 'imgsz=33'), (['--model.capture_segment_heads', '1'], 'capture_segment_heads'),
    (['--data.train_images', '/nope', '--data.train_annotations', '/nope.json'], '/nope.json'),
    (['--ckpt_path', '/nope/last.ckpt'], '/nope/last.ckpt'),
    (['--model.lr', 'nan'], '--model.lr nan: must be a finite number'), (['--model.lr', 'inf'], '--model.lr inf: must be a finite number'),
    (['--model.conf', 'NaN'], '--model.conf NaN: must be a finite number'),
    (['--model.weights', 'yolo11n-seg.pt'], 'no such file; Ultralytics publishes it at https://github.com/ultralytics/assets/releases')])
def test_user_errors_are_one_line(tmp_path, monkeypatch, capsys, args, says):
    "A bad option value, an unknown option, a missing path: one `lucid: error:` line naming it, exit status 2, no traceback."
    monkeypatch.chdir(tmp_path)
    assert lucid_main(monkeypatch, 'fit', '--trainer.max_epochs', '1', *args) == 2
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if 'error' in l.lower()]
    assert len(lines) == 1 and lines[0].startswith('lucid: error:') and says in lines[0], err[-2000:]
    assert 'Traceback' not in err and 'usage:' not in err
