"""Checks of `lucid_nb.masks` and `lucid_nb.metrics` beyond `nbs/07a_masks.ipynb` and `nbs/07b_metrics.ipynb` (which teaches and checks NMS against its reference on small
inputs, the crop windows, `unletterbox_masks` against a float64 reference, the rectangle round trip, RLE against
pycocotools on ellipses, perfect and empty COCOeval, the full path fed with the ground truth and spoilt predictions,
equal JSON bytes): brute-force NMS parity over many seeds, modes and chunk sizes, properties of the greedy answer,
RLE edge cases and fuzz, soft-mask areas, the JSON schema and atomic writes, COCOeval against pycocotools on ~2,400
detections, the batched post-processing against the old path, and the CUDA checks."""
import copy, hashlib, json

import numpy as np
import pytest
import torch
from pycocotools import mask as mask_utils
from pycocotools.coco import COCO

from pycocotools.cocoeval import COCOeval

from lucid_nb.core import EMBEDDED_ANNOTATIONS, MASK_STRIDE
from lucid_nb.core import test_bytes_equal as assert_bytes_equal
from lucid_nb.loss import crop_mask
from lucid_nb.masks import (batch_mask_runs, mask_runs, mask_runs_full, masks_to_rle, proto_masks, rle_encode, rle_extent, rle_runs,
                            rle_strings, unletterbox_boxes, unletterbox_masks)
from lucid_nb.metrics import (COCO80_IDS, STAT_NAMES, Validator, box_iou, class_rows, coco_evaluate, coco_results, load_coco, nms, nms_reference,
                              quiet, results_bytes, write_results)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')


# ---------------------------------------------------------------------------------------------------------------- NMS
def _preds(seed, B=2, A=80, K=4, S=64., q=10, clusters=5):
    "Clustered random boxes (lots of overlap) and scores quantised to `q` levels (lots of ties)."
    g = torch.Generator().manual_seed(seed)
    c = torch.rand(B, clusters, 2, generator=g) * S
    xy = c[:, torch.randint(0, clusters, (A,), generator=g)] + torch.randn(B, A, 2, generator=g) * 5
    wh = torch.rand(B, A, 2, generator=g) * 20 + 1
    sc = (torch.rand(B, A, K, generator=g) * q).floor() / q if q else torch.rand(B, A, K, generator=g)
    return torch.cat([xy - wh / 2, xy + wh / 2], -1), sc


def _assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        for k in ('anchors', 'classes', 'scores', 'boxes'): assert_bytes_equal(g[k], w[k], k)


MODES = [dict(), dict(multi_label=False), dict(agnostic=True), dict(agnostic=True, multi_label=False),
         dict(iou=.3), dict(iou=.9), dict(max_det=5), dict(max_nms=17), dict(conf=.55, iou=.5),
         dict(per_class=2), dict(per_class=1, agnostic=True), dict(per_class=3, max_det=7, multi_label=False)]


@pytest.mark.parametrize('seed', range(6))
@pytest.mark.parametrize('mode', range(len(MODES)), ids=lambda i: ','.join(f'{k}={v}' for k, v in MODES[i].items()) or 'default')
def test_nms_equals_brute_force(seed, mode):
    kw = dict(dict(conf=.05), **MODES[mode])
    bx, sc = _preds(seed, q=0 if seed % 3 == 0 else 10)
    want = nms_reference(bx, sc, **kw)
    for chunk in ((1, 16, 4096) if seed == 0 else (16, 4096)):  # one box per step, several chunks, one chunk
        _assert_same(nms(bx, sc, chunk=chunk, **kw), want)


def test_nms_equals_brute_force_larger():
    bx, sc = _preds(99, B=1, A=800, K=3, S=200., q=50, clusters=20)
    for kw in (dict(conf=.2), dict(conf=.2, multi_label=False, iou=.5)):
        _assert_same(nms(bx, sc, chunk=256, **kw), nms_reference(bx, sc, **kw))


def test_nms_output_is_greedy():
    "Independent check of the greedy property itself: kept boxes of a class never overlap above `iou`, and every dropped candidate is covered by a better kept one."
    bx, sc = _preds(5, B=1, A=200, K=2, q=0)
    d = nms(bx, sc, conf=.1, iou=.5, max_det=1000)[0]
    for k in d['classes'].unique():
        kb = d['boxes'][d['classes'] == k]
        assert (box_iou(kb, kb).triu(1) <= .5).all()
    kept = set(zip(d['anchors'].tolist(), d['classes'].tolist()))
    for a, k in zip(*(sc[0] > .1).nonzero(as_tuple=True)):
        if (int(a), int(k)) in kept: continue
        better = (d['classes'] == k) & (d['scores'] >= sc[0, a, k])
        assert (box_iou(bx[0, a, None], d['boxes'][better]) > .5).any()


def test_nms_no_candidates():
    bx, sc = _preds(0)
    for d in nms(bx, sc * 0, conf=.001) + nms(bx, sc * 0, conf=.001, multi_label=False):
        assert d['boxes'].shape == (0, 4) and d['scores'].shape == d['classes'].shape == d['anchors'].shape == (0,)


def test_nms_full_scale_is_fast_enough():
    "8400 anchors x 80 classes at conf 0.001 (all 672,000 pairs are candidates, max_nms keeps 30,000)."
    import time
    g = torch.Generator().manual_seed(0)
    xy = torch.rand(2, 8400, 2, generator=g) * 600
    bx = torch.cat([xy, xy + torch.rand(2, 8400, 2, generator=g) * 200 + 8], -1)
    sc = torch.rand(2, 8400, 80, generator=g) ** 4
    t0 = time.perf_counter()
    out = nms(bx, sc)
    assert time.perf_counter() - t0 < 5
    assert [len(d['scores']) for d in out] == [300, 300]


# -------------------------------------------------------------------------------------------------------------- masks
@pytest.mark.parametrize('hw', [(480, 640), (640, 427), (333, 500)])
def test_soft_mask_round_trip_area(hw):
    "A rectangle anywhere (fractional pads, edges inside cells) drawn as occupancy on the prototype grid comes back with ~its area."
    H, W = hw; S = 640
    s = S / max(H, W); lb = (s, (S - W * s) / 2, (S - H * s) / 2)
    box = torch.tensor([[W * .21, H * .33, W * .77, H * .81]])
    lbox = box * s + torch.tensor([lb[1], lb[2]] * 2)
    fine = 8  # draw at 8x the prototype grid, then average: coverage of each cell
    n = S // MASK_STRIDE
    x = (torch.arange(n * fine) + .5) / fine * MASK_STRIDE
    inside = ((x[None] >= lbox[0, 0]) & (x[None] < lbox[0, 2])) & ((x[:, None] >= lbox[0, 1]) & (x[:, None] < lbox[0, 3]))
    occ = torch.nn.functional.avg_pool2d(inside.float()[None], fine)[0]
    proto = torch.logit(occ.clamp(1e-6, 1 - 1e-6))[None]
    rle = masks_to_rle(torch.ones(1, 1), proto, lbox, lb, (H, W))
    want = (box[0, 2] - box[0, 0]) * (box[0, 3] - box[0, 1])
    assert abs(mask_utils.area(rle)[0] / want.item() - 1) < .03
    tol = MASK_STRIDE / s + 1  # the crop on the prototype grid (corner rule: cells from ceil(x1)) may move an edge by up to a cell
    got = torch.tensor(mask_utils.toBbox(rle)[0], dtype=torch.float32)
    assert ((got - torch.cat([box[0, :2], box[0, 2:] - box[0, :2]])).abs() <= tol).all()


def _encode(masks):
    "pycocotools' `encode`, mask by mask, with `counts` as str: the reference."
    out = []
    for m in masks.cpu().numpy().astype(np.uint8):
        r = mask_utils.encode(np.asfortranarray(m))
        out.append(dict(size=r['size'], counts=r['counts'].decode('ascii')))
    return out


def _edge_masks(H, W, g):
    "Empty, full, random, sparse, one pixel at each corner (and its complement), each border, halves."
    z = torch.zeros(H, W, dtype=torch.bool)
    ms = [z, ~z, torch.rand(H, W, generator=g) > .5, torch.rand(H, W, generator=g) > .97]
    for r, c in ((0, 0), (0, W - 1), (H - 1, 0), (H - 1, W - 1)):
        m = z.clone(); m[r, c] = True; ms += [m, ~m]
    for sl in (np.s_[0, :], np.s_[-1, :], np.s_[:, 0], np.s_[:, -1], np.s_[:, W // 2:], np.s_[H // 3:, :], np.s_[1:-1, 1:-1]):
        m = z.clone(); m[sl] = True; ms.append(m)
    return torch.stack(ms)


@pytest.mark.parametrize('hw', [(1, 1), (1, 9), (7, 1), (2, 3), (17, 23), (96, 64), (427, 640), (1025, 1024)])
def test_rle_encode_matches_pycocotools(hw):
    "Byte-identical to pycocotools' encode, edge cases and all sizes (1025 x 1024: counts above 2^20, 5 characters)."
    m = _edge_masks(*hw, torch.Generator().manual_seed(sum(hw)))
    assert rle_encode(m) == _encode(m)


def _area_bbox(rles):
    "pycocotools' `area` and `toBbox` of RLE dicts (counts as str): the reference for `batch_mask_runs`' extents (`rle_extent`)."
    enc = [dict(size=r['size'], counts=r['counts'].encode()) for r in rles]
    return [(int(mask_utils.area(e)), mask_utils.toBbox(e).tolist()) for e in enc]   # one by one, as `loadRes` calls them



def test_rle_extent_matches_pycocotools_area_and_toBbox():
    "Masks of several image sizes in one call: edge cases (empty, full, corners, borders, runs into the next column) and random ones."
    g, masks = torch.Generator().manual_seed(3), []
    for H, W in [(1, 1), (1, 9), (7, 1), (2, 3), (17, 23), (96, 64)]:
        masks += list(_edge_masks(H, W, g))
        x = torch.rand(6, H, W, generator=g)
        masks += list(x > torch.rand(6, 1, 1, generator=g))   # each its own density
    runs = [rle_runs(m[None]) for m in masks]
    counts, per_mask = torch.cat([c for c, _ in runs]), torch.cat([r for _, r in runs])
    ext = rle_extent(counts.int(), per_mask, torch.tensor([m.shape[0] for m in masks]))
    want = _area_bbox([dict(size=list(m.shape), counts=rle_encode(m[None])[0]['counts']) for m in masks])
    assert [(int(e[0]), [float(v) for v in e[1:]]) for e in ext.tolist()] == want
    for most in (1, 50, 1000):   # in slices of whole masks: one mask at a time, a few, many
        assert torch.equal(rle_extent(counts.int(), per_mask, torch.tensor([m.shape[0] for m in masks]), most), ext)
    assert rle_extent(counts[:0], per_mask[:0], per_mask[:0]).shape == (0, 5)

def test_rle_encode_random_sizes_and_shapes():
    "Fuzz: random sizes, random rectangles and blobs, long runs crossing columns, masks that differ by one pixel."
    g = torch.Generator().manual_seed(7)
    for _ in range(40):
        H, W = (int(v) for v in torch.randint(1, 90, (2,), generator=g))
        n = int(torch.randint(1, 12, (1,), generator=g))
        x = torch.rand(n, H, W, generator=g)
        m = x > torch.rand(n, 1, 1, generator=g)                                  # each mask its own density
        xy = torch.randint(0, max(H, W), (n, 4), generator=g)
        yy, xx = torch.arange(H)[:, None], torch.arange(W)[None]
        rect = (xx >= xy[:, 0, None, None]) & (xx < xy[:, 2, None, None]) & (yy >= xy[:, 1, None, None]) & (yy < xy[:, 3, None, None])
        both = torch.cat([m, rect, rect ^ m])
        assert rle_encode(both) == _encode(both)


def _masks_to_rle_before(coef, proto, boxes, letterbox, orig_hw, offset):
    "The path before the crop rule was unified: crop tested at `offset` (.5: cell centres), pycocotools' encode on the host."
    def window(b, h, w):
        x, y = torch.arange(w, dtype=b.dtype) + offset, torch.arange(h, dtype=b.dtype) + offset
        return ((y >= b[:, 1, None]) & (y < b[:, 3, None]))[:, :, None] & ((x >= b[:, 0, None]) & (x < b[:, 2, None]))[:, None, :]
    P, h, w = proto.shape
    soft = (coef.float() @ proto.float().reshape(P, -1)).sigmoid().reshape(-1, h, w)
    soft = soft * window(boxes.float() / MASK_STRIDE, h, w)
    m = unletterbox_masks(soft, letterbox, orig_hw) > .5
    return _encode(m & window(unletterbox_boxes(boxes, letterbox, orig_hw), *m.shape[1:]))


def _random_masks_input(seed, n=40, S=64, P=8):
    g = torch.Generator().manual_seed(seed)
    xy = torch.rand(n, 2, generator=g) * S * .8
    boxes = torch.cat([xy, (xy + torch.rand(n, 2, generator=g) * S * .5 + 1).clamp(max=S)], 1)
    return torch.randn(n, P, generator=g), torch.randn(P, S // 4, S // 4, generator=g) * 3, boxes


@pytest.mark.parametrize('lb,hw', [((.5, 8., 0.), (128, 96)), ((.2, 0., 7.3), (250, 320)), ((.137, 3.1, 9.6), (331, 421))])
def test_masks_to_rle_old_vs_new(lb, hw):
    "New path = the old one with the loss's corner rule (any box); = the old centre rule on boxes on the cell grid."
    coef, proto, boxes = _random_masks_input(0)
    new = masks_to_rle(coef, proto, boxes, lb, hw, max_pixels=3 * hw[0] * hw[1])  # several chunks
    assert new == _masks_to_rle_before(coef, proto, boxes, lb, hw, offset=0.)
    grid = (boxes / 4).round() * 4                              # edges on prototype cells ...
    ob = unletterbox_boxes(grid, lb, hw)
    on_px = (ob.round() == ob).all(1)                           # ... and on original pixels: both rules agree there
    if lb[0] == .5: assert on_px.all()
    new = masks_to_rle(coef[on_px], proto, grid[on_px], lb, hw)
    assert new == _masks_to_rle_before(coef[on_px], proto, grid[on_px], lb, hw, offset=.5)
    assert masks_to_rle(coef, proto, boxes, lb, hw) != _masks_to_rle_before(coef, proto, boxes, lb, hw, offset=.5)


def test_proto_crop_is_the_loss_crop():
    "The prototype-grid window of every detection is exactly the loss's `crop_mask` of its box."
    _, _, boxes = _random_masks_input(3, n=200)
    inside = proto_masks(torch.ones(200, 1), torch.full((1, 16, 16), 30.), boxes) > 0
    assert torch.equal(inside, crop_mask(boxes * (16 / 64), 16, 16))


@cuda
@pytest.mark.cuda
def test_rle_encode_on_cuda_equals_cpu():
    g = torch.Generator().manual_seed(0)
    m = torch.cat([_edge_masks(427, 640, g), torch.rand(200, 427, 640, generator=g) > torch.rand(200, 1, 1, generator=g)])
    assert rle_encode(m.cuda()) == rle_encode(m) == _encode(m)
    coef, proto, boxes = _random_masks_input(1, n=300)
    lb, hw = (.137, 3.1, 9.6), (331, 421)
    got = masks_to_rle(coef.cuda(), proto.cuda(), boxes.cuda(), lb, hw)
    assert got == masks_to_rle(coef.cuda(), proto.cuda(), boxes.cuda(), lb, hw)     # deterministic on the device
    agree = sum(a == b for a, b in zip(got, masks_to_rle(coef, proto, boxes, lb, hw)))
    assert agree >= .95 * len(got)  # CPU and GPU sigmoid/lerp may differ in a last bit at the 0.5 level


# ------------------------------------------------------------------------------------------------- COCO results, eval
CATS = [1, 3, 18]  # COCO ids of a few classes


def _rect_poly(x1, y1, x2, y2): return [[x1, y1, x2, y1, x2, y2, x1, y2]]


def _gt():
    "A tiny COCO ground truth: two images with rectangles aligned to the prototype cells at S=64, one crowd region."
    rects = {1: [(16, 32, 56, 96, 1), (64, 8, 88, 40, 18)], 2: [(8, 8, 40, 56, 3), (40, 64, 88, 120, 3)]}
    anns, aid = [], 1
    for iid, rs in rects.items():
        for x1, y1, x2, y2, c in rs:
            anns.append(dict(id=aid, image_id=iid, category_id=c, iscrowd=0, area=float((x2 - x1) * (y2 - y1)),
                             bbox=[x1, y1, x2 - x1, y2 - y1], segmentation=_rect_poly(x1, y1, x2, y2)))
            aid += 1
    crowd = mask_utils.encode(np.asfortranarray(np.pad(np.ones((8, 8), np.uint8), ((110, 10), (80, 8)))))
    anns.append(dict(id=aid, image_id=2, category_id=1, iscrowd=1, area=64., bbox=[80, 110, 8, 8],
                     segmentation=dict(size=crowd['size'], counts=crowd['counts'].decode())))
    coco = COCO()
    coco.dataset = dict(images=[dict(id=1, height=128, width=96, file_name='a.jpg'), dict(id=2, height=128, width=96, file_name='b.jpg')],
                        annotations=anns, categories=[dict(id=c, name=str(c)) for c in CATS])
    quiet(coco.createIndex)
    return coco, rects


def _gt_head_output(rects, S=64, shift=0.):
    "The head's eval output that predicts the rectangles: letterbox scale 0.5, pad_x 8; one anchor per rectangle."
    B, A = len(rects), max(map(len, rects.values()))
    lb = torch.tensor([[.5, 8., 0.]] * B)
    boxes, scores = torch.zeros(B, A, 4), torch.zeros(B, A, len(CATS))
    proto = torch.full((B, A, S // 4, S // 4), -20.)
    for b, rs in enumerate(rects.values()):
        for a, (x1, y1, x2, y2, c) in enumerate(rs):
            lbx = torch.tensor([x1, y1, x2, y2]) * .5 + torch.tensor([8., 0., 8., 0.]) + shift
            boxes[b, a], scores[b, a, CATS.index(c)] = lbx, .9 - .1 * a
            cx1, cy1, cx2, cy2 = (lbx / 4).round().long().tolist()
            proto[b, a, cy1:cy2, cx1:cx2] = 20.
    eval_out = dict(boxes=boxes, scores=scores, coef=torch.eye(A).expand(B, A, A), proto=proto)
    batch = dict(image_id=torch.tensor(list(rects)), orig_hw=torch.tensor([[128, 96]] * B), letterbox=lb)
    return eval_out, batch


def test_validator_end_to_end_perfect():
    coco, rects = _gt()
    v = Validator(cat_ids=CATS)
    v.update(*_gt_head_output(rects))
    assert len(v.results) == 4 and v.image_ids == [1, 2]
    st = v.compute(coco)
    assert st['mAP50-95(B)'] == pytest.approx(1.) and st['mAP50-95(M)'] == pytest.approx(1.)
    assert set(st) == {f'{t}/{n}' for t in ('bbox', 'segm') for n in STAT_NAMES} | {'mAP50-95(B)', 'mAP50(B)', 'mAP50-95(M)', 'mAP50(M)'}
    assert 'Average Precision' in st.log and 'segm' in st.log
    v.reset()
    assert v.results == [] and v.image_ids == []


def test_validator_keeps_only_the_scored_detections():
    "Validating, only each image's first 100 detections of a class are made and kept (COCOeval's `maxDets`): fewer results, the others' bytes unchanged, and the 24 numbers `==` those of every detection and of a plain pycocotools run; predicting keeps every one."
    coco, rects = _gt()
    out, batch = _gt_head_output(rects)
    g, n = torch.Generator().manual_seed(0), 150
    B, A, _ = out['boxes'].shape
    rep = lambda t: t.repeat_interleave(n, 1)   # 150 jittered, lower-scored copies of each rectangle's anchor
    many = dict(boxes=rep(out['boxes']) + torch.randn(B, A * n, 4, generator=g) * 2, coef=rep(out['coef']), proto=out['proto'],
                scores=rep(out['scores']) * torch.rand(B, A * n, 1, generator=g))
    def run(**kw):
        v = Validator(cat_ids=CATS, iou=1., **kw); v.update(many, batch)   # iou 1: nothing suppressed, 300 an image
        return v
    every, scored = run(scored=None), run()
    ranks, seen = [], {}
    for r in every.results:
        key = r['image_id'], r['category_id']; ranks.append(seen.get(key, 0)); seen[key] = ranks[-1] + 1
    assert max(seen.values()) > 100 and len(every.results) > 500
    assert results_bytes(scored.results) == results_bytes([r for r, k in zip(every.results, ranks) if k < 100])
    assert scored.mask_stats == [s for s, k in zip(every.mask_stats, ranks) if k < 100]
    numbers = lambda v: [st[f'{t}/{n}'] for st in [v.compute(coco)] for t in ('bbox', 'segm') for n in STAT_NAMES]
    assert numbers(scored) == numbers(every) == _pycocotools_stats(coco, every.results, [1, 2])   # exactly: ==
    assert 0 < numbers(scored)[0] < 1 and 0 < numbers(scored)[12] < 1
    assert len(run(predict=True).results) == len(every.results)      # predicting: every detection


def test_one_mask_an_anchor_gives_the_same_bytes(monkeypatch):
    "On the CPU an anchor kept in several classes makes its mask once (`anchor_masks`): the same results, strings and extents as a mask a detection."
    import lucid_nb.metrics
    from lucid_nb.metrics import anchor_masks, nms
    coco, rects = _gt()
    out, batch = _gt_head_output(rects, shift=1.37)
    alive = out['scores'].amax(-1, keepdim=True) > 0
    out['scores'] = torch.where(out['scores'] > 0, out['scores'], alive * torch.linspace(.2, .5, len(CATS)))   # every class
    assert anchor_masks(nms(out['boxes'], out['scores'])) is not None                         # anchors repeat
    def run():
        v = Validator(cat_ids=CATS); v.update(out, batch)
        return results_bytes(v.results), v.mask_stats, len(v.results)
    once = run()
    monkeypatch.setattr(lucid_nb.metrics, 'anchor_masks', lambda dets: None)                  # a mask a detection
    assert once == run() and once[2] == 4 * len(CATS)


@cuda
@pytest.mark.cuda
def test_validator_on_cuda_same_bytes_as_cpu():
    "The predictions JSON from CUDA head outputs: the same bytes run after run, and the same as from the CPU."
    coco, rects = _gt()
    eval_out, batch = _gt_head_output(rects, shift=1.37)
    blobs = []
    for dev in ('cuda', 'cuda', 'cpu'):
        v = Validator(cat_ids=CATS)
        v.update({k: t.to(dev) for k, t in eval_out.items()}, {k: t.to(dev) for k, t in batch.items()})
        blobs.append((results_bytes(v.results), v.mask_stats))
    assert blobs[0] == blobs[1] == blobs[2]
    assert blobs[0][1] == _area_bbox([r['segmentation'] for r in v.results])


def test_results_json_is_valid_coco(tmp_path):
    coco, rects = _gt()
    v = Validator(cat_ids=CATS)
    v.update(*_gt_head_output(rects))
    path = tmp_path / 'sub' / 'predictions.json'
    sha = v.write(path)
    data = path.read_bytes()
    assert sha == hashlib.sha256(data).hexdigest()
    assert [p.name for p in path.parent.iterdir()] == ['predictions.json']  # no temp file left behind
    res = json.loads(data)
    for r in res:
        assert set(r) == {'image_id', 'category_id', 'bbox', 'score', 'segmentation'}
        assert type(r['image_id']) is int and r['category_id'] in CATS and type(r['score']) is float
        assert len(r['bbox']) == 4 and all(type(x) is float for x in r['bbox'])
        assert r['segmentation']['size'] == [128, 96] and type(r['segmentation']['counts']) is str
    dt, log = quiet(coco.loadRes, str(path))
    assert len(dt.getAnnIds()) == len(res) and 'DONE' in log
    assert sorted(dt.getImgIds()) == [1, 2]


def test_results_json_byte_identical(tmp_path):
    coco, rects = _gt()
    shas, blobs = [], []
    for i in range(2):
        v = Validator(cat_ids=CATS)
        v.update(*_gt_head_output(rects, shift=1.37))
        shas.append(v.write(tmp_path / f'{i}.json'))
        blobs.append((tmp_path / f'{i}.json').read_bytes())
    assert shas[0] == shas[1] and blobs[0] == blobs[1]
    assert b' ' not in blobs[0]  # fixed separators
    shas.append(write_results(tmp_path / '0.json', json.loads(blobs[0])))  # overwrite, from a parsed copy
    assert shas[2] == shas[0]


def test_coco_results_mapping_and_rounding():
    p = dict(boxes=torch.tensor([[1.23456, 2., 11.5, 12.25]]), scores=torch.tensor([.1234567]), classes=torch.tensor([2]))
    (r,) = coco_results([p], torch.tensor([7]), CATS)
    assert r == dict(image_id=7, category_id=18, bbox=[1.235, 2.0, 10.265, 10.25], score=0.12346)
    (r,) = coco_results([p], [7])
    assert r['category_id'] == COCO80_IDS[2] and 'segmentation' not in r


def test_empty_results():
    coco, rects = _gt()
    assert 'no detections' in coco_evaluate(coco, [], [1, 2]).log   # its zeros: 07b_metrics
    v = Validator(cat_ids=CATS)
    eval_out, batch = _gt_head_output(rects)
    v.update(dict(eval_out, scores=eval_out['scores'] * 0), batch)  # nothing above conf
    assert v.results == [] and v.image_ids == [1, 2]
    assert all(x == 0. for x in v.compute(coco).values())
    st = coco_evaluate(coco, [dict(image_id=1, category_id=1, bbox=[0., 0., 5., 5.], score=.5)], [1])  # boxes, no masks
    assert st['bbox/mAP50-95'] == 0. and st['segm/mAP50-95'] == 0.


def test_coco_evaluate_restricts_to_image_ids():
    coco, rects = _gt()
    v = Validator(cat_ids=CATS)
    eval_out, batch = _gt_head_output(rects)
    v.update(eval_out, batch)
    res_img1 = [r for r in v.results if r['image_id'] == 1]
    assert coco_evaluate(coco, res_img1, [1])['mAP50-95(B)'] == pytest.approx(1.)  # image 2's objects not counted
    assert coco_evaluate(coco, res_img1, [1, 2])['mAP50-95(B)'] < 1.              # ...but are here


def test_write_results_failure_leaves_no_temp_file(tmp_path):
    (tmp_path / 'out.json').mkdir()  # os.replace cannot put a file over a directory
    with pytest.raises(OSError):
        write_results(tmp_path / 'out.json', [])
    assert [p.name for p in tmp_path.iterdir()] == ['out.json']
    assert write_results(tmp_path / 'empty.json', []) == hashlib.sha256(b'[]').hexdigest()


# ------------------------------------------------------------------------------- COCOeval: our call vs pycocotools' own
def _encode_np(m):
    r = mask_utils.encode(np.asfortranarray(m))
    return dict(size=r['size'], counts=r['counts'].decode('ascii'))


def _perturbed_gt_results(coco, ids, seed=0, per_gt=6, false_pos=30):
    "Many detections: jittered copies of each ground-truth object (some of the wrong class), on crowd regions too, and false positives of any of the 80 classes; scores with ties."
    rng = np.random.default_rng(seed)
    res = []
    for iid in ids:
        img = coco.imgs[iid]; H, W = img['height'], img['width']
        for a in coco.loadAnns(coco.getAnnIds(imgIds=[iid])):            # crowd regions included
            m = coco.annToMask(a)
            for j in range(per_gt):
                dx, dy = (int(v) for v in rng.integers(-6, 7, 2))
                mm = np.roll(m, (dy, dx), (0, 1))
                if j % 4 == 3: mm = np.maximum(mm, np.roll(mm, 3, 0))      # a fatter mask
                x, y, w, h = a['bbox']; s = rng.uniform(.8, 1.25, 2)
                c = a['category_id'] if rng.random() > .2 else int(rng.choice(COCO80_IDS))
                res.append(dict(image_id=iid, category_id=c, bbox=[round(x + dx, 3), round(y + dy, 3), round(w * s[0], 3), round(h * s[1], 3)],
                                score=round(int(rng.integers(1, 20)) / 20, 5), segmentation=_encode_np(mm)))
        for _ in range(false_pos):
            x0, y0 = int(rng.integers(0, W - 2)), int(rng.integers(0, H - 2))
            w, h = int(rng.integers(1, min(120, W - x0) + 1)), int(rng.integers(1, min(120, H - y0) + 1))
            mm = np.zeros((H, W), np.uint8); mm[y0:y0 + h, x0:x0 + w] = 1
            res.append(dict(image_id=iid, category_id=int(rng.choice(COCO80_IDS)), bbox=[float(x0), float(y0), float(w), float(h)],
                            score=round(float(rng.random()), 5), segmentation=_encode_np(mm)))
    return res


def _pycocotools_stats(coco, results, ids, COCO=COCO, COCOeval=COCOeval):
    "The 24 numbers as pycocotools' README computes them: full ground truth, default parameters, one results list per iouType."
    out = []
    for iou_type, drop in (('bbox', 'segmentation'), ('segm', 'bbox')):
        gt = COCO(); gt.dataset = copy.deepcopy(coco.dataset); quiet(gt.createIndex)
        dt = quiet(gt.loadRes, [{k: v for k, v in r.items() if k != drop} for r in copy.deepcopy(results)])[0]
        E = COCOeval(gt, dt, iou_type); E.params.imgIds = sorted(ids)
        quiet(E.evaluate); quiet(E.accumulate); quiet(E.summarize)
        out += E.stats.tolist()
    return out


def test_coco_evaluate_equals_pycocotools_exactly():
    "All 24 numbers bit-equal to a plain COCOeval run, on the 32 validation images with ~2,400 detections (crowd regions, false positives of classes absent from the ground truth, tied scores)."
    coco = load_coco(EMBEDDED_ANNOTATIONS)
    ids = [im['id'] for im in sorted(coco.dataset['images'], key=lambda im: im['file_name'])[-32:]]
    res = _perturbed_gt_results(coco, ids)
    assert len(res) > 2000 and any(a['iscrowd'] for a in coco.loadAnns(coco.getAnnIds(imgIds=ids)))
    gt_cats = {a['category_id'] for a in coco.loadAnns(coco.getAnnIds(imgIds=ids))}
    assert sum(r['category_id'] not in gt_cats for r in res) > 300     # the category restriction has work to skip
    st = coco_evaluate(coco, res, ids)
    want = _pycocotools_stats(coco, res, ids)
    got = [st[f'{t}/{n}'] for t in ('bbox', 'segm') for n in STAT_NAMES]
    assert got == want                                                 # exactly: ==, no tolerance
    known = coco_evaluate(coco, res, ids, _area_bbox([r['segmentation'] for r in res]))   # masks' areas and boxes given
    assert [known[f'{t}/{n}'] for t in ('bbox', 'segm') for n in STAT_NAMES] == want and known.per_class == st.per_class
    with pytest.raises(ValueError, match='mask_stats'): coco_evaluate(coco, res, ids, [None])
    assert 0 < st['mAP50-95(B)'] < 1 and 0 < st['mAP50-95(M)'] < 1


def test_ultrafast_pycocotools_equals_pycocotools():
    "The evaluator `coco_evaluate` runs (ultrafast-pycocotools): its 24 numbers must be pycocotools' exactly."
    import ultrafast_pycocotools.coco as uc, ultrafast_pycocotools.cocoeval as ue
    coco = load_coco(EMBEDDED_ANNOTATIONS)
    ids = [im['id'] for im in sorted(coco.dataset['images'], key=lambda im: im['file_name'])[-32:]]
    res = _perturbed_gt_results(coco, ids, seed=1)
    assert _pycocotools_stats(coco, res, ids, uc.COCO, ue.COCOeval) == _pycocotools_stats(coco, res, ids)


# ------------------------------------------------------------------- the batched, sync-light post-processing = the old
def _old_greedy_keep(boxes, cls, iou, max_det, chunk=512):
    "`greedy_keep` as it was, one image at a time: a host look per fixed-point round and per chunk."
    kept = torch.zeros(0, dtype=torch.long)
    i = torch.arange(min(chunk, len(boxes)))
    before = i[:, None] < i[None]
    for s in range(0, len(boxes), chunk):
        b, c = boxes[s:s + chunk], cls[s:s + chunk]
        over = lambda kb, kc: (box_iou(kb, b) > iou) & (kc[:, None] == c[None])
        alive = ~over(boxes[kept], cls[kept]).any(0)
        sup = over(b, c) & before[:len(b), :len(b)]
        keep = alive
        while True:
            new = alive & ~(sup & keep[:, None]).any(0)
            if torch.equal(new, keep): break
            keep = new
        kept = torch.cat([kept, keep.nonzero()[:, 0] + s])
        if len(kept) >= max_det: break
    return kept[:max_det]


def _old_candidates(scores, conf, multi_label, max_nms):
    "One image's candidates, as before the batch went through at once: anchors, classes, scores, best first (stable)."
    if multi_label:
        a, k = (scores > conf).nonzero(as_tuple=True)
        s = scores[a, k]
    else:
        s, k = scores.max(-1)
        a = (s > conf).nonzero()[:, 0]
        s, k = s[a], k[a]
    if len(s) > max_nms:
        i = (s >= s.topk(max_nms).values[-1]).nonzero()[:, 0]
        a, k, s = a[i], k[i], s[i]
    o = torch.sort(s, descending=True, stable=True).indices[:max_nms]
    return a[o], k[o], s[o]


def test_batched_candidates_equal_the_per_image_ones():
    "Every image's candidates, its max_nms cut (ties kept at the cut) and the padding, as image by image."
    from lucid_nb.metrics import _candidates
    g = torch.Generator().manual_seed(0)
    sc = (torch.rand(5, 300, 6, generator=g) * 20).floor() / 20   # many ties
    sc[1] = 0; sc[3, :, 2:] = 0                                    # an image without candidates, one with few
    for multi_label, max_nms in ((True, 30000), (True, 50), (False, 30000), (False, 7)):
        a, k, s = _candidates(sc, .001, multi_label, max_nms)
        for i in range(len(sc)):
            want = _old_candidates(sc[i], .001, multi_label, max_nms)
            n = len(want[0])
            assert all(torch.equal(t[i, :n], w) for t, w in zip((a, k, s), want)), (multi_label, max_nms, i)
            assert (k[i, n:] == -1).all() and (a[i, n:] == 0).all() and (s[i, n:] == 0).all()
        assert a.shape[1] == max(len(_old_candidates(x, .001, multi_label, max_nms)[0]) for x in sc)


def _old_nms(boxes, scores, conf=0.001, iou=0.7, max_det=300, max_nms=30000, multi_label=True, agnostic=False, chunk=512):
    out = []
    for bx, sc in zip(boxes.float(), scores.float()):
        a, k, s = _old_candidates(sc, conf, multi_label, max_nms)
        keep = _old_greedy_keep(bx[a], torch.zeros_like(k) if agnostic else k, iou, max_det, chunk)
        out.append(dict(boxes=bx[a[keep]], scores=s[keep], classes=k[keep], anchors=a[keep]))
    return out


def _old_rle_encode(masks):
    from lucid_nb.masks import rle_chars, rle_runs
    n, H, W = masks.shape
    if n == 0: return []
    counts, runs = rle_runs(masks)
    chars, runs = rle_chars(counts, runs, H * W).cpu().numpy(), runs.cpu().numpy()
    live = chars != 0
    text = chars[live].tobytes().decode('ascii')
    ends = np.add.reduceat(live.sum(1), runs.cumsum() - runs).cumsum().tolist()
    return [{'size': [H, W], 'counts': text[a:b]} for a, b in zip([0] + ends[:-1], ends)]


def _old_masks_to_rle(coef, proto, boxes, letterbox, orig_hw, max_pixels=2**25):
    from lucid_nb.masks import crop_window
    ob, out = unletterbox_boxes(boxes, letterbox, orig_hw), []
    H, W = (int(v) for v in torch.as_tensor(orig_hw).tolist())
    step = max(1, max_pixels // (H * W))
    for i in range(0, len(coef), step):
        m = unletterbox_masks(proto_masks(coef[i:i + step], proto, boxes[i:i + step]), letterbox, orig_hw) > .5
        rows, cols = crop_window(ob[i:i + step], H, W)
        out += _old_rle_encode(m.logical_and_(rows).logical_and_(cols))
    return out


def _old_validator_results(outs, batches, cat_ids, **nms_kw):
    "`Validator.update` as it was: image by image, NMS, masks and strings (the JSON it wrote, as results)."
    results = []
    for eval_out, batch in zip(outs, batches):
        eval_out = {k: v.float() for k, v in eval_out.items()}
        dets = _old_nms(eval_out['boxes'], eval_out['scores'], **nms_kw)
        ids, hws, lbs = (batch[k].cpu() for k in ('image_id', 'orig_hw', 'letterbox'))
        for i, d in enumerate(dets):
            p = dict(boxes=unletterbox_boxes(d['boxes'], lbs[i], hws[i]), scores=d['scores'], classes=d['classes'],
                     masks=_old_masks_to_rle(eval_out['coef'][i][d['anchors']], eval_out['proto'][i], d['boxes'], lbs[i], hws[i]))
            results += coco_results([p], [ids[i]], cat_ids)
    return results


def _young_head(seed, B=3, S=320):
    "Outputs shaped like a young model's head (`lucid_nb.testing.young_head`, `benchmarks/validation_speed.py`'s case): every pair above conf 0.001, near-copies of a few boxes on 4 classes."
    from lucid_nb.testing import young_head
    return young_head([dict(img=torch.zeros(B, 3, S, S))], seed)[0]


def _batch_of(B, S, seed=0):
    g = torch.Generator().manual_seed(seed)
    hw = torch.stack([torch.randint(S // 2, S * 2, (B,), generator=g), torch.randint(S // 2, S * 2, (B,), generator=g)], 1)
    r = S / hw.max(1).values.float()
    lb = torch.stack([r, (S - hw[:, 1] * r) / 2, (S - hw[:, 0] * r) / 2], 1)
    return dict(image_id=torch.arange(B) + 100 * seed, orig_hw=hw, letterbox=lb)


@pytest.mark.parametrize('kw', [dict(), dict(max_det=40, iou=.5), dict(multi_label=False), dict(agnostic=True, max_nms=3000)])
def test_batched_nms_equals_old_on_deep_suppression(kw):
    "Near-copies of a few boxes: most candidates are suppressed, so NMS goes through many chunks before max_det."
    h = _young_head(1, B=4, S=448)   # 4116 anchors
    a, k, _ = _old_candidates(h['scores'][0], .001, True, 30000)
    assert _old_greedy_keep(h['boxes'][0][a], k, .7, 300).max() > 8 * 512   # the 300th kept box is deep in the list
    want = _old_nms(h['boxes'], h['scores'], **kw)
    for chunk, rounds in ((512, None), (97, None), (512, 4), (97, 3)):   # rounds 4: the GPU's default
        _assert_same(nms(h['boxes'], h['scores'], chunk=chunk, rounds=rounds, **kw), want)


@pytest.mark.parametrize('group_pixels', [2**25, 2_000_000, 1])   # one group a batch; a few images a group; one image a group
def test_validator_results_equal_old_path(group_pixels):
    "The whole post-processing, new vs old, to the byte: a seeded nano model's outputs (class biases 0: max_det boxes) and a young-model-like head."
    from lucid_nb.heads import yolo_seg
    torch.manual_seed(0)
    net = yolo_seg('n', num_classes=80).eval()
    for conv in net.head.cls: conv[-1].bias.data.zero_()
    with torch.no_grad(): outs = [net(torch.rand(2, 3, 160, 160, generator=torch.Generator().manual_seed(i))) for i in range(2)]
    outs = [{k: o[k] for k in ('boxes', 'scores', 'coef', 'proto')} for o in outs] + [_young_head(2, B=3, S=320)]
    batches = [_batch_of(2, 160, 0), _batch_of(2, 160, 1), _batch_of(3, 320, 2)]
    kw = dict(conf=0.001, iou=0.7, max_det=300)
    v = Validator(COCO80_IDS, group_pixels=group_pixels, **kw)
    for o, b in zip(outs, batches): v.update(o, b)
    old = _old_validator_results(outs, batches, COCO80_IDS, **kw)
    assert len(v.results) == len(old) > 1200
    assert results_bytes(v.results) == results_bytes(old)
    assert v.image_ids == [int(i) for b in batches for i in b['image_id']]
    assert v.mask_stats == _area_bbox([r['segmentation'] for r in v.results])   # areas and boxes from the device: pycocotools'


# ------------------------------------------------------------------------------- masks made inside their boxes only
def _box_local_case(g, n, H, W, S=64, P=8, device='cpu'):
    "Random detections on an H×W image: boxes fractional or on pixel edges, cut by the border, whole columns, the whole image, empty."
    scale = S / max(H, W); lb = (scale, (S - W * scale) / 2, (S - H * scale) / 2)
    ob = torch.randint(-3, max(H, W) + 4, (n, 2, 2), generator=g).float().sort(1).values.reshape(n, 4)[:, [0, 2, 1, 3]]
    ob = torch.where(torch.rand(n, 4, generator=g) < .4, ob + torch.rand(n, 4, generator=g), ob)   # x1 y1 x2 y2
    kind = torch.randint(0, 6, (n,), generator=g)
    ob[kind == 0, 1], ob[kind == 0, 3] = -1., H + 1.                  # whole columns
    ob[kind == 1] = torch.tensor([-1., -1., W + 1., H + 1.])          # the whole image
    ob[kind == 2, 2] = ob[kind == 2, 0]                               # empty
    boxes = ob * scale + torch.tensor([lb[1], lb[2]] * 2)
    coef, proto = torch.randn(n, P, generator=g), torch.randn(P, S // 4, S // 4, generator=g) * 4
    full = torch.rand(P, 1, 1, generator=g) < .3
    proto = torch.where(full, proto.abs() + 6, proto)                 # some masks full inside their crops
    return coef.to(device), proto.to(device), boxes.to(device), lb, (H, W)


@pytest.mark.parametrize('seed', range(6))
def test_mask_runs_equal_the_full_resolution_definition(seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(40):
        H, W = (int(v) for v in torch.randint(1, 70, (2,), generator=g))
        n = int(torch.randint(0, 20, (1,), generator=g))
        coef, proto, boxes, lb, hw = _box_local_case(g, n, H, W)
        want = mask_runs_full(coef, proto, boxes, lb, hw)
        for max_pixels in (1, int(torch.randint(2, 2000, (1,), generator=g)), 2**23):
            got = mask_runs(coef, proto, boxes, lb, hw, max_pixels)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (seed, H, W, n, max_pixels)


def _images_case(g, sizes, S=64, P=8, device='cpu'):
    "`_box_local_case` for several images of a batch: their detections one image after the other, prototypes stacked."
    cases = [_box_local_case(g, n, H, W, S, P, device) for H, W, n in sizes]
    coef, boxes = (torch.cat([c[k] for c in cases]) for k in (0, 2))
    return cases, coef, torch.stack([c[1] for c in cases]), boxes, [n for _, _, n in sizes], [c[3] for c in cases], [c[4] for c in cases]


@pytest.mark.parametrize('seed', range(4))
def test_batch_mask_runs_equal_each_image_alone(seed):
    "Images of different sizes (one without detections) in one pass: chunks mix their crops; the runs are each image's own, in order."
    g = torch.Generator().manual_seed(seed)
    sizes = [(int(torch.randint(1, 70, (1,), generator=g)), int(torch.randint(1, 70, (1,), generator=g)),
              int(torch.randint(0, 15, (1,), generator=g))) for _ in range(4)] + [(33, 41, 0)]
    cases, coef, proto, boxes, per_image, lbs, hws = _images_case(g, sizes)
    want = [mask_runs_full(*c) for c in cases]
    want = torch.cat([c for c, _ in want]), torch.cat([r for _, r in want])
    for max_pixels in (1, 500, 2**23):
        got = batch_mask_runs(coef, proto, boxes, per_image, lbs, hws, max_pixels)
        assert all(torch.equal(a, b.to(a.dtype)) for a, b in zip(got, want)), (seed, max_pixels)
    *runs, ext = batch_mask_runs(coef, proto, boxes, per_image, lbs, hws, 500, extent=True)
    assert all(torch.equal(a, b.to(a.dtype)) for a, b in zip(runs, want))
    hw = [tuple(map(int, hw)) for hw, (_, _, k) in zip(hws, sizes) for _ in range(k)]   # each mask's image
    rles = [dict(size=list(s), counts=t) for s, t in zip(hw, rle_strings(*runs, max(H * W for H, W in hw)))]
    assert [(int(e[0]), [float(v) for v in e[1:]]) for e in ext.tolist()] == _area_bbox(rles)   # pycocotools' area and toBbox


@cuda
@pytest.mark.cuda
def test_batch_mask_runs_equal_each_image_alone_on_the_gpu():
    "A validation batch's worth on the GPU: 8 images of different sizes, up to 300 detections each."
    g = torch.Generator().manual_seed(1)
    sizes = [(427, 640, 300), (640, 427, 300), (333, 501, 120), (1, 640, 40), (480, 640, 0), (512, 512, 200), (97, 13, 30), (640, 640, 300)]
    cases, coef, proto, boxes, per_image, lbs, hws = _images_case(g, sizes, S=640, P=32, device='cuda')
    want = [mask_runs(*c) for c in cases if c[0].numel()]   # each image alone, as the Validator made them before
    got = batch_mask_runs(coef, proto, boxes, per_image, lbs, hws)
    assert torch.equal(got[0], torch.cat([c for c, _ in want])) and torch.equal(got[1], torch.cat([r for _, r in want]))


@cuda
@pytest.mark.cuda
def test_mask_runs_equal_the_full_resolution_definition_on_the_gpu():
    "300 detections of a 427×640 image (and odd sizes): the same counts on the GPU, where chunks and kernels differ."
    g = torch.Generator().manual_seed(0)
    for H, W, n in ((427, 640, 300), (640, 427, 300), (333, 501, 120), (1, 640, 40)):
        coef, proto, boxes, lb, hw = _box_local_case(g, n, H, W, S=640, P=32, device='cuda')
        want = mask_runs_full(coef, proto, boxes, lb, hw, max_pixels=2**30)   # one matmul, as `mask_runs`
        got = mask_runs(coef, proto, boxes, lb, hw)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (H, W)


def test_greedy_keep_stops_once_every_image_is_full_or_out_of_candidates(monkeypatch):
    "A batch whose images end short of max_det stops at their last candidate, not at the longest image's: the same keeps, few looks."
    from lucid_nb.metrics import greedy_keep
    g = torch.Generator().manual_seed(0)
    xy = torch.rand(2, 4000, 2, generator=g) * 600
    boxes = torch.cat([xy, xy + 2 + torch.rand(2, 4000, 2, generator=g) * 40], -1)   # small boxes, few overlaps
    cls = torch.randint(0, 3, (2, 4000), generator=g)
    cls[1, 100:] = -1                                    # image 1: 100 candidates, all kept, never full
    looks, tolist = [0], torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, 'tolist', lambda t: (looks.__setitem__(0, looks[0] + 1), tolist(t))[1])
    keep, count = greedy_keep(boxes, cls, .7, 300, chunk=512, rounds=1)
    monkeypatch.undo()
    for i, n in enumerate((4000, 100)):
        want = _old_greedy_keep(boxes[i, :n], cls[i, :n], .7, 300)
        assert int(count[i]) == len(want) and torch.equal(keep[i, :len(want)], want)
    assert int(count[1]) == 100 < 300 <= int(count[0])   # image 0 full within its first chunk, image 1 out of candidates
    assert looks[0] <= 3   # the first chunk (512 candidates) settles the batch: before, all 8 of image 0's chunks (10 looks)


# ---------------------------------------------------------------------------------------------------- per class
def _counted_at(E, conf):
    "Per category of a plain pycocotools COCOeval: (TP, detections, ground truths) scoring >= `conf` at IoU 0.5, area all, 100 detections, read off its `evalImgs`."
    out = {}
    for e in E.evalImgs:
        if e is None or e['aRng'] != [0, 1e10] or e['maxDet'] != 100: continue
        tp, det, gt = out.get(e['category_id'], (0, 0, 0))
        for s, m, ig in zip(e['dtScores'], e['dtMatches'][0], e['dtIgnore'][0]):
            if s >= conf and not ig: tp, det = tp + (m > 0), det + 1
        out[e['category_id']] = (tp, det, gt + int((np.asarray(e['gtIgnore']) == 0).sum()))
    return out


def test_per_class_numbers_equal_pycocotools_arrays():
    "Per-class mAP50 and mAP50-95 equal a plain COCOeval's `eval['precision']` (every category, default parameters); P and R equal a count of its `evalImgs` at the operating point, which has the best mean F1."
    coco = load_coco(EMBEDDED_ANNOTATIONS)
    ids = [im['id'] for im in sorted(coco.dataset['images'], key=lambda im: im['file_name'])[-32:]]
    res = _perturbed_gt_results(coco, ids, seed=1)
    st = coco_evaluate(coco, res, ids)
    names = [c['name'] for c in sorted(coco.dataset['categories'], key=lambda c: c['id'])]
    rows = class_rows(st, names)
    for t, drop, key in (('bbox', 'segmentation', 'box'), ('segm', 'bbox', 'mask')):
        gt = COCO(); gt.dataset = copy.deepcopy(coco.dataset); quiet(gt.createIndex)
        E = COCOeval(gt, quiet(gt.loadRes, [{k: v for k, v in r.items() if k != drop} for r in copy.deepcopy(res)])[0], t)
        E.params.imgIds = sorted(ids); quiet(E.evaluate); quiet(E.accumulate)
        prec, cats = E.eval['precision'][:, :, :, 0, 2], list(E.params.catIds)   # area all, 100 detections
        conf, counts = st.classes[t]['conf'], _counted_at(E, st.classes[t]['conf'])
        assert len(rows) > 20 and 0 < conf < 1
        for r in rows[1:]:
            p = prec[:, :, cats.index(r['category_id'])]
            assert r[key]['mAP50-95'] == float(p[p > -1].mean()) and r[key]['mAP50'] == float(p[0][p[0] > -1].mean())
            tp, det, n = counts[r['category_id']]
            assert n == r['instances'] and r[key]['P'] == (tp / det if det else 0.) and r[key]['R'] == tp / n
        quiet(E.summarize)
        assert (rows[0][key]['mAP50-95'], rows[0][key]['mAP50']) == tuple(E.stats[:2])   # the "all" row: COCOeval's summary
        f1 = lambda c: np.mean([2 * tp / (det + n) for tp, det, n in _counted_at(E, c).values() if n])   # F1 = 2TP / (detections + GT)
        best = f1(conf)
        assert best > 0 and all(f1(c) <= best + 1e-12 for c in np.linspace(.02, .98, 13))
