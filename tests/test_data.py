"Data pipeline checks beyond the notebook: any COCO dataset, every bad-input case, the disk cache, determinism, threads."
import json, os, threading, types
from pathlib import Path

import numpy as np, pytest, torch
from PIL import Image
from pycocotools import mask as mask_utils

from lucid_nb import augment, loader
from helpers import TensorBytes
from lucid_nb.core import BATCH_KEYS, MASK_STRIDE, digest
from lucid_nb.cache import default_cache_dir
from lucid_nb.data import (BadInputError, DataReport, YoloData, YoloDataset, YoloLoader, hsv_jitter,
                           load_coco_json, coco_categories)
from lucid_nb.data_command import data_main

CATS = [{'id': 3, 'name': 'car'}, {'id': 17, 'name': 'cat'}, {'id': 90, 'name': 'toothbrush'}]


def rect(x1, y1, x2, y2): return [x1, y1, x2, y1, x2, y2, x1, y2]


def make_coco(root: Path) -> tuple[Path, Path]:
    """A small COCO dataset in `root`: PNG and JPEG images, polygons (one multi-part), uncompressed and compressed RLE,
    a crowd region, an image without annotations, and category ids 3, 17, 90. Sorted by name, the last three validate."""
    imgs = root / 'images'; imgs.mkdir(parents=True)
    g = np.random.default_rng(0)
    specs = [('a_train.jpg', 96, 64), ('b_train.png', 64, 96), ('c_train.jpg', 80, 80), ('d_train.png', 100, 60),
             ('x_poly.png', 120, 80), ('y_rle.png', 64, 96), ('z_empty.png', 100, 100)]
    images, anns = [], []
    for i, (name, w, h) in enumerate(specs, 1):
        Image.fromarray(g.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(imgs / name)
        images.append(dict(id=i * 10, file_name=name, width=w, height=h))
    def ann(img, cat, seg, bbox, crowd=0):
        anns.append(dict(id=len(anns) + 1, image_id=img, category_id=cat, segmentation=seg, bbox=bbox, area=bbox[2] * bbox[3], iscrowd=crowd))
    for img, (w, h) in ((10, (96, 64)), (20, (64, 96)), (30, (80, 80)), (40, (100, 60))):   # training images
        ann(img, 3, [rect(8, 8, w // 2, h // 2)], [8, 8, w // 2 - 8, h // 2 - 8])
        ann(img, 17, [[w - 30, h - 30, w - 5, h - 30, w - 5, h - 5]], [w - 30, h - 30, 25, 25])
    ann(50, 3, [rect(10, 10, 50, 40)], [10, 10, 40, 30])                                    # x_poly: a rectangle
    ann(50, 17, [rect(60, 10, 80, 30), rect(90, 50, 110, 70)], [60, 10, 50, 60])           # multi-part polygon
    m = np.zeros((80, 120), np.uint8); m[5:75, 5:115] = 1
    crowd = mask_utils.encode(np.asfortranarray(m)); crowd['counts'] = crowd['counts'].decode()
    ann(50, 90, crowd, [5, 5, 110, 70], crowd=1)                                            # crowd region (compressed RLE)
    m = np.zeros((96, 64), np.uint8); m[20:60, 10:40] = 1                                   # y_rle: uncompressed RLE
    flat = m.flatten(order='F'); counts, v, run = [], 0, 0
    for px in flat:
        if px != v: counts.append(run); v, run = px, 0
        run += 1
    counts.append(run)
    ann(60, 90, {'size': [96, 64], 'counts': counts}, [10, 20, 30, 40])
    m = np.zeros((96, 64), np.uint8); m[70:90, 30:60] = 1                                   # y_rle: compressed RLE
    r = mask_utils.encode(np.asfortranarray(m)); r['counts'] = r['counts'].decode()
    ann(60, 3, r, [30, 70, 30, 20])
    (root / 'annotations.json').write_text(json.dumps(dict(images=images, annotations=anns, categories=CATS)))
    return imgs, root / 'annotations.json'


@pytest.fixture
def coco(tmp_path): return make_coco(tmp_path / 'coco')


def dm_for(coco, **kw):
    imgs, ann = coco
    kw = dict(train_images=str(imgs), train_annotations=str(ann), val_count=3, imgsz=64, batch_size=2, val_batch_size=2, prefetch=False) | kw
    return YoloData(**kw)


def live_prefetch_threads(): return [t for t in threading.enumerate() if t.name == 'lucid_nb-prefetch']


# ---- any COCO dataset: contract, classes, crowd, letterbox, masks ----

def test_synthetic_dataset_batches(coco):
    dm = dm_for(coco); dm.setup()
    assert (dm.cat_ids, dm.class_names, dm.num_classes) == ([3, 17, 90], ['car', 'cat', 'toothbrush'], 3)
    assert dm.val_image_ids == [50, 60, 70] and [r.image_id for r in dm._train.records] == [10, 20, 30, 40]
    assert dm.report.notes == {'crowd regions (evaluation only)': 1, 'images without annotations (kept as negatives)': 1}
    batches = list(dm.val_dataloader())
    assert [len(b['img']) for b in batches] == [2, 1]                          # validation keeps the partial batch
    b = batches[0]
    want = dict(img=((2, 3, 64, 64), torch.uint8), boxes=((2, 8, 4), torch.float32), cls=((2, 8), torch.int64),
                valid=((2, 8), torch.bool), masks=((2, 8, 16, 16), torch.uint8), owner=((2,), torch.int64), image_id=((2,), torch.int64),
                orig_hw=((2, 2), torch.int64), letterbox=((2, 3), torch.float32), hsv=((2, 3), torch.float32))
    assert tuple(b) == BATCH_KEYS and {k: (tuple(v.shape), v.dtype) for k, v in b.items()} == want
    assert b['valid'].sum(1).tolist() == [2, 2] and b['owner'].tolist() == [0, 1]   # one group each; the crowd region is not a target
    assert b['image_id'].tolist() == [50, 60] and b['orig_hw'].tolist() == [[80, 120], [96, 64]]
    assert b['cls'][0, :2].tolist() == [0, 1] and b['cls'][1, :2].tolist() == [2, 0]   # ids 3, 17, 90 -> 0, 1, 2
    assert torch.equal(b['hsv'], torch.ones(2, 3))
    # letterbox: letterboxed = original * scale + pad
    s, px, py = b['letterbox'][0].tolist()
    assert (s, px, py) == (pytest.approx(64 / 120), 0, 10)
    torch.testing.assert_close(b['boxes'][0, 0], torch.tensor([10 * s + px, 10 * s + py, 50 * s + px, 40 * s + py]), atol=.3, rtol=0)
    # masks lie in their boxes; the multi-part polygon gives two blobs
    for k in range(2):
        ys, xs = np.nonzero(b['masks'][0, k].numpy())
        box = b['boxes'][0, k].numpy() / MASK_STRIDE
        assert xs.min() >= box[0] - 1 and xs.max() + 1 <= box[2] + 1 and ys.min() >= box[1] - 1 and ys.max() + 1 <= box[3] + 1
    two = b['masks'][0, 1].numpy()
    assert two.sum() == pytest.approx(2 * (20 * s / 4) ** 2, rel=.5)
    # RLE instances (uncompressed, compressed) follow the image
    for k, (x1, y1, x2, y2) in enumerate([(10, 20, 40, 60), (30, 70, 60, 90)]):
        s1, px1, py1 = b['letterbox'][1].tolist()
        assert b['masks'][1, k].sum().item() == pytest.approx((x2 - x1) * (y2 - y1) * s1 * s1 / 16, rel=.35)
    # evaluation keeps the crowd region, through pycocotools
    gt = dm.val_coco()
    assert sorted(gt.getImgIds()) == [50, 60, 70] and len(gt.getAnnIds(imgIds=[50], iscrowd=None)) == 3


def test_augmented_masks_stay_in_their_boxes(coco):
    "Under mosaic, rotation, shear, scale and flip, every valid box is > 2 px and its mask lies inside it."
    dm = dm_for(coco, val_count=2, degrees=15., shear=5., scale=.5, translate=.2, mosaic=1.); dm.setup()
    ds, seen = dm._train, 0
    for epoch in range(4):
        for i in range(len(ds)):
            s = ds[(epoch, i)]
            assert s['img'].shape == (64, 64, 3) and len(s['boxes']) == len(s['masks']) == len(s['cls'])
            for box, m in zip(s['boxes'], s['masks']):
                w, h = box[2] - box[0], box[3] - box[1]
                assert w > 2 and h > 2 and (box >= 0).all() and (box <= 64).all()
                ys, xs = np.nonzero(m)
                if len(xs):
                    seen += 1
                    b4 = box / MASK_STRIDE
                    assert xs.min() >= b4[0] - 1.5 and xs.max() + 1 <= b4[2] + 1.5 and ys.min() >= b4[1] - 1.5 and ys.max() + 1 <= b4[3] + 1.5
    assert seen > 10


def test_separate_validation_set(coco, tmp_path):
    imgs, ann = coco
    dm = dm_for(coco, val_images=str(imgs), val_annotations=str(ann)); dm.setup()
    assert len(dm._train) == len(dm._val) == 7
    d = json.loads(ann.read_text()); d['categories'] = d['categories'][:2]
    other = tmp_path / 'other.json'; other.write_text(json.dumps(d))
    with pytest.raises(ValueError, match='categories differ'): dm_for(coco, val_images=str(imgs), val_annotations=str(other)).setup()


# ---- bad input: each fault in a temporary copy ----

def _edit_json(ann, f):
    d = json.loads(ann.read_text()); f(d); ann.write_text(json.dumps(d))

def _ann(d, i): return next(a for a in d['annotations'] if a['id'] == i)

FAULTS = {  # name: (inject(imgs, ann), reason, what the message names)
    'missing file': (lambda i, a: (i / 'b_train.png').unlink(), 'missing file', 'b_train.png'),
    'truncated image': (lambda i, a: (i / 'a_train.jpg').write_bytes((i / 'a_train.jpg').read_bytes()[:300]), 'unreadable image', 'a_train.jpg'),
    'not an image': (lambda i, a: (i / 'c_train.jpg').write_bytes(b'hello'), 'unreadable image', 'c_train.jpg'),
    'wrong size in JSON': (lambda i, a: _edit_json(a, lambda d: d['images'][3].update(width=101)), 'image size differs from the JSON', 'd_train.png'),
    'unknown category id': (lambda i, a: _edit_json(a, lambda d: _ann(d, 1).update(category_id=5)), 'unknown category id', 'annotation 1'),
    'zero-area box': (lambda i, a: _edit_json(a, lambda d: _ann(d, 2).update(bbox=[5, 5, 0, 10])), 'zero-area box', 'annotation 2'),
    'box outside the image': (lambda i, a: _edit_json(a, lambda d: _ann(d, 3).update(bbox=[500, 5, 10, 10])), 'box outside the image', 'annotation 3'),
    'short polygon': (lambda i, a: _edit_json(a, lambda d: _ann(d, 4).update(segmentation=[[1, 1, 5, 5]])), 'polygon with fewer than 3 points', 'annotation 4'),
    'odd polygon': (lambda i, a: _edit_json(a, lambda d: _ann(d, 4).update(segmentation=[[1, 1, 5, 5, 9, 9, 3]])), 'bad segmentation', 'annotation 4'),
    'polygon far outside': (lambda i, a: _edit_json(a, lambda d: _ann(d, 4).update(segmentation=[[1, 1, 1e30, 5, 9, -1e30]])), 'polygon far outside the image', 'annotation 4'),
    'polygon outside': (lambda i, a: _edit_json(a, lambda d: _ann(d, 4).update(segmentation=[[300, 1, 310, 5, 305, 20]])), 'polygon outside the image', 'annotation 4'),
    'no segmentation': (lambda i, a: _edit_json(a, lambda d: _ann(d, 5).update(segmentation=[])), 'bad segmentation', 'annotation 5'),
    'RLE of another size': (lambda i, a: _edit_json(a, lambda d: _ann(d, 12).update(segmentation={'size': [5, 5], 'counts': [25]})), 'bad segmentation', 'annotation 12'),
    'bad bbox': (lambda i, a: _edit_json(a, lambda d: _ann(d, 6).pop('bbox')), 'bad bbox', 'annotation 6'),
    'unknown image id': (lambda i, a: _edit_json(a, lambda d: _ann(d, 7).update(image_id=999)), 'unknown image id', 'annotation 7'),
    'bad image entry': (lambda i, a: _edit_json(a, lambda d: d['images'][6].pop('height')), 'bad image entry', 'image entry 70'),
    'duplicate image id': (lambda i, a: _edit_json(a, lambda d: d['images'].append(dict(d['images'][0]))), 'duplicate image id', 'image id 10'),
}


@pytest.mark.parametrize('fault', FAULTS)
def test_bad_input_skip(coco, fault):
    inject, reason, where = FAULTS[fault]
    inject(*coco)
    dm = dm_for(coco); dm.setup()
    assert dm.report.counts == {reason: 1}, dm.report.problems
    assert where in dm.report.problems[0][0] and reason in str(dm.report)
    assert sum(1 for _ in dm.train_dataloader()) == len(dm._train) // 2    # an epoch runs


@pytest.mark.parametrize('fault', ['missing file', 'truncated image', 'unknown category id', 'short polygon', 'box outside the image', 'polygon far outside'])
def test_bad_input_error(coco, fault):
    inject, reason, where = FAULTS[fault]
    inject(*coco)
    with pytest.raises(BadInputError, match=reason) as e: dm_for(coco, on_bad_input='error').setup()
    assert where in str(e.value) and "on_bad_input='skip'" in str(e.value)


def test_malformed_json_names_file_and_place(coco):
    imgs, ann = coco
    ann.write_text('{"images": [\n{"id": 1,\n "file_name": }')
    for policy in ('skip', 'error'):
        with pytest.raises(ValueError, match=r'annotations\.json: malformed JSON at line 3, column 15'): dm_for(coco, on_bad_input=policy).setup()
    ann.write_bytes(b'{"a": "\xc3\x28"}')
    with pytest.raises(ValueError, match='not UTF-8'): load_coco_json(ann)
    ann.write_text('{"images": []}')
    with pytest.raises(ValueError, match="needs a list 'annotations'"): load_coco_json(ann)
    with pytest.raises(FileNotFoundError, match='nope.json'): load_coco_json(ann.parent / 'nope.json')
    with pytest.raises(ValueError, match='duplicate category'): coco_categories(dict(categories=[{'id': 1}, {'id': 1}]))


def test_file_going_bad_mid_epoch_is_replaced(coco):
    "With cache none only headers are checked at setup; a file that breaks later is reported and replaced, not a crash."
    imgs, ann = coco
    dm = dm_for(coco, cache='none', val_count=2, mosaic=0.); dm.setup()
    assert dm.report.counts == {}
    (imgs / 'b_train.png').write_bytes((imgs / 'b_train.png').read_bytes()[:200])
    ids = [i for b in dm.train_dataloader() for i in b['image_id'].tolist()]
    assert len(ids) == 4 and 20 not in ids                                  # 5 training images: 2 batches of 2
    assert dm.report.counts == {'unreadable image': 1} and 'replaced' in dm.report.problems[0][2]
    strict = dm_for(coco, cache='none', val_count=2, on_bad_input='error', prefetch=True); strict.setup()
    (imgs / 'c_train.jpg').write_bytes(b'garbage')
    with pytest.raises(BadInputError, match='c_train.jpg'): list(strict.train_dataloader())
    assert live_prefetch_threads() == []                                    # the thread ended with the exception


def test_more_instances_than_slots_keeps_the_largest(coco):
    dm = dm_for(coco, max_instances=1, on_bad_input='error'); dm.setup()    # not a fatal problem, even under 'error'
    assert dm.report.counts == {'more instances than max_instances': 6}
    b = next(iter(dm.val_dataloader()))
    assert b['valid'].sum(1).tolist() == [1, 1] and b['owner'].tolist() == [0, 1]
    assert b['cls'][0, 0] == 1                                              # the multi-part polygon spans more than the rectangle
    big = [dict(img=np.zeros((64, 64, 3), np.uint8), boxes=np.zeros((3, 4), np.float32), cls=np.zeros(3, np.int64),
                masks=np.zeros((3, 16, 16), np.uint8), image_id=0, orig_hw=np.zeros(2, np.int64), letterbox=np.zeros(3, np.float32), hsv=np.ones(3, np.float32))]
    from lucid_nb.data import collate
    with pytest.raises(ValueError, match='max_instances'): collate(big, 2)


# ---- the disk cache ----

def test_disk_cache_reuse_stale_corrupt(coco, tmp_path):
    imgs, ann = coco
    cache = tmp_path / 'cache'
    def run():
        dm = dm_for(coco, cache='disk', cache_dir=str(cache)); dm.setup(); return dm
    first = run()
    assert first.report.notes['disk cache built'] == 7
    folder = next(cache.iterdir())
    assert (folder / 'manifest.json').exists() and not list(folder.glob('*.tmp'))
    ref = [digest(b) for b in first.val_dataloader()]
    again = run()
    assert again.report.notes['disk cache reused'] == 7 and [digest(b) for b in again.val_dataloader()] == ref
    # a changed source (the same pixels in other bytes) and a changed annotation are rebuilt; a damaged cache file too
    Image.open(imgs / 'x_poly.png').copy().save(imgs / 'x_poly.png', compress_level=0)
    _edit_json(ann, lambda d: _ann(d, 1).update(bbox=[8, 8, 30, 20]))
    f = folder / '60.bin'; f.write_bytes(f.read_bytes()[:-100])
    third = run()
    n = third.report.notes
    assert (n['disk cache rebuilt (stale)'], n['disk cache rebuilt (corrupt)'], n['disk cache reused']) == (2, 1, 4)
    assert [digest(b) for b in third.val_dataloader()] == ref                # x_poly rebuilt the same; y_rle repaired
    # a cache file gone after setup is rebuilt on access; a wrong-format manifest is ignored
    (folder / '50.bin').unlink()
    assert [digest(b) for b in third.val_dataloader()] == ref and (folder / '50.bin').exists()
    (folder / 'manifest.json').write_text('{"format": 0}')
    assert run().report.notes['disk cache built'] == 7


def test_default_cache_dir(coco, tmp_path, monkeypatch):
    imgs, ann = coco
    assert default_cache_dir(imgs, ann, 64).parent == imgs.parent.resolve() / '.cache'
    monkeypatch.setattr(os, 'access', lambda *a: False)
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'xdg'))
    assert default_cache_dir(imgs, ann, 64).parent == tmp_path / 'xdg' / 'lucid_nb'
    monkeypatch.undo()
    dm = dm_for(coco, cache='disk'); dm.setup()
    assert (imgs.parent / '.cache').is_dir()


# ---- a cache that fits (or says why not), a disk mode without images in memory, warm starts ----

def test_ram_cache_that_would_not_fit_goes_to_disk_or_none(coco, tmp_path, monkeypatch, caplog):
    from lucid_nb import cache
    ref = dm_for(coco); ref.setup(); want = [digest(b) for b in ref.val_dataloader()]
    need = cache.prepared_size(ref._train.records + ref._val.records, 64)
    monkeypatch.setattr(cache, 'mem_available', lambda: int(1.9 * need))          # less than twice the cache: declined
    monkeypatch.setattr(cache, 'disk_free', lambda f: 100 * need)
    dm = dm_for(coco, cache_dir=str(tmp_path / 'c')); dm.setup()
    lines = [r.getMessage() for r in caplog.records if 'would take' in r.getMessage()]
    assert dm.cache_mode == 'disk' and len(lines) == 1 and f"would take {cache._size(need)}, more than 50% of the {cache._size(1.9 * need)}" in lines[0] and 'using the disk cache in' in lines[0]
    assert str(tmp_path / 'c') in lines[0] and 'cache \'disk\'' in dm.summary()
    assert [digest(b) for b in dm.val_dataloader()] == want and list((tmp_path / 'c').glob('*/*.bin'))
    monkeypatch.setattr(cache, 'disk_free', lambda f: need)                         # nor on the disk: no cache
    caplog.clear(); dm = dm_for(coco, cache_dir=str(tmp_path / 'd')); dm.setup()
    lines = [r.getMessage() for r in caplog.records if 'would take' in r.getMessage()]
    assert dm.cache_mode == 'none' and len(lines) == 1 and 'no cache' in lines[0] and not (tmp_path / 'd').exists()
    assert [digest(b) for b in dm.val_dataloader()] == want
    monkeypatch.setattr(cache, 'mem_available', lambda: 2 * need)                   # exactly half: it fits
    caplog.clear(); dm = dm_for(coco); dm.setup()
    assert dm.cache_mode == 'ram' and not [r for r in caplog.records if 'would take' in r.getMessage()]


def test_disk_setup_holds_no_prepared_images(coco, tmp_path):
    import tracemalloc
    from lucid_nb.cache import DiskCache
    from lucid_nb.data import read_records, load_coco_json, coco_categories
    from lucid_nb.core import EMBEDDED_ANNOTATIONS, EMBEDDED_IMAGES
    d = load_coco_json(EMBEDDED_ANNOTATIONS)
    recs = read_records(d, EMBEDDED_IMAGES, coco_categories(d)[0], DataReport())[:12]
    from lucid_nb.coco import resized_hw
    px = sum(h * w * 3 for h, w in (resized_hw(r.hw, 640) for r in recs))     # the prepared pixels
    tracemalloc.start()
    try: ds = YoloDataset(recs, 640, 'disk', DiskCache(tmp_path / 'c', 640), threads=1); peak = tracemalloc.get_traced_memory()[1]
    finally: tracemalloc.stop()
    # one image at a time, not all twelve (the RAM cache's peak): its file's bytes (hashed, then decoded), the decoded
    # and the prepared pixels, and the cache file's bytes
    assert len(ds) == 12 and peak < px / 2, (peak, px)


def test_warm_disk_start_reads_no_cache_file(coco, tmp_path, monkeypatch):
    from lucid_nb import cache, loader
    dm_for(coco, cache='disk', cache_dir=str(tmp_path)).setup()
    reads = []
    real = cache.prepared_from_bytes
    for m in (cache, loader):   # the cache's own reads (setup) and the dataset's (every load)
        monkeypatch.setattr(m, 'prepared_from_bytes', lambda b: reads.append(1) or real(b))
    warm = dm_for(coco, cache='disk', cache_dir=str(tmp_path)); warm.setup()
    assert warm.report.notes['disk cache reused'] == 7 and reads == []          # the manifest vouches: no file read or hashed
    list(warm.val_dataloader())
    assert len(reads) == 3                                                      # every load checks its file's hash


def test_label_index_is_cached_and_follows_the_json(coco, tmp_path, monkeypatch):
    from lucid_nb import cache
    imgs, ann = coco
    monkeypatch.setattr(cache, 'INDEX_MIN_BYTES', 0)
    def run(**kw):
        dm = dm_for(coco, cache_dir=str(tmp_path), **kw); dm.setup(); return dm
    first = run(max_instances=1)
    want, report = [digest(b) for b in first.val_dataloader()], str(first.report)
    assert list(tmp_path.glob('*.labels.npz'))
    def parse(p): raise AssertionError(f'{p} parsed again')
    with monkeypatch.context() as m:
        m.setattr(cache, 'load_coco_json', parse); m.setattr('lucid_nb.data.load_coco_json', parse)
        second = YoloData(**(dict(train_images=str(imgs), train_annotations=str(ann), val_count=3, imgsz=64, batch_size=2,
                                  val_batch_size=2, prefetch=False, cache_dir=str(tmp_path), max_instances=1)))
        assert second.num_classes == 3                                          # the CLI's link, before setup
        second.setup()
    assert [digest(b) for b in second.val_dataloader()] == want and str(second.report) == report
    assert second.val_coco().getImgIds() == first.val_coco().getImgIds()      # the JSON is read when scoring needs it
    _edit_json(ann, lambda d: _ann(d, 1).update(bbox=[8, 8, 30, 20]))           # a changed JSON is read again
    calls = []
    real = cache.load_coco_json
    monkeypatch.setattr(cache, "load_coco_json", lambda p, data=None: calls.append(p) or real(p, data))
    third = run(max_instances=1)
    assert len(calls) == 1 and third._train.records[0].instances[0].box[2] == 38
    path = next(tmp_path.glob('*.labels.npz')); path.write_bytes(path.read_bytes()[:100])   # a damaged index: read the JSON
    run(max_instances=1); assert len(calls) == 2
    assert [r.instances[0].polys[0].dtype for r in third._train.records[:1]] == [np.float64]

# ---- determinism, workers, prefetch, threads ----

def _digests(dm, epoch):
    ld = dm.train_dataloader(); ld.set_epoch(epoch)
    out = [digest(b) for b in ld]; ld.close(); return out


def test_same_bytes_with_prefetch_and_workers(coco, monkeypatch):
    base = dm_for(coco, val_count=2, seed=3, threads=1); base.setup()   # every sample built one after the other
    ref = [_digests(base, e) for e in (0, 1)]
    assert ref[0] != ref[1]
    pools, Pool = [], loader.ThreadPoolExecutor   # the sample threads' pools made, by their number of threads
    class Counted(Pool):
        def __init__(self, n, thread_name_prefix=''):
            if thread_name_prefix == 'lucid_nb-samples': pools.append(n)
            super().__init__(n, thread_name_prefix=thread_name_prefix)
    monkeypatch.setattr(loader, 'ThreadPoolExecutor', Counted)
    for kw in (dict(prefetch=True), dict(workers=2), dict(workers=2, prefetch=True), dict(cache='none'), dict(cache='disk'),
               dict(threads=3), dict(threads=3, prefetch=True), dict(threads=3, workers=2)):
        dm = dm_for(coco, val_count=2, seed=3, **kw); dm.setup(); pools.clear()
        assert [_digests(dm, e) for e in (0, 1)] == ref, kw
        if kw.get('threads') and not kw.get('workers'):   # the batch's samples were built by the dataset's threads
            assert pools and set(pools) == {3}, (kw, pools)
        assert dm._train._pool is None, kw   # each epoch's pool ended with its epoch
    other = dm_for(coco, val_count=2, seed=4); other.setup()
    assert _digests(other, 0) != ref[0]
    assert live_prefetch_threads() == []


def test_epoch_prefetch_with_workers_after_an_abandoned_epoch(coco):
    "Running ahead into the next epoch (persistent workers) gives the same batches, also after an epoch left half-way."
    base = dm_for(coco, val_count=2, seed=3, max_epochs=3, close_mosaic=1); base.setup()
    ref = [_digests(base, e) for e in range(3)]
    dm = dm_for(coco, val_count=2, seed=3, workers=2, prefetch=True, max_epochs=3, close_mosaic=1); dm.setup()
    ld = dm.train_dataloader(); assert ld.ahead_until == 2
    def epoch(e, n=None):
        ld.set_epoch(e); out = []
        for b in ld:
            out.append(digest(b))
            if n and len(out) == n: break          # as `limit_train_batches` leaves an epoch: not closed
        return out
    assert epoch(0, n=1) == ref[0][:1]
    assert epoch(1) == ref[1] and ld._ahead is not None and ld._ahead[0] == 2   # epoch 2 started as epoch 1 ended
    assert epoch(2) == ref[2] and ld._ahead is None
    dm.teardown(); assert live_prefetch_threads() == []


def test_close_mosaic(coco):
    dm = dm_for(coco, val_count=2, max_epochs=3, close_mosaic=1); dm.setup()
    dm.train_dataloader(); assert dm._train.mosaic_until == 2
    dm2 = dm_for(coco, val_count=2, close_mosaic=2); dm2.setup()
    dm2.train_dataloader(); assert dm2._train.mosaic_until is None          # unknown length: mosaic stays on
    dm2.trainer = types.SimpleNamespace(max_epochs=5, training=True, global_rank=0, world_size=1,
                                      strategy=types.SimpleNamespace(root_device=torch.device('cpu')))
    dm2.train_dataloader(); assert dm2._train.mosaic_until == 3
    off = dm_for(coco, val_count=2, mosaic=0.); off.setup()
    ds, ds_off = dm._train, off._train                                      # same draws, so after close_mosaic = no mosaic
    assert digest(ds[(2, 1)]) == digest(ds_off[(2, 1)]) and digest(ds[(0, 1)]) != digest(ds_off[(0, 1)])


def test_prefetch_threads_stop(coco):
    dm = dm_for(coco, val_count=2, prefetch=True, batch_size=1); dm.setup()   # 5 batches: more than the queue holds
    ld = dm.train_dataloader()
    list(ld); assert live_prefetch_threads() == []                           # end of an epoch
    it = iter(ld); next(it)
    assert len(live_prefetch_threads()) == 1                                 # blocked on a full queue, so still there
    dm.teardown(); assert live_prefetch_threads() == []                     # teardown with an epoch half-way
    it.close(); dm.teardown()                                               # closing twice is harmless


def test_lightning_fit_uses_the_datamodule(coco):
    import lightning as L
    seen = []
    class Tiny(L.LightningModule):
        def __init__(self): super().__init__(); self.w = torch.nn.Parameter(torch.zeros(1))
        def training_step(self, b, i):
            seen.append(('train', b['img'].dtype, float(b['img'].max()), self.trainer.current_epoch, b['image_id'].tolist()))
            return (self.w * b['img'].mean()).sum() + self.w.square().sum()
        def validation_step(self, b, i): seen.append(('val', b['img'].dtype, float(b['img'].max()), -1, b['image_id'].tolist()))
        def configure_optimizers(self): return torch.optim.SGD(self.parameters(), lr=.1)
    dm = dm_for(coco, val_count=2, prefetch=True, close_mosaic=1)
    L.Trainer(accelerator='cpu', max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, num_sanity_val_steps=0).fit(Tiny(), datamodule=dm)
    train = [s for s in seen if s[0] == 'train']
    assert len(train) == 4 and all(s[1] == torch.float32 and s[2] <= 1 for s in seen)
    assert [s[3] for s in train] == [0, 0, 1, 1] and dm._train.mosaic_until == 1
    order = [s[4] for s in train]
    ref = dm_for(coco, val_count=2, prefetch=False); ref.setup()
    assert [b['image_id'].tolist() for e in (0, 1) for b in (lambda ld: (ld.set_epoch(e), list(ld))[1])(ref.train_dataloader())] == order
    assert [s[4] for s in seen if s[0] == 'val'] == [[60, 70]] * 2
    assert live_prefetch_threads() == []


# ---- configuration errors, hsv, the command ----

@pytest.mark.parametrize('kw, msg', [
    (dict(cache='fast'), "cache='fast' is not allowed: use one of 'none', 'ram', 'disk'"),
    (dict(on_bad_input='ignore'), "on_bad_input='ignore'"), (dict(imgsz=100), 'imgsz=100 must be a positive multiple of 32'),
    (dict(batch_size=0), 'batch_size=0'), (dict(workers=-1), 'workers=-1'), (dict(threads=0), 'threads=0 must be at least 1'),
    (dict(fliplr=2.), 'fliplr=2.0'),
    (dict(scale=1.), r'scale=1.0 must be in \[0, 1\)'), (dict(train_images='x'), 'give both --data.train_images and --data.train_annotations'),
])
def test_bad_options(kw, msg):
    with pytest.raises(ValueError, match=msg): YoloData(**kw)


def test_validation_batches(coco):
    "Validation batches hold `val_batch_size` images (default twice `batch_size`); a process left without one is named."
    dm = dm_for(coco, val_batch_size=None); dm.setup()
    assert dm.val_batch_size == 4 and [len(b['img']) for b in dm.val_dataloader()] == [3]
    dm = dm_for(coco, val_batch_size=2); dm.setup()
    assert [len(b['img']) for b in dm.val_dataloader()] == [2, 1]
    dm.trainer = types.SimpleNamespace(global_rank=3, world_size=4, max_epochs=1, state=types.SimpleNamespace(fn='validate'),
                                     strategy=types.SimpleNamespace(root_device=torch.device('cpu')))   # 3 images for 4 processes
    with pytest.raises(ValueError, match=r'3 validation images make 2 batches of val_batch_size=2, fewer than the 4 processes.*give --trainer.devices 3 or fewer and --data.val_batch_size 1, or a larger --data.val_count'):
        dm.val_dataloader()


def test_bad_sizes_at_setup(coco):
    with pytest.raises(ValueError, match='val_count=7 leaves no training images'): dm_for(coco, val_count=7).setup()
    with pytest.raises(ValueError, match='batch_size=5 exceeds the 4 usable training images'): dm_for(coco, batch_size=5).setup()
    with pytest.raises(RuntimeError, match='setup'): dm_for(coco).val_image_ids


def test_hsv_jitter_uint8_and_float_agree():
    x = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    g = torch.tensor([[1.01, 1.5, .7], [.99, .3, 1.2]])
    torch.testing.assert_close(hsv_jitter(x, g), hsv_jitter(x.float() / 255, g))
    grey = torch.full((1, 3, 2, 2), .5)
    torch.testing.assert_close(hsv_jitter(grey, torch.tensor([[1.5, 2., 1.]])), grey)   # no saturation: hue is moot



def _hsv_plain(img, gains):
    "hsv_jitter's plain formulas over the whole batch (the version before chunking): the bytes it must keep."
    x = img.float() / 255 if not img.is_floating_point() else img.float()
    r, g, b = x.unbind(1)
    mx, mn = x.amax(1), x.amin(1)
    d = mx - mn
    dd = torch.where(d > 0, d, torch.ones_like(d))
    h = torch.where(mx == r, ((g - b) / dd) % 6, torch.where(mx == g, (b - r) / dd + 2, (r - g) / dd + 4)) / 6
    h = torch.where(d > 0, h, torch.zeros_like(h))
    s = torch.where(mx > 0, d / torch.where(mx > 0, mx, torch.ones_like(mx)), torch.zeros_like(mx))
    gh, gs, gv = (gains.to(x)[:, i, None, None] for i in range(3))
    h, s, v = (h * gh) % 1, (s * gs).clamp(0, 1), (mx * gv).clamp(0, 1)
    n = torch.arange(5., 0., -2., device=x.device)
    k = (n[None, :, None, None] + h[:, None] * 6) % 6
    return v[:, None] - (v * s)[:, None] * torch.minimum(k, 4 - k).clamp(0, 1)


@pytest.mark.parametrize('chunk_pixels', [40 * 40 * 2, 2 ** 20])
def test_hsv_jitter_keeps_the_plain_bytes_a_few_images_at_a_time(monkeypatch, chunk_pixels):
    monkeypatch.setattr(augment, 'HSV_CHUNK_PIXELS', chunk_pixels)   # 2 images a chunk (3 chunks), or one chunk
    img = torch.randint(0, 256, (5, 3, 40, 40), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    img[:, :, :4] = 128; img[:, 0, 4:8] = 255; img[:, 1:, 4:8] = 0; img[:, :2, 8:12] = 200   # grey, pure red, ties
    img[0, :, 12:16] = 0; img[-1, :, 12:16] = 255                                           # black, white
    gains = torch.rand(5, 3, generator=torch.Generator().manual_seed(1)) * 1.6 + .2
    for x in (img, img.float() / 255, img.float().div(255).contiguous(memory_format=torch.channels_last)):
        assert hsv_jitter(x, gains).numpy().tobytes() == _hsv_plain(x, gains).numpy().tobytes()


def test_hsv_jitter_makes_fewer_batch_sized_temporaries(monkeypatch):
    monkeypatch.setattr(augment, 'HSV_CHUNK_PIXELS', 2 * 128 * 128)   # 2 of the 16 images at a time, as at 640 px
    img = torch.randint(0, 256, (16, 3, 128, 128), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    gains, batch_bytes = torch.rand(16, 3) + .5, 16 * 3 * 128 * 128 * 4
    peaks = []
    for fn in (_hsv_plain, hsv_jitter):
        with TensorBytes() as m: fn(img, gains)
        peaks.append(m.peak / batch_bytes)
    assert peaks[0] > 5 and peaks[1] < 2, peaks   # the output plus a chunk's, against ~6 batch-sized tensors


def test_data_main_on_a_given_dataset(coco, capsys):
    imgs, ann = coco
    dm = data_main(['--train-images', str(imgs), '--train-annotations', str(ann), '--imgsz', '64', '--batch-size', '2', '--cache', 'disk', '--val-count', '3',
                    '--cache-dir', str(imgs.parent / 'c')])
    out = capsys.readouterr().out
    assert 'train 4 images' in out and 'classes: car, cat, toothbrush' in out and 'throughput:' in out and 'masks' in out
    assert dm.hparams.cache == 'disk' and live_prefetch_threads() == []


def test_edge_paths(coco, tmp_path, caplog):
    from lucid_nb.data import atomic_write
    imgs, ann = coco
    (tmp_path / 'd').mkdir()
    with pytest.raises(OSError): atomic_write(tmp_path / 'd', b'x')                # cannot replace a folder: no temp file left
    assert [p.name for p in tmp_path.iterdir()] == ['coco', 'd']
    dm = dm_for(coco, cache='none', val_count=2, max_instances=1, mosaic=1.); dm.setup()
    with caplog.at_level('WARNING', logger='lucid_nb.data'): dm._train[(0, 0)]
    assert 'over max_instances=1' in caplog.text                                    # a mosaic over the slots is logged
    ld = YoloLoader(dm._train, 1, prefetch=True, depth=1)                           # a slow consumer fills the queue
    it = iter(ld); next(it); import time; time.sleep(.3); assert len(list(it)) == len(dm._train) - 1
    for p in imgs.iterdir(): p.write_bytes(b'gone')
    with pytest.raises(RuntimeError, match='no readable image'): dm._train.prepared(0)


def test_lucid_data_command_exits_zero(tmp_path):
    "The `lucid-data` console script on the embedded data: exit status 0 and a readable report."
    import subprocess, sys
    r = subprocess.run([str(Path(sys.executable).parent / 'lucid-data'), '--imgsz', '64', '--batch-size', '2'],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert 'lucid_nb data: train 96 images' in r.stdout and 'YoloData object' not in r.stdout + r.stderr


@pytest.mark.parametrize('args, names', [(['--train-images', 'no/such/folder', '--train-annotations', 'a.json'], 'no/such/folder'),
                                         (['--dataset', 'missing.yaml'], 'missing.yaml')])
def test_lucid_data_bad_path_is_one_line(tmp_path, args, names):
    "A path that is not there: one line naming it, exit status 2, no traceback."
    import subprocess, sys
    r = subprocess.run([str(Path(sys.executable).parent / 'lucid-data'), *args], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith('lucid-data: error: ') and names in lines[0], r.stderr[-2000:]
