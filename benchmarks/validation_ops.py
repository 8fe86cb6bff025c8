"""Where one validation's post-processing spends its operator calls: a diagnostic (device-independent counts).

Feeds the `young_head` outputs of `validation_speed.py` (a young model's head: 9,600 detections kept, most candidates
suppressed) for the 32 embedded validation images, batch by batch as the trainer's validation does (`YoloData`
defaults: batches of 8), to a `Validator`, and counts the ATen operator calls (on a GPU each is a kernel launch or at
least a dispatch) by the metrics function they come from (`nms`, `mask_runs`, `rle_strings`, `coco_results`, the box
helpers; the rest is `Validator.update` itself), and the host looks (`validation_speed.Counts`).

    python benchmarks/validation_ops.py [--out benchmarks/results]
    python benchmarks/validation_ops.py --checkpoint CKPT [--gpu-nms] [--tag _young_cpu]

`--checkpoint`: the head outputs of a real model instead (its EMA weights on the same batches): a young model's boxes
are large and spread, unlike `young_head`'s near-copies of six, so they load the mask crops and NMS differently. The
one these results name is the reference configuration trained 4 epochs on the CPU:
    lucid fit --config configs/coco128-seg-n.yaml --trainer.accelerator cpu --trainer.precision 32-true \
        --trainer.max_epochs 4 --data.workers 2 --trainer.default_root_dir /tmp/young    # /tmp/young/checkpoints/last.ckpt
`--gpu-nms`: NMS with the chunk and rounds it takes on a GPU (1024, 4) instead of the CPU's (512, 1).

Writes `validation_ops_<device><tag>.json` (counts, env, command) to `--out`.
"""
import argparse, collections, json, sys
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import validation_speed as vs
import lucid_nb.metrics as M
from lucid_nb.core import device_tag, env_info
from lucid_nb.data import YoloData
from lucid_nb.predict import load

PARTS = ('nms', 'greedy_keep', 'batch_mask_runs', 'crop_starts', 'rle_strings', 'coco_results', 'unletterbox_boxes', 'box_spans')


def main():
    p = argparse.ArgumentParser(); p.add_argument('--out', default='benchmarks/results')
    p.add_argument('--checkpoint', help="a lucid checkpoint: its EMA network's outputs instead of young_head's")
    p.add_argument('--gpu-nms', action='store_true', help="NMS chunks and rounds as on a GPU (1024, 4)")
    p.add_argument('--tag', default='', help='added to the result file name'); a = p.parse_args()
    dm = YoloData(prefetch=False); dm.setup('fit')
    batches = list(dm.val_dataloader())
    if a.checkpoint:
        net = load(a.checkpoint).net.eval()
        with torch.no_grad(): outs = [net(b['img'].float() / 255) for b in batches]
    else: outs = vs.young_head(batches)
    if a.gpu_nms:
        keep = M.greedy_keep
        M.greedy_keep = lambda boxes, cls, iou, max_det, chunk=None, rounds=None: keep(boxes, cls, iou, max_det, 1024, 4)
    part, per = ['update'], collections.Counter()

    class ByPart(vs.Counts):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            per[part[0]] += 1
            return super().__torch_dispatch__(func, types, args, kwargs)

    def attribute(name):   # calls of `name` made through the module (as `Validator` makes them) count as its part
        f = getattr(M, name)
        def counted(*args, **kwargs):
            before, part[0] = part[0], name
            try: return f(*args, **kwargs)
            finally: part[0] = before
        setattr(M, name, counted)
    for name in PARTS: attribute(name)
    v = M.Validator(dm.cat_ids)
    with ByPart() as c, torch.no_grad():
        for o, b in zip(outs, batches): v.update(o, b)
    res = dict(what=f"ATen operator calls of one validation's post-processing ({a.checkpoint or 'young_head'} outputs, 32 images), "
                    f"by part (a function's calls inside another count as its own part){'; NMS as on a GPU' if a.gpu_nms else ''}",
               batches=len(batches), images=sum(len(b['img']) for b in batches), detections=len(v.results),
               ops=sum(c.ops.values()), ops_by_part=dict(per), host_looks=dict(c.looks), top_ops=c.ops.most_common(15),
               command=' '.join([sys.executable, *sys.argv]), date=datetime.now(timezone.utc).isoformat(timespec='seconds'),
               env=env_info())
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    path = out / f'validation_ops_{device_tag()}{a.tag}.json'
    path.write_text(json.dumps(res, indent=1))
    print(f"{res['ops']} ops in {res['batches']} batches: {res['ops_by_part']}; host looks {res['host_looks']}\n-> {path}")


if __name__ == '__main__':
    main()
