"""YOLO26 (`nbs/03b_yolo26.ipynb`, its loss `nbs/04b_loss26.ipynb`) through the commands: `lucid fit --model.family
yolo26` from scratch, the family recorded in checkpoints and taken from a file by validate and predict, Ultralytics'
YOLO26 files (`tests/fixtures/yolo26n*-random.pt`, written by real Ultralytics: `make_ultralytics_fixture.py`), the
refusals of a family that does not match, a resume that ends as the uninterrupted fit (the loss's branch weights follow
the epoch), and the replay of the head and of the whole step (CPU stand-in of CUDA graphs), byte for byte native."""
import json
from pathlib import Path

import pytest, torch

from lucid_nb.core import synth_batch
from lucid_nb.graphs import EagerGraphs
from lucid_nb.loss26 import branch_gains, family_loss
from lucid_nb.recorder import HeadRegion, StepRegion
from lucid_nb.yolo26 import read_model_weights, yolo26

from helpers import StopAfterFirstEpoch, fit, hashes_only, lucid_main, replayed_fits_are_native, tiny, train_trace
from helpers import test_traces_equal as traces_equal   # (not collected as a test)

FIX = Path(__file__).resolve().parent / 'fixtures'
SEG26, DET26, SEG11 = FIX / 'yolo26n-seg-random.pt', FIX / 'yolo26n-random.pt', FIX / 'yolo11n-seg-random.pt'
FAMILY = ('--model.family', 'yolo26')


def last_line(err: str) -> str: return [l for l in err.splitlines() if l.strip()][-1]


@pytest.fixture(scope='module')
def fit26(tmp_path_factory):
    "A tiny YOLO26 segmentation fit from scratch, two epochs."
    return fit(tmp_path_factory.mktemp('fit26'), *FAMILY)


def test_fit_from_scratch_trains_both_branches_and_records_the_family(fit26):
    cli, run, _ = fit26
    assert type(cli.model.model.head).__name__ == 'SegHead26' and type(cli.model.loss_fn).__name__ == 'E2ELoss26'
    # the branch weights of the last epoch (1 of 2): Ultralytics' schedule, told by the trainer
    assert torch.equal(cli.model.loss_fn.weights, torch.tensor(branch_gains(1, 2)))
    c = torch.load(run / 'checkpoints' / 'last.ckpt', map_location='cpu', weights_only=True)
    assert c['hyper_parameters']['family'] == 'yolo26'
    assert any('.one2one_' in k for k in c['state_dict'])
    header = (run / 'metrics.csv').read_text().splitlines()[0].split(',')
    assert {'train/o2m_seg_epoch', 'train/o2o_seg_epoch', 'train/o2m_sem_epoch', 'train/o2o_l1_epoch'} <= set(header)
    line = json.loads((run / 'val_metrics.jsonl').read_text().splitlines()[-1])
    assert 'segm/mAP50' in line and 'bbox/mAP50' in line


def test_a_checkpoint_gives_its_family_to_validate_and_predict(fit26, tmp_path, monkeypatch, capsys):
    ckpt = fit26[1] / 'checkpoints' / 'last.ckpt'
    w = read_model_weights(ckpt)
    assert (w.family, w.kind, w.title) == ('yolo26', 'lucid', 'lucid YOLO26n-seg, 80 classes')
    assert lucid_main(monkeypatch, *tiny(tmp_path / 'v', '--model.weights', str(ckpt), sub='validate')) == 0
    out = capsys.readouterr()
    assert "family='yolo26'" in out.err and 'Mask(P' in out.out


@pytest.mark.parametrize('file, title', [(SEG26, 'Ultralytics YOLO26n-seg, 80 classes'), (DET26, 'Ultralytics YOLO26n, 80 classes')])
def test_predict_with_an_ultralytics_yolo26_file_takes_its_family(tmp_path, monkeypatch, capsys, file, title):
    images = sorted((Path(__file__).resolve().parent.parent / 'lucid_nb' / 'embedded' / 'coco128' / 'images').glob('*.jpg'))[:2]
    folder = tmp_path / 'img'; folder.mkdir()
    for f in images: (folder / f.name).symlink_to(f)
    assert lucid_main(monkeypatch, 'predict', '--model.weights', str(file), '--data.predict_images', str(folder),
                      '--model.conf', '0', '--model.end2end', 'true', '--trainer.accelerator', 'cpu', '--trainer.logger', 'false',
                      '--trainer.default_root_dir', str(tmp_path / 'p'), '--trainer.enable_progress_bar', 'false') == 0
    err = capsys.readouterr().err
    assert f'lucid: --model.family yolo26: taken from --model.weights {file} ({title})' in err
    results = json.loads((tmp_path / 'p' / 'predict' / 'predictions.json').read_text())
    if file == DET26:   # --model.end2end: no NMS, at conf 0 the detector keeps max_det (300) of its best pairs an image
        assert len(results) == 2 * 300
    else:               # a random network's masks are mostly empty, and predicting drops those, as Ultralytics does
        assert all('segmentation' in r for r in results)


def test_end2end_is_refused_for_yolo11_in_one_line(tmp_path, monkeypatch, capsys):
    assert lucid_main(monkeypatch, *tiny(tmp_path, '--model.end2end', 'true')) == 2
    assert last_line(capsys.readouterr().err).startswith(
        'lucid: error: --model.end2end true: a YOLO11 network has no one-to-one branch; YOLO26 has (--model.family yolo26)')


@pytest.mark.parametrize('given, file, has', [('yolo11', SEG26, 'YOLO26'), ('yolo26', SEG11, 'YOLO11')])
def test_another_family_is_refused_in_one_line(tmp_path, monkeypatch, capsys, given, file, has):
    assert lucid_main(monkeypatch, *tiny(tmp_path, '--model.family', given, '--model.weights', str(file))) == 2
    err = capsys.readouterr().err
    assert last_line(err).startswith(f'lucid: error: --model.family {given}, and --model.weights {file} holds a {has} network: '
                                     'leave --model.family out') and 'Traceback' not in err
    assert not list(tmp_path.rglob('*.ckpt'))


def test_checkpoint_of_another_family_is_refused_in_one_line(fit26, tmp_path, monkeypatch, capsys):
    ckpt = fit26[1] / 'checkpoints' / 'last.ckpt'
    assert lucid_main(monkeypatch, *tiny(tmp_path, '--ckpt_path', str(ckpt), '--model.family', 'yolo11', sub='validate')) == 2
    line = last_line(capsys.readouterr().err)
    assert line.startswith("lucid: error: --ckpt_path: the checkpoint does not match this model: it has family='yolo26' "
                           "(this run: 'yolo11')"), line


def test_resumed_yolo26_fit_is_the_uninterrupted_one(fit26, tmp_path):
    "Stopped after epoch 0 and resumed: the second epoch's branch weights, and so every byte, as in one go."
    _, run, _ = fit(tmp_path, *FAMILY, callbacks=[StopAfterFirstEpoch()])
    _, _, h = fit(tmp_path, *FAMILY, ckpt=str(run / 'checkpoints' / 'last.ckpt'))
    assert hashes_only(h) == hashes_only(fit26[2])


def test_fine_tune_from_the_ultralytics_detect_file(tmp_path, capsys):
    "fit from Ultralytics' YOLO26n detector: family, task and every tensor taken from the file."
    cli, _, _ = fit(tmp_path, '--model.weights', str(DET26), epochs=1)
    err = capsys.readouterr().err
    n = len(read_model_weights(DET26).state)
    assert '--model.family yolo26: taken from' in err and '--model.task detect: taken from' in err
    assert f'lucid: weights: {n} of {n} tensors taken from {DET26}' in err
    assert cli.model.hparams.family == 'yolo26' and type(cli.model.model.head).__name__ == 'DetectHead26'


@pytest.mark.parametrize('task', ['segment', 'detect'])
@pytest.mark.parametrize('region', ['head', 'step'])
def test_replayed_yolo26_steps_are_native_to_the_bit(task, region):
    "Both branches' calls, and the whole step with the end-to-end loss, through the CPU stand-in: every byte native."
    batches = [synth_batch(B=2, S=64, M=12, K=4, seed=s, empty=s == 1, masks=task == 'segment') for s in range(4)]
    def fresh(): torch.manual_seed(0); return yolo26('n', 4, task=task)
    rec = HeadRegion(backend=EagerGraphs()) if region == 'head' else StepRegion(backend=EagerGraphs())
    native = train_trace(fresh(), batches, loss_fn=family_loss('yolo26', task, 4))
    replay = train_trace(fresh(), batches, rec, loss_fn=family_loss('yolo26', task, 4))
    traces_equal(native, replay)
    assert rec.replayed >= 2, rec.report()


# ---- the GPU (`pytest -m cuda`; skipped where there is none) ----

GPU = ('--trainer.accelerator', 'gpu', '--trainer.devices', '1', '--trainer.precision', 'bf16-mixed', '--trainer.limit_train_batches', '6',
       '--data.imgsz', '320', '--data.val_count', '8', '--data.batch_size', '4')


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')
def test_replayed_yolo26_equals_native_on_the_gpu(tmp_path):
    "A YOLO26 segmentation fit natively, with the head replayed and with the whole step replayed: every step's loss bytes and the state hashes equal."
    replayed_fits_are_native(tmp_path, *FAMILY, *GPU)
