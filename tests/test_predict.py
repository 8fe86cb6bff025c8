"""A user's first hour after training: `lucid predict` on plain image files, the Python API (`lucid_nb.load`) and
`lucid export`, from a tiny CPU checkpoint."""
import importlib.util, json, os, subprocess, sys
from pathlib import Path

import numpy as np, pytest, torch
from PIL import Image

import lucid_nb
from lucid_nb.checkpoints import with_hashes
from lucid_nb.core import EMBEDDED_IMAGES
from lucid_nb.data import load_rgb
from lucid_nb.predict import to_detections

from helpers import LUCID, fit, lucid_main

IMAGES = sorted(EMBEDDED_IMAGES.glob('*.jpg'))[:3]


@pytest.fixture(scope='module')
def ckpt(tmp_path_factory):
    "The last checkpoint of a 2-epoch tiny run (imgsz 64; it already scores some boxes over the 0.25 of predict)."
    _, run, _ = fit(tmp_path_factory.mktemp("run"))
    return run / 'checkpoints' / 'last.ckpt'


@pytest.fixture(scope='module')
def folder(tmp_path_factory):
    "Three JPEGs and a greyscale PNG, with no annotations."
    d = tmp_path_factory.mktemp('images')
    for p in IMAGES: (d / p.name).write_bytes(p.read_bytes())
    Image.open(IMAGES[0]).convert('L').save(d / 'grey.png')
    return d


def test_checkpoint_carries_classes(ckpt):
    c = torch.load(ckpt, map_location='cpu', weights_only=True)
    assert c['lucid']['class_names'][:2] == ['person', 'bicycle'] and c['lucid']['cat_ids'][:2] == [1, 2]
    assert c['lucid']['imgsz'] == 64


def predict(monkeypatch, tmp_path, ckpt, images, *extra):
    root = tmp_path / 'out'
    code = lucid_main(monkeypatch, 'predict', '--ckpt_path', str(ckpt), '--data.predict_images', str(images),
                      '--trainer.accelerator', 'cpu', '--trainer.logger', 'false', '--trainer.default_root_dir', str(root),
                      '--trainer.enable_progress_bar', 'false', *extra)
    assert code == 0
    return root / 'predict'


def test_predict_folder_without_json(monkeypatch, tmp_path, ckpt, folder, capsys):
    out = predict(monkeypatch, tmp_path, ckpt, folder)
    assert sorted(p.name for p in out.glob('*.jpg')) == sorted(f'{p.stem}.jpg' for p in folder.iterdir())
    results = json.loads((out / 'predictions.json').read_text())
    assert {Path(r['file_name']).name for r in results} == {p.name for p in folder.iterdir()}
    assert {'image_id', 'category_id', 'bbox', 'score', 'segmentation', 'file_name'} <= set(results[0])
    assert '  imgsz: 64\n' in (out.parent / 'config.yaml').read_text()      # the checkpoint's size, not the default 640
    assert f"on {len(list(folder.iterdir()))} images" in capsys.readouterr().out


@pytest.mark.parametrize('pattern', ['one', 'glob'])
def test_predict_one_file_or_glob(monkeypatch, tmp_path, ckpt, folder, pattern):
    images = folder / IMAGES[0].name if pattern == 'one' else folder / '*.png'
    out = predict(monkeypatch, tmp_path, ckpt, images)
    assert [p.name for p in out.glob('*.jpg')] == [f'{IMAGES[0].stem}.jpg' if pattern == 'one' else 'grey.jpg']


def test_predict_nothing_there_is_one_line(monkeypatch, tmp_path, ckpt, capsys):
    code = lucid_main(monkeypatch, 'predict', '--ckpt_path', str(ckpt), '--data.predict_images', str(tmp_path / 'none'),
                      '--trainer.accelerator', 'cpu', '--trainer.logger', 'false', '--trainer.default_root_dir', str(tmp_path))
    assert code == 2 and 'no image files' in capsys.readouterr().err


def test_inference_api(ckpt):
    model = lucid_nb.load(ckpt, conf=0.0)
    arr = load_rgb(IMAGES[1])
    results = model.predict([str(IMAGES[0]), Image.open(IMAGES[1]), arr])
    assert len(results) == 3
    r = results[1]
    H, W = arr.shape[:2]
    assert r.boxes.shape == (len(r), 4) and r.scores.shape == (len(r),) and len(r.names) == len(r) > 0
    assert r.masks.shape == (len(r), H, W) and r.masks.dtype == bool
    assert set(r.names) <= set(model.class_names) and r.class_ids.max() < len(model.class_names)
    assert (r.boxes[:, 2] <= W + 1).all() and (r.boxes[:, 3] <= H + 1).all()
    np.testing.assert_array_equal(r.boxes, results[2].boxes)           # a PIL image and its pixels: the same detections
    assert r.plot().shape == (H, W, 3) and r.plot(pil=True).size == (W, H)


def cli_predict(tmp_path, *args) -> str:
    "What a `lucid predict` subprocess on the CPU, on one thread, printed; it writes into `tmp_path/out/predict`."
    r = subprocess.run([str(LUCID), 'predict', *args, '--trainer.accelerator', 'cpu', '--trainer.logger', 'false',
                        '--trainer.enable_progress_bar', 'false', '--trainer.default_root_dir', str(tmp_path / 'out')],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS='1'))
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout + r.stderr


def cli_predictions(tmp_path, *args) -> list:
    "The results JSON of a `lucid predict` subprocess on the CPU, on one thread."
    cli_predict(tmp_path, *args)
    return json.loads((tmp_path / 'out' / 'predict' / 'predictions.json').read_text())


def assert_same_detections(cli: list, model, files: list):
    """`model.predict(files)` gives what `lucid predict` wrote, in the same order (count, boxes, scores, classes,
    masks), equal as the results JSON holds them: both round in `coco_results` (boxes to 3 decimals, scores to 5),
    so any other difference shows. Run on one thread, as the subprocess is: the CPU's convolutions sum in an order
    that depends on the thread count, which moves a box's third decimal now and then."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try: got = model.predict(files)
    finally: torch.set_num_threads(threads)
    for f, d in zip(files, got):
        want = to_detections([x for x in cli if x['file_name'] == str(f)], d.image, model.cat_ids, model.class_names)
        assert len(d) == len(want), f.name
        for k in ('boxes', 'scores', 'class_ids', 'category_ids', 'masks'):
            np.testing.assert_array_equal(getattr(d, k), getattr(want, k), err_msg=f'{f.name}: {k}')


@pytest.mark.parametrize('conf', ['as trained', 'raised'])
def test_api_matches_lucid_predict(tmp_path, ckpt, folder, conf):
    """`lucid predict --ckpt_path` and `lucid_nb.load(...).predict` on the same files: the same detections. 'raised':
    a checkpoint validated with `--model.conf` above predict's 0.25, which `lucid predict` applied and `load` did not."""
    files = sorted(folder.iterdir())
    if conf == 'raised':
        scores = np.concatenate([d.scores for d in lucid_nb.load(ckpt).predict(files)])
        c = torch.load(ckpt, map_location='cpu', weights_only=True)
        c['hyper_parameters']['conf'] = float(np.median(scores))   # what `lucid fit --model.conf` stores
        assert (scores <= c['hyper_parameters']['conf']).any()       # some detections fall below it
        torch.save(with_hashes(c), ckpt := tmp_path / 'raised.ckpt')   # its hashes, as `lucid fit` writes them
    cli = cli_predictions(tmp_path, '--ckpt_path', str(ckpt), '--data.predict_images', str(folder))
    if conf == 'as trained': assert len(cli) > 0      # the fixture scores some boxes over 0.25
    assert_same_detections(cli, lucid_nb.load(ckpt), files)


def test_predict_takes_conf_as_given(tmp_path):
    """`lucid predict --model.conf 0.05` was raised to 0.25 without a word (a young model: "0 detections"); now the
    threshold is taken as given, and one line says what it allows per image (`--model.max_det`). The model: a
    YOLO11n-seg Ultralytics trained (`test_ultralytics_parity.py`), whose scores spread over (0, 1)."""
    folder = tmp_path / 'images'; folder.mkdir()
    for p in sorted(EMBEDDED_IMAGES.glob('*.jpg'))[-3:]: (folder / p.name).write_bytes(p.read_bytes())   # images it was trained on
    args = ['--model.weights', str(Path(__file__).parent / 'fixtures' / 'yolo11n-seg-coco128.pt'), '--data.predict_images', str(folder)]
    out = cli_predict(tmp_path / 'low', *args, '--model.conf', '0.05')
    assert out.count('scores above 0.05 kept (below the default 0.25): up to 300 detections per image') == 1
    low = json.loads((tmp_path / 'low' / 'out' / 'predict' / 'predictions.json').read_text())
    assert 'scores above' not in cli_predict(tmp_path / 'default', *args)          # the default 0.25: no line
    default = json.loads((tmp_path / 'default' / 'out' / 'predict' / 'predictions.json').read_text())
    assert min(r['score'] for r in low) < 0.25 <= min(r['score'] for r in default) and len(low) > len(default)


def test_api_matches_lucid_predict_with_ultralytics_weights(tmp_path, folder):
    """`lucid predict --model.weights yolo11n-seg.pt` took the classes of the default data (COCO ids 1..90, and a
    fresh head for a file of another class count); `lucid_nb.load` the file's own (ids 0..K-1): now both the file's."""
    ultra = Path(__file__).parent / 'fixtures' / 'yolo11n-seg-random.pt'
    files = sorted(folder.iterdir())
    cli = cli_predictions(tmp_path, '--model.weights', str(ultra), '--data.predict_images', str(folder), '--data.imgsz', '64')
    assert len(cli) > 0
    assert_same_detections(cli, lucid_nb.load(ultra, imgsz=64), files)


def test_api_matches_lucid_predict_with_lucid_checkpoint_as_weights(tmp_path, ckpt, folder):
    """`lucid predict --model.weights last.ckpt` predicted at 640 px with the default conf, iou and max_det;
    `lucid_nb.load` of the same file at its own size and options: now both the checkpoint's."""
    files = sorted(folder.iterdir())
    cli = cli_predictions(tmp_path, '--model.weights', str(ckpt), '--data.predict_images', str(folder))
    assert '  imgsz: 64\n' in (tmp_path / 'out' / 'config.yaml').read_text()      # not the default 640
    assert_same_detections(cli, lucid_nb.load(ckpt), files)


@pytest.mark.parametrize('source', ['folder', 'validation'])
def test_limited_predict_counts_and_writes_only_the_images_it_ran(tmp_path, ckpt, folder, source):
    """`--trainer.limit_predict_batches 1` ran one batch but said "N detections on <all> images" and drew a JPEG,
    with no detections, for every image it never ran: the line, the JPEGs and predictions.json now cover the same images."""
    images = ['--data.predict_images', str(folder)] if source == 'folder' else []   # 4 images; the fit's validation: 2
    n = 2 if source == 'folder' else 1                                                # the images of one batch
    said = cli_predict(tmp_path, '--ckpt_path', str(ckpt), *images, '--data.batch_size', str(n), '--data.val_batch_size', str(n),
                       '--trainer.limit_predict_batches', '1')
    out = tmp_path / 'out' / 'predict'
    drawn = sorted(p.stem for p in out.glob('*.jpg'))
    results = json.loads((out / 'predictions.json').read_text())
    assert len(drawn) == n and {Path(r['file_name']).stem for r in results} <= set(drawn)
    if source == 'folder': assert drawn == sorted(p.stem for p in sorted(folder.iterdir())[:n])
    assert f"predict: {len(results)} detections on {n} images" in said, said[-2000:]


def test_import_stays_light():
    code = "import sys, lucid_nb; assert 'torch' not in sys.modules; lucid_nb.load; assert 'lucid_nb.predict' in sys.modules"
    subprocess.run([sys.executable, '-c', code], check=True)


@pytest.mark.parametrize('fmt', ['torchscript', 'onnx'])
def test_export_round_trip(monkeypatch, tmp_path, ckpt, capsys, fmt):
    if fmt == 'onnx' and importlib.util.find_spec('onnxscript') is None: pytest.skip('onnxscript is not installed')
    out = tmp_path / f'model.{fmt}'
    assert lucid_main(monkeypatch, 'export', '--ckpt_path', str(ckpt), '--format', fmt, '--output', str(out)) == 0
    said = capsys.readouterr().out
    assert out.exists()
    if fmt == 'onnx' and importlib.util.find_spec('onnxruntime') is None:
        assert 'onnxruntime is not installed' in said; return
    rel = float(said.split(' of the output')[0].rsplit('(', 1)[1])
    assert 'max abs difference vs PyTorch' in said and rel < 1e-4


@pytest.mark.parametrize('case', ['imgsz', 'unwritable', 'image'])
def test_export_options_are_checked_in_one_line(monkeypatch, tmp_path, ckpt, capsys, case):
    "A size the network cannot tile, a file that cannot be written and an image that cannot be read are one line each, before anything is built."
    (blocker := tmp_path / 'a-file').write_text('')
    out = tmp_path / 'model.torchscript'
    args = {'imgsz': ['--imgsz', '100'], 'unwritable': ['--format', 'torchscript', '--output', str(blocker / 'model.torchscript')],
            'image': ['--format', 'torchscript', '--output', str(out), '--image', str(blocker)]}[case]
    monkeypatch.setattr('lucid_nb.predict.export_model', lambda *a: pytest.fail('exported before the options were checked'))
    assert lucid_main(monkeypatch, 'export', '--ckpt_path', str(ckpt), *args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    says = {'imgsz': '--imgsz 100: the input side must be a positive multiple of 32', 'unwritable': f'lucid export: cannot write {blocker / "model.torchscript"}',
            'image': f'--image {blocker}: unreadable image'}[case]
    assert err[-1].startswith(f'lucid: error: {says}'), err
    assert 'Traceback' not in '\n'.join(err) and not out.exists()


def test_predict_keeps_the_good_images_and_names_every_bad_one(monkeypatch, tmp_path, ckpt, folder, capsys):
    "Two unreadable files (one batch of them alone) among good ones: every good result is written, each bad file named once."
    d = tmp_path / 'mixed'; d.mkdir()
    for p in folder.iterdir(): (d / p.name).write_bytes(p.read_bytes())
    (d / 'a_broken.jpg').write_bytes(b'\xff\xd8\xff truncated'); (d / 'a_empty.png').write_bytes(b'')
    out = predict(monkeypatch, tmp_path, ckpt, d, '--data.batch_size', '2')
    good = sorted(p.name for p in folder.iterdir())
    assert sorted(p.name for p in out.glob('*.jpg')) == sorted(f'{Path(n).stem}.jpg' for n in good)
    assert {Path(r['file_name']).name for r in json.loads((out / 'predictions.json').read_text())} == set(good)
    said = capsys.readouterr().out
    for name in ('a_broken.jpg', 'a_empty.png'): assert said.count(f'predict: skipped {d / name}') == 1, said
    assert f'on {len(good)} images' in said and '2 could not be read' in said
