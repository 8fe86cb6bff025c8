"""The helpers that the loss and the metrics used to keep apart, now one each (`00b_core`, `03_heads`), give the
bytes the old ones gave: forward values and, for the loss's CIoU, gradients. The old code is copied here verbatim
as the reference."""
import math
import torch
from lucid_nb.core import bbox_iou, box_iou
from lucid_nb.core import test_bytes_equal as same_bytes
from lucid_nb.heads import decode_boxes, dist2bbox, make_anchors, flatten_levels, SegHead


def old_loss_bbox_iou(b1, b2, ciou=False, eps=1e-7):
    (x1, y1, x2, y2), (u1, v1, u2, v2) = b1.unbind(-1), b2.unbind(-1)
    w1, h1, w2, h2 = x2 - x1, y2 - y1 + eps, u2 - u1, v2 - v1 + eps
    inter = (torch.minimum(x2, u2) - torch.maximum(x1, u1)).clamp(0) * (torch.minimum(y2, v2) - torch.maximum(y1, v1)).clamp(0)
    iou = inter / (w1 * h1 + w2 * h2 - inter + eps)
    if not ciou: return iou
    cw, ch = torch.maximum(x2, u2) - torch.minimum(x1, u1), torch.maximum(y2, v2) - torch.minimum(y1, v1)
    c2 = cw**2 + ch**2 + eps
    rho2 = ((u1 + u2 - x1 - x2)**2 + (v1 + v2 - y1 - y2)**2) / 4
    v = (4 / math.pi**2) * (torch.atan(w2 / h2) - torch.atan(w1 / h1))**2
    with torch.no_grad(): a = v / (v - iou + (1 + eps))
    return iou - (rho2 / c2 + v * a)


def old_metrics_box_iou(a, b):
    area = lambda t: (t[..., 2] - t[..., 0]).clamp(min=0) * (t[..., 3] - t[..., 1]).clamp(min=0)
    lt = torch.maximum(a[:, None, :2], b[None, :, :2])
    rb = torch.minimum(a[:, None, 2:], b[None, :, 2:])
    wh = (rb - lt).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]
    union = area(a)[:, None] + area(b)[None] - inter
    return inter / union.clamp(min=torch.finfo(union.dtype).tiny)


def boxes(n, g, S=64.):
    xy = torch.rand(n, 2, generator=g) * S
    b = torch.cat([xy, xy + torch.rand(n, 2, generator=g) * S / 2], -1)
    b[:3] = 0.                                   # padding slots: all-zero boxes
    b[3, 2:] = b[3, :2]                          # a point
    b[4] = b[5]                                  # identical pair with its neighbour
    return b


def test_loss_iou_and_ciou_same_bytes_and_gradients():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        p, t = boxes(300, g).to(dtype), boxes(300, g).to(dtype)
        for ciou in (False, True):
            # the assigner's broadcast (B,M,1,4) x (B,1,A,4) and the box loss's elementwise call
            same_bytes(bbox_iou(t[None, :40, None], p[None, None], ciou=ciou), old_loss_bbox_iou(t[None, :40, None], p[None, None], ciou=ciou))
            p1, p2 = p.clone().requires_grad_(), p.clone().requires_grad_()
            new, old = bbox_iou(p1, t, ciou=ciou), old_loss_bbox_iou(p2, t, ciou=ciou)
            same_bytes(new, old, f'ciou={ciou}')
            (1 - new).sum().backward(); (1 - old).sum().backward()
            same_bytes(p1.grad, p2.grad, f'grad ciou={ciou}')


def test_metrics_pairwise_iou_same_bytes():
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.float64):
        a, b = boxes(70, g).to(dtype), boxes(50, g).to(dtype)
        b[6] = b[6, [2, 3, 0, 1]]                # an inverted box: area 0
        same_bytes(box_iou(a, b), old_metrics_box_iou(a, b))
        same_bytes(box_iou(a[:0], b), old_metrics_box_iou(a[:0], b))


def test_loss_box_decode_same_bytes_as_before():
    "The loss's former decode (softmax · bins on the (B,A,4,R) view) equals the head's `decode_boxes`."
    torch.manual_seed(0)
    R, shapes = 16, [(8, 8), (4, 4), (2, 2)]
    levels = [torch.randn(2, 4 * R, h, w, requires_grad=True) for h, w in shapes]
    anchors, _ = make_anchors(shapes, (8, 16, 32))
    box = torch.cat([x.flatten(2) for x in levels], 2).transpose(1, 2).float()
    pdist = box.view(*box.shape[:2], 4, R)
    bins = torch.arange(R, dtype=pdist.dtype)
    old = dist2bbox((pdist.softmax(-1) * bins).sum(-1), anchors)
    new = decode_boxes(flatten_levels(levels).float().view(*box.shape[:2], 4, R).flatten(-2), anchors, R)
    same_bytes(new, old)
    g_old = torch.autograd.grad(old.square().sum(), levels)
    g_new = torch.autograd.grad(new.square().sum(), levels)
    for a, b in zip(g_new, g_old): same_bytes(a, b)


def test_head_eval_decode_same_bytes_as_before():
    "The head's eval boxes: `decode_boxes` equals the former `dist2bbox(DFL(box), anchors) * strides`."
    torch.manual_seed(0)
    head = SegHead((16, 32, 64), num_classes=3, proto_channels=16).train()
    out = head([torch.randn(1, c, s, s) for c, s in ((16, 8), (32, 4), (64, 2))])
    box = flatten_levels(out['box'])
    anchors, strides = make_anchors([t.shape[-2:] for t in out['box']], head.strides)
    p = box.float().unflatten(-1, (4, head.reg_max)).softmax(-1)
    old = dist2bbox((p * torch.arange(head.reg_max, dtype=p.dtype)).sum(-1), anchors) * strides
    same_bytes(head.decode(out)['boxes'], old)
