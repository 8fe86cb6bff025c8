"""Ultralytics YOLO-seg datasets (`--data.dataset data.yaml`, issue 41): read as the COCO JSON they stand for, byte
for byte; background images; bad lines named `file:line`; fit, validate and predict from the command line."""
import json, os, shutil, subprocess
from pathlib import Path

import numpy as np, pytest, torch, yaml
from pycocotools import mask as mask_utils

from lucid_nb.core import EMBEDDED_ANNOTATIONS, EMBEDDED_IMAGES
from lucid_nb.metrics import coco_evaluate
from lucid_nb.data import BadInputError, YoloData, coco_categories, load_coco_json, yolo_label_path

from helpers import LUCID, TINY, fit

N_VAL = 32   # the last 32 images by file name validate, as the embedded set's default split


def _px(text: list, hw: tuple) -> list:
    "Pixel coordinates of normalised coordinate strings in an (H, W) image, as documented for the reader: x·W, y·H."
    H, W = hw
    return [float(t) * (W if k % 2 == 0 else H) for k, t in enumerate(text)]


def to_yolo(root: Path, names_as: str = 'list') -> Path:
    """Write the embedded coco128 to `root` in Ultralytics' YOLO-seg layout (`data.yaml`, `images/{train,val}`,
    `labels/{train,val}`), and beside it `coco/{train,val}.json`: the COCO JSON that corresponds exactly to those
    label files. Returns the data.yaml.

    Exact equality with the original COCO JSON is not possible, so the comparison is with that second JSON:
    - YOLO holds one polygon per line: a COCO annotation of several parts becomes one line (one instance) per part,
      and crowd regions (RLE) have no YOLO form, so they are left out;
    - a YOLO box is the polygon's extent, a COCO box need not be: the second JSON's bbox is the extent;
    - the text holds `x / W` (written with `repr`, so it reads back as the same float, clipped to 0..1), and
      `float(text) · W` need not be `x` again: the second JSON holds `float(text) · W`, what the text says;
    - area is the polygon's pixel count (pycocotools), as the reader computes it for evaluation's size ranges;
    - image ids count from 1 in file order, train first, then val; annotation ids from 1 within a split.
    The embedded set's two images without annotations stay background: one gets no label file, the other an empty
    one. Class index = position in the sorted COCO categories; `names` is written as a list or as a dict."""
    d = load_coco_json(EMBEDDED_ANNOTATIONS)
    cat_ids, names = coco_categories(d)
    entries = sorted(d['images'], key=lambda e: e['file_name'])
    by_image = {}
    for a in d['annotations']: by_image.setdefault(a['image_id'], []).append(a)
    splits, next_id, no_label_file = dict(train=entries[:-N_VAL], val=entries[-N_VAL:]), 1, True
    (root / 'coco').mkdir(parents=True)
    for split, es in splits.items():
        images, anns = [], []
        for f in ('images', 'labels'): (root / f / split).mkdir(parents=True)
        for e in es:
            shutil.copy(EMBEDDED_IMAGES / e['file_name'], root / 'images' / split)
            H, W, lines = e['height'], e['width'], []
            for a in by_image.get(e['id'], []):
                if a.get('iscrowd') or not isinstance(a['segmentation'], list): continue
                for p in a['segmentation']:
                    text = [repr(min(max(v / (W if k % 2 == 0 else H), 0.), 1.)) for k, v in enumerate(p)]
                    px = _px(text, (H, W))
                    x0, y0, x1, y1 = min(px[::2]), min(px[1::2]), max(px[::2]), max(px[1::2])
                    lines.append(' '.join([str(cat_ids.index(a['category_id']))] + text))
                    anns.append(dict(id=len(anns) + 1, image_id=next_id, category_id=cat_ids.index(a['category_id']), segmentation=[px],
                                     bbox=[x0, y0, x1 - x0, y1 - y0], area=float(mask_utils.area(mask_utils.frPyObjects([px], H, W))[0]), iscrowd=0))
            label = root / 'labels' / split / (Path(e['file_name']).stem + '.txt')
            if lines or not no_label_file: label.write_text(''.join(l + '\n' for l in lines))
            else: no_label_file = False   # the first image without a polygon has no label file; later ones an empty one
            images.append(dict(id=next_id, file_name=e['file_name'], height=H, width=W)); next_id += 1
        cats = [dict(id=k, name=n) for k, n in enumerate(names)]
        (root / 'coco' / f'{split}.json').write_text(json.dumps(dict(images=images, annotations=anns, categories=cats)))
    (root / 'data.yaml').write_text(yaml.safe_dump(dict(path='.', train='images/train', val='images/val',
                                                        names=names if names_as == 'list' else dict(enumerate(names)))))
    return root / 'data.yaml'


@pytest.fixture(scope='module')
def ydata(tmp_path_factory): return to_yolo(tmp_path_factory.mktemp('yolo'))


def both(data_yaml: Path, **kw) -> tuple:
    "The YOLO dataset and the COCO JSON that stands for it, as two datamodules set up alike."
    root, kw = data_yaml.parent, dict(imgsz=64, batch_size=4, prefetch=False, seed=0) | kw
    y = YoloData(dataset=str(data_yaml), **kw)
    c = YoloData(train_images=str(root / 'images/train'), train_annotations=str(root / 'coco/train.json'),
                 val_images=str(root / 'images/val'), val_annotations=str(root / 'coco/val.json'), **kw)
    y.setup('fit'); c.setup('fit')
    return y, c


def near_misses(gt) -> list:
    "COCO results of every other ground-truth instance, its box shifted 2 px and its mask eroded, with seeded scores."
    g, out = np.random.default_rng(0), []
    for a in gt.dataset['annotations'][::2]:
        m = gt.annToMask(a); m[:, :2] = 0; m = np.asfortranarray(np.roll(m, 1, 0))
        rle = mask_utils.encode(m); rle['counts'] = rle['counts'].decode()
        x, y, w, h = a['bbox']
        out.append(dict(image_id=a['image_id'], category_id=a['category_id'], bbox=[x + 2, y, w, h], segmentation=rle, score=float(g.random())))
    return out


def record_key(r) -> tuple:
    "A record as plain values: its polygons' coordinates as bytes (float64 arrays compare element-wise)."
    return (r.image_id, r.path, r.hw, [(i.ann_id, i.cls, i.box, [(p.dtype.str, p.tobytes()) for p in i.polys], i.rle) for i in r.instances])


def test_labels_read_as_the_coco_json_they_stand_for(ydata):
    y, c = both(ydata)
    assert (y.class_names, y.cat_ids) == (c.class_names, c.cat_ids) and y.class_names[:2] == ['person', 'bicycle']
    assert y.cat_ids == list(range(80))
    for a, b in ((y._train, c._train), (y._val, c._val)):
        assert [record_key(r) for r in a.records] == [record_key(r) for r in b.records]
    assert len(y._train) == 128 - N_VAL and len(y._val) == N_VAL and sum(len(r.instances) for r in y._train.records) > 500
    gy, gc = y.val_coco().dataset, c.val_coco().dataset   # the ground truth pycocotools scores
    assert (gy['annotations'], gy['categories']) == (gc['annotations'], gc['categories']) and gy['annotations']
    no_name = lambda g: [{k: v for k, v in e.items() if k != 'file_name'} for e in g['images']]   # YOLO's are relative to `path`
    assert no_name(gy) == no_name(gc) and [Path(e['file_name']).name for e in gy['images']] == [e['file_name'] for e in gc['images']]
    results = near_misses(c.val_coco())
    sy, sc = coco_evaluate(y.val_coco(), results), coco_evaluate(c.val_coco(), results)
    assert sy == sc and 0 < sy['segm/mAP50-95'] < 1 and 0 < sy['bbox/mAP50-95'] < 1
    # the embedded set's two images without annotations: one without a label file, one with an empty one; each counted once
    assert y.report.counts == {} and y.report.notes['images without annotations (kept as negatives)'] == 1
    assert y.report.notes['images without a label file (background)'] == 1


@pytest.mark.parametrize('cache', ['ram', 'disk', 'none'])
def test_batches_are_the_same_bytes(ydata, tmp_path, cache):
    "What the loss receives (images, boxes, classes, masks), augmented with mosaic, and the validation batches."
    y, c = both(ydata, cache=cache, cache_dir=str(tmp_path))
    for ly, lc in ((y.train_dataloader(), c.train_dataloader()), (y.val_dataloader(), c.val_dataloader())):
        for k, (a, b) in enumerate(zip(ly, lc)):
            assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a), k
            if k == 2: break
    y.teardown(); c.teardown()


def test_fit_and_validation_numbers_are_equal(ydata, tmp_path):
    "A short CPU fit on each: the same state bytes and the same validation numbers, with instances to score."
    root = ydata.parent
    ry = fit(tmp_path / 'y', '--data.dataset', str(ydata), epochs=1)
    rc = fit(tmp_path / 'c', '--data.train_images', str(root / 'images/train'), '--data.train_annotations', str(root / 'coco/train.json'),
             '--data.val_images', str(root / 'images/val'), '--data.val_annotations', str(root / 'coco/val.json'), epochs=1)
    assert ry[2]['all'] == rc[2]['all']
    my, mc = (r[0].model.last_val_stats for r in (ry, rc))
    assert my == mc and len(my) >= 24
    assert ry[0].datamodule.val_coco().getAnnIds()   # scored against annotations, not an empty ground truth


def _tiny(root: Path, labels: dict, names=('a', 'b'), **cfg) -> Path:
    "A YOLO dataset of two train and one val image (64x48), with these label files (name: text; None: no file)."
    from PIL import Image
    for split, stems in (('train', ('t1', 't2')), ('val', ('v1',))):
        for f in ('images', 'labels'): (root / f / split).mkdir(parents=True, exist_ok=True)
        for s in stems:
            Image.fromarray(np.full((48, 64, 3), 40 * len(s), np.uint8)).save(root / 'images' / split / f'{s}.png')
            if labels.get(s) is not None: (root / 'labels' / split / f'{s}.txt').write_text(labels[s])
    (root / 'data.yaml').write_text(yaml.safe_dump(dict(dict(path='.', train='images/train', val='images/val', names=names), **cfg)))
    return root / 'data.yaml'


SQUARE = '0.1 0.1 0.5 0.1 0.5 0.5 0.1 0.5'


def records(data_yaml, **kw):
    dm = YoloData(dataset=str(data_yaml), imgsz=64, batch_size=1, prefetch=False, **kw); dm.setup('fit')
    return dm, {r.path.stem: r for r in dm._train.records + dm._val.records}


@pytest.mark.parametrize('names', [['cat', 'dog'], {0: 'cat', 1: 'dog'}, {1: 'dog', 0: 'cat'}, {'0': 'cat', '1': 'dog'}])
def test_names_as_list_or_dict(tmp_path, names):
    dm, recs = records(_tiny(tmp_path, {'t1': f'1 {SQUARE}\n', 'v1': f'0 {SQUARE}\n'}, names=names))
    assert dm.class_names == ['cat', 'dog'] and dm.cat_ids == [0, 1] and dm.num_classes == 2
    assert [i.cls for i in recs['t1'].instances] == [1]


@pytest.mark.parametrize('names, msg', [({0: 'a', 'b': 'b'}, "'names' key 'b' is not a class number"), ({1: 'a', '1': 'b'}, 'gives class 1 twice'),
                                       ('abc', "'names' must be a list")])
def test_bad_names_are_one_error(tmp_path, names, msg):
    with pytest.raises(ValueError, match=msg): YoloData(dataset=str(_tiny(tmp_path, {'t1': f'0 {SQUARE}'}, names=names))).num_classes


def test_missing_or_empty_label_file_is_background(tmp_path):
    from PIL import Image
    y = _tiny(tmp_path, {'t1': f'0 {SQUARE}\n1 {SQUARE}\n', 't2': '', 'v1': f'1 {SQUARE}\n'})
    Image.fromarray(np.zeros((48, 64, 3), np.uint8)).save(tmp_path / 'images/train/t3.png')   # no label file
    dm, recs = records(y)
    assert [len(recs[s].instances) for s in ('t1', 't2', 't3', 'v1')] == [2, 0, 0, 1]
    assert dm.report.counts == {} and dm.report.notes['images without a label file (background)'] == 1
    assert dm.report.notes['images without annotations (kept as negatives)'] == 1   # t2; t3 is counted once, as without a label file
    assert recs['t1'].instances[0].box == pytest.approx((6.4, 4.8, 32., 24.))   # the polygon's extent in pixels


def test_detection_only_line_names_file_and_line(tmp_path):
    y = _tiny(tmp_path, {'t1': f'0 {SQUARE}\n\n1 0.5 0.5 0.2 0.2\n'})
    for policy in ('skip', 'error'):   # not bad input to skip: the wrong kind of dataset
        with pytest.raises(BadInputError, match=rf"{tmp_path / 'labels/train/t1.txt'}:3: a detection label .* trains segmentation"):
            records(y, on_bad_input=policy)


BAD = [(f'7 {SQUARE}', 'unknown class index'), (f'x {SQUARE}', 'bad class index'), ('0 0.1 0.1 0.5 0.1 0.5', 'bad segmentation'),
       ('0 0.1 0.1', 'polygon with fewer than 3 points'), ('0 0.1 0.1 0.5 0.1 0.5 nan', 'NaN or infinite number'),
       ('0 0.1 0.1 0.5 0.1 0.5 1.5', 'coordinate outside 0..1'), ('0 0.1 0.1 0.5 0.1 0.5 x', 'bad number'),
       ('0 0.1 0.1 0.1 0.2 0.1 0.3', 'zero-area box')]


@pytest.mark.parametrize('line, reason', BAD)
def test_bad_line_is_named_by_file_and_line(tmp_path, line, reason):
    y = _tiny(tmp_path, {'t1': f'1 {SQUARE}\n{line}\n', 't2': f'0 {SQUARE}\n', 'v1': f'0 {SQUARE}\n'})
    where = f"{tmp_path / 'labels/train/t1.txt'}:2"
    dm, recs = records(y)                                   # skip: that line is left out, the rest of the file kept
    assert [(w, r) for w, r, _ in dm.report.problems] == [(where, reason)] and len(recs['t1'].instances) == 1
    with pytest.raises(BadInputError, match=f"{where}: {reason}"): records(y, on_bad_input='error')


@pytest.mark.parametrize('extra, msg', [(('--data.train_images', 'x'), 'both name the data: give one or the other'),
                                        (('--data.dataset', 'nowhere.yaml'), 'dataset file not found: nowhere.yaml')])
def test_bad_dataset_option_is_one_line(tmp_path, extra, msg):
    args = [*extra] if extra[0] == '--data.dataset' else ['--data.dataset', 'd.yaml', *extra]
    r = subprocess.run([str(LUCID), 'fit', '--trainer.accelerator', 'cpu', *args], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    errors = [l for l in r.stderr.splitlines() if 'error' in l.lower() or 'Traceback' in l]
    assert r.returncode == 2 and len(errors) == 1 and errors[0].startswith('lucid: error: ') and msg in errors[0], r.stderr


def test_unsupported_split_is_one_error(tmp_path):
    y = _tiny(tmp_path, {'t1': f'0 {SQUARE}'}, train='train.txt')
    (tmp_path / 'train.txt').write_text('images/train/t1.png\n')
    with pytest.raises(ValueError, match="only folders of images are read"): YoloData(dataset=str(y)).num_classes
    with pytest.raises(ValueError, match="no 'val'"):
        YoloData(dataset=str(_tiny(tmp_path / 'b', {}, val=None))).num_classes


def test_label_path_follows_ultralytics():
    assert yolo_label_path('d/images/train/a.b.jpg') == Path('d/labels/train/a.b.txt')
    assert yolo_label_path('images/x/images/a.png') == Path('images/x/labels/a.txt')


def test_lucid_fit_and_predict_on_a_yolo_dataset(ydata, tmp_path):
    "The command line: fit trains, validates and writes predictions; predict runs on the checkpoint with the dataset's classes."
    env = dict(os.environ, OMP_NUM_THREADS='1')
    # clipped (TINY's unclipped two steps can blow the eval-mode features up to nan here); a one-epoch model scores every
    # box far below the default threshold: --model.conf keeps some
    r = subprocess.run([str(LUCID), 'fit', *TINY, '--trainer.max_epochs', '1', '--data.dataset', str(ydata), '--model.clip_grad_norm', '10',
                        '--model.conf', '1e-9'], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / 'runs/lucid/version_0'
    preds = json.loads((run / 'predictions.json').read_text())
    assert preds and {p['category_id'] for p in preds} <= set(range(80)) and 'mAP50-95(M)' in (run / 'metrics.csv').read_text()
    ckpt = torch.load(run / 'checkpoints/last.ckpt', map_location='cpu', weights_only=True)
    assert ckpt['lucid']['cat_ids'] == list(range(80)) and ckpt['lucid']['class_names'][:2] == ['person', 'bicycle']
    assert ckpt['lucid']['data']['dataset'] == str(ydata.absolute())
    r = subprocess.run([str(LUCID), 'predict', '--ckpt_path', str(run / 'checkpoints/last.ckpt'), '--trainer.accelerator', 'cpu',
                        '--trainer.enable_progress_bar', 'false', '--model.conf', '1e-9'], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = sorted((tmp_path / 'runs/lucid').glob('version_*/predict/predictions.json'))
    assert out and {Path(p['file_name']).parent.name for p in json.loads(out[-1].read_text())} == {'val'}


def test_oriented_image_is_read_as_displayed(tmp_path):
    "A 64x48 JPEG tagged 'turn 90° clockwise' shows 48x64: that is its size, and its label's polygon is of what shows."
    from PIL import Image
    y = _tiny(tmp_path, {'t1': f'0 {SQUARE}\n', 't2': f'0 {SQUARE}\n', 'v1': '0 0.5 0.5 1 0.5 1 1\n'})
    f = tmp_path / 'images/val/v1.png'; f.unlink()
    exif = Image.Exif(); exif[0x0112] = 6
    Image.fromarray(np.zeros((48, 64, 3), np.uint8)).save(f.with_suffix('.jpg'), exif=exif)
    dm, recs = records(y)
    assert recs['v1'].hw == (64, 48) and recs['v1'].instances[0].box == pytest.approx((24, 32, 48, 64))
    assert [(w, r) for w, r, _ in dm.report.problems] == [('v1.jpg', 'EXIF orientation applied')]


@pytest.mark.parametrize('policy', ['skip', 'error'])
def test_two_images_with_one_label_file_are_named(tmp_path, policy):
    "`t1.png` and `t1.jpg` both read `t1.txt`: whose polygons they are cannot be told, so both are a named problem (skipped, or fatal)."
    from PIL import Image
    y = _tiny(tmp_path, {'t1': f'0 {SQUARE}\n', 't2': f'1 {SQUARE}\n', 'v1': f'0 {SQUARE}\n'})
    Image.fromarray(np.zeros((48, 64, 3), np.uint8)).save(tmp_path / 'images/train/t1.jpg')
    txt = tmp_path / 'labels/train/t1.txt'
    if policy == 'error':
        with pytest.raises(BadInputError, match=rf"t1.jpg: label file shared by several images \({txt} is also the label file of t1.png"):
            records(y, on_bad_input='error')
        return
    dm, recs = records(y)
    assert dm.report.counts == {'label file shared by several images': 2}
    assert [w for w, *_ in dm.report.problems] == [str(tmp_path / 'images/train/t1.jpg'), str(tmp_path / 'images/train/t1.png')]
    assert sorted(r.path.name for r in dm._train.records) == ['t2.png'] and 'none' not in str(dm.report).split('\n')[0]
    for f in ('v9.jpg', 'v9.png'): (tmp_path / 'images/val' / f).write_bytes((tmp_path / 'images/train/t1.jpg').read_bytes())
    dm, recs = records(y)   # a shared stem without a label file: two background images
    assert dm.report.counts == {'label file shared by several images': 2} and len(dm._val.records) == 3


# Third-party folders (issue 49): LightlyTrain's `names` keyed by COCO ids with gaps, `skip_if_label_file_missing`,
# `nc`, a `test` split, keys not read, and refusals that say what to change in one short line.
GAPS = Path(__file__).resolve().parent / 'fixtures' / 'yolo_gaps' / 'data.yaml'   # tests/fixtures/make_yolo_gaps.py


def gaps_copy(tmp_path: Path, **cfg) -> Path:
    "A copy of the fixture whose data.yaml has `cfg` merged in (a None value removes the key)."
    shutil.copytree(GAPS.parent, tmp_path / 'g')
    y = tmp_path / 'g' / 'data.yaml'
    d = yaml.safe_load(y.read_text()) | cfg
    y.write_text(yaml.safe_dump({k: v for k, v in d.items() if v is not None}, sort_keys=False))
    return y


def coco_classes(path: Path) -> list:
    "The COCO category ids of an embedded image's polygons, one per part, in JSON order: what its label lines say."
    d = load_coco_json(EMBEDDED_ANNOTATIONS)
    i = next(e['id'] for e in d['images'] if Path(e['file_name']).stem == path.stem)
    return [a['category_id'] for a in d['annotations'] if a['image_id'] == i and not a['iscrowd'] for _ in a['segmentation']]


def test_names_keyed_with_gaps_are_read_by_key():
    "The classes are the keys 1..90 (gaps) in order, with their names; each instance is of the class its COCO id keys."
    dm, recs = records(GAPS)
    ids, names = coco_categories(load_coco_json(EMBEDDED_ANNOTATIONS))
    assert (dm.cat_ids, dm.class_names) == (ids, names) and dm.cat_ids[11:13] == [13, 14]
    for r in recs.values():
        assert [dm.cat_ids[i.cls] for i in r.instances] == coco_classes(r.path), r.path
    assert sorted({c for r in recs.values() for c in coco_classes(r.path)} - set(range(1, 12))), 'the fixture crosses a gap'
    gt = dm.val_coco().dataset
    assert {c['id'] for c in gt['categories']} == set(ids) and {a['category_id'] for a in gt['annotations']} == {85, 65, 88}


def test_skip_if_label_file_missing(tmp_path):
    "Left out and counted once when asked; kept as background otherwise; the data line never counts an image twice."
    dm, recs = records(GAPS)
    assert sorted(recs) == ['000000000025', '000000000030', '000000000042', '000000000072', '000000000078', '000000000133']
    assert dm.report.notes == {'images without a label file (left out: skip_if_label_file_missing)': 2}
    assert '2 × images without a label file (left out: skip_if_label_file_missing)' in dm.summary()
    dm, recs = records(gaps_copy(tmp_path, skip_if_label_file_missing=False))
    assert len(recs) == 8 and not recs['000000000034'].instances and not recs['000000000081'].instances
    assert dm.report.notes == {'images without a label file (background)': 2}


@pytest.mark.parametrize('nc, ok', [(80, True), (None, True), (79, False), ('80', False), (True, False)])
def test_nc_is_checked_against_names(tmp_path, nc, ok):
    y = gaps_copy(tmp_path, nc=nc)
    if ok: assert YoloData(dataset=str(y)).num_classes == 80; return
    with pytest.raises(ValueError, match=rf"nc: {nc!r}.* but 'names' has 80 classes: set nc: 80, or remove nc"): YoloData(dataset=str(y)).num_classes


def test_unknown_keys_are_named_once(tmp_path, caplog):
    y = gaps_copy(tmp_path, download='https://example.org/x.zip', nmaes=['a'])
    with caplog.at_level('WARNING', logger='lucid_nb.data'): records(y)
    lines = [r.getMessage() for r in caplog.records if 'not read' in r.getMessage()]
    assert lines == [f"{y}: not read: download, nmaes (lucid reads path, train, val, test, names, nc, skip_if_label_file_missing)"]


def test_lucid_test_scores_the_test_split(tmp_path):
    "A fit validates on `val`; `lucid test` on its checkpoint scores the `test` images, and says so in the data line."
    cli, run, _ = fit(tmp_path / 'f', '--data.dataset', str(GAPS), '--data.batch_size', '2', epochs=1)
    ckpt = torch.load(run / 'checkpoints/last.ckpt', map_location='cpu', weights_only=True)
    assert ckpt['lucid']['cat_ids'] == coco_categories(load_coco_json(EMBEDDED_ANNOTATIONS))[0]
    assert {Path(r.path).parent.name for r in cli.datamodule.val_records} == {'val'}
    r = subprocess.run([str(LUCID), 'test', '--ckpt_path', str(run / 'checkpoints/last.ckpt'), '--trainer.accelerator', 'cpu',
                        '--trainer.enable_progress_bar', 'false'], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, OMP_NUM_THREADS='1'))
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(l for l in (r.stdout + r.stderr).splitlines() if l.startswith('lucid_nb data:'))
    assert 'train' not in line and 'scoring 2 images (' in line and 'the test images of' in line, line   # the scored split alone
    dm = YoloData(dataset=str(GAPS), imgsz=64, batch_size=2, prefetch=False); dm.setup('test')
    assert {r.path.parent.name for r in dm.val_records} == {'test'} and dm.scored == 'test'
    assert sorted(e['file_name'] for e in dm.val_coco().dataset['images']) == ['images/test/000000000092.jpg', 'images/test/000000000144.jpg']


def test_lucid_test_without_a_test_split_says_it_scores_val(tmp_path, caplog):
    "A data.yaml without `test`: `lucid test` scores `val`, and says so once."
    y = gaps_copy(tmp_path, test=None)
    dm = YoloData(dataset=str(y), imgsz=64, batch_size=2, prefetch=False)
    with caplog.at_level('WARNING', logger='lucid_nb.data'): dm.test_dataloader()
    said = [r.getMessage() for r in caplog.records if 'lucid test' in r.getMessage()]
    assert said == [f"lucid test: {y} names no test split, so its val split is scored"] and dm.scored == 'val'


BAD_YAML = {   # what is wrong: (data.yaml keys merged into the fixture's, what the message must say)
    'names missing': (dict(names=None), "no 'names': add it"),
    'val misspelt': (dict(val=None, valid='images/val'), "no 'val': rename 'valid' to 'val'"),
    'names a word': (dict(names='abc'), "'names' must be a list of class names or a dict"),
    'names key not a number': (dict(names={'x': 'a'}), "'names' key 'x' is not a class number: write each class as N: name"),
    'names key twice': (dict(names={1: 'a', '1': 'b'}, nc=None), "'names' gives class 1 twice: keep one of them"),
    'nc disagrees': (dict(nc=81), "nc: 81 but 'names' has 80 classes: set nc: 80, or remove nc"),
    'skip not a bool': (dict(skip_if_label_file_missing='yes'), "skip_if_label_file_missing: 'yes': write true or false"),
    'no such split folder': (dict(val='images/valid'), "'val': no folder images/valid under 'path': point 'val' at a folder of images"),
    'split a list file': (dict(train='data.yaml'), "'train': data.yaml is a file; only folders of images are read: point 'train' at a folder"),
    'no such root': (dict(path='../nowhere'), "'path': no folder '../nowhere': point it at the dataset folder"),
    'empty split': (dict(test='labels/test'), "'test': no image files in its folder: point 'test' at a folder of .jpg/.png images"),
}


@pytest.mark.parametrize('case', [*BAD_YAML, 'no label file at all'])
def test_bad_data_yaml_is_one_short_line(tmp_path, case):
    "Each refusal is one line naming the data.yaml and what to change, at most 200 characters."
    cfg, says = BAD_YAML.get(case, ({}, "'test': no image has a label file in labels/test/: put the labels there, or set skip_if_label_file_missing: false"))
    y = gaps_copy(tmp_path, **cfg)
    if case == 'no label file at all': shutil.rmtree(y.parent / 'labels/test')
    with pytest.raises((ValueError, FileNotFoundError)) as e: YoloData(dataset=str(y), imgsz=64, batch_size=2, prefetch=False).setup('test')
    msg = str(e.value)
    assert msg.startswith(f"{y}: ") and says in msg and '\n' not in msg and len(msg) <= 200, (len(msg), msg)


@pytest.mark.parametrize('text, says', [('names: [a\n', 'not readable as YAML'), ('- a\n- b\n', 'not a YOLO data.yaml: it needs the keys')])
def test_unreadable_data_yaml_is_one_short_line(tmp_path, text, says):
    (y := tmp_path / 'data.yaml').write_text(text)
    with pytest.raises(ValueError) as e: YoloData(dataset=str(y)).num_classes
    msg = str(e.value)
    assert says in msg and '\n' not in msg and len(msg) <= 200, (len(msg), msg)
    with pytest.raises(FileNotFoundError, match='give --data.dataset the path of a YOLO data.yaml'): YoloData(dataset=str(tmp_path / 'no.yaml')).num_classes
