"""`--model.weights` (`nbs/03a_weights.ipynb`) and the safe reader (`nbs/03a_checkpoints.ipynb`): Ultralytics parity
on a fixture written by real Ultralytics, the size check, the class-count transfer, refused code-running pickles on every
path (`--model.weights`, `--ckpt_path` and Lightning's own read of it, `lucid_nb.load`), and starting a fit from a lucid
checkpoint."""
import json, os, pickle, subprocess, tempfile
from pathlib import Path

import pytest, torch
from lightning.pytorch.callbacks import Callback

import lucid_nb
from lucid_nb.core import EMBEDDED_IMAGES
from lucid_nb.heads import yolo_seg
from lucid_nb.checkpoints import SafeCheckpointIO
from lucid_nb.trainer import LitYolo
from lucid_nb.checkpoints import UnsafeCheckpoint, pickle_globals
from lucid_nb.weights import PARITY_RTOL, load_weights, parity, read_weights
from lucid_nb.testing import write_ultralytics_layout

from helpers import LUCID, cli_main, fit, lucid_main, tiny

FIX = Path(__file__).resolve().parent / 'fixtures'
ULTRA = FIX / 'yolo11n-seg-random.pt'           # written by real Ultralytics 8.4.190 (make_ultralytics_fixture.py)
OUTPUTS = FIX / 'yolo11n-seg-random.outputs.pt'  # its head outputs on a fixed input, computed by Ultralytics


@pytest.fixture(scope='module')
def ckpt(tmp_path_factory):
    "The last checkpoint of a 1-epoch tiny lucid run."
    _, run, _ = fit(tmp_path_factory.mktemp('run'), epochs=1)
    return run / 'checkpoints' / 'last.ckpt'


# ---- Ultralytics: parity, sizes, the size check ----

def test_ultralytics_fixture_matches_its_recorded_outputs():
    w = read_weights(ULTRA)
    assert (w.kind, w.scale, w.num_classes) == ('ultralytics', 'n', 80)
    net = yolo_seg('n')
    assert load_weights(net, w).complete
    diffs = parity(net, torch.load(OUTPUTS, weights_only=True))
    assert set(diffs) == {*(f'{b}{i}' for b in ('box', 'cls', 'coef') for i in range(3)), 'proto', 'decoded'}
    assert max(diffs.values()) < PARITY_RTOL, diffs   # float32 rounding of attention's scale and the DFL sum only


@pytest.mark.parametrize('size', ['s', 'm'])
def test_generated_s_and_m_files_load_fully(tmp_path, size):
    torch.manual_seed(0)
    src = yolo_seg(size)
    f = write_ultralytics_layout(src, tmp_path / f'yolo11{size}-seg.pt')
    assert any(n.startswith('ultralytics.nn.modules.') for n in pickle_globals(f))
    w = read_weights(f)
    assert w.scale == size and w.kind == 'ultralytics'
    dst = yolo_seg(size)
    assert load_weights(dst, w).complete
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v.half().float() if v.is_floating_point() else v), k


def test_writing_the_layout_leaves_torch_as_it_was():
    "The writer names its records after torch's classes for the save only: torch's modules hold their own classes after it."
    import sys, torch.nn.modules.container as container, torch.nn.modules.conv as conv
    before = {m: dict(vars(sys.modules[m])) for m in ('torch.nn.modules.container', 'torch.nn.modules.conv')}
    write_ultralytics_layout(yolo_seg('n'), Path(tempfile.mkdtemp()) / 'n.pt')
    assert container.ModuleList is torch.nn.ModuleList and conv.Conv2d is torch.nn.Conv2d
    for m, d in before.items(): assert dict(vars(sys.modules[m])) == d, m
    assert pickle.loads(pickle.dumps(torch.nn.ModuleList([torch.nn.Conv2d(1, 1, 1)])))   # pickles by those names again


def test_size_mismatch_is_one_line(tmp_path):
    r = subprocess.run([str(LUCID), *tiny(tmp_path, '--model.weights', str(ULTRA), '--model.size', 's')], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and lines[-1].startswith(f'lucid: error: --model.weights {ULTRA} holds a size n network'), r.stderr[-2000:]
    assert 'Traceback' not in r.stderr and '--model.size n' in lines[-1]


def test_size_comes_from_the_file_when_not_given(tmp_path, capsys):
    f = write_ultralytics_layout(yolo_seg('s'), tmp_path / 's.pt')
    cli = cli_main(tiny(tmp_path, '--model.weights', str(f))[1:], run=False)
    assert cli.model.hparams.size == 's'
    assert '--model.size s: taken from --model.weights' in capsys.readouterr().err


def test_weights_file_is_read_once(tmp_path, monkeypatch):
    "The CLI reads `--model.weights` before it builds the model (for its size) and hands that reading on: one read, not two."
    import lucid_nb.weights as W
    reads, real = [], W.safe_load
    monkeypatch.setattr(W, 'safe_load', lambda p, *a, **k: reads.append(Path(p)) or real(p, *a, **k))
    cli = cli_main(tiny(tmp_path, '--model.weights', str(ULTRA))[1:], run=False)
    assert reads == [ULTRA] and cli.model.hparams.size == 'n'


def test_size_mismatch_has_one_wording(tmp_path, monkeypatch, capsys):
    "The CLI's check and `LitYolo`'s say the same line (`Weights.check_size`)."
    with pytest.raises(ValueError) as api: LitYolo(size='s', weights=str(ULTRA))
    assert lucid_main(monkeypatch, *tiny(tmp_path, '--model.weights', str(ULTRA), '--model.size', 's')) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f'lucid: error: {api.value} ') and err.count(err[-1]) == 1, err


# ---- another class count ----

def test_three_classes_take_every_tensor_that_fits(capsys):
    torch.manual_seed(0)
    fresh = {k: v.clone() for k, v in yolo_seg('n', 3).state_dict().items()}
    torch.manual_seed(0)
    m = LitYolo(num_classes=3, weights=str(ULTRA))
    lines = [l for l in capsys.readouterr().err.splitlines() if 'weights:' in l]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f'lucid: weights: 509 of 560 tensors taken from {ULTRA}') and \
        'shape differs (80 classes in the file, 3 here): head.cls.{0,1,2}.0.1.conv' in lines[0], lines[0]
    w, sd = read_weights(ULTRA), m.model.state_dict()
    differ = [k for k in sd if w.state[k].shape != sd[k].shape]
    assert len(differ) == 51 and all(k.startswith('head.cls.') for k in differ)
    assert all(torch.equal(sd[k], fresh[k]) for k in differ)                     # freshly initialised
    assert all(torch.equal(sd[k], w.state[k]) for k in sd if k not in differ)    # the rest from the file
    assert all(torch.equal(m.ema.module.state_dict()[k], v) for k, v in sd.items())   # the EMA starts there


@pytest.fixture(scope='module', params=['pose'])
def other_task(request, tmp_path_factory):
    "An Ultralytics YOLO11n file of a task lucid has not (`yolo11n-pose.pt`), as its training saves it (a detection file is a detector: `test_detect.py`)."
    torch.manual_seed(0)
    return request.param, write_ultralytics_layout(yolo_seg('n'), tmp_path_factory.mktemp('task') / f'yolo11n-{request.param}.pt', task=request.param)


def test_another_tasks_file_is_refused(other_task, tmp_path, monkeypatch, capsys):
    "predict, validate, test, export and `lucid_nb.load` refuse a pose file in one line naming its task: lucid has no network of it."
    task, f = other_task
    says = f'{f} is an Ultralytics YOLO11n {task} model, neither a segmentation nor a detection one: lucid has no {task} branch'
    with pytest.raises(ValueError, match=f'lucid_nb.load {says}'): lucid_nb.load(f)
    for sub in ('validate', 'test', 'predict'):
        assert lucid_main(monkeypatch, *tiny(tmp_path, '--model.weights', str(f), sub=sub)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith(f'lucid: error: --model.weights {says}'), err
    assert lucid_main(monkeypatch, 'export', '--model.weights', str(f), '--output', str(tmp_path / 'x.onnx')) == 2
    assert f'--model.weights {says}' in capsys.readouterr().err and not (tmp_path / 'x.onnx').exists()


def test_fit_from_another_tasks_file_says_what_it_loaded(other_task, tmp_path, capsys):
    "fit may start from a pose file: one line names the file's task and which parts were loaded and which start fresh."
    task, f = other_task
    cli, run, _ = fit(tmp_path, '--model.weights', str(f), epochs=1)
    line = next(l for l in capsys.readouterr().err.splitlines() if 'tensors taken from' in l)
    assert f'(Ultralytics YOLO11n, a {task} model, 80 classes); loaded: backbone, neck, box branch' in line, line
    assert '; fresh: mask-coefficient branch, mask prototypes' in line and 'seg' not in line.split('tensors taken from')[1], line
    w = read_weights(f)
    start = LitYolo(num_classes=80, weights=str(f)).model.state_dict()   # where the fit started
    assert all(torch.equal(start[k], w.state[k]) for k in start if k.startswith(('backbone.', 'neck.', 'head.box.', 'head.cls.')))
    assert not any(k.startswith(('head.coef.', 'head.proto.')) for k in w.state)   # the third branch is no mask branch


def test_fused_file_is_refused_with_the_reason(tmp_path):
    f = write_ultralytics_layout(yolo_seg('n'), tmp_path / 'fused.pt', fused=True)
    with pytest.raises(ValueError, match=r'fused.pt is a fused Ultralytics model \(its BatchNorm folded into the convolutions'): lucid_nb.load(f)


def test_fit_from_ultralytics_takes_the_class_names_of_the_data(tmp_path, capsys):
    cli, run, _ = fit(tmp_path, '--model.weights', str(ULTRA), epochs=1)
    assert f'lucid: weights: 560 of 560 tensors taken from {ULTRA}' in capsys.readouterr().err
    c = torch.load(run / 'checkpoints' / 'last.ckpt', map_location='cpu', weights_only=True)
    assert c['lucid']['class_names'][:2] == ['person', 'bicycle']   # the data's, not the file's '0', '1'


# ---- a lucid checkpoint as weights ----

class AtStart(Callback):
    "What the fit starts from: epoch, step, optimiser state, EMA weights and updates."
    def on_train_start(self, trainer, module):
        self.seen = dict(epoch=trainer.current_epoch, step=trainer.global_step, opt_state=len(trainer.optimizers[0].state),
                         ema={k: v.clone() for k, v in module.ema.module.state_dict().items()},
                         model={k: v.clone() for k, v in module.model.state_dict().items()}, updates=module.ema.updates)


def test_our_checkpoint_loads_weights_only(ckpt):
    assert all(not n.startswith('ultralytics.') for n in pickle_globals(ckpt))
    c = torch.load(ckpt, map_location='cpu', weights_only=True)   # no stand-ins, no extra globals
    assert c['epoch'] == 0 and any(k.startswith('ema.module.') for k in c['state_dict'])


def test_fit_from_lucid_checkpoint_starts_fresh(ckpt, tmp_path):
    saved = torch.load(ckpt, map_location='cpu', weights_only=True)
    ema = {k[len('ema.module.'):]: v for k, v in saved['state_dict'].items() if k.startswith('ema.module.')}
    at = AtStart()
    cli, run, _ = fit(tmp_path, '--model.weights', str(ckpt), callbacks=[at], epochs=1)
    s = at.seen
    assert (s['epoch'], s['step'], s['opt_state'], s['updates']) == (0, 0, 0, 0)   # not resumed: fresh optimiser and schedule
    assert all(torch.equal(s['ema'][k], v) for k, v in ema.items())                 # the EMA is the loaded weights
    assert all(torch.equal(s['model'][k], v) for k, v in ema.items())
    assert saved['epoch'] == 0 and cli.trainer.current_epoch == 1


def test_validate_with_weights_scores_what_ckpt_path_scores(ckpt, tmp_path, monkeypatch):
    scores = {}
    for how in ('--ckpt_path', '--model.weights'):
        d = tmp_path / how.strip('-')
        assert lucid_main(monkeypatch, *tiny(d, how, str(ckpt), sub='validate')) == 0
        scores[how] = json.loads(next((d / 'runs').rglob('val_metrics.jsonl')).read_text().splitlines()[-1])
    assert scores['--ckpt_path']['mAP50-95(M)'] == scores['--model.weights']['mAP50-95(M)']
    assert scores['--ckpt_path']['mAP50(B)'] == scores['--model.weights']['mAP50(B)']


def test_weights_with_ckpt_path_is_not_read(ckpt, tmp_path, monkeypatch, capsys):
    "A run resumed with its first options and `--ckpt_path`: the checkpoint restores the network; the weights file is not read."
    gone = tmp_path / 'gone.pt'
    assert lucid_main(monkeypatch, *tiny(tmp_path, '--model.weights', str(gone), '--ckpt_path', str(ckpt), sub='validate')) == 0
    assert f'lucid: --model.weights {gone} is not read: --ckpt_path {ckpt} restores the network' in capsys.readouterr().err


# ---- predict, export and the Python API accept the weights ----

def test_predict_export_and_load_accept_weights(tmp_path, monkeypatch):
    images = tmp_path / 'images'; images.mkdir()
    for p in sorted(EMBEDDED_IMAGES.glob('*.jpg'))[:2]: (images / p.name).write_bytes(p.read_bytes())
    assert lucid_main(monkeypatch, 'predict', '--model.weights', str(ULTRA), '--data.predict_images', str(images),
                      '--data.imgsz', '64', '--trainer.accelerator', 'cpu', '--trainer.logger', 'false',
                      '--trainer.default_root_dir', str(tmp_path / 'out'), '--trainer.enable_progress_bar', 'false') == 0
    assert (tmp_path / 'out' / 'predict' / 'predictions.json').is_file()
    out = tmp_path / 'net.torchscript'
    assert lucid_main(monkeypatch, 'export', '--model.weights', str(ULTRA), '--format', 'torchscript', '--imgsz', '64',
                      '--output', str(out)) == 0 and out.is_file()
    p = lucid_nb.load(ULTRA, imgsz=64, conf=0.0)
    assert len(p.class_names) == 80 and p.imgsz == 64
    assert len(p.predict(sorted(images.glob('*.jpg'))[0])) == 1


# ---- code-running pickles are refused on every path ----

class Payload:
    "Unpickling this runs a shell command that creates `target`."
    def __init__(self, target): self.target = target
    def __reduce__(self): return (os.system, (f'touch {self.target}',))


def hidden_payload(target) -> bytes:
    "A bare pickle whose callable `posix.system` is named by strings kept in its memo, after two harmless strings: a scan of the opcodes' arguments alone reads `collections.OrderedDict`."
    s8 = lambda t: b'\x8c' + bytes([len(t)]) + t.encode()
    return (b'\x80\x04' + s8('posix') + b'\x94' + s8('system') + b'\x94' + b'00' + s8('collections') + s8('OrderedDict') + b'00'
            + b'h\x00h\x01\x93' + s8(f'touch {target}') + b'\x85R.')


@pytest.fixture(params=['pt', 'ckpt', 'legacy', 'hidden'])
def evil(request, tmp_path):
    """A crafted file whose loading would create `pwned`: a bare pickle (`.pt`), a torch archive (`.ckpt`), torch's legacy
    format (several pickles, then storages), or a pickle that hides its callable in its memo."""
    f, target = tmp_path / f'evil-{request.param}.pt', tmp_path / 'pwned'
    obj = {'state_dict': {}, 'model': Payload(target)}
    if request.param == 'pt':
        with open(f, 'wb') as fh: pickle.dump(obj, fh)
    elif request.param == 'hidden': f.write_bytes(hidden_payload(target))
    else: torch.save(obj, f, _use_new_zipfile_serialization=request.param == 'ckpt')
    return f, target


@pytest.mark.parametrize('how', ['--model.weights', '--ckpt_path'])
def test_evil_file_refused_by_the_cli(evil, how, tmp_path, monkeypatch, capsys):
    f, target = evil
    sub = 'fit' if how == '--model.weights' else 'validate'
    assert lucid_main(monkeypatch, *tiny(tmp_path, how, str(f), sub=sub)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f'lucid: error: {how} {f}: refused: its pickle would call posix.system, which no weights file needs'), err
    assert 'weights_only' not in '\n'.join(err) and '\x1b' not in '\n'.join(err), err   # lucid's sentence, not torch's advice
    assert not target.exists()


def test_evil_file_refused_by_load_and_export(evil, monkeypatch, capsys):
    f, target = evil
    with pytest.raises(UnsafeCheckpoint, match='refused: its pickle would call posix.system'): lucid_nb.load(f)
    assert lucid_main(monkeypatch, 'export', '--ckpt_path', str(f)) == 2
    assert 'refused' in capsys.readouterr().err.strip().splitlines()[-1]
    assert not target.exists()


def test_lightning_reads_ckpt_path_through_the_safe_reader(evil, tmp_path):
    "Lightning's own read of `--ckpt_path` (its strategy's checkpoint I/O) is `read_checkpoint`, also when lucid's up-front read is skipped."
    f, target = evil
    cli = cli_main(tiny(tmp_path)[1:], run=False)
    assert isinstance(cli.trainer.strategy.checkpoint_io, SafeCheckpointIO)
    with pytest.raises(UnsafeCheckpoint): cli.trainer.fit(cli.model, cli.datamodule, ckpt_path=str(f))
    assert not target.exists()
