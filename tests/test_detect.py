"""Object detection, `--model.task detect` (`nbs/00c_tasks.ipynb`), through every entry point: data from a COCO JSON
without segmentation and from YOLO label files of 5 numbers, read as the same boxes; fits whose state hashes agree
across processes; checkpoints that record the task and the commands that follow it (validate, test, predict,
export, `lucid_nb.load`); Ultralytics' YOLO11 detect file (`tests/fixtures/yolo11n-random.pt`, written by real
Ultralytics: `make_ultralytics_fixture.py detect`) loaded exactly; the refusals of a task that does not match; the
replay of the step (CPU stand-in here, the GPU in `test_detect_cuda`-marked tests below); and that a detector learns."""
import importlib.util, json, logging, math, os, subprocess, sys
from pathlib import Path

import numpy as np, pytest, torch, yaml

import lucid_nb
from lucid_nb.coco import BadInputError, DataReport, load_coco_json
from lucid_nb.yolo import yolo_annotations
from lucid_nb.core import EMBEDDED_ANNOTATIONS, EMBEDDED_IMAGES, synth_batch
from lucid_nb.data import YoloData
from lucid_nb.graphs import EagerGraphs
from lucid_nb.heads import yolo
from lucid_nb.predict import to_detections
from lucid_nb.recorder import Recorder
from lucid_nb.weights import PARITY_RTOL, load_weights, parity, read_weights

from helpers import LUCID, StepLosses, StopAfterFirstEpoch, cli_main, fit, hashes_only, lucid_main, replayed_fits_are_native, tiny
from helpers import train_trace
from helpers import test_traces_equal as traces_equal   # (not collected as a test)

ROOT = Path(__file__).resolve().parent.parent
FIX = Path(__file__).resolve().parent / 'fixtures'
DETECT_PT = FIX / 'yolo11n-random.pt'          # Ultralytics 8.4.190, `yolo11n.yaml`, random weights (make_ultralytics_fixture.py)
DETECT_OUTPUTS = FIX / 'yolo11n-random.outputs.pt'
SEG_PT = FIX / 'yolo11n-seg-random.pt'
DETECT = ('--model.task', 'detect')
N_VAL = 8


def box_lines(d: dict, images: list) -> dict:
    "For each image entry: its YOLO detection lines (`class cx cy w h`, normalised, `repr`) of its non-crowd COCO boxes."
    cats = sorted(c['id'] for c in d['categories'])
    out = {e['id']: [] for e in images}
    for a in d['annotations']:
        if a['image_id'] in out and not a['iscrowd']:
            e = next(e for e in images if e['id'] == a['image_id']); W, H = e['width'], e['height']
            x, y, w, h = a['bbox']
            out[a['image_id']].append(f"{cats.index(a['category_id'])} {(x + w / 2) / W!r} {(y + h / 2) / H!r} {w / W!r} {h / H!r}")
    return out


def detection_data(root: Path) -> Path:
    """The embedded coco128 as a detection dataset, twice: Ultralytics' layout with 5-number label files
    (`data.yaml`), and COCO JSON files without `segmentation` or `area` (`coco/{train,val}.json`) holding the boxes the
    label lines stand for, computed as the reader computes them (`_yolo_box`). Returns the data.yaml."""
    d = load_coco_json(EMBEDDED_ANNOTATIONS)
    names = [c['name'] for c in sorted(d['categories'], key=lambda c: c['id'])]
    entries = sorted(d['images'], key=lambda e: e['file_name'])
    next_id = 1
    for split, chosen in (('train', entries[:-N_VAL]), ('val', entries[-N_VAL:])):
        (root / 'images' / split).mkdir(parents=True); (root / 'labels' / split).mkdir(parents=True); (root / 'coco').mkdir(exist_ok=True)
        lines, images, anns = box_lines(d, chosen), [], []
        for e in chosen:
            (root / 'images' / split / e['file_name']).symlink_to(EMBEDDED_IMAGES / e['file_name'])
            (root / 'labels' / split / (Path(e['file_name']).stem + '.txt')).write_text(''.join(l + '\n' for l in lines[e['id']]))
            H, W = e['height'], e['width']
            for l in lines[e['id']]:
                c, cx, cy, w, h = l.split(); cx, cy, w, h = map(float, (cx, cy, w, h))
                clip = lambda f: min(max(f, 0.), 1.)
                x0, y0, x1, y1 = clip(cx - w / 2) * W, clip(cy - h / 2) * H, clip(cx + w / 2) * W, clip(cy + h / 2) * H
                anns.append(dict(id=len(anns) + 1, image_id=next_id, category_id=int(c), bbox=[x0, y0, x1 - x0, y1 - y0], iscrowd=0))
            images.append(dict(id=next_id, file_name=e['file_name'], height=H, width=W)); next_id += 1
        (root / 'coco' / f'{split}.json').write_text(json.dumps(dict(images=images, annotations=anns,
                                                                     categories=[dict(id=k, name=n) for k, n in enumerate(names)])))
    (root / 'data.yaml').write_text(yaml.safe_dump(dict(path='.', train='images/train', val='images/val', names=names)))
    return root / 'data.yaml'


@pytest.fixture(scope='module')
def ddata(tmp_path_factory): return detection_data(tmp_path_factory.mktemp('detect'))


def coco_kwargs(data_yaml: Path) -> dict:
    "The YoloData options of the COCO JSON files that stand for the box labels of `data_yaml`."
    root = data_yaml.parent
    return dict(train_images=str(root / 'images/train'), train_annotations=str(root / 'coco/train.json'),
                val_images=str(root / 'images/val'), val_annotations=str(root / 'coco/val.json'))

def coco_args(data_yaml: Path) -> list: return [x for k, v in coco_kwargs(data_yaml).items() for x in (f'--data.{k}', v)]


@pytest.fixture(scope='module')
def dfit(tmp_path_factory, ddata):
    "A tiny 2-epoch detection fit on the YOLO box labels: (cli, run folder, state hashes)."
    return fit(tmp_path_factory.mktemp('dfit'), *DETECT, '--data.dataset', str(ddata))


@pytest.fixture(scope='module')
def dckpt(dfit): return dfit[1] / 'checkpoints' / 'last.ckpt'


def last_line(err: str) -> str: return err.strip().splitlines()[-1]


# ---- data ----

def test_box_labels_read_as_the_coco_boxes_they_stand_for(ddata):
    "YOLO 5-number lines and a COCO JSON without segmentation give the same records, ground truth and batches: no masks."
    root, kw = ddata.parent, dict(imgsz=64, batch_size=4, prefetch=False, seed=0, task='detect')
    y = YoloData(dataset=str(ddata), **kw)
    c = YoloData(**coco_kwargs(ddata), **kw)
    y.setup('fit'); c.setup('fit')
    key = lambda r: (r.image_id, r.hw, [(i.cls, i.box, i.polys, i.rle) for i in r.instances])
    for a, b in ((y._train, c._train), (y._val, c._val)):
        assert [key(r) for r in a.records] == [key(r) for r in b.records]
    assert sum(len(r.instances) for r in y._train.records) > 500 and y.report.counts == {} and c.report.counts == {}
    strip = lambda g: [{k: v for k, v in a.items() if k != 'area'} for a in g.dataset['annotations']]
    assert strip(y.val_coco()) == strip(c.val_coco()) and all('segmentation' not in a for a in c.val_coco().dataset['annotations'])
    for ly, lc in ((y.train_dataloader(), c.train_dataloader()), (y.val_dataloader(), c.val_dataloader())):
        for k, (a, b) in enumerate(zip(ly, lc)):
            assert 'masks' not in a and a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), k
            if k == 2: break
    y.teardown(); c.teardown()


def test_fits_on_box_labels_and_on_bbox_only_json_are_the_same(ddata, dfit, tmp_path):
    "The same detector trained from the COCO JSON without segmentation: the same state bytes and validation numbers."
    cli, run, h = fit(tmp_path, *DETECT, *coco_args(ddata))
    assert h['all'] == dfit[2]['all'] and cli.model.last_val_stats == dfit[0].model.last_val_stats
    assert sorted(cli.model.last_val_stats.summary()) == ['mAP50(B)', 'mAP50-95(B)']


@pytest.mark.parametrize('line, reason', [('80 0.5 0.5 0.2 0.2', 'unknown class index'), ('x 0.5 0.5 0.2 0.2', 'bad class index'),
                                          ('1 0.5 nan 0.2 0.2', 'NaN or infinite number'), ('1 0.5 1.5 0.2 0.2', 'coordinate outside 0..1'),
                                          ('1 0.5 0.5 0 0.2', 'zero-area box'), ('1 0.5 0.5 a 0.2', 'bad number')])
def test_bad_box_line_is_named_by_file_and_line(tmp_path, line, reason):
    "A bad detection line: one problem naming `file:line` and the reason, the line left out (the rest kept); fatal under 'error'."
    txt = tmp_path / 'a.txt'
    txt.write_text(f"0 0.5 0.5 0.2 0.2\n{line}\n")
    rep = DataReport('skip')
    anns = yolo_annotations(txt, (100, 200), list(range(80)), rep, task='detect')
    assert len(anns) == 1 and rep.problems == [(f'{txt}:2', reason, 'skipped')]
    with pytest.raises(BadInputError, match=rf'{txt}:2: {reason}'): yolo_annotations(txt, (100, 200), list(range(80)), DataReport('error'), task='detect')


def test_segmentation_refuses_box_labels_in_one_line_naming_the_task(ddata, tmp_path, monkeypatch, capsys):
    assert lucid_main(monkeypatch, *tiny(tmp_path, '--data.dataset', str(ddata))) == 2
    line = last_line(capsys.readouterr().err)
    assert line.startswith('lucid: error: ') and ':1: a detection label (class cx cy w h: 5 numbers), and this run trains segmentation' in line
    assert 'give --model.task detect' in line


def test_device_augmentation_is_refused_for_detection_in_one_line(ddata, tmp_path, monkeypatch, capsys):
    "`--data.augment_on device` makes masks on the device: a detection run refuses it in one line, before anything is built."
    assert lucid_main(monkeypatch, *tiny(tmp_path, *DETECT, '--data.dataset', str(ddata), '--data.augment_on', 'device')) == 2
    err = capsys.readouterr().err
    assert last_line(err) == ("lucid: error: augment_on='device' is for segmentation (it makes the masks on the device); task='detect' "
                              "augments on the CPU: leave --data.augment_on out, or give cpu (LUCID_DEBUG=1 shows the traceback)") and 'Traceback' not in err
    assert not list(tmp_path.rglob('*.ckpt'))


def test_lucid_data_reads_box_labels(ddata):
    r = subprocess.run([sys.executable, '-c', 'from lucid_nb.data_command import data_cli; data_cli()', '--dataset', str(ddata),
                        '--task', 'detect', '--imgsz', '64', '--batches', '1'], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f'val {N_VAL} images' in r.stdout and '  masks ' not in r.stdout and '  boxes ' in r.stdout


# ---- fit: hashes across processes, the checkpoint records the task ----

def test_detect_fit_hashes_are_stable_across_processes(ddata, dfit, tmp_path):
    "The same tiny detection fit in a fresh process: the same model, optimiser, scheduler, EMA, loss and predictions bytes."
    r = subprocess.run([str(LUCID), *tiny(tmp_path, *DETECT, '--data.dataset', str(ddata))], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    again = json.loads(next(tmp_path.rglob('state_hashes.json')).read_text())
    assert hashes_only(again) == hashes_only(dfit[2]) and 'predictions' in again


def test_checkpoint_records_the_task(dfit, dckpt):
    c = torch.load(dckpt, map_location='cpu', weights_only=True)
    assert c['hyper_parameters']['task'] == 'detect' and c['datamodule_hyper_parameters']['task'] == 'detect'
    assert not any('.coef.' in k or '.proto.' in k for k in c['state_dict'])
    assert set(c['lucid']['val']) == {'mAP50-95(B)', 'mAP50(B)'}
    run = dfit[1]
    line = json.loads((run / 'val_metrics.jsonl').read_text().splitlines()[-1])
    assert 'mAP50-95(M)' not in line and 'segm/mAP50' not in line and 'mask' not in line['classes'][0]
    assert (run / 'BoxPR_curve.png').is_file() and not (run / 'MaskPR_curve.png').exists()
    assert all('segmentation' not in r for r in json.loads((run / 'predictions.json').read_text()))


def test_validate_test_and_predict_follow_the_checkpoints_task(dckpt, ddata, tmp_path, monkeypatch, capsys):
    for sub in ('validate', 'test'):
        assert lucid_main(monkeypatch, *tiny(tmp_path / sub, '--ckpt_path', str(dckpt), '--data.dataset', str(ddata), sub=sub)) == 0
        out = capsys.readouterr()
        assert "task='detect'" in out.err and 'Box(P' in out.out and 'Mask(P' not in out.out
    folder = ddata.parent / 'images' / 'val'
    assert lucid_main(monkeypatch, 'predict', '--ckpt_path', str(dckpt), '--data.predict_images', str(folder), '--trainer.accelerator', 'cpu',
                      '--trainer.logger', 'false', '--trainer.default_root_dir', str(tmp_path / 'p'), '--trainer.enable_progress_bar', 'false') == 0
    out = tmp_path / 'p' / 'predict'
    results = json.loads((out / 'predictions.json').read_text())   # a 2-epoch detector: few boxes, if any, score 0.25
    assert all('segmentation' not in r and len(r['bbox']) == 4 for r in results) and len(list(out.glob('*.jpg'))) == N_VAL
    assert f'predict: {len(results)} detections on {N_VAL} images' in capsys.readouterr().out


def test_resumed_detect_fit_is_the_uninterrupted_one(ddata, dfit, tmp_path):
    _, run, _ = fit(tmp_path / 'a', *DETECT, '--data.dataset', str(ddata), callbacks=[StopAfterFirstEpoch()])
    _, _, h = fit(tmp_path / 'a', *DETECT, '--data.dataset', str(ddata), ckpt=str(run / 'checkpoints' / 'last.ckpt'))
    assert hashes_only(h) == hashes_only(dfit[2])


# ---- Ultralytics' detect file ----

def test_detect_file_loads_layer_for_layer():
    w = read_weights(DETECT_PT)
    assert (w.kind, w.task, w.scale, w.num_classes, w.title) == ('ultralytics', 'detect', 'n', 80, 'Ultralytics YOLO11n, 80 classes')
    net = yolo('n', task='detect')
    r = load_weights(net, w)
    assert r.complete and r.total == len(w.state)
    diffs = parity(net, torch.load(DETECT_OUTPUTS, weights_only=True))
    assert set(diffs) == {*(f'{b}{i}' for b in ('box', 'cls') for i in range(3)), 'decoded'}
    assert max(diffs.values()) < PARITY_RTOL, diffs


def test_fit_from_the_detect_file_takes_its_task(ddata, tmp_path, capsys):
    cli, run, _ = fit(tmp_path, '--model.weights', str(DETECT_PT), '--data.dataset', str(ddata), epochs=1)
    err = capsys.readouterr().err
    n = len(read_weights(DETECT_PT).state)
    assert f'lucid: --model.task detect: taken from --model.weights {DETECT_PT} (Ultralytics YOLO11n, 80 classes)' in err
    assert f'lucid: weights: {n} of {n} tensors taken from {DETECT_PT}' in err
    assert cli.model.hparams.task == 'detect' and cli.datamodule.hparams.task == 'detect'
    c = torch.load(run / 'checkpoints' / 'last.ckpt', map_location='cpu', weights_only=True)
    assert c['lucid']['class_names'][:2] == ['person', 'bicycle'] and c['hyper_parameters']['task'] == 'detect'


@pytest.mark.parametrize('given, file, says', [
    ('segment', DETECT_PT, 'holds a detect network (Ultralytics YOLO11n, 80 classes), and --model.task is segment: give --model.task detect'),
    ('detect', SEG_PT, 'holds a segment network (Ultralytics YOLO11n-seg, 80 classes), and --model.task is detect: give --model.task segment')])
@pytest.mark.parametrize('sub', ['fit', 'validate'])
def test_another_task_is_refused_in_one_line(tmp_path, monkeypatch, capsys, given, file, says, sub):
    assert lucid_main(monkeypatch, *tiny(tmp_path, '--model.task', given, '--model.weights', str(file), sub=sub)) == 2
    err = capsys.readouterr().err
    assert last_line(err).startswith(f'lucid: error: --model.weights {file} {says}') and 'Traceback' not in err
    assert not list(tmp_path.rglob('*.ckpt'))


def test_another_task_from_python_is_refused_too():
    from lucid_nb.trainer import LitYolo
    with pytest.raises(ValueError, match='holds a detect network .* and --model.task is segment'): LitYolo(weights=str(DETECT_PT))


def test_checkpoint_of_another_task_is_refused_in_one_line(dckpt, ddata, tmp_path, monkeypatch, capsys):
    assert lucid_main(monkeypatch, *tiny(tmp_path, '--ckpt_path', str(dckpt), '--model.task', 'segment', '--data.dataset', str(ddata), sub='validate')) == 2
    line = last_line(capsys.readouterr().err)
    assert line.startswith("lucid: error: --ckpt_path: the checkpoint does not match this model: it has task='detect' (this run: 'segment')"), line


def test_backbone_start_takes_the_backbone_and_neck_of_the_other_task(tmp_path, capsys):
    "fit --model.task segment from a detector's file with --model.weights_backbone true: its backbone and neck, a fresh head."
    cli = cli_main(tiny(tmp_path / 'a', '--model.task', 'segment', '--model.weights', str(DETECT_PT), '--model.weights_backbone', 'true')[1:], run=False)
    err, w = capsys.readouterr().err, read_weights(DETECT_PT)
    assert 'not taken (--model.weights_backbone: the backbone and neck only): the head' in err
    assert cli.model.hparams.task == 'segment' and type(cli.model.model.head).__name__ == 'SegHead'
    sd = cli.model.model.state_dict()
    shared = [k for k in sd if k.startswith(('backbone.', 'neck.'))]
    assert shared and all(torch.equal(sd[k], w.state[k]) for k in shared)
    own = cli_main(tiny(tmp_path / 'b', '--model.task', 'segment')[1:], run=False).model.model.state_dict()   # the same seed, no file
    head = [k for k in sd if k.startswith('head.')]
    assert all(torch.equal(sd[k], own[k]) for k in head) and not all(torch.equal(sd[k], own[k]) for k in shared)


def test_backbone_start_is_for_fit_only(tmp_path, monkeypatch, capsys):
    assert lucid_main(monkeypatch, *tiny(tmp_path, '--model.weights', str(DETECT_PT), '--model.weights_backbone', 'true', sub='validate')) == 2
    assert last_line(capsys.readouterr().err).startswith('lucid: error: --model.weights_backbone true is for fit')


def test_predict_export_and_load_with_the_detect_file(tmp_path, monkeypatch, capsys):
    "`lucid predict --model.weights yolo11n.pt` and `lucid_nb.load` give the same boxes, no masks; export carries the task."
    images = tmp_path / 'images'; images.mkdir()
    files = []
    for p in sorted(EMBEDDED_IMAGES.glob('*.jpg'))[:3]: (images / p.name).write_bytes(p.read_bytes()); files.append(images / p.name)
    args = ['predict', '--model.weights', str(DETECT_PT), '--data.predict_images', str(images), '--data.imgsz', '64',
            '--trainer.accelerator', 'cpu', '--trainer.logger', 'false', '--trainer.default_root_dir', str(tmp_path / 'out'),
            '--trainer.enable_progress_bar', 'false']
    r = subprocess.run([str(LUCID), *args], capture_output=True, text=True, cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS='1'))
    assert r.returncode == 0, r.stderr[-2000:]
    cli = json.loads((tmp_path / 'out' / 'predict' / 'predictions.json').read_text())
    assert cli and all('segmentation' not in x for x in cli)
    model = lucid_nb.load(DETECT_PT, imgsz=64)
    threads = torch.get_num_threads(); torch.set_num_threads(1)
    try: got = model.predict(files)
    finally: torch.set_num_threads(threads)
    for f, d in zip(files, got):
        want = to_detections([x for x in cli if x['file_name'] == str(f)], d.image, model.cat_ids, model.class_names, task='detect')
        assert d.masks is None and len(d) == len(want) > 0
        for k in ('boxes', 'scores', 'class_ids', 'category_ids'): np.testing.assert_array_equal(getattr(d, k), getattr(want, k))
    fmt = 'onnx' if importlib.util.find_spec('onnxscript') and importlib.util.find_spec('onnx') else 'torchscript'
    out = tmp_path / f'net.{fmt}'
    assert lucid_main(monkeypatch, 'export', '--model.weights', str(DETECT_PT), '--format', fmt, '--imgsz', '64', '--output', str(out)) == 0
    assert 'detect outputs boxes, scores' in capsys.readouterr().out
    if fmt == 'onnx':
        import onnx
        props = {p.key: p.value for p in onnx.load(str(out), load_external_data=False).metadata_props}
        assert (props['task'], props['outputs']) == ('detect', 'boxes,scores')



def test_export_of_an_untrained_detector_and_a_task_the_file_does_not_hold(tmp_path, monkeypatch, capsys):
    "`lucid export --model.weights none --model.task detect` writes a detector; a task other than a file's is refused in one line."
    out = tmp_path / 'untrained.torchscript'
    assert lucid_main(monkeypatch, 'export', '--model.weights', 'none', '--model.task', 'detect', '--format', 'torchscript',
                      '--imgsz', '64', '--output', str(out)) == 0
    assert 'detect outputs boxes, scores' in capsys.readouterr().out and out.is_file()
    assert lucid_main(monkeypatch, 'export', '--model.weights', str(DETECT_PT), '--model.task', 'segment', '--imgsz', '64',
                      '--output', str(tmp_path / 'x.torchscript'), '--format', 'torchscript') == 2
    assert last_line(capsys.readouterr().err) == (f"lucid: error: --model.task segment: --model.weights {DETECT_PT} holds a detect network; "
                                                  "leave --model.task out to export it (LUCID_DEBUG=1 shows the traceback)")
    assert not (tmp_path / 'x.torchscript').exists()


# ---- replay ----

def test_capture_options_on_the_cpu_fall_back_in_one_line(ddata, dfit, tmp_path, caplog):
    "On the CPU `--model.capture_train_step true` trains a detector natively, says why once, and ends with the native bytes."
    caplog.set_level(logging.WARNING, 'lucid_nb.recorder')
    _, run, h = fit(tmp_path, *DETECT, '--data.dataset', str(ddata), '--model.capture_train_step', 'true')
    lines = [r.getMessage() for r in caplog.records if r.name == 'lucid_nb.recorder']
    assert len(lines) == 1 and lines[0].startswith('capture_train_step: ') and 'the recorder needs a CUDA GPU' in lines[0], lines
    assert hashes_only(h) == hashes_only(dfit[2])
    assert json.loads((run / 'recorder.json').read_text())['step']['replayed_steps'] == 0


@pytest.mark.parametrize('region', ['head', 'step'])
def test_replayed_detection_steps_are_native_to_the_bit(region):
    "The Detect head's calls, and the whole detection step, through the CPU stand-in of CUDA graphs: every loss and gradient byte as native."
    from lucid_nb.recorder import HeadRegion, StepRegion
    batches = [synth_batch(B=2, S=64, M=12, K=4, seed=s, empty=s == 1, masks=False) for s in range(4)]
    def fresh(): torch.manual_seed(0); return yolo('n', 4, task='detect')
    rec = HeadRegion(backend=EagerGraphs()) if region == 'head' else StepRegion(backend=EagerGraphs())
    native, replay = train_trace(fresh(), batches), train_trace(fresh(), batches, rec)
    traces_equal(native, replay)
    assert rec.replayed >= 2, rec.report()


def test_replayed_detect_fit_is_bitwise_native(ddata, tmp_path):
    "A bf16 detection fit with every region recorded (CPU stand-in): the native fit's losses step by step and its hashes."
    bf16 = ('--trainer.precision', 'bf16-mixed')
    native_steps, replay_steps = StepLosses(), StepLosses()
    _, _, hn = fit(tmp_path / 'n', *DETECT, '--data.dataset', str(ddata), *bf16, callbacks=[native_steps])
    rec = Recorder(backend=EagerGraphs(), step=True)
    _, run, hr = fit(tmp_path / 'r', *DETECT, '--data.dataset', str(ddata), *bf16, callbacks=[replay_steps], recorder=rec)
    assert replay_steps.steps == native_steps.steps and len(native_steps.steps) == 4
    assert hashes_only(hr) == hashes_only(hn)
    report = json.loads((run / 'recorder.json').read_text())
    assert report['step']['replayed_steps'] >= 2 and report['step']['backend'] == 'eager', report['step']


# ---- the GPU (`pytest -m cuda`; skipped where there is none) ----

GPU = ('--trainer.accelerator', 'gpu', '--trainer.devices', '1', '--trainer.precision', 'bf16-mixed', '--trainer.limit_train_batches', '6',
       '--data.imgsz', '320', '--data.val_count', '8')


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')
@pytest.mark.parametrize('batch', [4, 16])
def test_replayed_detection_equals_native_on_the_gpu(tmp_path, batch):
    "A detection fit natively, with the head replayed and with the whole step replayed: the same loss bytes at every step and the same state hashes."
    replayed_fits_are_native(tmp_path, *DETECT, *GPU, '--data.batch_size', str(batch))


# ---- it learns ----

@pytest.mark.slow
def test_a_detector_learns_at_least_as_well_as_the_segmentation_model(tmp_path):
    """The it-learns protocol at reduced size on the CPU: the same 16 embedded images as training and validation set,
    160 px, batch 4, no mosaic, the same 40 epochs and seed for both tasks. The detector's box mAP50 at the end is at
    least the segmentation model's (and above nothing)."""
    d = load_coco_json(EMBEDDED_ANNOTATIONS)
    keep = sorted(e['id'] for e in d['images'] if any(a['image_id'] == e['id'] and not a['iscrowd'] for a in d['annotations']))[:16]
    small = dict(d, images=[e for e in d['images'] if e['id'] in keep], annotations=[a for a in d['annotations'] if a['image_id'] in keep])
    (ann := tmp_path / 'small.json').write_text(json.dumps(small))
    data = ['--data.train_images', str(EMBEDDED_IMAGES), '--data.train_annotations', str(ann), '--data.val_images', str(EMBEDDED_IMAGES),
            '--data.val_annotations', str(ann), '--data.imgsz', '160', '--data.batch_size', '4', '--data.mosaic', '0',
            '--data.close_mosaic', '0', '--trainer.limit_train_batches', '1.0', '--trainer.check_val_every_n_epoch', '40',
            '--model.warmup_epochs', '1', '--model.max_det', '100']
    box50 = {}
    for task in ('segment', 'detect'):
        cli, run, _ = fit(tmp_path / task, '--model.task', task, *data, epochs=40)
        box50[task] = json.loads((run / 'val_metrics.jsonl').read_text().splitlines()[-1])['mAP50(B)']
    assert box50['detect'] > 0 and box50['detect'] >= box50['segment'], box50
