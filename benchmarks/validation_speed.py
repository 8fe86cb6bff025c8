"""How long one validation of the 32 embedded validation images takes: forward, post-processing, evaluation.

Usage (from the repository root):
    .venv/bin/python benchmarks/validation_speed.py [--device cuda] [--runs 5] [--warmup 1] [--out benchmarks/results]

Data: `YoloData()` with its defaults (imgsz 640, batch 4, the last 32 images of the embedded coco128 by file name),
batches loaded onto the device once, before any timing. Model: the nano `yolo_seg('n')`, random init, in eval mode.
Three cases; for each, the forward pass over all batches runs once (`--forward-runs` times, timed), and the
post-processing and the evaluation of those outputs are warmed up, then timed `--runs` times (median, min, max):

- `random_init`: the model as built, the trainer's `Validator(cat_ids, conf=0.001, iou=0.7, max_det=300)`. YOLO's
  class prior (`bias_init`, p ≈ 1e-5) puts nearly every score under `conf`: few detections.
- `many_detections`: the same model with its class-logit biases set to 0, so that every (anchor, class) pair scores
  ≈ 0.5, and the same Validator: NMS keeps `max_det` = 300 per image (9,600 in all), as a young model does at
  conf 0.001.
- `young_head`: head outputs drawn from a seeded generator, shaped like the nano head's at 640 px (8400 anchors,
  80 classes, 32 prototypes of 160 × 160), with every pair above conf 0.001 and the boxes near-copies of a few
  objects on 4 classes, as a model a few epochs old gives: most candidates are suppressed, so NMS goes through many
  chunks before it has 300 per image (the case that made in-run validation slow and variable).

Per run: `forward` (the model on all batches), `postprocess` (`Validator.update` on all batches: NMS, masks, RLE, COCO
results; `nms` is NMS alone on the same outputs, part of it), `evaluate` (`Validator.compute`, both COCOeval runs).
GPU work is timed between `torch.cuda.synchronize()` calls. Device-independent counts of one post-processing:
`ops` (ATen operator calls, views included: on a GPU each is a kernel launch or at least a dispatch) and
`host_looks` (counted as on a GPU: on a CPU run `greedy_keep` is given the GPU's 4 rounds per look; calls that wait for the device: `nonzero`, `equal`, `item`, `tolist` and copies to the host; on a CPU
run every tensor is a host tensor, so `tolist` calls are all counted as `tolist_host`, bookkeeping included). The
JSON goes to `<out>/validation_speed_<device>.json`, named after the device found at run time, with torch version,
date and this exact command; `--tag` adds a suffix (e.g. `_before`).

`--baseline REV` (a git revision of this repository, e.g. `7a13c73`, the post-processing before the batched NMS)
also loads that revision's `lucid_nb/` (from `git archive`, as the package `lucid_nb_baseline`) and, in every run,
post-processes the same outputs with it right after the current code — alternating, so that both see the same
machine load — and checks that both give the same results bytes. Its times are under `baseline_*` in each case.
"""
import argparse, collections, contextlib, importlib, io, json, os, re, shlex, statistics, subprocess, sys, tarfile, tempfile, time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


def young_head(batches, seed=0, K=80, P=32, objects=6, jitter=.03) -> list[dict]:
    "Head outputs like a young model's (see the module docstring), one dict per batch, on the batches' device."
    g, out = torch.Generator().manual_seed(seed), []
    for b in batches:
        B, S = b['img'].shape[0], b['img'].shape[-1]
        A = sum((S // s) ** 2 for s in (8, 16, 32))
        obj = torch.rand(B, objects, 4, generator=g) * torch.tensor([.7 * S, .7 * S, .3 * S, .3 * S]) + 8
        o = torch.gather(obj, 1, torch.randint(0, objects, (B, A, 1), generator=g).expand(-1, -1, 4))
        xy = o[..., :2] + torch.randn(B, A, 2, generator=g) * o[..., 2:] * jitter
        wh = o[..., 2:] * (1 + torch.randn(B, A, 2, generator=g) * jitter)
        sc = torch.rand(B, A, K, generator=g) * .01 + .0011
        cls = torch.tensor([0, 2, 56, 60])[torch.randint(0, 4, (B, A, 1), generator=g)]
        sc.scatter_(2, cls, torch.rand(B, A, 1, generator=g) * .5 + .1)
        h = dict(boxes=torch.cat([xy, xy + wh], -1), scores=sc, coef=torch.randn(B, A, P, generator=g),
                 proto=torch.randn(B, P, S // 4, S // 4, generator=g) * 2)
        out.append({k: v.to(b['img'].device) for k, v in h.items()})
    return out


class Counts(TorchDispatchMode):
    "ATen operator calls and host looks (`tolist` and `item` do not pass the dispatcher: counted by a wrapper)."
    LOOKS = ('nonzero', 'equal', '_local_scalar_dense', 'is_nonzero')
    def __enter__(self):
        self.ops, self.looks = collections.Counter(), collections.Counter()
        self._tolist = torch.Tensor.tolist
        def tolist(t, _f=self._tolist): self.looks['tolist' if t.device.type != 'cpu' else 'tolist_host'] += 1; return _f(t)
        torch.Tensor.tolist = tolist
        return super().__enter__()
    def __exit__(self, *a):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*a)
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if name in self.LOOKS: self.looks[name] += 1
        if name == '_to_copy' and (kwargs or {}).get('device') == torch.device('cpu') and args[0].device.type != 'cpu':
            self.looks['to_host'] += 1
        return func(*args, **(kwargs or {}))


def load_baseline(rev: str):
    "The `lucid_nb.metrics` module of git revision `rev`, imported as `lucid_nb_baseline.metrics`."
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run(['git', 'archive', rev, 'lucid_nb'], cwd=root, capture_output=True)
    if r.returncode: raise SystemExit(f"--baseline {rev}: git archive failed: {r.stderr.decode().strip()}")
    tar = r.stdout
    d = Path(tempfile.mkdtemp(prefix='lucid_nb_baseline_'))
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        for m in t.getmembers():
            if m.name.endswith('.py'): m.name = m.name.replace('lucid_nb/', 'lucid_nb_baseline/', 1); t.extract(m, d)
    sys.path.insert(0, str(d))
    return importlib.import_module('lucid_nb_baseline.metrics')


@contextlib.contextmanager
def gpu_rounds(device):
    "On the CPU, count the path a GPU takes: `greedy_keep` with its GPU default of 4 rounds per look (CPU default: 1)."
    from lucid_nb import metrics
    keep = metrics.greedy_keep
    if device.type == 'cpu': metrics.greedy_keep = lambda *a, **kw: keep(*a[:5], rounds=4)
    try: yield
    finally: metrics.greedy_keep = keep


def postprocess(outs, batches, cat_ids, validator=Validator) -> Validator:
    v = validator(cat_ids, conf=0.001, iou=0.7, max_det=300)
    for o, b in zip(outs, batches): v.update(o, b)
    return v


def one_run(outs, batches, coco, cat_ids, device, base=None) -> dict:
    "Times of one post-processing and evaluation of `outs`, in seconds, and its detections (and the baseline's)."
    sync(device); t1 = time.perf_counter()
    v = postprocess(outs, batches, cat_ids)
    sync(device); t2 = time.perf_counter()
    stats = v.compute(coco)
    t3 = time.perf_counter()
    for o in outs: nms(o['boxes'].float(), o['scores'].float(), **v.nms_kw)
    sync(device); t4 = time.perf_counter()
    r = dict(postprocess=t2 - t1, nms=t4 - t3, evaluate=t3 - t2, detections=len(v.results), summary=stats.summary())
    if base is not None:
        sync(device); t5 = time.perf_counter()
        b = postprocess(outs, batches, cat_ids, base.Validator)
        sync(device); t6 = time.perf_counter()
        for o in outs: base.nms(o['boxes'].float(), o['scores'].float(), **v.nms_kw)
        sync(device); t7 = time.perf_counter()
        if base.results_bytes(b.results) != base.results_bytes(v.results): raise SystemExit('the baseline gives other results bytes')
        r.update(baseline_postprocess=t6 - t5, baseline_nms=t7 - t6)
    return r


def measure(model, batches, coco, cat_ids, device, runs, warmup, forward_runs, outs=None, base=None) -> dict:
    fw = []
    for _ in range(forward_runs if outs is None else 0):
        sync(device); t0 = time.perf_counter()
        with torch.no_grad(): outs = [model(b['img']) for b in batches]
        sync(device); fw.append(time.perf_counter() - t0)
    for _ in range(warmup): one_run(outs, batches, coco, cat_ids, device, base)
    rs = [one_run(outs, batches, coco, cat_ids, device, base) for _ in range(runs)]
    with Counts() as c, gpu_rounds(device): postprocess(outs, batches, cat_ids)
    keys = ('postprocess', 'nms', 'evaluate') + (('baseline_postprocess', 'baseline_nms') if base is not None else ())
    extra = {}
    if base is not None:
        with Counts() as cb: postprocess(outs, batches, cat_ids, base.Validator)
        extra = dict(baseline_postprocess_ops=sum(cb.ops.values()), baseline_postprocess_host_looks=dict(cb.looks))
    med = {k: statistics.median(r[k] for r in rs) for k in keys}
    if fw: med['forward'] = statistics.median(fw)
    med['total'] = sum(med.get(k, 0.) for k in ('forward', 'postprocess', 'evaluate'))
    return dict(median_s=med, min_s={k: min(r[k] for r in rs) for k in keys}, max_s={k: max(r[k] for r in rs) for k in keys},
                forward_s=fw, postprocess_runs_s=[r['postprocess'] for r in rs],
                postprocess_ops=sum(c.ops.values()), postprocess_host_looks=dict(c.looks),
                **extra, detections=rs[-1]['detections'], summary=rs[-1]['summary'], runs=runs, warmup=warmup)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    p.add_argument('--runs', type=int, default=5)
    p.add_argument('--warmup', type=int, default=1)
    p.add_argument('--forward-runs', type=int, default=2)
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--cases', default='random_init,many_detections,young_head')
    p.add_argument('--tag', default='')
    p.add_argument('--batches', type=int, default=None, help='only the first N validation batches (quick CPU runs)')
    p.add_argument('--baseline', default=None, help='a git revision whose post-processing runs alternately with this one')
    p.add_argument('--out', default='benchmarks/results')
    a = p.parse_args(argv)
    device = torch.device(a.device)
    batches, dm = val_batches(device)
    batches = batches[:a.batches]
    coco, cat_ids = dm.val_coco(), dm.cat_ids
    torch.manual_seed(a.seed)
    model = yolo_seg('n', num_classes=len(cat_ids)).to(device).eval()
    res = dict(what='one validation of the 32 embedded validation images (YoloData defaults), nano model, '
                    'Validator(conf=0.001, iou=0.7, max_det=300); median of runs after warm-up',
               command=shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None else shlex.join(['validation_speed.py', *argv]),
               device=device_slug(device), device_name=env_info()['device'], images=sum(len(b['img']) for b in batches), batches=len(batches),
               torch_threads=torch.get_num_threads(), load_average_before=os.getloadavg(), env=env_info(),
               baseline=a.baseline, cases={})
    base = load_baseline(a.baseline) if a.baseline else None
    for case in a.cases.split(','):
        if case == 'many_detections':
            for conv in model.head.cls: conv[-1].bias.data.zero_()   # every pair scores ~0.5: NMS keeps max_det
        outs = young_head(batches, a.seed) if case == 'young_head' else None
        res['cases'][case] = r = measure(model, batches, coco, cat_ids, device, a.runs, a.warmup, a.forward_runs, outs, base)
        print(f"{case}: {r['detections']} detections, {r['postprocess_ops']} ops, host looks {r['postprocess_host_looks']} | "
              + ' | '.join(f"{k} {v * 1e3:.0f} ms" for k, v in r['median_s'].items()), flush=True)
    res['load_average_after'] = os.getloadavg()  # other processes on a small machine skew CPU numbers
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    path = out / f"validation_speed_{res['device']}{a.tag}.json"
    path.write_text(json.dumps(res, indent=1) + '\n')
    print(f"wrote {path}")


if __name__ == '__main__':
    main()
