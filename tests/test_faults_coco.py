"""COCO files that are legal or nearly so, and files that go bad after set-up, each injected into a temporary copy of a
small COCO dataset: repeated and missing annotation ids, ids that are strings, two datasets under one `cache_dir`, a
validation image that becomes unreadable, a training set without one usable annotation, a checkpoint of other
categories, an unreadable file among the images to predict."""
import json, types

import numpy as np, pytest
from PIL import Image

import lucid_nb.data as data
import lucid_nb.images as images
import lucid_nb.command as command
from lucid_nb.core import digest
from test_data import _edit_json, dm_for, make_coco
from test_faults_data import perfect_mask_map
from helpers import lucid_main


@pytest.fixture
def coco(tmp_path): return make_coco(tmp_path / 'coco')


# ---- annotation ids: evaluation numbers its ground truth itself ----

@pytest.mark.parametrize('policy', ['skip', 'error'])
def test_repeated_annotation_ids_are_scored_as_distinct(coco, policy):
    """Every annotation with id 1: pycocotools' index would keep one of them. Reported (not fatal, the ids do not
    matter to training), and perfect predictions still score 1.0: the validation ground truth is numbered 1, 2, …"""
    imgs, ann = coco
    truth = data.to_coco(json.loads(ann.read_text()))
    _edit_json(ann, lambda d: [a.update(id=1) for a in d['annotations']])
    dm = dm_for(coco, on_bad_input=policy); dm.setup()
    assert dm.report.counts == {'duplicate annotation id': 1}
    gt = dm.val_coco()
    assert [a['id'] for a in gt.dataset['annotations']] == list(range(1, len(gt.dataset['annotations']) + 1))
    assert perfect_mask_map(gt, truth, set(dm.val_image_ids)) == 1.0


def test_annotation_without_id_is_numbered(coco):
    "A validation annotation without an `id`: reported once, kept, and the ground truth builds (it raised KeyError after the first epoch)."
    imgs, ann = coco
    truth = data.to_coco(json.loads(ann.read_text()))
    def drop_id(d):
        a = next(a for a in d['annotations'] if a['image_id'] == 50); del a['id']
    _edit_json(ann, drop_id)
    dm = dm_for(coco); dm.setup()
    assert dm.report.counts == {'annotations without an id': 1}
    assert perfect_mask_map(dm.val_coco(), truth, set(dm.val_image_ids)) == 1.0


def test_a_bad_annotation_leaves_out_only_itself(coco):
    "Two annotations share an id and one of them is bad: the other stays in the validation ground truth (ids keyed it before)."
    imgs, ann = coco
    def share(d):
        v = [a for a in d['annotations'] if a['image_id'] in (50, 60) and not a.get('iscrowd')]
        v[1]['id'] = v[0]['id']; v[0]['bbox'] = [5, 5, 0, 10]   # v[0] bad (zero area), v[1] good with the same id
    _edit_json(ann, share)
    before = len([a for a in json.loads(ann.read_text())['annotations'] if a['image_id'] in (50, 60, 70)])
    dm = dm_for(coco); dm.setup()
    assert dm.report.counts == {'zero-area box': 1, 'duplicate annotation id': 1}
    assert len(dm.val_coco().dataset['annotations']) == before - 1


@pytest.mark.parametrize('bad_id', ['50', 'img_50', True, 50.5])
def test_image_ids_must_be_integers(coco, bad_id):
    """An image id that is a string (even of digits), a bool or a fraction: the entry is bad input naming the id, at set-up.
    Before, `"50"` was read as 50 while its annotations' `"50"` matched nothing, and validation failed after training."""
    imgs, ann = coco
    def string_id(d):
        d['images'][4]['id'] = bad_id
        for a in d['annotations']:
            if a['image_id'] == 50: a['image_id'] = bad_id
    _edit_json(ann, string_id)
    with pytest.raises(data.BadInputError, match=f"image entry 4: bad image entry \\(id {bad_id!r}".replace('.', '\\.')):
        dm_for(coco, on_bad_input='error').setup()
    dm = dm_for(coco); dm.setup()
    assert dm.report.counts['bad image entry'] == 1 and 50 not in dm.val_image_ids


def test_integral_float_ids_are_ints(coco):
    "Ids written as floats with integral values (some tools do) are those ints, in images and annotations alike."
    imgs, ann = coco
    _edit_json(ann, lambda d: [e.update(id=float(e['id'])) for e in d['images']] + [a.update(image_id=float(a['image_id'])) for a in d['annotations']])
    dm = dm_for(coco); dm.setup()
    assert dm.report.counts == {} and dm.val_image_ids == [50, 60, 70]
    assert all(isinstance(e['id'], int) for e in dm.val_coco().dataset['images'])


# ---- two datasets under one cache folder ----

def test_cache_dir_keeps_datasets_apart(coco, tmp_path):
    """Training and validation from two folders whose image ids overlap, both cached under one `--data.cache_dir`: the
    validation batches are those of its own images (the shared folder served the training images before)."""
    imgs, ann = coco
    vroot = tmp_path / 'val'; (vroot / 'images').mkdir(parents=True)
    d = json.loads(ann.read_text())
    g = np.random.default_rng(1)
    for e in d['images']:   # the same ids and sizes, other pixels
        Image.fromarray(g.integers(0, 256, (e['height'], e['width'], 3), dtype=np.uint8)).save(vroot / 'images' / e['file_name'])
    (vroot / ann.name).write_text(json.dumps(d))   # folders and files of the same names: `images`, the JSON's
    kw = dict(val_images=str(vroot / 'images'), val_annotations=str(vroot / ann.name))
    ram = dm_for(coco, cache='ram', **kw); ram.setup(); ref = [digest(b) for b in ram.val_dataloader()]
    for _ in range(2):   # built, then reused
        dm = dm_for(coco, cache='disk', cache_dir=str(tmp_path / 'cache'), **kw); dm.setup()
        assert [digest(b) for b in dm.val_dataloader()] == ref
    assert len(list((tmp_path / 'cache').iterdir())) == 2


# ---- a validation image that goes bad ----

def test_truncated_validation_image_is_found_at_setup_without_cache(coco):
    "`cache: none` decodes each validation image once at set-up: a truncated one is bad input there, not a substitute later."
    imgs, ann = coco
    (imgs / 'x_poly.png').write_bytes((imgs / 'x_poly.png').read_bytes()[:200])
    with pytest.raises(data.BadInputError, match='x_poly.png: unreadable image'):
        dm_for(coco, cache='none', on_bad_input='error').setup()
    dm = dm_for(coco, cache='none'); dm.setup()
    assert dm.report.counts == {'unreadable image': 1} and 50 not in dm.val_image_ids


def test_validation_stops_on_an_image_gone_bad(coco):
    "A validation image unreadable after set-up is an error naming the file: another image's pixels under its id would score wrongly."
    imgs, ann = coco
    dm = dm_for(coco, cache='none'); dm.setup()
    (imgs / 'y_rle.png').write_bytes(b'not an image any more')
    with pytest.raises(data.BadInputError, match='y_rle.png: unreadable since setup checked it'):
        list(dm.val_dataloader())


# ---- nothing to learn ----

def test_training_set_without_any_usable_annotation_is_refused(coco):
    "Box-only annotations (no segmentation): each is reported, and set-up stops saying there is nothing to learn."
    imgs, ann = coco
    _edit_json(ann, lambda d: [a.pop('segmentation') for a in d['annotations']])
    with pytest.raises(ValueError, match='no training instance.*needs masks: polygons or RLE') as e:
        dm_for(coco).setup()
    assert 'bad segmentation' in str(e.value)


@pytest.mark.parametrize('kept', ['none', 'crowd'])
def test_validation_without_any_instance_is_refused(coco, tmp_path, monkeypatch, capsys, kept):
    """Validation images without an annotation, or with only a crowd region: mAP is undefined there (COCOeval gives
    -1, shown as 0.0000) and best.ckpt would be chosen on it. Refused in one line, exit 2; `predict` needs no annotation."""
    imgs, ann = coco
    _edit_json(ann, lambda d: d.update(annotations=[a for a in d['annotations'] if a['image_id'] < 50 or (kept == 'crowd' and a['iscrowd'])]))
    want = r"no validation instance: none of the 3 validation images \(the last 3 images of annotations.json \(by file name\)\) has a usable annotation"
    with pytest.raises(ValueError, match=want + r", so mAP is undefined there .* a larger --data.val_count"): dm_for(coco).setup()
    dm = dm_for(coco); dm.setup('predict')
    assert dm.val_image_ids == [50, 60, 70]
    capsys.readouterr()
    args = ['--trainer.accelerator', 'cpu', '--data.train_images', str(imgs), '--data.train_annotations', str(ann), '--data.val_count', '3',
            '--data.imgsz', '64', '--data.batch_size', '2', '--trainer.max_epochs', '1', '--trainer.default_root_dir', str(tmp_path / 'runs')]
    assert lucid_main(monkeypatch, 'fit', *args) == 2
    err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert len(err) == 1 and err[0].startswith('lucid: error: no validation instance: none of the 3'), err
    assert not (tmp_path / 'runs').exists() or not list((tmp_path / 'runs').rglob('*.ckpt'))


# ---- a checkpoint of other categories ----

def test_checkpoint_of_other_categories_is_refused(coco):
    "Validating a checkpoint on data with other category ids would relabel its classes by position: refused, naming both."
    dm = dm_for(coco)
    cli = types.SimpleNamespace(ckpt_extra=dict(cat_ids=[7, 42, 1000], class_names=['a', 'b', 'c']))
    with pytest.raises(ValueError, match=r'trained on category ids \[7, 42, 1000\], the data has \[3, 17, 90\]'):
        command.LucidCLI.data_classes(cli, dm)
    cli.ckpt_extra['cat_ids'] = [3, 17, 90]
    assert command.LucidCLI.data_classes(cli, dm) == 3


# ---- files to predict, drawings at fit end ----

def test_unreadable_file_to_predict_is_named(coco, tmp_path):
    "A file `predict` cannot read is a problem sample naming it; the batch keeps the good ones (`collate_images`)."
    bad = tmp_path / 'broken.jpg'; bad.write_bytes(b'\xff\xd8\xff truncated')
    files = images.ImageFiles([bad, sorted(data.EMBEDDED_IMAGES.glob('*.jpg'))[0]], 64)
    assert files[0]['image_id'] == 0 and 'broken.jpg: unreadable image' in files[0]['problem']
    batch = images.collate_images([files[0], files[1]])
    assert batch['img'].shape[0] == 1 and batch['image_id'].tolist() == [1] and batch['problems'][0][0] == 0
    assert set(images.collate_images([files[0]])) == {'problems'}   # no image read: no `img`


def test_load_rgb_names_an_unreadable_file(tmp_path):
    "What the fit-end drawings and `predict` read with: the error names the file (it did not)."
    bad = tmp_path / 'gone.png'; bad.write_bytes(b'')
    with pytest.raises(data.BadInputError, match='gone.png: unreadable'): data.load_rgb(bad)
