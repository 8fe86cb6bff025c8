"""Faults around a training run (issue 9, trainer side): checkpoints after every epoch, leftover temporary files,
SIGTERM / Ctrl-C / kill -9 of a real `lucid` process and its exact resume, two runs in one folder, bad checkpoint
files, options given with `--ckpt_path`, and user errors reported in one line with exit status 2."""
import csv, json, os, re, shutil, signal, socket, subprocess, sys, time
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lucid_nb.allocator import allocator_defaults
from lucid_nb.core import EMBEDDED_ANNOTATIONS, EMBEDDED_IMAGES
from lucid_nb.command import cli_main
from lucid_nb.predict import load as load_predictor
from lucid_nb.checkpoints import read_checkpoint
from lucid_nb.run_folder import LOCK_NAME
from lucid_nb.checkpoints import HASH_KEY
from lucid_nb.testing import DAMAGE, damaged_copy

from helpers import LUCID, fit, hashes_only, lucid_main, signal_at_line, start_lucid, tiny

TESTS = Path(__file__).resolve().parent


def load(path: Path) -> dict: return torch.load(path, map_location='cpu', weights_only=True)


def ckpts(run: Path) -> Path: return run / 'checkpoints'


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
    "An uninterrupted 2-epoch tiny run."
    return fit(tmp_path_factory.mktemp('ref'))


# ---- last.ckpt after every epoch; leftover temporary files ----

class LastCkptEpochs(Callback):
    "The epoch stored in last.ckpt, and whether it is best.ckpt's file, read after each epoch's checkpoints are written."
    def __init__(self): self.epochs, self.linked = [], []
    def look(self, trainer):
        trainer.checkpoint_callback.wait(); d = ckpts(Path(trainer.log_dir))   # the background writes of the epoch
        self.epochs.append(load(d / 'last.ckpt')['epoch']); self.linked.append(os.path.samefile(d / 'last.ckpt', d / 'best.ckpt'))
    def on_train_epoch_start(self, trainer, module):
        if trainer.current_epoch: self.look(trainer)
    def on_train_end(self, trainer, module): self.look(trainer)


@pytest.fixture(scope='module')
def three_epochs(tmp_path_factory):
    """A 3-epoch tiny run whose mAP never improves after epoch 0, into a folder where a killed run left `*.ckpt.tmp`
    (`last-v1`: a name that no save of this run writes over)."""
    tmp = tmp_path_factory.mktemp('three')
    d = tmp / 'runs' / 'tiny' / 'v' / 'checkpoints'; d.mkdir(parents=True)
    for name in ('last.ckpt.tmp', 'best.ckpt.tmp', 'last-v1.ckpt.tmp'): (d / name).write_bytes(b'half a checkpoint')
    seen = LastCkptEpochs()
    cli, run, h = fit(tmp, callbacks=[seen], epochs=3, version='v')
    return cli, run, seen


def test_last_ckpt_is_the_last_epoch(three_epochs):
    cli, run, seen = three_epochs
    maps = [json.loads(l)['mAP50-95(M)'] for l in (run / 'val_metrics.jsonl').read_text().splitlines()]
    assert len(maps) == 3 and max(maps[1:]) <= maps[0]       # mAP did not improve after epoch 0
    assert seen.epochs == [0, 1, 2]                           # last.ckpt after every epoch
    assert seen.linked == [True, False, False]                # at the step best.ckpt is written, last.ckpt is its link
    last = load(ckpts(run) / 'last.ckpt')
    assert (last['epoch'], last['global_step']) == (2, cli.trainer.global_step) == (2, 6)
    assert load(ckpts(run) / 'best.ckpt')['epoch'] == 0      # best stays the best by mAP50-95(M)


class FullDisk(Callback):
    "Every checkpoint write fails, as on a full disk."
    def setup(self, trainer, module, stage):
        def fail(*a, **k): raise OSError(28, 'No space left on device')
        trainer.strategy.checkpoint_io.save_checkpoint = fail   # a strategy's own writer
        self.patch.setattr('lucid_nb.saving.write_checkpoint_file', fail)   # lucid's, beside the target
    def __init__(self, monkeypatch): self.patch = monkeypatch


def test_a_failed_background_write_fails_the_fit(tmp_path, monkeypatch):
    "The checkpoint writer's error stops the fit in one true line: the file, no space, the sizes, no checkpoint written; the old file stays."
    d = tmp_path / 'runs' / 'tiny' / 'v' / 'checkpoints'; d.mkdir(parents=True); (d / 'last.ckpt').write_bytes(b'previous')
    with pytest.raises(OSError, match=r'writing best.ckpt into .*checkpoints failed: no space left on device: a checkpoint takes about \d+ MB, '
                                      r'\d+ MB were free before the write; the fit stopped, no checkpoint was written$'):
        fit(tmp_path, callbacks=[FullDisk(monkeypatch)], epochs=1, version='v')
    assert (d / 'last.ckpt').read_bytes() == b'previous' and not (d / 'best.ckpt').exists() and not list(d.glob('*.tmp'))
    assert not (d.parent / 'state_hashes.json').exists()


def test_checkpoints_are_not_staged_in_tmpdir(tmp_path, monkeypatch):
    "A full or missing $TMPDIR does not stop the checkpoints, which are written beside their names."
    import tempfile
    monkeypatch.setattr(tempfile, 'tempdir', str(tmp_path / 'no-such-tmpdir'))
    cli, run, h = fit(tmp_path, epochs=1, version='v')
    assert load(ckpts(run) / 'last.ckpt')['epoch'] == 0 and 'all' in h


def test_leftover_tmp_files_are_removed(three_epochs):
    _, run, _ = three_epochs
    assert (run / 'checkpoints').is_dir() and not list(run.rglob('*.tmp'))


# ---- SIGTERM, Ctrl-C and kill -9 of a real `lucid fit` ----

def start_fit(tmp: Path) -> subprocess.Popen:
    "A 2-epoch tiny `lucid fit` subprocess that waits for a signal at the start of epoch 1, after touching `tmp/waiting`."
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join([str(TESTS), os.environ.get('PYTHONPATH', '')]),
           'WAIT_MARKER': str(tmp / 'waiting')}
    return subprocess.Popen([str(LUCID), *tiny(tmp, '--trainer.callbacks', 'helpers.WaitForSignal')], cwd=tmp, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300):
    t = time.monotonic()
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() - t < timeout, f'{path} did not appear'
        time.sleep(0.1)


def resume(tmp: Path, ckpt: Path) -> dict:
    "Resume with `--ckpt_path` in a subprocess to the end; its state hashes."
    r = subprocess.run([str(LUCID), *tiny(tmp, '--ckpt_path', str(ckpt))], cwd=tmp, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = sorted((tmp / 'runs' / 'tiny').glob('version_*'), key=lambda p: int(p.name.split('_')[1]))
    hashes = json.loads((runs[-1] / 'state_hashes.json').read_text())
    assert hashes['env']['allocator'] == allocator_defaults(dict(os.environ))   # the console script set the allocator's default
    return hashes


@pytest.mark.parametrize('sig, status', [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=['SIGTERM', 'SIGINT'])
def test_signal_stops_with_a_resume_hint(reference, tmp_path, sig, status):
    proc = start_fit(tmp_path)
    run = tmp_path / 'runs' / 'tiny' / 'version_0'
    wait_for(tmp_path / 'waiting', proc)   # epoch 0 and its checkpoints are done
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    last_line = err.strip().splitlines()[-1]
    assert proc.returncode == status, err[-3000:]
    assert 'stopped by' in last_line and f"--ckpt_path {ckpts(run) / 'last.ckpt'}" in last_line, last_line
    assert not (run / 'state_hashes.json').exists() and not (run / LOCK_NAME).exists()
    assert isinstance(json.loads((run / 'predictions.json').read_text()), list)   # epoch 0's validation, kept on the way out
    assert load(ckpts(run) / 'last.ckpt')['epoch'] == 0      # the finished epoch, not half of epoch 1
    assert hashes_only(resume(tmp_path, ckpts(run) / 'last.ckpt')) == hashes_only(reference[2])


def test_kill_9_leaves_a_loadable_last_ckpt(reference, tmp_path):
    proc = start_fit(tmp_path)
    run = tmp_path / 'runs' / 'tiny' / 'version_0'
    wait_for(tmp_path / 'waiting', proc)   # epoch 0 and its checkpoints are done
    proc.kill(); proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert read_checkpoint(ckpts(run) / 'last.ckpt')['epoch'] == 0
    assert json.loads((run / LOCK_NAME).read_text())['pid'] == proc.pid   # left behind, for the next run to take over
    assert hashes_only(resume(tmp_path, ckpts(run) / 'last.ckpt')) == hashes_only(reference[2])


# ---- two runs in one folder ----

def plant_lock(run: Path, pid: int) -> Path:
    run.mkdir(parents=True)
    lock = run / LOCK_NAME
    lock.write_text(json.dumps(dict(pid=pid, host=socket.gethostname(), started='2026-12-01 08:00:00 UTC', command='lucid fit')))
    return lock


def test_second_run_in_a_folder_is_refused(tmp_path, monkeypatch, capsys):
    other = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])
    try:
        run = tmp_path / 'runs' / 'tiny' / 'v'
        lock = plant_lock(run, other.pid)
        assert lucid_main(monkeypatch, *tiny(tmp_path, version='v', epochs=1)) == 2
        last_line = capsys.readouterr().err.strip().splitlines()[-1]
        assert str(run) in last_line and f'pid {other.pid}' in last_line and 'in use' in last_line, last_line
        assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME]          # nothing of the second run was written
        assert json.loads(lock.read_text())['pid'] == other.pid
    finally:
        other.kill(); other.wait()


def test_stale_lock_is_taken_over(tmp_path, monkeypatch, capsys):
    gone = subprocess.Popen([sys.executable, '-c', 'pass']); gone.wait()
    run = tmp_path / 'runs' / 'tiny' / 'v'
    plant_lock(run, gone.pid)
    assert lucid_main(monkeypatch, *tiny(tmp_path, version='v', epochs=1)) == 0
    assert f'taking over the lock of a run that is gone (pid {gone.pid}' in capsys.readouterr().err
    assert (run / 'state_hashes.json').exists() and not (run / LOCK_NAME).exists()   # released at the end


def test_lock_released_after_an_error(tmp_path, monkeypatch, capsys):
    "An error inside the run (here the schedule's, raised while fit sets up) still releases the folder."
    run = tmp_path / 'runs' / 'tiny' / 'v'
    run.mkdir(parents=True); (run / 'kept.txt').write_text('')   # a folder with files is kept (an unused new one is removed)
    assert lucid_main(monkeypatch, *tiny(tmp_path, version='v', epochs=-1)) == 2
    assert 'max_epochs=-1' in capsys.readouterr().err.strip().splitlines()[-1]
    assert run.is_dir() and not (run / LOCK_NAME).exists()


# ---- bad checkpoint files ----

@pytest.mark.parametrize('kind, says', [('text', 'is not a checkpoint'), ('truncated', 'is corrupt')])
def test_bad_checkpoint_file(reference, tmp_path, kind, says):
    bad = tmp_path / f'{kind}.ckpt'
    good = (ckpts(reference[1]) / 'last.ckpt').read_bytes()
    bad.write_bytes(b'hello, not a checkpoint\n' if kind == 'text' else good[:len(good) // 2])
    r = subprocess.run([str(LUCID), *tiny(tmp_path, '--ckpt_path', str(bad), sub='validate')], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    last_line = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and last_line.startswith(f'lucid: error: --ckpt_path {bad} {says}'), r.stderr[-3000:]
    assert 'Traceback' not in r.stderr and 'weights_only' not in r.stderr


@pytest.mark.parametrize('source', ['http://127.0.0.1:9/last.ckpt', 'https://example.invalid/last.ckpt', 'registry:my-model'])
def test_remote_checkpoint_is_refused_in_one_line(tmp_path, monkeypatch, capsys, source):
    "Lightning would download a URL (weights_only=False before torch 2.6) or ask its registry: lucid reads local files only."
    assert lucid_main(monkeypatch, *tiny(tmp_path, '--ckpt_path', source, sub='validate')) == 2
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert last_line.startswith(f'lucid: error: --ckpt_path {source}: lucid reads checkpoints from local files only'), last_line
    assert 'download the file yourself' in last_line


def test_one_path_rule_for_every_entry_point(reference, tmp_path, monkeypatch, capsys):
    """`--ckpt_path`, `--model.weights`, `lucid_nb.load` and `export` name a checkpoint alike: a local file whatever its name
    (Lightning's registry keyword is only `registry` or `registry:NAME`), a `file://` URL as its path, another URL refused."""
    ckpt = tmp_path / 'registry_ok.ckpt'; shutil.copyfile(ckpts(reference[1]) / 'last.ckpt', ckpt)
    for source in (str(ckpt), ckpt.as_uri()):
        assert load_predictor(source).class_names
        assert lucid_main(monkeypatch, *tiny(tmp_path, '--ckpt_path', source, sub='validate')) == 0
        assert lucid_main(monkeypatch, *tiny(tmp_path, '--model.weights', source, sub='validate')) == 0
        out = tmp_path / 'net.torchscript'; out.unlink(missing_ok=True)
        assert lucid_main(monkeypatch, 'export', '--ckpt_path', source, '--format', 'torchscript', '--imgsz', '64', '--output', str(out)) == 0
        assert out.is_file()
    capsys.readouterr()
    for source in ('https://example.invalid/last.ckpt', 'hf://org/model/last.ckpt', 'registry'):
        for how in ('--ckpt_path', '--model.weights'):
            assert lucid_main(monkeypatch, *tiny(tmp_path, how, source, sub='validate')) == 2
            last = capsys.readouterr().err.strip().splitlines()[-1]
            assert last.startswith(f'lucid: error: {how} {source}: lucid reads checkpoints from local files only'), last
        assert lucid_main(monkeypatch, 'export', '--model.weights', source) == 2
        assert f'--model.weights {source}: lucid reads checkpoints from local files only' in capsys.readouterr().err
        with pytest.raises(ValueError, match=f'lucid_nb.load {source}: lucid reads checkpoints from local files only'): load_predictor(source)


def test_file_url_is_read_as_its_path(reference, tmp_path, capsys):
    "A `file://` checkpoint goes through the same reading as a path: its options are taken, and Lightning gets the path."
    ckpt = ckpts(reference[1]) / 'best.ckpt'   # trained with max_det 20
    cli = cli_main(validate_args(tmp_path, ckpt.as_uri()))
    assert f'model options taken from {ckpt}' in capsys.readouterr().err
    assert cli.model.hparams.max_det == 20 and detections_per_image(cli) == 20
    assert cli.trainer.ckpt_path == str(ckpt)


def test_new_fit_into_a_finished_run_folder_is_refused(reference, tmp_path, monkeypatch, capsys):
    "A fit without --ckpt_path into the version folder of a finished run would mix the two runs' files: one line, nothing written."
    run = reference[1]                       # <root>/runs/tiny/version_0
    root = run.parent.parent.parent
    before = {p: p.read_bytes() for p in run.rglob('*') if p.is_file()}
    assert lucid_main(monkeypatch, *tiny(root, epochs=1, version=run.name)) == 2
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert last_line.startswith(f'lucid: error: {run} holds an earlier run'), last_line
    assert f'--ckpt_path {run}/checkpoints/last.ckpt' in last_line
    assert re.search(rf'--trainer.logger.save_dir {re.escape(str(root / "runs"))} --trainer.logger.name tiny --trainer.logger.version [1-9]\d*\) \(LUCID_DEBUG', last_line)
    assert {p: p.read_bytes() for p in run.rglob('*') if p.is_file()} == before


# ---- options given with --ckpt_path ----

def validate_args(tmp: Path, ckpt: Path, *extra) -> list:
    "A tiny `lucid validate` of `ckpt`, with no `--model.max_det` unless `extra` gives one."
    args = tiny(tmp, '--ckpt_path', str(ckpt), *extra, sub='validate')
    i = args.index('--model.max_det')
    return args[:i] + args[i + 2:]


def detections_per_image(cli) -> int:
    results = json.loads((Path(cli.trainer.log_dir) / 'predictions.json').read_text())
    return max(sum(r['image_id'] == i for r in results) for i in {r['image_id'] for r in results})


@pytest.mark.parametrize('given', ['command line', 'config'])
def test_given_options_win_over_the_checkpoint(reference, tmp_path, capsys, given):
    ckpt = ckpts(reference[1]) / 'best.ckpt'   # trained with max_det 20
    cli = cli_main(validate_args(tmp_path, ckpt))
    assert detections_per_image(cli) == 20
    assert 'model options taken from' in (err := capsys.readouterr().err) and 'max_det=20' in err
    (cfg := tmp_path / 'c.yaml').write_text('model:\n  max_det: 1\n')
    cli = cli_main(validate_args(tmp_path, ckpt, *(['--model.max_det', '1'] if given == 'command line' else ['--config', str(cfg)])))
    assert cli.model.hparams.max_det == 1 and detections_per_image(cli) == 1
    line = next(l for l in capsys.readouterr().err.splitlines() if 'model options taken from' in l)
    assert 'max_det' not in line


def test_other_architecture_is_an_error(reference, tmp_path, monkeypatch, capsys):
    ckpt = ckpts(reference[1]) / 'last.ckpt'   # size n
    assert lucid_main(monkeypatch, *tiny(tmp_path, '--model.size', 's', '--ckpt_path', str(ckpt), epochs=1)) == 2
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert last_line.startswith('lucid: error:') and "size='n' (this run: 's')" in last_line, last_line
    assert not list(tmp_path.rglob('*.ckpt'))    # nothing trained


# ---- malformed annotations; the traceback on request ----

def test_malformed_annotations_reported_once(tmp_path, monkeypatch, capsys):
    text = EMBEDDED_ANNOTATIONS.read_text()
    (bad := tmp_path / 'bad.json').write_text(text[:5000] + ',,' + text[5000:])
    args = tiny(tmp_path, '--data.train_images', str(EMBEDDED_IMAGES), '--data.train_annotations', str(bad), epochs=1)
    assert lucid_main(monkeypatch, *args) == 2
    err = capsys.readouterr().err
    last_line = err.strip().splitlines()[-1]
    assert f'{bad}: malformed JSON at line 1, column 5001' in last_line, last_line
    assert err.count('malformed JSON') == 1 and 'compute_fn' not in err and 'Traceback' not in err
    monkeypatch.setenv('LUCID_DEBUG', '1')
    with pytest.raises(ValueError, match='malformed JSON at line 1'): lucid_main(monkeypatch, *args)


# ---- signals timed against the epoch line (issue 39) ----

@pytest.mark.parametrize('epoch', [1, 2])
def test_ctrl_c_right_after_the_epoch_line_keeps_the_epoch(tmp_path, epoch):
    """Ctrl-C within milliseconds of `epoch N/3` stops as SIGTERM does, after the step in flight: epoch N is saved (or
    a later one, if the next epoch ended meanwhile), and the stop line names the epoch `last.ckpt` holds."""
    proc = start_lucid(tmp_path)
    out, err = signal_at_line(proc, f'epoch {epoch}/3', signal.SIGINT)
    last = ckpts(tmp_path / 'runs' / 'tiny' / 'v') / 'last.ckpt'
    last_line = err.strip().splitlines()[-1]
    assert proc.returncode == 130, err[-3000:]
    held = load(last)['epoch'] + 1
    assert held >= epoch and 'stopped by Ctrl-C' in last_line and f'{last} holds epoch {held}/3' in last_line, last_line
    assert (held == 3 or f'--ckpt_path {last}' in last_line) and 'Traceback' not in err   # the last epoch: nothing to resume
    assert not (last.parent.parent / LOCK_NAME).exists()


@pytest.mark.parametrize('epoch,delay', [(1, 0.), (2, 0.), (1, 0.05), (2, 0.2)])
def test_a_kill_after_the_epoch_line_keeps_the_epoch(tmp_path, epoch, delay):
    """`kill -9` `delay` s after `epoch N/3` is printed: `last.ckpt` holds epoch N (or a later one), whole: its stored
    hashes check. The line used to come about 0.2 s before the file: 5 of 5 such kills lost the epoch."""
    signal_at_line(proc := start_lucid(tmp_path), f'epoch {epoch}/3', signal.SIGKILL, delay)
    last = ckpts(tmp_path / 'runs' / 'tiny' / 'v') / 'last.ckpt'
    assert proc.returncode == -signal.SIGKILL
    assert last.is_file(), f'epoch {epoch} was printed, and no last.ckpt was on disk when the process died'
    assert read_checkpoint(last)['epoch'] >= epoch - 1   # the safe reader: CRCs and stored hashes checked


@pytest.mark.parametrize('when', ['during the copy', 'during the copy, three', 'while the stop waits for the write'])
def test_a_second_ctrl_c_never_loses_a_printed_epoch(tmp_path, when):
    """Ctrl-C at the epoch line, and again while the next checkpoint's state is copied to the host (before its write
    is queued; a third one too), or while the stop waits for a write: epoch 1 (or a later one) is in last.ckpt, and the
    stop line, said once the write is done, names it. Before, the second Ctrl-C lost the epoch (\"no epoch had
    finished\") or the line came before the file."""
    marks = tmp_path / 'marks'; marks.mkdir()
    slow = {'SLOW_WRITE': '3'} if 'write' in when else {'SLOW_COPY': '3'}
    proc = start_lucid(tmp_path, '--trainer.callbacks', 'helpers.CheckpointTiming', env={'MARKERS': str(marks), **slow})
    for line in proc.stdout:
        if line.startswith('epoch 1/3'): proc.send_signal(signal.SIGINT); break
    wait_for(marks / ('stopping' if 'write' in when else 'copying'), proc)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    if 'three' in when: time.sleep(0.3); proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    last = ckpts(tmp_path / 'runs' / 'tiny' / 'v') / 'last.ckpt'
    lines = [l for l in err.strip().splitlines() if l.startswith('lucid:')]
    assert proc.returncode == 130, err[-3000:]
    held = load(last)['epoch'] + 1
    assert lines[-1].startswith('lucid: fit stopped by Ctrl-C before it finished;') and f'{last} holds epoch {held}/3' in lines[-1], err[-3000:]
    assert 'Traceback' not in err and 'before training started' not in err, err[-3000:]
    assert held >= 1 and not list(last.parent.glob('*.tmp'))


# ---- resuming into a run folder (issue 39) ----

@pytest.fixture(scope='module')
def one_epoch(tmp_path_factory):
    "A finished 1-epoch tiny run in `runs/tiny/v`: its last.ckpt is the hard link of its best.ckpt."
    tmp = tmp_path_factory.mktemp('one')
    cli, run, h = fit(tmp, epochs=1, version='v')
    assert os.path.samefile(ckpts(run) / 'last.ckpt', ckpts(run) / 'best.ckpt')
    return run


def test_resuming_a_complete_run_is_refused(one_epoch, tmp_path, monkeypatch, capsys):
    last = ckpts(one_epoch) / 'last.ckpt'
    assert lucid_main(monkeypatch, *tiny(tmp_path, '--ckpt_path', str(last), epochs=1)) == 2
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert last_line.startswith(f'lucid: error: --ckpt_path {last}: the run is complete: 1 epochs; give --trainer.max_epochs 2 or more'), last_line
    assert '--model.weights' in last_line
    assert not list(tmp_path.rglob('*.ckpt')) and not list(tmp_path.rglob('state_hashes.json'))


def best_epoch(run: Path) -> int:
    "The first epoch with the highest mask mAP50-95 in the run folder's val_metrics.jsonl."
    lines = [json.loads(l) for l in (run / 'val_metrics.jsonl').read_text().splitlines()]
    return max(lines, key=lambda l: (l['mAP50-95(M)'], -l['epoch']))['epoch']


def test_last_ckpt_stays_the_newest_epoch_across_resumes_and_moves(one_epoch, tmp_path):
    "Resumed into its own folder from a last.ckpt that is best.ckpt's link, then moved and resumed again: never `-v1`."
    shutil.copytree(one_epoch.parent, tmp_path / 'runs' / 'tiny')
    run = tmp_path / 'runs' / 'tiny' / 'v'
    fit(tmp_path, ckpt=str(ckpts(run) / 'last.ckpt'), epochs=2, version='v')
    assert sorted(p.name for p in ckpts(run).iterdir()) == ['best.ckpt', 'last.ckpt']
    assert load(ckpts(run) / 'last.ckpt')['epoch'] == 1
    fit(tmp_path, ckpt=str(ckpts(run) / 'last.ckpt'), epochs=3, version='v')      # a second resume
    assert load(ckpts(run) / 'last.ckpt')['epoch'] == 2
    moved = run.rename(run.parent / 'w')
    fit(tmp_path, ckpt=str(ckpts(moved) / 'last.ckpt'), epochs=4, version='w')    # the folder moved
    assert sorted(p.name for p in ckpts(moved).iterdir()) == ['best.ckpt', 'last.ckpt']
    assert load(ckpts(moved) / 'last.ckpt')['epoch'] == 3
    assert load(ckpts(moved) / 'best.ckpt')['epoch'] == best_epoch(moved)       # the best score survived the move


@pytest.mark.parametrize('epoch', [0, 2], ids=['full from the start', 'full at the last epoch'])
def test_full_disk_stops_the_fit_in_one_line(tmp_path, epoch):
    """A checkpoint that cannot be written (torch's '[enforce fail ...] unexpected pos', ENOSPC its context) stops the fit
    at once, in one true line: no space, what a checkpoint takes and what was free before the write, what last.ckpt
    holds (or that no checkpoint was written); no state hashes, no 'Results saved'."""
    proc = start_lucid(tmp_path, '--trainer.callbacks', 'helpers.FullDisk', env={'FULL_DISK_EPOCH': str(epoch), 'FREE_MB': '5'})
    out, err = proc.communicate(timeout=300)
    run = tmp_path / 'runs' / 'tiny' / 'v'
    last_line = err.strip().splitlines()[-1]
    assert proc.returncode == 2, err[-3000:]
    held = f'last.ckpt holds epoch {epoch}' if epoch else 'no checkpoint was written'
    assert re.fullmatch(rf"lucid: error: writing (best|last)\.ckpt into {re.escape(str(ckpts(run)))} failed: no space left on device: a checkpoint "
                        rf"takes about \d+ MB, 5 MB were free before the write; the fit stopped, {held} \(LUCID_DEBUG=1 shows the traceback\)", last_line), last_line
    assert 'Traceback' not in err and 'enforce fail' not in err and 'unexpected pos' not in err
    assert out.count('epoch ') == epoch + 1, out                     # no epoch trained after the failed write
    assert 'Results saved' not in out and not (run / 'state_hashes.json').exists()
    assert not list(ckpts(run).glob('*.tmp'))
    if epoch: assert load(ckpts(run) / 'last.ckpt')['epoch'] == epoch - 1   # the last epoch written


def test_resume_refuses_an_optimiser_option_it_cannot_honour(one_epoch, tmp_path, monkeypatch, capsys):
    "`--model.lr 0.05` on resume was ignored while config.yaml and hparams.yaml recorded it: now one line, exit 2."
    last = ckpts(one_epoch) / 'last.ckpt'
    assert lucid_main(monkeypatch, *tiny(tmp_path, '--ckpt_path', str(last), '--model.lr', '0.05', epochs=2)) == 2
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert last_line.startswith("lucid: error: --model.lr 0.05 (the checkpoint's: 0.01)") and '--model.weights' in last_line, last_line
    assert not list(tmp_path.rglob('*.ckpt')) and not list(tmp_path.rglob('hparams.yaml'))
    assert lucid_main(monkeypatch, *tiny(tmp_path, '--ckpt_path', str(last), '--model.lr', '0.01', epochs=2, version='w')) == 0   # the same value: fine (into a new folder: the fixture's stays as it is)


# ---- Ctrl-C before the fit loop; the stop line after a progress bar (issue 39) ----

@pytest.mark.parametrize('when', [0.3, 1.0, 'setup'], ids=['0.3 s', '1 s', 'trainer setup'])
def test_ctrl_c_before_training_is_one_line(tmp_path, when):
    "A Ctrl-C while torch is imported, the options parsed or the trainer set up: one line, status 130, no traceback, no run folder."
    extra = ('--trainer.callbacks', 'helpers.WaitAtSetup') if when == 'setup' else ()
    proc = start_lucid(tmp_path, *extra, env={'WAIT_MARKER': str(tmp_path / 'waiting')})
    if when == 'setup': wait_for(tmp_path / 'waiting', proc)
    else: time.sleep(when)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    said = 'lucid: interrupted by Ctrl-C before training started; nothing was saved'
    assert proc.returncode == 130, err[-3000:]
    assert err.strip().splitlines()[-1] == said and (out + err).count(said) == 1, err[-3000:]
    assert 'Traceback' not in err and 'KeyboardInterrupt' not in out + err, err[-3000:]
    assert not (tmp_path / 'runs' / 'tiny' / 'v').exists()


def test_stop_line_starts_a_line_after_the_progress_bar(tmp_path):
    "SIGTERM with the progress bar on (stdout and stderr in one stream, as in a terminal): the stop line is not glued to the bar."
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join([str(TESTS), os.environ.get('PYTHONPATH', '')])}
    proc = subprocess.Popen([str(LUCID), *tiny(tmp_path, '--trainer.enable_progress_bar', 'true', epochs=3, version='v')],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in proc.stdout:   # text mode: the bar's carriage returns end lines too
        seen.append(line)
        if 'epoch 1/3' in line: proc.send_signal(signal.SIGTERM); break
    rest, _ = proc.communicate(timeout=300)
    stop = [l for l in (''.join(seen) + rest).splitlines() if 'stopped by SIGTERM' in l]
    assert proc.returncode == 143 and len(stop) == 1, (''.join(seen) + rest)[-3000:]
    assert stop[0].startswith('lucid: fit stopped by SIGTERM'), stop[0]


# ---- leftovers of the folder a fit resumes from; a checkpoint changed on disk (issue 39) ----

def test_resume_into_a_new_folder_removes_the_old_folders_leftovers(one_epoch, tmp_path, capsys):
    "A resume into a new version folder removes the `*.ckpt.tmp` a killed run left beside the checkpoint it resumes from."
    old = tmp_path / 'old' / 'v'
    shutil.copytree(one_epoch, old)
    for name in ('last.ckpt.tmp', 'best.ckpt.tmp'): (ckpts(old) / name).write_bytes(b'a complete state, never renamed')
    fit(tmp_path, ckpt=str(ckpts(old) / 'last.ckpt'), epochs=2, version='new')   # named: not the checkpoint's own folder
    assert sorted(p.name for p in ckpts(old).iterdir()) == ['best.ckpt', 'last.ckpt']
    assert f'removed 2 unfinished checkpoint file(s) (0 MB) that a stopped run left in {ckpts(old)}' in capsys.readouterr().err
    assert load(ckpts(tmp_path / 'runs' / 'tiny' / 'new') / 'last.ckpt')['epoch'] == 1


@pytest.mark.parametrize('damage', DAMAGE)
def test_a_corrupt_checkpoint_is_one_line(one_epoch, tmp_path, monkeypatch, capsys, damage):
    """A checkpoint damaged on disk — a tensor byte (torch reads it without a word), a `data.pkl` byte (a 15-frame
    BadZipFile traceback), the zip directory, a copy cut short — is the same one line on every path, exit 2; one that
    stores no hashes loads quietly."""
    good = ckpts(one_epoch) / 'last.ckpt'
    bad = damaged_copy(good, tmp_path / 'bad.ckpt', damage)
    if damage == 'a tensor byte': assert load(bad)['epoch'] == load(good)['epoch']   # an archive torch still reads
    says = (f'{bad} is corrupt: its bytes changed after it was written (a disk error, or a copy that failed or was cut short); '
            'use another checkpoint of the run, or copy it again from where it was written')
    with pytest.raises(ValueError) as e: load_predictor(bad)
    assert str(e.value) == f'lucid_nb.load {says}'
    for how, args in (('--ckpt_path', tiny(tmp_path, '--ckpt_path', str(bad), sub='validate')),
                      ('--model.weights', tiny(tmp_path, '--model.weights', str(bad), epochs=1))):
        assert lucid_main(monkeypatch, *args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1] == f'lucid: error: {how} {says} (LUCID_DEBUG=1 shows the traceback)' and 'Traceback' not in '\n'.join(err), err
    old = load(good); old.pop(HASH_KEY); torch.save(old, tmp_path / 'old.ckpt')   # as written before the hashes were stored
    assert load_predictor(tmp_path / 'old.ckpt').class_names and capsys.readouterr().err == ''


# ---- a resumed run continues its run folder (issue 58) ----

def test_a_run_killed_after_an_epoch_line_resumes_in_its_folder_to_the_same_end(tmp_path):
    """`kill -9` at `epoch 1/3`, then the same command with `--ckpt_path` of its last.ckpt: the run continues in its own
    folder (no `version_1`), without a Lightning warning, and ends with the uninterrupted run's state hashes, best.ckpt's
    included; its records hold every epoch once."""
    whole, cut = tmp_path / 'whole', tmp_path / 'cut'; whole.mkdir(); cut.mkdir()
    proc = start_lucid(whole, version=None)   # each process with the same environment: one torch thread
    out, err = proc.communicate(timeout=600); assert proc.returncode == 0, err[-3000:]
    signal_at_line(start_lucid(cut, version=None), 'epoch 1/3', signal.SIGKILL)
    run = cut / 'runs' / 'tiny' / 'version_0'
    proc = start_lucid(cut, '--ckpt_path', str(ckpts(run) / 'last.ckpt'), version=None)
    out, err = proc.communicate(timeout=600)
    r = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in run.parent.iterdir()) == ['version_0']
    assert not [l for l in r.stderr.splitlines() if 'Warning' in l or 'warn' in l.lower()], r.stderr[-3000:]
    want = json.loads((whole / 'runs' / 'tiny' / 'version_0' / 'state_hashes.json').read_text())
    got = json.loads((run / 'state_hashes.json').read_text())
    assert 'best' in got and hashes_only(got) == hashes_only(want)
    assert [json.loads(l)['epoch'] for l in (run / 'val_metrics.jsonl').read_text().splitlines()] == [0, 1, 2]
    with open(run / 'metrics.csv') as f: rows = list(csv.DictReader(f))
    val = [int(float(r['epoch'])) for r in rows if r.get('mAP50-95(M)')]
    assert val == [0, 1, 2], val   # the killed run's partial epoch is not in it twice
