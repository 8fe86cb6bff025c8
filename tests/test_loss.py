"""Fast checks of `lucid_nb.loss` that stand on their own (the notebook `04_loss` holds the lessons and references)."""
import contextlib, io

import numpy as np
import pytest
import torch
from PIL import Image

from lucid_nb.core import EMBEDDED_ANNOTATIONS, EMBEDDED_IMAGES, digest, synth_batch
from lucid_nb.loss import HostSyncError, SegLoss, assert_no_host_sync, assign, synth_head_out


def real_batch(n=2, S=128):
    "The first `n` embedded images with instances, letterboxed to `S` (scaled, padded right/bottom), as a padded batch."
    from pycocotools.coco import COCO
    with contextlib.redirect_stdout(io.StringIO()): coco = COCO(str(EMBEDDED_ANNOTATIONS))
    cat = {c: i for i, c in enumerate(sorted(coco.getCatIds()))}
    ids = [i for i in sorted(coco.getImgIds()) if coco.getAnnIds(imgIds=i, iscrowd=False)][:n]
    imgs, rows = [], []
    for i in ids:
        info = coco.loadImgs(i)[0]; H, W = info['height'], info['width']; r = S / max(H, W)
        h, w = round(H * r), round(W * r)
        img = np.full((S, S, 3), 114, np.uint8)
        img[:h, :w] = np.asarray(Image.open(EMBEDDED_IMAGES / info['file_name']).convert('RGB').resize((w, h)))
        anns = [a for a in coco.loadAnns(coco.getAnnIds(imgIds=i, iscrowd=False)) if min(a['bbox'][2:]) * r >= 1]
        m = np.zeros((len(anns), S // 4, S // 4), np.uint8)
        for j, a in enumerate(anns):
            small = Image.fromarray(coco.annToMask(a) * 255).resize((round(w / 4), round(h / 4)), Image.BILINEAR)
            m[j, :small.height, :small.width] = np.asarray(small) > 127
        rows.append(([[x * r, y * r, (x + bw) * r, (y + bh) * r] for x, y, bw, bh in (a['bbox'] for a in anns)],
                     [cat[a['category_id']] for a in anns], m))
        imgs.append(torch.from_numpy(img).permute(2, 0, 1))
    B, M = len(ids), max(len(r[1]) for r in rows)
    boxes, cls, valid = torch.zeros(B, M, 4), torch.zeros(B, M, dtype=torch.long), torch.zeros(B, M, dtype=torch.bool)
    masks = torch.zeros(B, M, S // 4, S // 4, dtype=torch.uint8)
    for b, (bx, c, m) in enumerate(rows):
        k = len(c); boxes[b, :k], cls[b, :k], valid[b, :k], masks[b, :k] = torch.tensor(bx), torch.tensor(c), True, torch.from_numpy(m)
    return dict(img=torch.stack(imgs), boxes=boxes, cls=cls, valid=valid, masks=masks)


def test_overfit_real_batch_nano_128px():
    "The nano model fits two real images: the total halves and every term falls (a broken gradient path fails)."
    from lucid_nb.model import yolo_seg
    torch.manual_seed(0)
    batch = real_batch(2, 128)
    model, loss_fn = yolo_seg('n').train(), SegLoss()
    opt, x, hist = torch.optim.Adam(model.parameters(), lr=2e-3), batch['img'].float() / 255, []
    for _ in range(15):
        opt.zero_grad(); losses = loss_fn(model(x), batch); sum(losses.values()).backward(); opt.step()
        hist.append({k: v.item() for k, v in losses.items()})
    first, last = hist[0], hist[-1]
    assert sum(last.values()) < 0.5 * sum(first.values()), (first, last)
    for k in first: assert last[k] < 0.8 * first[k], (k, first[k], last[k])


@pytest.mark.parametrize('empty', [False, True])
def test_no_host_sync_forward_backward(empty):
    out, batch = synth_head_out(B=2, S=64, K=10), synth_batch(B=2, S=64, K=10, empty=empty)
    with assert_no_host_sync():
        losses = SegLoss(num_classes=10)(out, batch)
        sum(losses.values()).backward()
    assert all(torch.isfinite(v) for v in losses.values())


def test_checker_catches_syncs():
    x = torch.randn(4)
    for bad in (lambda: x.sum().item(), lambda: x[x > 0], lambda: torch.unique(x), lambda: x.tolist(),
                lambda: x.nonzero(), lambda: bool(x.sum()), lambda: torch.tensor([1., 2.])):
        with assert_no_host_sync(), pytest.raises(HostSyncError): bad()


def test_batch_without_instances():
    out, batch = synth_head_out(B=3, S=64), synth_batch(B=3, S=64)
    batch['valid'][:] = False
    losses = SegLoss()(out, batch)
    assert [losses[k].item() for k in ('box', 'dfl', 'seg')] == [0., 0., 0.]
    assert torch.isfinite(losses['cls']) and losses['cls'] > 0
    sum(losses.values()).backward()
    assert out['proto'].grad is not None and torch.isfinite(out['proto'].grad).all()


def test_padded_slots_never_matter():
    out = synth_head_out(B=2, S=64, requires_grad=False)
    b1 = synth_batch(B=2, S=64, seed=4, empty=True)
    b2 = {k: v.clone() for k, v in b1.items()}
    pad = ~b2['valid']
    b2['boxes'][pad] = float('nan'); b2['cls'][pad] = 3; b2['masks'][pad] = 1
    assert digest(SegLoss()(out, b1)) == digest(SegLoss()(out, b2))


def test_gains_and_bf16():
    out, batch = synth_head_out(B=2, S=64, seed=1), synth_batch(B=2, S=64, seed=1)
    base = SegLoss()(out, batch)
    doubled = SegLoss(box=15., cls=1., dfl=3., seg=15.)(out, batch)
    for k in base: torch.testing.assert_close(doubled[k], 2 * base[k])
    with torch.autocast('cpu', dtype=torch.bfloat16):
        half = SegLoss()({k: [t.bfloat16() for t in v] if isinstance(v, list) else v.bfloat16() for k, v in out.items()}, batch)
    assert all(torch.isfinite(v) and v.dtype == torch.float32 for v in half.values())


def test_each_anchor_has_at_most_one_gt():
    g = torch.Generator().manual_seed(0)
    B, A, K, M = 2, 300, 4, 12
    anchors = torch.rand(A, 2, generator=g) * 100
    c = torch.rand(B, A, 2, generator=g) * 100
    pd_boxes = torch.cat([c - 10, c + 10], -1)
    xy = torch.rand(B, M, 2, generator=g) * 60
    gt = torch.cat([xy, xy + 40], -1)
    a = assign(torch.rand(B, A, K, generator=g), pd_boxes, anchors, torch.randint(0, K, (B, M), generator=g), gt,
               torch.ones(B, M, dtype=torch.bool))
    assert (a.mask_pos.sum(1) <= 1).all() and torch.equal(a.mask_pos.any(1), a.fg)
    assert (a.target_scores[~a.fg] == 0).all() and (a.target_scores.sum(-1) <= 1 + 1e-6).all()
