"""How long one validation of the 32 embedded validation images takes: forward, post-processing, evaluation.

Usage (from the repository root):
    .venv/bin/python benchmarks/validation_speed.py [--device cuda] [--runs 5] [--warmup 1] [--out benchmarks/results]

Data: `YoloData()` with its defaults (imgsz 640, batch 4, the last 32 images of the embedded coco128 by file name),
batches loaded onto the device once, before any timing. Model: the nano `yolo_seg('n')`, random init, in eval mode.
Two cases, each warmed up, then timed `--runs` times (median, min and max reported):

- `random_init`: the model as built, the trainer's `Validator(cat_ids, conf=0.001, iou=0.7, max_det=300)`. YOLO's
  class prior (`bias_init`, p ≈ 1e-5) puts nearly every score under `conf`: few detections.
- `many_detections`: the same model with its class-logit biases set to 0, so that every (anchor, class) pair scores
  ≈ 0.5, and the same Validator: NMS keeps `max_det` = 300 per image (9,600 in all), as a young model does at
  conf 0.001 — the case that made validation slow.

Per run: `forward` (the model on all batches), `postprocess` (`Validator.update` on all batches: NMS, masks, RLE, COCO
results; `nms` is NMS alone on the same outputs, part of it), `evaluate` (`Validator.compute`, both COCOeval runs).
GPU work is timed between `torch.cuda.synchronize()` calls. The JSON goes to `<out>/validation_speed_<device>.json`,
named after the device found at run time, with torch version, date and this exact command.
"""
import argparse, json, os, shlex, statistics, sys, time
from pathlib import Path

import torch

from lucid_nb.core import device_tag, env_info
from lucid_nb.data import YoloData
from lucid_nb.metrics import Validator, nms
from lucid_nb.heads import yolo_seg


def device_slug(device: torch.device) -> str:
    "`nvidia-h200`, `cpu`...: the device's name as a file-name part."
    return device_tag() if device.type == 'cuda' else 'cpu'


def sync(device):
    if device.type == 'cuda': torch.cuda.synchronize(device)


def val_batches(device) -> tuple[list, YoloData]:
    "The validation batches of `YoloData()`, on `device`, as `validation_step` gets them."
    dm = YoloData(prefetch=False)
    dm.setup('fit')
    out = []
    for b in dm.val_dataloader():
        b = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in b.items()}
        out.append(dm.on_after_batch_transfer(b))
    return out, dm


def one_run(model, batches, coco, cat_ids, device) -> dict:
    "Times of one validation, in seconds, and its detections."
    sync(device); t0 = time.perf_counter()
    with torch.no_grad(): outs = [model(b['img']) for b in batches]
    sync(device); t1 = time.perf_counter()
    v = Validator(cat_ids, conf=0.001, iou=0.7, max_det=300)
    for o, b in zip(outs, batches): v.update(o, b)
    sync(device); t2 = time.perf_counter()
    stats = v.compute(coco)
    t3 = time.perf_counter()
    for o in outs: nms(o['boxes'].float(), o['scores'].float(), **v.nms_kw)
    sync(device); t4 = time.perf_counter()
    return dict(forward=t1 - t0, postprocess=t2 - t1, nms=t4 - t3, evaluate=t3 - t2, total=t3 - t0,
                detections=len(v.results), summary=stats.summary())


def measure(model, batches, coco, cat_ids, device, runs, warmup) -> dict:
    for _ in range(warmup): one_run(model, batches, coco, cat_ids, device)
    rs = [one_run(model, batches, coco, cat_ids, device) for _ in range(runs)]
    keys = ('forward', 'postprocess', 'nms', 'evaluate', 'total')
    med = {k: statistics.median(r[k] for r in rs) for k in keys}
    return dict(median_s=med, min_s={k: min(r[k] for r in rs) for k in keys}, max_s={k: max(r[k] for r in rs) for k in keys},
                detections=rs[-1]['detections'], summary=rs[-1]['summary'], runs=runs, warmup=warmup)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    p.add_argument('--runs', type=int, default=5)
    p.add_argument('--warmup', type=int, default=1)
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--cases', default='random_init,many_detections')
    p.add_argument('--out', default='benchmarks/results')
    a = p.parse_args(argv)
    device = torch.device(a.device)
    batches, dm = val_batches(device)
    coco, cat_ids = dm.val_coco(), dm.cat_ids
    torch.manual_seed(a.seed)
    model = yolo_seg('n', num_classes=len(cat_ids)).to(device).eval()
    res = dict(what='one validation of the 32 embedded validation images (YoloData defaults), nano model, '
                    'Validator(conf=0.001, iou=0.7, max_det=300); median of runs after warm-up',
               command=shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None else shlex.join(['validation_speed.py', *argv]),
               device=device_slug(device), device_name=env_info()['device'], images=sum(len(b['img']) for b in batches), batches=len(batches),
               torch_threads=torch.get_num_threads(), load_average_before=os.getloadavg(), env=env_info(), cases={})
    for case in a.cases.split(','):
        if case == 'many_detections':
            for conv in model.head.cls: conv[-1].bias.data.zero_()   # every pair scores ~0.5: NMS keeps max_det
        res['cases'][case] = r = measure(model, batches, coco, cat_ids, device, a.runs, a.warmup)
        print(f"{case}: {r['detections']} detections | " + ' | '.join(f"{k} {v * 1e3:.0f} ms" for k, v in r['median_s'].items()))
    res['load_average_after'] = os.getloadavg()  # other processes on a small machine skew CPU numbers
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    path = out / f"validation_speed_{res['device']}.json"
    path.write_text(json.dumps(res, indent=1) + '\n')
    print(f"wrote {path}")


if __name__ == '__main__':
    main()
