"""Where one validation's post-processing spends its operator calls: a diagnostic (device-independent counts).

Feeds the `young_head` outputs of `validation_speed.py` (a young model's head: 9,600 detections kept, most candidates
suppressed) for the 32 embedded validation images, batch by batch as the trainer's validation does (`YoloData`
defaults: batches of 8), to a `Validator`, and counts the ATen operator calls (on a GPU each is a kernel launch or at
least a dispatch) by the metrics function they come from (`nms`, `mask_runs`, `rle_strings`, `coco_results`, the box
helpers; the rest is `Validator.update` itself), and the host looks (`validation_speed.Counts`).

    python benchmarks/validation_ops.py [--out benchmarks/results]

Writes `validation_ops_<device>.json` (counts, env, command) to `--out`.
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

PARTS = ('nms', 'batch_mask_runs', 'rle_strings', 'coco_results', 'unletterbox_boxes', 'box_spans')


def main():
    p = argparse.ArgumentParser(); p.add_argument('--out', default='benchmarks/results'); a = p.parse_args()
    dm = YoloData(prefetch=False); dm.setup('fit')
    batches = list(dm.val_dataloader())
    outs = vs.young_head(batches)
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
    res = dict(what="ATen operator calls of one validation's post-processing (young_head outputs, 32 images), by part",
               batches=len(batches), images=sum(len(b['img']) for b in batches), detections=len(v.results),
               ops=sum(c.ops.values()), ops_by_part=dict(per), host_looks=dict(c.looks), top_ops=c.ops.most_common(15),
               command=' '.join([sys.executable, *sys.argv]), date=datetime.now(timezone.utc).isoformat(timespec='seconds'),
               env=env_info())
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    path = out / f'validation_ops_{device_tag()}.json'
    path.write_text(json.dumps(res, indent=1))
    print(f"{res['ops']} ops in {res['batches']} batches: {res['ops_by_part']}; host looks {res['host_looks']}\n-> {path}")


if __name__ == '__main__':
    main()
