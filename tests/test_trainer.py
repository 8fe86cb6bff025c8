"""The trainer end to end on the CPU: the `lucid` CLI (fit → validate → predict), resume exactness, hash determinism,
atomic checkpoints and clear errors for bad options, data paths and checkpoints."""
import json, subprocess, sys
from pathlib import Path

import pytest
from pycocotools.coco import COCO

from lucid_nb.core import EMBEDDED_ANNOTATIONS
import lightning.pytorch as L
from lucid_nb.data import YoloData
from lucid_nb.loader import YoloLoader
from lucid_nb.metrics import results_bytes
from lightning.pytorch.callbacks import Callback
from lucid_nb.command import cli_main
from lucid_nb.trainer import LitYolo

from helpers import tiny, StopAfterFirstEpoch, fit, hashes_only


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
    "An uninterrupted 2-epoch tiny run."
    return fit(tmp_path_factory.mktemp('ref'))


def test_run_folder(reference):
    cli, run, h = reference
    for f in ('config.yaml', 'metrics.csv', 'predictions.json', 'val_metrics.jsonl', 'curves.png',
              'val_batch_labels.jpg', 'val_batch_pred.jpg', 'train_batch.jpg', 'labels.jpg', 'state_hashes.json', 'timing.json',
              'checkpoints/last.ckpt', 'checkpoints/best.ckpt'):
        assert (run / f).exists(), f
    assert not list(run.rglob('*.tmp')), 'a temporary file was left behind'
    lines = [json.loads(l) for l in (run / 'val_metrics.jsonl').read_text().splitlines()]
    assert [l['epoch'] for l in lines] == [0, 1] and len([k for k in lines[0] if k.startswith('segm/')]) == 12
    assert set(h) >= {'model', 'optimizer', 'scheduler', 'ema', 'loss', 'best', 'predictions', 'all'}


def test_same_seed_same_hashes(reference, tmp_path):
    _, _, h = fit(tmp_path)
    assert hashes_only(h) == hashes_only(reference[2])


def test_resume_is_exact(reference, tmp_path):
    _, run, h1 = fit(tmp_path, callbacks=[StopAfterFirstEpoch()])
    assert hashes_only(h1) != hashes_only(reference[2])   # it really stopped early
    _, _, h = fit(tmp_path, ckpt=str(run / 'checkpoints' / 'last.ckpt'))
    assert hashes_only(h) == hashes_only(reference[2])


def test_validate_and_predict(reference, tmp_path):
    _, run, _ = reference
    ckpt = str(run / 'checkpoints' / 'best.ckpt')
    cli_main(tiny(tmp_path, '--ckpt_path', ckpt, sub='validate'))
    cli = cli_main(tiny(tmp_path, '--ckpt_path', ckpt, sub='test'))
    assert 'mAP50-95(M)' in cli.trainer.callback_metrics
    cli = cli_main(tiny(tmp_path, '--ckpt_path', ckpt, '--model.conf', '0.0', sub='predict'))
    out = Path(cli.trainer.log_dir) / 'predict'
    results = json.loads((out / 'predictions.json').read_text())
    assert results and list(out.glob('*.jpg'))
    gt = COCO(str(EMBEDDED_ANNOTATIONS))
    assert len(gt.loadRes(str(out / 'predictions.json')).anns) == len(results)


@pytest.mark.parametrize('allocator, default', [('expandable_segments:True', 2**27), ('expandable_segments:False', 2**25)])
def test_val_group_pixels_changes_no_prediction(reference, tmp_path, monkeypatch, allocator, default):
    "Validation's group size trades GPU memory for host operator calls; unset, it follows the allocator's setting; the predictions are the same bytes."
    monkeypatch.delenv('PYTORCH_ALLOC_CONF', raising=False); monkeypatch.setenv('PYTORCH_CUDA_ALLOC_CONF', allocator)
    ckpt, got = str(reference[1] / 'checkpoints' / 'best.ckpt'), []
    for g in (None, 1):
        cli = cli_main(tiny(tmp_path / str(g), '--ckpt_path', ckpt, *(('--model.val_group_pixels', str(g)) if g else ()), sub='validate'))
        v = cli.model.validator
        assert v.group_pixels == (g or default) and len(v.results) > 10
        got.append(results_bytes(v.results))
    assert got[0] == got[1]


def test_checkpoint_of_another_model_is_refused(reference, tmp_path):
    "Through the API a checkpoint of another architecture gets a clear error (the CLI: test_faults_trainer.py)."
    ckpt = str(reference[1] / 'checkpoints' / 'last.ckpt')
    trainer = L.Trainer(accelerator='cpu', logger=False, enable_progress_bar=False, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match=r"size='n' \(this run: 's'\)"):
        trainer.validate(LitYolo(size='s'), datamodule=YoloData(imgsz=64, batch_size=2, val_count=2), ckpt_path=ckpt)


@pytest.mark.parametrize('opt, value, says', [('--data.cache', 'bogus', 'cache'), ('--model.size', 'x', 'size'),
                                              ('--model.optimizer', 'adam9', 'optimizer'),
                                              ('--model.capture_segment_heads', '1', 'capture_segment_heads'),
                                              ('--model.val_group_pixels', '0', 'val_group_pixels')])
def test_bad_option_values(tmp_path, capsys, opt, value, says):
    with pytest.raises((SystemExit, ValueError)) as e:
        cli_main(tiny(tmp_path, opt, value), run=True)
    assert says in str(e.value) + capsys.readouterr().err


def test_missing_dataset_paths(tmp_path):
    with pytest.raises((FileNotFoundError, ValueError)) as e:
        cli_main(tiny(tmp_path, '--data.train_images', str(tmp_path / 'nope'),
                      '--data.train_annotations', str(tmp_path / 'nope.json')))
    assert 'nope' in str(e.value)


class KeepTrainer(Callback):
    def setup(self, trainer, module, stage): self.trainer = trainer


def test_validation_batches_are_made_ahead(tmp_path, monkeypatch):
    "In a fit, the next validation's batches start as soon as a validation ends (at the training epoch before)."
    keep, seen, produce = KeepTrainer(), [], YoloLoader._produce
    def record(loader, epoch):   # the validation loader's: (training epoch now, validation epoch produced)
        if not loader.batch_sampler.shuffle: seen.append((keep.trainer.current_epoch, epoch))
        return produce(loader, epoch)
    monkeypatch.setattr(YoloLoader, '_produce', record)
    cli, run, _ = fit(tmp_path, callbacks=[keep], epochs=3)
    assert seen == [(0, 0), (0, 1), (1, 2)]
    timing = json.loads((run / 'timing.json').read_text())
    assert all(e['validation']['data_wait'] >= 0 and e['checkpoint_seconds'] > 0 and e['boundary_seconds'] > 0 for e in timing['epochs'])
    ld = cli.datamodule._make_loader(cli.datamodule._val, False)
    assert ld.ahead_until == 2 and cli.datamodule._make_loader(cli.datamodule._train, True).ahead_until == 2


def test_lucid_command(tmp_path):
    r = subprocess.run([str(Path(sys.executable).parent / 'lucid'), 'fit', '--help'], capture_output=True, text=True,
                       cwd=tmp_path, timeout=120)
    assert r.returncode == 0 and '--model.capture_segment_heads' in r.stdout and '--data.train_images' in r.stdout


def test_lucid_fit_exits_zero(tmp_path):
    "The real console script, end to end: exit status 0 and nothing printed after the run."
    r = subprocess.run([str(Path(sys.executable).parent / 'lucid'), *tiny(tmp_path, epochs=1)], capture_output=True,
                       text=True, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout + r.stderr
    assert 'LucidCLI object' not in out
    assert 'Tip:' not in out and 'will override existing callbacks' not in out   # no adverts, no callback note
    epochs = [l for l in r.stdout.splitlines() if l.startswith('epoch ')]
    assert len(epochs) == 1 and epochs[0].startswith('epoch 1/1  loss box ') and 'mAP50-95 box ' in epochs[0] and ' mask ' in epochs[0]
    assert epochs[0].endswith(' s')
    table = [l.split() for l in r.stdout[r.stdout.index(' Class '):].splitlines()]
    assert table[0] == ['Class', 'Images', 'Instances', 'Box(P', 'R', 'mAP50', 'mAP50-95)', 'Mask(P', 'R', 'mAP50', 'mAP50-95)']
    assert table[1][:2] == ['all', '2'] and len(table[1]) == 11   # the 2 validation images of `tiny`
    assert any(l[:1] == ['Speed:'] and l[-2:] == ['per', 'image'] for l in table)
    assert r.stdout.rstrip().splitlines()[-1] == f"Results saved to {tmp_path / 'runs' / 'tiny' / 'version_0'}"


def test_empty_validation_set_is_an_error(tmp_path):
    "When bad input leaves no validation image, say so instead of training without validation."
    import shutil
    from lucid_nb.core import EMBEDDED_IMAGES
    images = tmp_path / 'images'; shutil.copytree(EMBEDDED_IMAGES, images)
    for p in sorted(images.glob('*.jpg'))[-2:]: p.write_bytes(b'not a jpeg')
    with pytest.raises(ValueError, match='no usable validation image') as e:
        cli_main(tiny(tmp_path, '--data.train_images', str(images), '--data.train_annotations', str(EMBEDDED_ANNOTATIONS)))
    assert 'every one of the 2 of the last 2 images' in str(e.value) and '2 × unreadable image' in str(e.value)   # the report in the line
    val = tmp_path / 'val.json'   # a validation JSON that lists no image: said so, not 'left out as bad input'
    val.write_text(json.dumps(dict(json.loads(EMBEDDED_ANNOTATIONS.read_text()), images=[], annotations=[])))
    with pytest.raises(ValueError, match=f'no validation image: {val} lists none that can be read'):
        cli_main(tiny(tmp_path, '--data.val_images', str(EMBEDDED_IMAGES), '--data.val_annotations', str(val)))


def test_bf16_mixed_fit_and_validate(tmp_path):
    "The GPU configuration's precision, on the CPU: training and COCO validation under bf16 autocast."
    cli, run, h = fit(tmp_path, '--trainer.precision', 'bf16-mixed')
    assert json.loads((run / 'val_metrics.jsonl').read_text().splitlines()[-1])['epoch'] == 1


def test_tensorboard_only_when_asked(tmp_path):
    "TensorBoard is opt-in (`--tensorboard true`): its writer costs seconds at fit end; a missing package is a clear error."
    import importlib.util
    from lucid_nb.command import add_tensorboard
    cli = cli_main(tiny(tmp_path)[1:], run=False)
    assert len(cli.trainer.loggers) == 1
    if importlib.util.find_spec('tensorboard') is None:
        with pytest.raises(ValueError, match='pip install tensorboard'): cli_main(tiny(tmp_path, '--tensorboard', 'true')[1:], run=False)
    else:
        cli = cli_main(tiny(tmp_path, '--tensorboard', 'true')[1:], run=False)
        assert type(cli.trainer.loggers[1]).__name__ == 'TensorBoardLogger'
        assert not add_tensorboard(cli.trainer)   # never twice


def test_timing_has_every_phase(reference):
    "timing.json splits the run: start-up, data setup, per-epoch training, data waits and validation parts, fit end."
    t = json.loads((reference[1] / 'timing.json').read_text())
    assert t['startup_seconds'] > 0 and t['fit_end_seconds'] >= 0 and t['data_setup_seconds'] >= 0
    assert 0 < t['first_step_seconds'] < t['epochs'][0]['train_seconds']   # one of the epoch's steps
    assert set(t['fit_end_parts']) == {'predictions', 'state_hashes', 'curves', 'val_drawings', 'val_plots'}
    assert sum(t['fit_end_parts'].values()) <= t['fit_end_seconds']
    for e in t['epochs']:
        assert e['train_seconds'] <= e['seconds'] and set(e['validation']) >= {'forward', 'postprocess', 'evaluate', 'epoch'}


def test_labels_grid_is_drawn_from_fit_start(reference, tmp_path):
    "val_batch_labels.jpg comes from the thread started with the fit, and is the grid drawn directly from the data."
    from lucid_nb.draw import save_jpeg, val_labels_grid
    from lucid_nb.run_artifacts import RunArtifacts
    cli, run, _ = reference
    artifacts = next(cb for cb in cli.trainer.callbacks if isinstance(cb, RunArtifacts))
    assert artifacts.labels is not None and artifacts.labels.done()
    images, grid = val_labels_grid(cli.datamodule)
    save_jpeg(grid, tmp_path / 'labels.jpg')
    assert (run / 'val_batch_labels.jpg').read_bytes() == (tmp_path / 'labels.jpg').read_bytes()
    assert [im.shape for im in artifacts.labels.result()[0]] == [im.shape for im in images]


def test_channels_last_fit(tmp_path):
    "`--model.channels_last true`: the network and its EMA copy are channels-last, and the fit ends with its hashes and predictions."
    import torch
    cli, run, h = fit(tmp_path, '--model.channels_last', 'true', epochs=1)
    for m in (cli.model.model, cli.model.ema.module):
        assert all(p.is_contiguous(memory_format=torch.channels_last) for p in m.parameters() if p.dim() == 4)
    assert {'all', 'model', 'ema', 'predictions'} <= set(h)
