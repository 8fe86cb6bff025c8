"""How many operator calls and host looks does one validation's post-processing make, by part? 17,470 calls at groups of 2^27 on a young model (20,918 at 2^25) (results/validation_ops_cpu_young_g27_6f8bdfc.json), at 6f8bdfc.

Where one validation's post-processing spends its operator calls: a diagnostic (device-independent counts).

Feeds the `young_head` outputs of `validation_speed.py` (a young model's head: 9,600 detections kept, most candidates
suppressed) for the 32 embedded validation images, batch by batch as the trainer's validation does (`YoloData`
defaults: batches of 8), to a `Validator`, and counts the ATen operator calls (on a GPU each is a kernel launch or at
least a dispatch) by the metrics function they come from (`nms`, `mask_runs`, `rle_strings`, `coco_results`, the box
helpers; the rest is `Validator.update` itself), and the host looks (`validation_speed.Counts`).

    python benchmarks/experiments/validation_ops.py [--out benchmarks/results]
    python benchmarks/experiments/validation_ops.py --checkpoint CKPT [--gpu-nms] [--tag _young_cpu]

`--checkpoint`: the head outputs of a real model instead (its EMA weights on the same batches): a young model's boxes
are large and spread, unlike `young_head`'s near-copies of six, so they load the mask crops and NMS differently. The
one these results name is the reference configuration trained 4 epochs on the CPU:
    lucid fit --config configs/coco128-seg-n.yaml --trainer.accelerator cpu --trainer.precision 32-true \
        --trainer.max_epochs 4 --data.workers 2 --trainer.default_root_dir /tmp/young    # /tmp/young/checkpoints/last.ckpt
`--many-detections`: the outputs of notebook 07's GPU cell instead (a random-init nano model, seed 0, with its
class-logit biases set to 0: every pair scores ~0.5, so NMS keeps 300 detections an image).
`--gpu-nms`: NMS with the chunk and rounds it takes on a GPU (1024, 4) instead of the CPU's (512, 1).
`--baseline REV...`: the same counts for those git revisions' `lucid_nb/` on the same outputs (their results bytes
checked equal), under `baselines`.

Besides operator calls by part, each count holds the calls of each part (`calls_by_part`: `crop_starts` calls are
the mask chunks, `batch_mask_runs` calls the image groups), the host looks made inside each part (nested parts count
in their callers too) and the crops' pixels against the padded pixels of their chunks (`crop_chunks`).

Writes `validation_ops_<device><tag>.json` (counts, env, command) to `--out`.
"""
import argparse, collections, json, sys
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/: validation_speed, common
import validation_speed as vs
import lucid_nb.metrics as M
from lucid_nb.core import device_tag, env_info
from lucid_nb.data import YoloData

PARTS = ('nms', 'greedy_keep', 'batch_mask_runs', 'crop_starts', 'rle_strings', 'coco_results', 'unletterbox_boxes', 'box_spans')


def count(mod, outs, batches, cat_ids, gpu_nms, group_pixels=None) -> dict:
    "One validation's post-processing by `mod` (a `lucid_nb.metrics` module), its functions wrapped while it runs."
    part, per, calls, looks, chunk_px = ['update'], collections.Counter(), collections.Counter(), collections.Counter(), collections.Counter()
    saved = {name: getattr(mod, name) for name in (*PARTS, 'crop_chunks') if hasattr(mod, name)}

    class ByPart(vs.Counts):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            per[part[0]] += 1
            return super().__torch_dispatch__(func, types, args, kwargs)

    def attribute(name, f):   # calls of `name` made through the module (as `Validator` makes them) count as its part
        def counted(*args, **kwargs):
            before, part[0], seen = part[0], name, sum(c.looks.values())
            calls[name] += 1
            try: return f(*args, **kwargs)
            finally: part[0] = before; looks[name] += sum(c.looks.values()) - seen
        setattr(mod, name, counted)

    def chunks(sizes, max_pixels):
        out = saved['crop_chunks'](sizes, max_pixels)
        chunk_px['crop'] += sum(h * w for h, w in sizes)
        chunk_px['padded'] += sum((b - a) * (r + 1) * w for a, b, r, w in out)
        return out

    keep = saved['greedy_keep']
    if gpu_nms: saved['greedy_keep'] = lambda boxes, cls, iou, max_det, chunk=None, rounds=None: keep(boxes, cls, iou, max_det, 1024, 4)
    try:
        for name in PARTS:
            if name in saved: attribute(name, saved[name])
        mod.crop_chunks = chunks
        v = mod.Validator(cat_ids, **({'group_pixels': group_pixels} if group_pixels else {}))
        with ByPart() as c, torch.no_grad():
            for o, b in zip(outs, batches): v.update(o, b)
    finally:
        for name, f in saved.items(): setattr(mod, name, keep if name == 'greedy_keep' else f)
    return dict(detections=len(v.results), results_bytes=mod.results_bytes(v.results), ops=sum(c.ops.values()),
                ops_by_part=dict(per), calls_by_part=dict(calls), host_looks=dict(c.looks), host_looks_by_part=dict(looks),
                crop_pixels=chunk_px['crop'], padded_chunk_pixels=chunk_px['padded'], top_ops=c.ops.most_common(15))


def main():
    p = argparse.ArgumentParser(); p.add_argument('--out', default='benchmarks/results')
    p.add_argument('--checkpoint', help="a lucid checkpoint: its EMA network's outputs instead of young_head's")
    p.add_argument('--many-detections', action='store_true', help="notebook 07's random-init model with class biases 0")
    p.add_argument('--gpu-nms', action='store_true', help="NMS chunks and rounds as on a GPU (1024, 4)")
    p.add_argument('--group-pixels', type=int, help="the Validator's group size (default: its own, 2**25; the trainer's with expandable segments: 2**27)")
    p.add_argument('--baseline', nargs='*', default=[], help='git revisions counted on the same outputs')
    p.add_argument('--tag', default='', help='added to the result file name'); a = p.parse_args()
    dm = YoloData(prefetch=False); dm.setup('fit')
    batches = list(dm.val_dataloader())
    if a.checkpoint or a.many_detections:
        net = vs.eval_net(a.checkpoint, len(dm.cat_ids))
        with torch.no_grad(): outs = [net(dm.on_after_batch_transfer(b)['img']) for b in batches]
    else: outs = vs.young_head(batches)
    res = count(M, outs, batches, dm.cat_ids, a.gpu_nms, a.group_pixels)
    source = a.checkpoint or ('many_detections' if a.many_detections else 'young_head')
    res = dict(what=f"ATen operator calls of one validation's post-processing ({source} outputs, 32 images), by part "
                    f"(a function's calls inside another count as its own part){'; NMS as on a GPU' if a.gpu_nms else ''}",
               group_pixels=a.group_pixels, batches=len(batches), images=sum(len(b['img']) for b in batches), **res)
    body = res.pop('results_bytes')
    res['baselines'] = {}
    for rev in a.baseline:
        r = count(vs.load_baseline(rev, f'lucid_nb_ops_{rev}'), outs, batches, dm.cat_ids, a.gpu_nms, a.group_pixels)
        if r.pop('results_bytes') != body: raise SystemExit(f'--baseline {rev}: other results bytes')
        res['baselines'][rev] = r
    res.update(command=' '.join([sys.executable, *sys.argv]), date=datetime.now(timezone.utc).isoformat(timespec='seconds'), env=env_info())
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    path = out / f'validation_ops_{device_tag()}{a.tag}.json'
    path.write_text(json.dumps(res, indent=1))
    for name, r in [('this checkout', res), *res['baselines'].items()]:
        print(f"{name}: {r['ops']} ops, {r['calls_by_part'].get('crop_starts', 0)} chunks, {r['calls_by_part'].get('batch_mask_runs', 0)} groups, "
              f"looks {r['host_looks']}; padded {r['padded_chunk_pixels'] / max(r['crop_pixels'], 1):.2f}x crop pixels; {r['ops_by_part']}")
    print('->', path)


if __name__ == '__main__':
    main()
