"""Tests of `lucid_nb.metrics`: NMS against a brute-force greedy reference, the mask path, COCO results JSON and COCOeval."""
import hashlib, json

import numpy as np
import pytest
import torch
from pycocotools import mask as mask_utils
from pycocotools.coco import COCO

from lucid_nb.core import MASK_STRIDE
from lucid_nb.core import test_bytes_equal as assert_bytes_equal
from lucid_nb.metrics import (COCO80_IDS, STAT_NAMES, Validator, box_iou, coco_evaluate, coco_results, masks_to_rle,
                              nms, nms_reference, quiet, rle_encode, unletterbox_boxes, unletterbox_masks, write_results)


# ---------------------------------------------------------------------------------------------------------------- IoU
def _iou_f64(p, q):
    iw, ih = max(0., min(p[2], q[2]) - max(p[0], q[0])), max(0., min(p[3], q[3]) - max(p[1], q[1]))
    u = (p[2] - p[0]) * (p[3] - p[1]) + (q[2] - q[0]) * (q[3] - q[1]) - iw * ih
    return iw * ih / u if u > 0 else 0.


def test_box_iou_against_float64():
    g = torch.Generator().manual_seed(1)
    xy = torch.rand(40, 2, generator=g, dtype=torch.float64) * 50
    b = torch.cat([xy, xy + torch.rand(40, 2, generator=g, dtype=torch.float64) * 30], 1)
    ref = torch.tensor([[_iou_f64(p, q) for q in b.tolist()] for p in b.tolist()], dtype=torch.float64)
    torch.testing.assert_close(box_iou(b, b), ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(box_iou(b.float(), b.float()).double(), ref, rtol=0, atol=1e-6)
    assert box_iou(torch.zeros(0, 4), b.float()).shape == (0, 40)
    assert box_iou(torch.tensor([[2., 2., 2., 2.]]), torch.tensor([[2., 2., 2., 2.]])).item() == 0.  # no 0/0


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
         dict(iou=.3), dict(iou=.9), dict(max_det=5), dict(max_nms=17), dict(conf=.55, iou=.5)]


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


def test_nms_sorted_and_limits():
    bx, sc = _preds(3, B=3, A=300, K=5, q=0)
    out = nms(bx, sc, conf=.01, iou=.6, max_det=20)
    for b, d in enumerate(out):
        assert len(d['scores']) == 20 and (d['scores'][:-1] >= d['scores'][1:]).all()
        assert d['anchors'].dtype == d['classes'].dtype == torch.long
        assert_bytes_equal(d['boxes'], bx[b][d['anchors']], 'boxes')
        assert_bytes_equal(d['scores'], sc[b][d['anchors'], d['classes']], 'scores')


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
def test_rectangle_round_trip_exact_edges():
    H, W, S = 128, 96, 64
    lb = (S / H, (S - W * S / H) / 2, 0.)                      # (0.5, 8, 0)
    lbox = torch.tensor([[16., 16., 36., 48.]])                # original (16,32,56,96): 40 x 64
    proto = torch.full((1, S // 4, S // 4), -20.)
    proto[0, 4:12, 4:9] = 20.
    rle = masks_to_rle(torch.ones(1, 1), proto, lbox, lb, (H, W))
    assert rle[0]['size'] == [H, W] and isinstance(rle[0]['counts'], str)
    assert mask_utils.toBbox(rle).tolist() == [[16., 32., 40., 64.]]
    assert mask_utils.area(rle).tolist() == [40 * 64 - 4 * 6]  # bilinear rounds 6 px off each corner
    torch.testing.assert_close(unletterbox_boxes(lbox, lb, (H, W)), torch.tensor([[16., 32., 56., 96.]]))


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
    tol = MASK_STRIDE / 2 / s + 1  # the crop on the prototype grid may move an edge by up to half a cell
    got = torch.tensor(mask_utils.toBbox(rle)[0], dtype=torch.float32)
    assert ((got - torch.cat([box[0, :2], box[0, 2:] - box[0, :2]])).abs() <= tol).all()


def test_unletterbox_masks_matches_grid_sample():
    g = torch.Generator().manual_seed(0)
    m = torch.rand(2, 24, 24, generator=g)
    lb, (H, W) = (0.81, 5.5, 17.25), (71, 90)
    gy, gx = torch.meshgrid(((torch.arange(H) + .5) * lb[0] + lb[2]) / 96 * 2 - 1,
                            ((torch.arange(W) + .5) * lb[0] + lb[1]) / 96 * 2 - 1, indexing='ij')
    want = torch.nn.functional.grid_sample(m[:, None], torch.stack([gx, gy], -1)[None].expand(2, -1, -1, -1).float(),
                                           mode='bilinear', padding_mode='border', align_corners=False)[:, 0]
    torch.testing.assert_close(unletterbox_masks(m, torch.tensor(lb), torch.tensor([H, W])), want, rtol=0, atol=1e-5)


def test_rle_encode_matches_pycocotools():
    "Byte-identical to pycocotools' encode: random, empty, full, first-pixel-set, one-pixel and smooth masks."
    g = torch.Generator().manual_seed(0)
    yy, xx = torch.meshgrid(torch.arange(17.), torch.arange(23.), indexing='ij')
    one = torch.zeros(17, 23, dtype=torch.bool); one[5, 7] = True
    corner = torch.zeros(17, 23, dtype=torch.bool); corner[0, 0] = True
    m = torch.cat([torch.rand(3, 17, 23, generator=g) > .5, torch.zeros(1, 17, 23, dtype=torch.bool),
                   torch.ones(1, 17, 23, dtype=torch.bool), one[None], corner[None],
                   (((xx - 11) / 8) ** 2 + ((yy - 8) / 5) ** 2 <= 1)[None]])
    rles = rle_encode(m)
    assert len(rles) == len(m)
    for r, mi in zip(rles, m.numpy().astype(np.uint8)):
        want = mask_utils.encode(np.asfortranarray(mi))
        assert r == dict(size=want['size'], counts=want['counts'].decode()) and mask_utils.area(r) == mi.sum()
    assert rle_encode(torch.zeros(0, 5, 5, dtype=torch.bool)) == []


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
    before = json.dumps(coco.dataset, sort_keys=True)
    v = Validator(cat_ids=CATS)
    v.update(*_gt_head_output(rects))
    assert len(v.results) == 4 and v.image_ids == [1, 2]
    st = v.compute(coco)
    assert st['mAP50-95(B)'] == pytest.approx(1.) and st['mAP50-95(M)'] == pytest.approx(1.)
    assert set(st) == {f'{t}/{n}' for t in ('bbox', 'segm') for n in STAT_NAMES} | {'mAP50-95(B)', 'mAP50(B)', 'mAP50-95(M)', 'mAP50(M)'}
    assert 'Average Precision' in st.log and 'segm' in st.log
    assert json.dumps(coco.dataset, sort_keys=True) == before  # COCOeval did not rewrite our ground truth
    v.reset()
    assert v.results == [] and v.image_ids == []


def test_validator_worse_predictions_score_lower():
    coco, rects = _gt()
    v = Validator(cat_ids=CATS)
    v.update(*_gt_head_output(rects, shift=6.))
    st = v.compute(coco)
    assert st['mAP50-95(B)'] < .6 and st['mAP50-95(M)'] < .6


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
    st = coco_evaluate(coco, [], [1, 2])
    assert all(v == 0. for v in st.values()) and len(st) == 28 and 'no detections' in st.log
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
