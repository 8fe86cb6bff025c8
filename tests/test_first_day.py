"""The first day, part 2 (issue 40): a one-line error where the input is wrong, a warning where the result is doubtful,
the right behaviour where `lucid` can know better."""
import json, re, os, subprocess, sys, textwrap
from pathlib import Path

import pytest, torch

from lucid_nb.core import EMBEDDED_ANNOTATIONS, EMBEDDED_IMAGES
from lightning.pytorch.loggers import Logger

from helpers import LUCID, TINY, lucid_main

KEEP = (1, 3, 62)   # person, car, chair: a 3-class dataset cut out of the embedded coco128


def _lucid(*args, cwd, env=None, timeout=600):
    return subprocess.run([str(LUCID), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS='1', **(env or {})))


def _errors(stderr: str) -> list:
    return [l for l in stderr.splitlines() if 'error' in l.lower() or 'Traceback' in l or 'terminate' in l or 'Abort' in l]


@pytest.fixture(scope='module')
def three(tmp_path_factory):
    "A checkpoint of one tiny epoch on 3 COCO classes, its annotations file and the folder it ran in."
    d = tmp_path_factory.mktemp('three')
    coco = json.loads(Path(EMBEDDED_ANNOTATIONS).read_text())
    coco['categories'] = [c for c in coco['categories'] if c['id'] in KEEP]
    coco['annotations'] = [a for a in coco['annotations'] if a['category_id'] in KEEP]
    (d / 'three.json').write_text(json.dumps(coco))
    r = _lucid('fit', *TINY, '--trainer.max_epochs', '1', '--data.train_images', str(EMBEDDED_IMAGES),
               '--data.train_annotations', 'three.json', cwd=d)
    assert r.returncode == 0, r.stderr[-3000:]
    return d, d / 'runs' / 'lucid' / 'version_0' / 'checkpoints' / 'last.ckpt'


@pytest.mark.parametrize('sub', ['validate', 'predict', 'fit'])
def test_checkpoint_of_other_classes_is_one_line(three, sub):
    "Lightning's `LightningDataModule.__str__`, called while jsonargparse words the link's error, crashed (and left threads that aborted fit)."
    d, ckpt = three
    r = _lucid(sub, *TINY, '--trainer.max_epochs', '2', '--data.train_images', str(EMBEDDED_IMAGES),
               '--data.train_annotations', str(EMBEDDED_ANNOTATIONS), '--ckpt_path', str(ckpt), cwd=d)
    assert r.returncode == 2, r.stderr[-3000:]
    errors = _errors(r.stderr)
    assert len(errors) == 1 and errors[0].startswith('lucid: error: the checkpoint was trained on category ids [1, 3, 62]'), r.stderr[-3000:]
    assert len(r.stderr.splitlines()) < 8 and sorted(p.name for p in (d / 'runs' / 'lucid').iterdir()) == ['version_0']


def test_datamodule_prints_without_reading():
    from lucid_nb.data import YoloData
    dm = YoloData(imgsz=64)
    assert str(dm) == 'YoloData(embedded coco128, imgsz=64, batch_size=4)' and dm._train is None and dm._loaders == []


def test_validate_and_test_take_the_checkpoint_size_and_data(three):
    "No data options: the checkpoint's data at its image size (it was the embedded coco128 at 640 px), said in one line."
    d, ckpt = three
    for sub in ('validate', 'test'):
        r = _lucid(sub, '--trainer.accelerator', 'cpu', '--trainer.enable_progress_bar', 'false', '--ckpt_path', str(ckpt), cwd=d)
        assert r.returncode == 0, r.stderr[-3000:]
        said = [l for l in r.stderr.splitlines() if "checkpoint's image size and data" in l]
        assert len(said) == 1 and 'imgsz=64' in said[0] and 'three.json' in said[0], r.stderr[-3000:]
        assert '3 classes; imgsz 64' in r.stdout
    given = _lucid('validate', '--trainer.accelerator', 'cpu', '--trainer.enable_progress_bar', 'false', '--ckpt_path', str(ckpt),
                   '--data.imgsz', '96', '--data.train_images', str(EMBEDDED_IMAGES), '--data.train_annotations', 'three.json',
                   '--data.val_count', '4', cwd=d)
    assert given.returncode == 0 and "checkpoint's image size" not in given.stderr and '3 classes; imgsz 96' in given.stdout


def test_export_warns_about_a_checkpoint_that_scored_nothing(three, tmp_path):
    d, ckpt = three
    e = _lucid('export', '--ckpt_path', str(ckpt), '--format', 'torchscript', '--output', str(tmp_path / 'net.torchscript'), cwd=d)
    assert e.returncode == 0 and re.search(r"lucid: warning: the checkpoint's last validation \(epoch [1-9]\d*\) scored mAP50-95\((B|M)\) 0\.0", e.stderr), e.stderr[-3000:]
    from lucid_nb.checkpoints import weak_checkpoint
    assert weak_checkpoint({'lucid': {'val': {'mAP50-95(B)': 0.2, 'mAP50-95(M)': 0.1}}}) is None
    assert weak_checkpoint({'callbacks': {'AtomicCheckpoint{...}': {'current_score': 0.0}}}) is not None   # written before 'val'


@pytest.mark.parametrize('given', ['--ckpt_path', '--model.weights'])
def test_predict_warns_about_a_checkpoint_that_scored_nothing(three, given):
    d, ckpt = three
    r = _lucid('predict', '--trainer.accelerator', 'cpu', '--trainer.enable_progress_bar', 'false', given, str(ckpt),
               '--data.predict_images', str(Path(EMBEDDED_IMAGES) / '000000000009.jpg'), cwd=d)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len([l for l in r.stderr.splitlines() if l.startswith("lucid: warning: the checkpoint's last validation (epoch 1) scored mAP50-95")]) == 1


def test_abbreviated_options_are_refused(tmp_path, monkeypatch, capsys):
    "argparse expanded `--trainer.max_epoch` to `--trainer.max_epochs` without a word, in every subcommand."
    monkeypatch.chdir(tmp_path)
    for args in (['fit', '--trainer.max_epoch', '1'], ['validate', '--data.imgs', '64'], ['fit', '--trainer.logger.init_args.save_d', 'x']):
        assert lucid_main(monkeypatch, *args) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and err.startswith('lucid: error:') and args[1].split('.')[-1] in err, err
    assert not (tmp_path / 'runs').exists()


def test_missing_images_folder_is_named_once(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert lucid_main(monkeypatch, 'fit', *TINY, '--data.train_images', str(tmp_path / 'nope'),
                      '--data.train_annotations', str(EMBEDDED_ANNOTATIONS)) == 2
    out = capsys.readouterr()
    assert f"train_images {tmp_path / 'nope'}: no such folder" in out.err and 'missing file' not in out.out + out.err
    assert len(out.err.splitlines()) < 6, out.err


@pytest.mark.parametrize('bad', [['--data.batch_size', '200'], ['--data.val_count', '200'], ['--trainer.max_epochs', '0']])
def test_failed_command_leaves_no_run_folder(tmp_path, monkeypatch, capsys, bad):
    "Errors found once the subcommand runs (data set-up, the schedule) used to leave an empty runs/lucid/version_N."
    monkeypatch.chdir(tmp_path)
    assert lucid_main(monkeypatch, 'fit', *TINY, *bad) == 2
    assert 'lucid: error:' in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    (tmp_path / 'runs' / 'lucid' / 'version_0').mkdir(parents=True)
    (tmp_path / 'runs' / 'lucid' / 'version_0' / 'mine.txt').write_text('kept')
    assert lucid_main(monkeypatch, 'fit', *TINY, *bad) == 2          # another folder's files are never touched
    assert [p.name for p in (tmp_path / 'runs' / 'lucid').iterdir()] == ['version_0']


def test_fast_dev_run_writes_into_a_run_folder(tmp_path):
    "Lightning's fast_dev_run swaps the loggers for a DummyLogger (log_dir None): the run's files landed in the working directory."
    r = _lucid('fit', *TINY, '--trainer.fast_dev_run', 'true', cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert [p.name for p in tmp_path.iterdir()] == ['runs']
    assert (tmp_path / 'runs' / 'lucid' / 'version_0' / 'state_hashes.json').is_file()


class FlatLogger(Logger):
    "A logger like W&B's: a `save_dir`, no `log_dir`."
    def __init__(self, save_dir: str): super().__init__(); self._save_dir = save_dir
    @property
    def name(self): return 'flat'
    @property
    def version(self): return 0
    @property
    def save_dir(self): return self._save_dir
    def log_metrics(self, metrics, step=None): pass
    def log_hyperparams(self, params, *args, **kwargs): pass


def test_another_logger_does_not_move_the_run_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    logger = json.dumps({'class_path': 'test_first_day.FlatLogger', 'init_args': {'save_dir': str(tmp_path / 'flat')}})
    assert lucid_main(monkeypatch, 'fit', *TINY, '--trainer.max_epochs', '1', '--trainer.logger', logger) == 0, capsys.readouterr().err[-2000:]
    run = tmp_path / 'runs' / 'lucid' / 'version_0'
    assert {'curves.png', 'metrics.csv', 'state_hashes.json', 'checkpoints'} <= {p.name for p in run.iterdir()}
    assert not (tmp_path / 'flat').exists() or not any((tmp_path / 'flat').rglob('*'))
    assert f"Results saved to {Path('runs') / 'lucid' / 'version_0'}" in capsys.readouterr().out


HIDE_ONNX = textwrap.dedent("""
    import sys
    sys.modules.update(onnxscript=None, onnx=None)     # as if the [export] extra were not installed
    sys.argv = ['lucid', *sys.argv[1:]]
    from lucid_nb.cli import main
    main()
""")


def test_onnx_without_the_extra_is_one_line(three, tmp_path):
    d, ckpt = three
    r = subprocess.run([sys.executable, '-c', HIDE_ONNX, 'export', '--ckpt_path', str(ckpt), '--output', str(tmp_path / 'x.onnx')],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    errors = _errors(r.stderr)
    assert len(errors) == 1 and "pip install 'lucid_nb[export]'" in errors[0] and 'onnxscript' in errors[0], r.stderr[-3000:]


def test_onnx_has_a_batch_axis_and_the_class_names(three, tmp_path):
    pytest.importorskip('onnxscript'); onnx = pytest.importorskip('onnx'); ort = pytest.importorskip('onnxruntime')
    import numpy as np, torch
    from lucid_nb.heads import yolo_seg
    from lucid_nb.predict import ExportNet, Predictor, export_input, export_main, export_model
    d, ckpt = three
    out = export_main(['--ckpt_path', str(ckpt), '--output', str(tmp_path / 'net.onnx')])
    meta = {p.key: p.value for p in onnx.load(str(out), load_external_data=False).metadata_props}
    assert json.loads(meta['names']) == ['person', 'car', 'chair'] and json.loads(meta['category_ids']) == list(KEEP)
    assert meta['imgsz'] == '64'
    torch.manual_seed(0)   # the tiny checkpoint's outputs are not finite (see the report of issue 40): a fresh network's are
    p = Predictor(yolo_seg('n', 3), ['a', 'b', 'c'], [1, 2, 3], imgsz=64)
    out = export_model(p, 'onnx', tmp_path / 'fresh.onnx')
    x = torch.cat([export_input(64), export_input(64).flip(-1)])
    got = ort.InferenceSession(str(out), providers=['CPUExecutionProvider']).run(None, {'img': x.numpy()})
    with torch.no_grad(): ref = ExportNet(p.net)(x)
    assert [g.shape[0] for g in got] == [2] * 4
    assert max(float(np.abs(g - r.numpy()).max()) for g, r in zip(got, ref)) < 1e-3


REPO = Path(__file__).resolve().parents[1]


def test_cpu_requirements_never_take_the_cuda_build_on_linux():
    "On Linux, PyPI's torch is the CUDA build: the CPU requirements pin the `+cpu` build, and README installs it from PyTorch's CPU index first."
    import re
    from packaging.requirements import Requirement
    lines = [l.strip() for l in (REPO / 'requirements-cpu.txt').read_text().splitlines() if l.strip() and not l.startswith('#')]
    torch_reqs = [Requirement(l) for l in lines if l.startswith('torch')]
    linux = [r for r in torch_reqs if r.marker is None or r.marker.evaluate({'sys_platform': 'linux'})]
    assert len(linux) == 1 and [s.version for s in linux[0].specifier] == ['2.13.0+cpu'], linux
    others = [r for r in torch_reqs if r.marker is not None and r.marker.evaluate({'sys_platform': 'darwin'})]
    assert [str(r.specifier) for r in others] == ['==2.13.0'], others   # macOS and Windows: PyPI's torch is the CPU build
    readme = re.sub(r'\\\n\s*', '', (REPO / 'README.md').read_text())   # a command wrapped with \ read as one line
    setup = next(l for l in readme.splitlines() if 'pip install -r requirements-cpu.txt' in l)
    first = setup.index('--no-deps torch==2.13.0+cpu --index-url https://download.pytorch.org/whl/cpu')
    assert first < setup.index('-r requirements-cpu.txt'), setup


# The first day, part 3 (issue 49): nothing after `fit` runs a network nobody trained, and it prints lucid's lines only.

@pytest.mark.parametrize('sub', ['validate', 'test', 'predict', 'export'])
def test_inference_without_weights_is_refused_in_one_line(tmp_path, monkeypatch, capsys, sub):
    "validate, test and predict ran a randomly initialised network without a word and exited 0; export gave a usage block."
    monkeypatch.chdir(tmp_path)
    assert lucid_main(monkeypatch, sub, *(TINY if sub != 'export' else [])) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(f'lucid: error: lucid {sub} needs trained weights: give --ckpt_path'), err
    assert '--model.weights FILE' in err and '--model.weights none' in err
    assert list(tmp_path.iterdir()) == []


def test_untrained_network_only_when_asked(tmp_path, monkeypatch, capsys):
    "`--model.weights none` is the one way to an untrained network, said in one line; export of a missing file names it."
    monkeypatch.chdir(tmp_path)
    assert lucid_main(monkeypatch, 'validate', *TINY, '--model.weights', 'none') == 0
    said = capsys.readouterr()
    assert 'lucid: validate with an untrained network (--model.weights none): its detections mean nothing' in said.err
    assert 'Class' in said.out
    assert lucid_main(monkeypatch, 'export', '--ckpt_path', 'gone.ckpt', '--output', str(tmp_path / 'x.onnx')) == 2
    err = capsys.readouterr().err   # it said "cannot write x.onnx"
    assert err == 'lucid: error: --ckpt_path gone.ckpt: no such file (LUCID_DEBUG=1 shows the traceback)\n', err


def _merged(*args, cwd) -> list:
    "The lines of a `lucid` subprocess, stdout and stderr together as a log file would hold them (stdout not a terminal)."
    r = subprocess.run([str(LUCID), *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600,
                       env=dict(os.environ, OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1'))
    assert r.returncode == 0, r.stdout[-3000:]
    return r.stdout.splitlines()


TABLE_ROW = r'^ +(Class|all|person|car|chair) '


@pytest.mark.parametrize('sub', ['validate', 'test', 'predict'])
def test_after_fit_prints_lucids_lines_only(three, sub):
    """validate, test and predict printed Lightning's restore lines, a UserWarning from site-packages, Lightning's metric
    box after lucid's table, and a progress bar into a redirected log (which swallowed predict's count line)."""
    import re
    d, ckpt = three
    lines = _merged(sub, '--trainer.accelerator', 'cpu', '--ckpt_path', str(ckpt), cwd=d)
    others = [l for l in lines if not (l.startswith(('lucid: ', 'lucid_nb data: ', 'Speed: ', 'predict: ', 'Results saved to '))
                                       or re.match(TABLE_ROW, l))]
    assert others == [], '\n'.join(lines)
    assert (sub == 'predict') == any(l.startswith('predict: ') and 'detections on' in l for l in lines), '\n'.join(lines)
    loud = '\n'.join(_merged(sub, '--trainer.accelerator', 'cpu', '--ckpt_path', str(ckpt), '--verbose', 'true', cwd=d))
    assert 'Restoring states from the checkpoint' in loud and (sub == 'predict' or 'metric' in loud), loud


def test_export_says_its_files_in_one_line(three, tmp_path):
    "export printed 18 lines of exporter chatter; a nano model's ONNX is one file (weights inside: under 2 GB), its only file named."
    pytest.importorskip('onnxscript'); pytest.importorskip('onnx')
    d, ckpt = three
    out = tmp_path / 'net.onnx'
    lines = _merged('export', '--ckpt_path', str(ckpt), '--output', str(out), cwd=d)
    assert all(l.startswith(('export: ', 'lucid: ')) for l in lines), '\n'.join(lines)
    (wrote,) = [l for l in lines if l.startswith('export: wrote ')]
    assert wrote.startswith(f'export: wrote {out} (') and not Path(f'{out}.data').exists(), wrote
    import onnx
    m = onnx.load(str(out), load_external_data=False)
    assert m.graph.initializer and all(t.data_location != onnx.TensorProto.EXTERNAL for t in m.graph.initializer)   # weights inside
    assert len(_merged('export', '--ckpt_path', str(ckpt), '--output', str(out), '--verbose', 'true', cwd=d)) > len(lines)


def test_lucid_data_takes_lucids_option_names_and_errs_in_one_line(tmp_path):
    "lucid-data spelt its options `--train-images` where lucid has `--data.train_images`; its errors were usage blocks."
    data = Path(sys.executable).parent / 'lucid-data'
    run = lambda *a: subprocess.run([str(data), *a], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                                    env=dict(os.environ, OMP_NUM_THREADS='1'))
    ok = run('--data.imgsz', '64', '--data.batch_size', '2', '--data.cache', 'none', '--data.prefetch', 'false', '--batches', '1')
    assert ok.returncode == 0 and 'prefetch off' in ok.stdout, ok.stderr[-2000:]
    for bad, says in ((['--data.imgsz', 'x'], '--data.imgsz'), (['--data.bogus', '1'], '--data.bogus'),
                      (['--data.train_images', 'nope', '--data.train_annotations', 'nope.json'], 'nope')):
        r = run(*bad)
        assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and r.stderr.startswith('lucid-data: error: '), r.stderr
        assert says in r.stderr, r.stderr


def test_subcommand_list_includes_export(monkeypatch, capsys):
    assert lucid_main(monkeypatch, 'bogus') == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "'predict', 'export')" in err, err
    assert lucid_main(monkeypatch, '--help') == 0
    assert '{fit,validate,test,predict,export}' in capsys.readouterr().out


def test_empty_prediction_picture_says_so(three, tmp_path, monkeypatch, capsys):
    "An untrained model's prediction picture was the bare image: now it says no detection passed the threshold it was drawn at."
    from lucid_nb.data import load_rgb
    from lucid_nb.draw import draw_note, save_jpeg
    d, ckpt = three
    image = Path(EMBEDDED_IMAGES) / '000000000009.jpg'
    monkeypatch.chdir(tmp_path)
    assert lucid_main(monkeypatch, 'predict', '--trainer.accelerator', 'cpu', '--ckpt_path', str(ckpt), '--model.conf', '0.99',
                      '--data.predict_images', str(image), '--trainer.default_root_dir', 'out') == 0, capsys.readouterr().err[-2000:]
    (drawn,) = Path('out').rglob('predict/000000000009.jpg')
    assert json.loads((drawn.parent / 'predictions.json').read_text()) == []
    save_jpeg(draw_note(load_rgb(image), 'no detections above conf 0.99'), tmp_path / 'want.jpg')   # the same encoder, the same bytes
    assert drawn.read_bytes() == (tmp_path / 'want.jpg').read_bytes()


def test_many_problems_of_a_kind_are_one_line_and_a_file(tmp_path):
    "A COCO file listing 30 images missing from the folder: one line for the kind, the count, and the run folder's file with all 30."
    images = tmp_path / 'images'; images.mkdir()
    for p in sorted(EMBEDDED_IMAGES.glob('*.jpg'))[30:]: (images / p.name).symlink_to(p)
    lines = _merged('fit', *TINY, '--trainer.max_epochs', '1', '--data.train_images', str(images),
                    '--data.train_annotations', str(EMBEDDED_ANNOTATIONS), '--trainer.default_root_dir', str(tmp_path / 'r'), cwd=tmp_path)
    missing = [l for l in lines if 'missing file' in l]
    assert len(missing) == 2, '\n'.join(missing)   # the first one, with its file; the data line's count
    assert any('30 × missing file' in l for l in missing) and not any('.problems' in l for l in lines)
    assert any(l.strip() == 'every one, the first of each kind said above: input_problems.txt in the run folder' for l in lines), '\n'.join(lines[:12])
    (listed,) = (tmp_path / 'r').rglob('input_problems.txt')
    assert len(listed.read_text().splitlines()) == 30 and all(': missing file -> skipped' in l for l in listed.read_text().splitlines())


def test_a_fit_whose_validation_dominates_says_so_once(tmp_path, monkeypatch, capsys):
    "Issue 59: a young model's validation took 130 of an epoch's 189 s and nothing said why; now one line, once a fit."
    import time
    import lucid_nb.trainer
    from lucid_nb.metrics import Validator
    monkeypatch.chdir(tmp_path)
    args = ['fit', *TINY, '--trainer.max_epochs', '2']
    assert lucid_main(monkeypatch, *args) == 0
    assert 'validation took' not in capsys.readouterr().err   # a short validation never says it
    update, start, training = Validator.update, lucid_nb.trainer.LitYolo.on_validation_epoch_start, []
    def timed_start(self): start(self); training.append(self.val_t0 - self.epoch_t0)
    def slow_update(self, *a, **k): time.sleep(training[-1] + .5); return update(self, *a, **k)   # longer than training
    monkeypatch.setattr(lucid_nb.trainer.LitYolo, 'on_validation_epoch_start', timed_start)
    monkeypatch.setattr(Validator, 'update', slow_update)
    monkeypatch.setattr(lucid_nb.trainer, 'SLOW_VALIDATION_SECONDS', 0.5)
    assert lucid_main(monkeypatch, *args) == 0
    lines = [l for l in capsys.readouterr().err.splitlines() if 'validation took' in l]
    assert len(lines) == 1, lines                                # two validations, one line
    assert lines[0].startswith('lucid: validation took') and '--trainer.check_val_every_n_epoch' in lines[0] \
        and '--trainer.limit_val_batches' in lines[0], lines[0]


def test_a_network_that_outputs_nan_says_so_once(tmp_path, monkeypatch, capsys):
    "A diverged network (here: an eval-mode batch norm with a negative variance) scored nothing without a word."
    import lucid_nb.trainer
    monkeypatch.chdir(tmp_path)
    start = lucid_nb.trainer.LitYolo.on_validation_epoch_start
    def diverged(self):
        start(self)
        next(m for m in self.ema.module.modules() if isinstance(m, torch.nn.BatchNorm2d)).running_var.fill_(-1.)
    monkeypatch.setattr(lucid_nb.trainer.LitYolo, 'on_validation_epoch_start', diverged)
    assert lucid_main(monkeypatch, 'fit', *TINY, '--trainer.max_epochs', '2') == 0
    lines = [l for l in capsys.readouterr().err.splitlines() if 'not finite' in l]
    assert len(lines) == 1 and 'on 2 of 2 validation images' in lines[0] and '--model.clip_grad_norm' in lines[0], lines
