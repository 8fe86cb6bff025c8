"""Data faults of issue 9, each injected into a temporary copy of a small COCO dataset: a duplicate image id in the
validation part, a full disk under the prepared cache, unusual image modes, EXIF orientation.

`lucid_nb.data` is used through the module (`data.load_rgb`, ...) so that the tests of behaviour that existed before
the fix fail on their assertions, not on an import."""
import contextlib, errno, io, json, os, threading

import numpy as np, pytest
from PIL import Image
from pycocotools.cocoeval import COCOeval

import lucid_nb.data as data
import lucid_nb.cache as lucid_cache
from lucid_nb.core import EMBEDDED_IMAGES, digest
from lucid_nb.coco import BadInputError
from test_data import _edit_json, dm_for, make_coco


@pytest.fixture
def coco(tmp_path): return make_coco(tmp_path / 'coco')


def warnings_with(caplog, text): return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def ready(coco, **kw):
    "A set-up data module over `coco` (see `test_data.dm_for`)."
    dm = dm_for(coco, **kw); dm.setup(); return dm


def epoch_digests(dm):
    "Digests of every validation batch and of two training epochs."
    out = [digest(b) for b in dm.val_dataloader()]
    for e in (0, 1):
        ld = dm.train_dataloader(); ld.set_epoch(e); out += [digest(b) for b in ld]; ld.close()
    return out


# ---- 5. a duplicate image id in the validation part ----

def perfect_mask_map(gt, truth, image_ids):
    "Mask mAP of the true annotations of `image_ids` (from the clean JSON `truth`), as results, against `gt`."
    res = [dict(image_id=a['image_id'], category_id=a['category_id'], segmentation=truth.annToRLE(a), bbox=a['bbox'], score=1.)
           for a in truth.dataset['annotations'] if a['image_id'] in image_ids and not a['iscrowd']]
    E = COCOeval(gt, gt.loadRes(res), 'segm')
    with contextlib.redirect_stdout(io.StringIO()): E.evaluate(); E.accumulate(); E.summarize()
    return E.stats[0]


@pytest.mark.parametrize('dup_of', [50, 10], ids=['of a validation image', 'of a training image'])
def test_duplicate_id_in_validation_is_not_scored(coco, caplog, dup_of):
    """A second entry with an existing id, sorted among the validation images, is skipped from loading and from the
    ground truth: perfect predictions score 1.0. The message names the kept and the skipped file."""
    imgs, ann = coco
    truth = data.to_coco(json.loads(ann.read_text()))
    Image.fromarray(np.zeros((70, 90, 3), np.uint8)).save(imgs / 'zz_dup.png')
    _edit_json(ann, lambda d: d['images'].append(dict(id=dup_of, file_name='zz_dup.png', width=90, height=70)))
    with caplog.at_level('WARNING', logger='lucid_nb.data'):
        dm = dm_for(coco, val_count=4); dm.setup()
    assert dm.report.counts == {'duplicate image id': 1}
    kept = truth.imgs[dup_of]['file_name']
    (line,) = warnings_with(caplog, 'duplicate image id')
    assert f"kept {kept}" in line and 'skipped zz_dup.png' in line
    assert dm.val_image_ids == [50, 60, 70] and [r.image_id for r in dm._train.records] == [10, 20, 30, 40]
    gt = dm.val_coco()
    assert len(gt.dataset['images']) == 3 and gt.imgs[50]['file_name'] == 'x_poly.png'
    assert perfect_mask_map(gt, truth, dm.val_image_ids) == 1.0
    # the annotations of the id stay with the kept entry, in training and in scoring alike
    n = len(truth.getAnnIds(imgIds=[dup_of], iscrowd=False))
    rec = next(r for r in dm._train.records + dm._val.records if r.image_id == dup_of)
    assert rec.path.name == kept and len(rec.instances) == n


# ---- 6. a full disk under the prepared cache ----

def fill_disk_after(monkeypatch, n:int):
    "`atomic_write` of the disk cache (`lucid_nb.cache`) succeeds `n` times, then fails with ENOSPC (the disk is full)."
    real, lock, done = lucid_cache.atomic_write, threading.Lock(), []
    def write(path, b):
        with lock:
            if len(done) >= n: raise OSError(errno.ENOSPC, 'No space left on device', str(path))
            done.append(path)
        return real(path, b)
    monkeypatch.setattr(lucid_cache, 'atomic_write', write)


@pytest.mark.parametrize('policy', ['skip', 'error'])
def test_full_disk_under_the_cache_keeps_every_image(coco, tmp_path, monkeypatch, caplog, policy):
    "ENOSPC from a cache write turns the disk cache off with one line; every image trains, with the same bytes as the RAM cache."
    ref = epoch_digests(ready(coco, cache='ram'))
    fill_disk_after(monkeypatch, 2)
    with caplog.at_level('WARNING', logger='lucid_nb.data'):
        dm = dm_for(coco, cache='disk', cache_dir=str(tmp_path / 'cache'), on_bad_input=policy); dm.setup()
        assert (len(dm._train), len(dm._val), dm.report.counts) == (4, 3, {})
        assert epoch_digests(dm) == ref
    (line,) = warnings_with(caplog, 'No space left on device')
    assert str(tmp_path / 'cache') in line and 'going on without it' in line
    assert (dm.report.notes['disk cache built'], dm.report.notes['disk cache not written (cache off)']) == (7, 5)


def test_full_disk_never_serves_an_old_cache_file(coco, tmp_path, monkeypatch):
    "An image changed since the cache was built, whose new cache file cannot be written, is decoded, not read from the old file."
    imgs, ann = coco
    dm_for(coco, cache='disk', cache_dir=str(tmp_path / 'cache')).setup()
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (80, 120, 3), dtype=np.uint8)).save(imgs / 'x_poly.png')
    st = (imgs / 'x_poly.png').stat(); os.utime(imgs / 'x_poly.png', ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    ref = epoch_digests(ready(coco, cache='ram'))
    fill_disk_after(monkeypatch, 0)
    dm = dm_for(coco, cache='disk', cache_dir=str(tmp_path / 'cache')); dm.setup()
    assert dm.report.notes['disk cache rebuilt (stale)'] == 1 and epoch_digests(dm) == ref


# ---- 7. image modes ----
# References in numpy, from the rule in the notebook: alpha dropped, 16-bit and 32-bit integers scaled by 0..65535,
# floats by 0..1, CMYK by (255-C)(255-K)/255, a palette looked up.

G = np.random.default_rng(7)
H, W = 5, 7
RGB8, GREY, ALPHA = G.integers(0, 256, (H, W, 3), dtype=np.uint8), *G.integers(0, 256, (2, H, W), dtype=np.uint8)
U16 = np.concatenate([[0, 1, 128, 129, 257, 32767, 32896, 65534, 65535], G.integers(0, 65536, H * W - 9)]).reshape(H, W).astype(np.uint16)
I32 = np.concatenate([[-5, 0, 65535, 65536, 2**31 - 1], G.integers(-1000, 70000, H * W - 5)]).reshape(H, W).astype(np.int32)
F32 = np.concatenate([[np.nan, -1, 0, .5, 1, 2, 1 / 510, 3 / 510], G.random(H * W - 8)]).reshape(H, W).astype(np.float32)
CMYK = G.integers(0, 256, (H, W, 4), dtype=np.uint8)
PAL, IDX = G.integers(0, 256, (256, 3), dtype=np.uint8), G.integers(0, 256, (H, W), dtype=np.uint8)

def grey3(g): return np.repeat(np.asarray(g, np.uint8)[..., None], 3, -1)
def scaled16(v): return grey3(np.round(np.clip(v.astype(np.float64), 0, 65535) * 255 / 65535))

def palette_image():
    im = Image.frombytes('P', (W, H), IDX.tobytes()); im.putpalette(PAL.ravel().tolist()); im.info['transparency'] = int(IDX[0, 0])
    return im

MODES = {  # mode: (image in that mode, numpy reference, file format that keeps the mode or None)
    'RGB': (lambda: Image.fromarray(RGB8), lambda: RGB8, 'PNG'),
    'RGBA': (lambda: Image.fromarray(np.dstack([RGB8, ALPHA])), lambda: RGB8, 'PNG'),
    'L': (lambda: Image.fromarray(GREY), lambda: grey3(GREY), 'PNG'),
    'LA': (lambda: Image.fromarray(np.dstack([GREY, ALPHA])), lambda: grey3(GREY), 'PNG'),
    'P': (palette_image, lambda: PAL[IDX], 'PNG'),
    'CMYK': (lambda: Image.frombytes('CMYK', (W, H), CMYK.tobytes()),
             lambda: np.round((255. - CMYK[..., :3]) * (255. - CMYK[..., 3:]) / 255).astype(np.uint8), 'TIFF'),
    'I;16': (lambda: Image.fromarray(U16), lambda: scaled16(U16), 'PNG'),
    'I;16L': (lambda: Image.frombytes('I;16L', (W, H), U16.astype('<u2').tobytes()), lambda: scaled16(U16), None),
    'I;16B': (lambda: Image.frombytes('I;16B', (W, H), U16.astype('>u2').tobytes()), lambda: scaled16(U16), None),
    'I;16N': (lambda: Image.frombytes('I;16N', (W, H), U16.astype('=u2').tobytes()), lambda: scaled16(U16), None),
    'I': (lambda: Image.fromarray(I32), lambda: scaled16(I32), 'TIFF'),
    'F': (lambda: Image.fromarray(F32), lambda: grey3(np.round(np.clip(np.nan_to_num(F32.astype(np.float64)), 0, 1) * 255)), 'TIFF'),
}


@pytest.mark.parametrize('mode', MODES)
def test_image_mode_to_rgb(mode, tmp_path):
    "Each mode a COCO image can have, in memory and (where a format keeps it) from a file, against the numpy reference."
    make, reference, fmt = MODES[mode]
    im, ref = make(), reference()
    assert im.mode == mode and ref.shape == (H, W, 3) and ref.dtype == np.uint8
    got = np.asarray(data.to_rgb(im))
    assert got.dtype == np.uint8 and np.array_equal(got, ref), np.argwhere(got != ref)[:5]
    if fmt:
        path = tmp_path / f"img.{fmt.lower()}"; im.save(path, fmt)
        with Image.open(path) as f: assert f.mode == mode
        assert np.array_equal(data.load_rgb(path), ref)


def test_16bit_png_trains_with_its_shades(coco):
    "Through the data module: a 16-bit PNG's prepared pixels are its values scaled by the full range, not clipped to white."
    imgs, _ = coco
    v = (np.arange(96 * 64).reshape(96, 64) * 10).astype(np.uint16)        # b_train.png is 64 wide, 96 high
    Image.fromarray(v).save(imgs / 'b_train.png')
    dm = dm_for(coco, imgsz=96); dm.setup()
    p = dm._train._ram[[r.path.name for r in dm._train.records].index('b_train.png')]
    assert np.array_equal(p.img, scaled16(v)) and dm.report.counts == {}


def test_embedded_images_decode_as_before():
    "The RGB and greyscale JPEGs of the embedded data give exactly `convert('RGB')`'s bytes (state hashes stay the same)."
    modes = set()
    for path in sorted(EMBEDDED_IMAGES.iterdir()):
        with Image.open(path) as im: modes.add(im.mode); old = np.asarray(im.convert('RGB'))
        assert np.array_equal(data.load_rgb(path), old), path.name
    assert modes == {'RGB', 'L'}


# ---- 8. EXIF orientation ----
# The reference applies the EXIF 2.32 definition of tag 0x0112 (where the stored 0th row and column belong) in numpy.

def oriented_ref(a, o):
    t = a.transpose(1, 0, 2)
    return {1: a, 2: a[:, ::-1], 3: a[::-1, ::-1], 4: a[::-1], 5: t, 6: t[:, ::-1], 7: t[::-1, ::-1], 8: t[::-1]}[o]

def save_oriented(path, stored, o, fmt='PNG'):
    exif = Image.Exif(); exif[0x0112] = o
    Image.fromarray(stored).save(path, fmt, exif=exif, **({'quality': 95} if fmt == 'JPEG' else {}))


@pytest.mark.parametrize('fmt', ['PNG', 'JPEG'])
@pytest.mark.parametrize('o', range(1, 9))
def test_load_rgb_applies_exif_orientation(tmp_path, o, fmt):
    stored = G.integers(0, 256, (6, 10, 3), dtype=np.uint8)
    path = tmp_path / f"o{o}.{fmt.lower()}"; save_oriented(path, stored, o, fmt)
    if fmt == 'JPEG':
        with Image.open(path) as im: stored = np.asarray(im.convert('RGB'))  # the decoded stored pixels
    assert np.array_equal(data.load_rgb(path), oriented_ref(stored, o))


def store_turned(imgs, name, o):
    "Rewrite `name` so that its stored pixels need EXIF orientation `o` to show as before: what a camera writes."
    shown = np.asarray(Image.open(imgs / name).convert('RGB'))
    stored = {3: shown[::-1, ::-1], 6: shown.transpose(1, 0, 2)[::-1]}[o]   # oriented_ref(stored, o) == shown
    assert np.array_equal(oriented_ref(stored, o), shown)
    save_oriented(imgs / name, np.ascontiguousarray(stored), o)


@pytest.mark.parametrize('cache', ['none', 'ram', 'disk'])
@pytest.mark.parametrize('o', [3, 6])
def test_oriented_image_trains_as_displayed(coco, tmp_path, caplog, o, cache):
    """Orientation 3 (stored upside down) and 6 (stored sideways; the JSON has the displayed size) train exactly as the
    displayed image does, with every cache; the orientation is reported once, naming the file and the rule."""
    ref = epoch_digests(ready(coco, cache='ram'))
    store_turned(coco[0], 'b_train.png', o)
    with caplog.at_level('WARNING', logger='lucid_nb.data'):
        dm = dm_for(coco, cache=cache, cache_dir=str(tmp_path / 'cache')); dm.setup()
        assert epoch_digests(dm) == ref
    assert dm.report.counts == {'EXIF orientation applied': 1}
    (line,) = warnings_with(caplog, 'EXIF orientation')
    assert line.startswith('b_train.png') and f"orientation {o}" in line and 'as browsers and OpenCV show it' in line


@pytest.mark.parametrize('cache', ['none', 'ram'])
def test_json_with_the_stored_size_gets_a_hint(coco, cache):
    "Orientation 6 and a JSON giving the stored (un-rotated) size: skipped as a size mismatch, and the message says why."
    imgs, ann = coco
    store_turned(imgs, 'b_train.png', 6)                                   # stored 96 wide, 64 high; shown 64 x 96
    def stored_size(d):                                                    # (its annotations would not fit the stored size)
        d['images'][1].update(width=96, height=64); d['annotations'] = [a for a in d['annotations'] if a['image_id'] != 20]
    _edit_json(ann, stored_size)
    with pytest.raises(data.BadInputError, match='image size differs|the JSON says') as e:
        dm_for(coco, cache=cache, on_bad_input='error').setup()
    assert 'image is 64x96, the JSON says 96x64; that is its stored size' in str(e.value) and 'orientation 6' in str(e.value)
    dm = dm_for(coco, cache=cache); dm.setup()
    assert dm.report.counts == {'image size differs from the JSON': 1} and len(dm._train) == 3


def test_disk_cache_sees_a_new_orientation(coco, tmp_path, caplog):
    "A file rewritten with an orientation tag is rebuilt (the fingerprint changed); the reused cache still reports it."
    imgs, _ = coco
    run = lambda: ready(coco, cache='disk', cache_dir=str(tmp_path / 'cache'))
    ref = epoch_digests(run())
    store_turned(imgs, 'b_train.png', 3)
    st = (imgs / 'b_train.png').stat(); os.utime(imgs / 'b_train.png', ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    again = run()
    assert again.report.notes['disk cache rebuilt (stale)'] == 1 and epoch_digests(again) == ref
    third = run()
    assert third.report.notes['disk cache reused'] == 7 and third.report.counts == {'EXIF orientation applied': 1}


# ---- NaN and infinities in annotations (issue 39) ----

NON_FINITE = {  # name: (edit of annotation 2, what the message shows)
    'NaN x': (dict(bbox=[float('nan'), 5, 10, 10]), 'bbox [nan, 5, 10, 10]'),
    'NaN y': (dict(bbox=[5, float('nan'), 10, 10]), 'bbox [5, nan'),
    'inf width': (dict(bbox=[5, 5, float('inf'), 10]), 'bbox [5, 5, inf'),
    'NaN polygon': (dict(segmentation=[[1, 1, 5, float('nan'), 9, 9]]), 'segmentation polygon 0'),
    'inf area': (dict(area=float('-inf')), 'area -inf'),
    'NaN x as text': (dict(bbox=['nan', 5, 10, 10]), "bbox ['nan', 5, 10, 10]"),   # float() reads it: it was kept as a NaN box
    'inf polygon as text': (dict(segmentation=[[1, 1, 5, 'Infinity', 9, 9]]), 'segmentation polygon 0'),
}


@pytest.mark.parametrize('policy', ['skip', 'error'])
@pytest.mark.parametrize('fault', NON_FINITE)
def test_non_finite_annotation_is_bad_input(coco, caplog, fault, policy):
    "JSON's NaN or Infinity anywhere in an annotation is reported with file and id (NaN x and y passed every check)."
    edit, shown = NON_FINITE[fault]
    imgs, ann = coco
    _edit_json(ann, lambda d: next(a for a in d['annotations'] if a['id'] == 2).update(edit))
    if policy == 'error':
        with pytest.raises(BadInputError, match='NaN or infinite number') as e: dm_for(coco, on_bad_input='error').setup()
        assert 'annotation 2' in str(e.value) and shown in str(e.value)
        return
    dm = dm_for(coco); dm.setup()
    assert dm.report.counts == {'NaN or infinite number': 1}, dm.report.problems
    where, *_ = dm.report.problems[0]
    assert 'annotation 2' in where and where.split()[0].endswith(('.jpg', '.png'))
    assert any(where in r.getMessage() and shown in r.getMessage() for r in caplog.records), caplog.text


# ---- caches that never serve stale data (issue 48) ----

def replace_keeping_size_and_mtime(path, new:bytes):
    "Write `new` (as many bytes as `path` holds) into `path` and give it back its modification time, as `cp -p`, `rsync -a` and `tar x` do."
    st = path.stat()
    assert len(new) == st.st_size, (len(new), st.st_size)
    path.write_bytes(new); os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def stored_png(a) -> bytes:
    "A PNG of the pixels `a` without compression: its length depends on the image's size alone."
    buf = io.BytesIO(); Image.fromarray(a).save(buf, 'PNG', compress_level=0); return buf.getvalue()


@pytest.mark.parametrize('which', ['x_poly.png', 'b_train.png'], ids=['validation image', 'training image'])
def test_disk_cache_sees_new_pixels_of_the_same_size_and_mtime(coco, tmp_path, which):
    "An image replaced by another of its byte size, its mtime restored, is rebuilt: the next start uses the new pixels."
    imgs, _ = coco
    g = np.random.default_rng(5)
    shape = np.asarray(Image.open(imgs / which)).shape
    (imgs / which).write_bytes(stored_png(g.integers(0, 256, shape, dtype=np.uint8)))
    run = lambda: ready(coco, cache='disk', cache_dir=str(tmp_path / 'cache'))
    old = epoch_digests(run())
    replace_keeping_size_and_mtime(imgs / which, stored_png(g.integers(0, 256, shape, dtype=np.uint8)))
    want = epoch_digests(ready(coco, cache='ram'))   # decoded from the files as they are now
    assert want != old
    warm = run()
    assert (warm.report.notes['disk cache rebuilt (stale)'], warm.report.notes['disk cache reused']) == (1, 6)
    assert epoch_digests(warm) == want


def test_disk_cache_is_reused_after_a_touch(coco, tmp_path):
    "The same bytes with a new modification time (a `touch`, a plain copy) are reused: the content decides, not the clock."
    imgs, _ = coco
    run = lambda: ready(coco, cache='disk', cache_dir=str(tmp_path / 'cache'))
    ref = epoch_digests(run())
    for f in imgs.iterdir(): st = f.stat(); os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    warm = run()
    assert warm.report.notes['disk cache reused'] == 7 and 'disk cache rebuilt (stale)' not in warm.report.notes
    assert epoch_digests(warm) == ref


def test_label_index_sees_an_edit_of_the_same_size_and_mtime(coco, tmp_path, monkeypatch):
    "A JSON edited in place with its size and mtime kept (a box moved 5 px, a category renamed) is read again, not served from its index."
    imgs, ann = coco
    monkeypatch.setattr(lucid_cache, 'INDEX_MIN_BYTES', 0)
    run = lambda: ready(coco, cache_dir=str(tmp_path))
    first = run()
    assert list(tmp_path.glob('*.labels.npz')) and first.class_names == ['car', 'cat', 'toothbrush']
    box = first._train.records[0].instances[0].box
    d = json.loads(ann.read_text())
    a = next(a for a in d['annotations'] if a['id'] == 1)
    a['bbox'][0] += 5; a['segmentation'][0][0::2] = [x + 5 for x in a['segmentation'][0][0::2]]   # 8 → 13 ...
    d['categories'][1]['name'] = 'dog'
    new = json.dumps(d, separators=(',', ':')).encode()   # shorter than the file: padded below
    new = new[:-1] + b' ' * (ann.stat().st_size - len(new)) + new[-1:]   # as many bytes as before
    replace_keeping_size_and_mtime(ann, new)
    again = run()
    assert again.class_names == ['car', 'dog', 'toothbrush']
    assert again._train.records[0].instances[0].box == (box[0] + 5, box[1], box[2] + 5, box[3])   # xyxy: moved 5 px right
