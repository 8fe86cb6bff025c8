"""How long one validation of the 32 embedded validation images takes in the trainer: forward, post-processing, evaluation.

Usage (from the repository root):
    .venv/bin/python benchmarks/validation_speed.py [--device cuda] [--precision 32-true] [--runs 5] [--warmup 1] [--out benchmarks/results]

Data: `YoloData(prefetch=False)`, otherwise its defaults (imgsz 640, batch 4, RAM cache, the last 32 images of the
embedded coco128 by file name), set up (decoded and cached) before any timing. Model: `LitYolo(num_classes=...)`,
nano, random init (`--seed`); validation runs its EMA copy, as in training. Cases:

- `random_init` (trainer): the module as built, its `Validator` (conf 0.001, iou 0.7, max_det 300, the `LitYolo`
  defaults). YOLO's class prior (`bias_init`, p ~ 1e-5) puts nearly every score under `conf`: few detections.
- `many_detections` (trainer): the same module with the class-logit biases of its EMA network set to 0, so that
  every (anchor, class) pair scores ~0.5: NMS keeps `max_det` = 300 per image (9,600 in all), as a young model does
  at conf 0.001.
- `young_head` (direct `Validator`, not the trainer): head outputs drawn from a seeded generator, shaped like the
  nano head's at 640 px (8400 anchors, 80 classes, 32 prototypes of 160 x 160), with every pair above conf 0.001
  and the boxes near-copies of a few objects on 4 classes, as a model a few epochs old gives: most candidates are
  suppressed, so NMS goes through many chunks before it has 300 per image (the case that made in-run validation
  slow and variable). These outputs replace the network's, which the trainer's `validation_step` cannot be given,
  so this case feeds them to the module's own `make_validator()` on the batches the trainer's validation loop
  received, one `update` per batch between device synchronisations as `validation_step` does, then `compute`. It
  has no forward and no `validate_wall`.
- `young_model` (trainer): a real young model, the YOLO11n-seg that Ultralytics trained for the parity fixture
  (`--young_weights`, tests/fixtures/yolo11n-seg-coco128.pt: box mAP50-95 ~0.15 on these images), loaded into
  `LitYolo(weights=...)` and validated by lucid's rules at its training size (`--young_imgsz` 320, its own
  `YoloData(imgsz=...)`): about 250 detections per image at conf 0.001, over a few classes, as a model a few epochs
  old gives; the case that takes about 2 s an image on the CPU.

A trainer case's run is one `Trainer(...).validate(module, datamodule)` on `--device` (one device, `--precision`;
no logger, checkpoints or progress bar; the run files go to a temporary folder). Its times are the ones `LitYolo`
records itself in `val_seconds`: `forward` (the EMA network, batch by batch), `postprocess` (`Validator.update`,
batch by batch: NMS, masks, RLE, COCO results), each between device synchronisations, and `evaluate` (the scoring
of the gathered results: both COCOeval runs); `validate_wall` is the whole `validate` call (data loading,
Lightning's loop, the hooks, the run files). `--warmup` validations run first, then `--runs` timed ones (median, min,
max). A callback keeps the last validation's batches as `validation_step` got them and a forward hook the EMA
network's outputs; on those: `nms` (NMS alone, part of `postprocess`, timed here) and the device-independent counts
of one post-processing (the module's `Validator` fed batch by batch, on ordinary copies of them and outside
inference mode, where composite operators such as `item` decompose into the ones counted): `ops` (ATen operator
calls, views included: on a GPU each is a kernel launch or at least a dispatch) and `host_looks` (counted as on a
GPU: on a CPU run `greedy_keep` is given the GPU's 4 rounds per look; calls that wait for the device: `nonzero`,
`equal`, `item`, `tolist` and copies to the host; on a CPU run every tensor is a host tensor, so `tolist` calls are
all counted as `tolist_host`, bookkeeping included). The JSON goes to `<out>/validation_speed_<device>_<commit>[_<tag>].json`
(`common.write_result`: torch version, GPU, date, commit and this exact command).

`--baseline REV` (a git revision of this repository, e.g. `7a13c73`, the post-processing before the batched NMS, or a
folder holding its `lucid_nb/`, `git archive REV lucid_nb | tar -x -C DIR`) also loads that revision's `lucid_nb/`
(`common.load_baseline`, as the package `lucid_nb_<rev>`) and, after every run, post-processes and scores the same
outputs with both — the run's own `Validator` (`new_*`) and the baseline's (`baseline_*`), in alternating order from
run to run, so that both see the same machine load — timed the way `validation_step` times `update`, then `compute`.
It checks that the two give the same 24 COCO numbers (`==`), and that the run's results bytes are the baseline's, or
the baseline's less the detections past the first 100 of their class in their image (`Validator(scored=100)`: what
COCOeval never scores). Each case then has `arms`: per arm the seconds per image (post-processing plus evaluation) of
every run, their median and range, and the predictions JSON's bytes.
"""
import argparse, collections, contextlib, gc, os, shlex, statistics, sys, tempfile, time
from pathlib import Path

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils._python_dispatch import TorchDispatchMode

from common import device_of, env, load_baseline, write_result
from lucid_nb.data import YoloData
from lucid_nb.metrics import STAT_NAMES, nms, results_bytes
from lucid_nb.command import quiet_lightning
from lucid_nb.trainer import LitYolo
from lucid_nb.testing import young_head   # shared with tests/test_metrics.py

TIMES = ('forward', 'postprocess', 'evaluate')   # the parts of `LitYolo.val_seconds`
CASES = ('random_init', 'many_detections', 'young_head', 'young_model')


def sync(device):
    if device.type == 'cuda': torch.cuda.synchronize(device)


def eval_net(checkpoint: str | None, num_classes: int):
    "The network whose outputs a benchmark post-processes: a lucid checkpoint's EMA weights, or (None) notebook 07's GPU-cell model: random init, seed 0, class-logit biases 0, so every (anchor, class) pair scores ~0.5."
    if checkpoint:
        from lucid_nb.predict import load
        return load(checkpoint).net.eval()
    from lucid_nb.heads import yolo_seg
    torch.manual_seed(0); net = yolo_seg('n', num_classes=num_classes).eval()
    for conv in net.head.cls: conv[-1].bias.data.zero_()
    return net


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


@contextlib.contextmanager
def gpu_rounds(device):
    "On the CPU, count the path a GPU takes: `greedy_keep` with its GPU default of 4 rounds per look (CPU default: 1)."
    from lucid_nb import metrics
    keep = metrics.greedy_keep
    if device.type == 'cpu': metrics.greedy_keep = lambda *a, **kw: keep(*a[:5], rounds=4)
    try: yield
    finally: metrics.greedy_keep = keep


class Capture(Callback):
    "The batches of the last validation as `validation_step` got them, and the EMA network's outputs on them."
    def on_validation_epoch_start(self, trainer, module):
        self.batches, self.outs = [], []
        self.hook = module.ema.module.register_forward_hook(lambda net, args, out: self.outs.append(out))
    def on_validation_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0): self.batches.append(batch)
    def on_validation_epoch_end(self, trainer, module): self.hook.remove()


def postprocess(make, outs, batches, device, inference=True) -> tuple:
    "A fresh `make()` validator fed `outs` batch by batch, each `update` between device synchronisations (as `validation_step` times it): (validator, seconds)."
    v, t = make(), 0.
    with torch.inference_mode(inference):   # as under `Trainer.validate`
        for o, b in zip(outs, batches):
            sync(device); t0 = time.perf_counter()
            v.update(o, b)
            sync(device); t += time.perf_counter() - t0
    return v, t


def nms_seconds(nms_fn, outs, nms_kw, device) -> float:
    "NMS alone on `outs`, as `Validator.update` calls it."
    sync(device); t0 = time.perf_counter()
    with torch.inference_mode():
        for o in outs: nms_fn(o['boxes'].float(), o['scores'].float(), **nms_kw)
    sync(device); return time.perf_counter() - t0


def baseline_validator(base, module):
    "The baseline's `Validator` with the module's thresholds and the datamodule's categories (`LitYolo.make_validator`)."
    h = module.hparams
    return base.Validator(module.trainer.datamodule.cat_ids, conf=h.conf, iou=h.iou, max_det=h.max_det)


def scored_only(results: list, most: int = 100) -> list:
    "`results` less every detection past the first `most` of its class in its image (in the results' order)."
    seen, out = collections.Counter(), []
    for r in results:
        key = r['image_id'], r['category_id']
        if seen[key] < most: out.append(r)
        seen[key] += 1
    return out


def numbers(stats) -> list:
    "The 24 numbers of COCOeval: bbox then segm, in `STAT_NAMES` order."
    return [stats[f'{t}/{n}'] for t in ('bbox', 'segm') for n in STAT_NAMES]


ARM_RUNS = collections.Counter()   # runs so far of each case: the order of the two arms alternates


def baseline_run(base, module, outs, batches, device, case) -> dict:
    "This revision's and the baseline's post-processing and scoring of the same outputs, in alternating order; the same 24 numbers, the results bytes checked."
    coco, out = module.trainer.datamodule.val_coco(), {}
    arms = dict(new=module.make_validator, baseline=lambda: baseline_validator(base, module))
    order = ('new', 'baseline') if ARM_RUNS[case] % 2 == 0 else ('baseline', 'new')
    ARM_RUNS[case] += 1
    for arm in order:
        gc.collect()
        v, t = postprocess(arms[arm], outs, batches, device)
        t0 = time.perf_counter(); stats = v.compute(coco); e = time.perf_counter() - t0
        out[arm] = dict(v=v, postprocess=t, evaluate=e, numbers=numbers(stats), json_bytes=len(results_bytes(v.results)))
    new, old = out['new'], out['baseline']
    if new['numbers'] != old['numbers']: raise SystemExit(f"the baseline gives other COCO numbers: {new['numbers']} vs {old['numbers']}")
    got, want = results_bytes(new['v'].results), base.results_bytes(old['v'].results)
    if got != want and got != base.results_bytes(scored_only(old['v'].results)): raise SystemExit('the baseline gives other results bytes')
    images = len(new['v'].image_ids)
    r = {f'{arm}_{k}': out[arm][k] for arm in out for k in ('postprocess', 'evaluate')}
    r.update({f'{arm}_per_image': (out[arm]['postprocess'] + out[arm]['evaluate']) / images for arm in out},
             baseline_nms=nms_seconds(base.nms, outs, old['v'].nms_kw, device),
             arm_detections={arm: len(out[arm]['v'].results) for arm in out}, arm_json_bytes={arm: out[arm]['json_bytes'] for arm in out},
             numbers=new['numbers'])
    return r


def trainer_run(trainer, module, dm, capture, device, base=None, case='') -> dict:
    "One `trainer.validate`: the module's own `val_seconds`, the call's wall time, NMS alone on its outputs (and the baseline's)."
    sync(device); t0 = time.perf_counter()
    trainer.validate(module, datamodule=dm, verbose=False)
    sync(device); wall = time.perf_counter() - t0
    v = module.validator
    r = dict(module.val_seconds, validate_wall=wall, nms=nms_seconds(nms, capture.outs, v.nms_kw, device),
             detections=len(v.results), summary=module.last_val_stats.summary())
    if base is not None: r.update(baseline_run(base, module, capture.outs, capture.batches, device, case))
    return r


def direct_run(module, outs, batches, device, base=None, case='') -> dict:
    "The module's `Validator` on given head outputs, batch by batch, then `compute` (no trainer, no forward)."
    v, t = postprocess(module.make_validator, outs, batches, device)
    t0 = time.perf_counter()
    stats = v.compute(module.trainer.datamodule.val_coco())
    r = dict(postprocess=t, evaluate=time.perf_counter() - t0, nms=nms_seconds(nms, outs, v.nms_kw, device),
             detections=len(v.results), summary=stats.summary())
    if base is not None: r.update(baseline_run(base, module, outs, batches, device, case))
    return r


def plain(d: dict) -> dict:
    "A copy of `d` whose tensors are ordinary ones (the trainer's loop makes inference tensors)."
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in d.items()}


def counts(module, outs, batches, device, validator=None) -> dict:
    "ATen operator calls and host looks of one post-processing of `outs` (the module's `Validator`, or `validator()`)."
    outs, batches = [plain(o) for o in outs], [plain(b) for b in batches]
    with Counts() as c, gpu_rounds(device):   # outside inference mode, where composite operators (`item`, ...) decompose as counted
        postprocess(validator or module.make_validator, outs, batches, device, inference=False)
    return dict(ops=sum(c.ops.values()), host_looks=dict(c.looks))


def summarise(rs: list, warmup: int) -> dict:
    "Median, min and max of each time over the runs, and the last run's detections and summary."
    keys = [k for k in rs[0] if k not in ('detections', 'summary', 'arm_detections', 'arm_json_bytes', 'numbers')]
    med = {k: statistics.median(r[k] for r in rs) for k in keys}
    med['total'] = sum(med.get(k, 0.) for k in TIMES)
    return dict(median_s=med, min_s={k: min(r[k] for r in rs) for k in keys}, max_s={k: max(r[k] for r in rs) for k in keys},
                postprocess_runs_s=[r['postprocess'] for r in rs], detections=rs[-1]['detections'], summary=rs[-1]['summary'],
                runs=len(rs), warmup=warmup, **(arms(rs) if 'numbers' in rs[0] else {}))


def arms(rs: list) -> dict:
    "Per arm: seconds per image (post-processing and evaluation) of every run, median and range; detections and JSON bytes; the 24 numbers (equal in every run)."
    if any(r['numbers'] != rs[0]['numbers'] for r in rs): raise SystemExit('the COCO numbers differ between runs')
    per = {arm: [r[f'{arm}_per_image'] for r in rs] for arm in ('new', 'baseline')}
    return dict(arms={arm: dict(per_image_s=xs, median_per_image_s=statistics.median(xs), range_per_image_s=[min(xs), max(xs)],
                                detections=rs[-1]['arm_detections'][arm], predictions_json_bytes=rs[-1]['arm_json_bytes'][arm])
                      for arm, xs in per.items()},
                numbers_equal=True, numbers=rs[0]['numbers'],
                speedup_median=statistics.median(b / n for b, n in zip(per['baseline'], per['new'])))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    p.add_argument('--precision', default='32-true', help="the Trainer's precision (the reference run trains and validates in bf16-mixed)")
    p.add_argument('--runs', type=int, default=5)
    p.add_argument('--warmup', type=int, default=1)
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--cases', default='random_init,many_detections,young_head')
    p.add_argument('--young_weights', default='tests/fixtures/yolo11n-seg-coco128.pt', help="the young_model case's weights")
    p.add_argument('--young_imgsz', type=int, default=320, help="the young_model case's image size (its training size)")
    p.add_argument('--tag', default='')
    p.add_argument('--batches', type=int, default=None, help='only the first N validation batches (quick CPU runs)')
    p.add_argument('--baseline', default=None, help='a git revision whose post-processing runs alternately with this one')
    p.add_argument('--out', default='benchmarks/results')
    a = p.parse_args(argv)
    cases = a.cases.split(',')
    if bad := [c for c in cases if c not in CASES]:
        raise SystemExit(f"--cases: {', '.join(bad)} is not a case; allowed: {', '.join(CASES)}")
    device = torch.device(a.device)
    quiet_lightning()
    dm = YoloData(prefetch=False)
    dm.setup('fit')
    torch.manual_seed(a.seed)
    module = LitYolo(num_classes=len(dm.cat_ids))
    capture, tmp = Capture(), tempfile.TemporaryDirectory(prefix='validation_speed_')
    trainer = L.Trainer(accelerator=device.type, devices=[device.index] if device.index is not None else 1, precision=a.precision,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=a.batches or 1.0, default_root_dir=tmp.name, callbacks=[capture])
    h = module.hparams
    res = dict(what=f'one validation of the 32 embedded validation images (YoloData defaults), nano LitYolo, Trainer.validate '
                    f'({a.precision}), Validator(conf={h.conf}, iou={h.iou}, max_det={h.max_det}); median of runs after warm-up',
               command=shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None else shlex.join(['validation_speed.py', *argv]),
               device=device_of(device.type == 'cuda'), device_name=env()['device'], precision=a.precision,
               torch_threads=torch.get_num_threads(), load_average_before=os.getloadavg(),
               baseline=a.baseline, cases={})
    base = load_baseline(a.baseline) if a.baseline else None
    def trainer_for(dm, capture):
        return L.Trainer(accelerator=device.type, devices=[device.index] if device.index is not None else 1, precision=a.precision,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=a.batches or 1.0, default_root_dir=tmp.name, callbacks=[capture])
    for case in cases:
        if case == 'young_model':   # its own data (its image size), module and trainer
            ydm = YoloData(prefetch=False, imgsz=a.young_imgsz); ydm.setup('fit')
            ymod, ycap = LitYolo(num_classes=len(ydm.cat_ids), weights=a.young_weights), Capture()
            ytr = trainer_for(ydm, ycap)
            run = lambda: trainer_run(ytr, ymod, ydm, ycap, device, base, case)
            for _ in range(a.warmup): run()
            r = summarise([run() for _ in range(a.runs)], a.warmup)
            c = counts(ymod, ycap.outs, ycap.batches, device)
            r.update(how='Trainer.validate', weights=a.young_weights, imgsz=a.young_imgsz, postprocess_ops=c['ops'],
                     postprocess_host_looks=c['host_looks'], images=sum(len(b['img']) for b in ycap.batches))
            res['cases'][case] = r
            print(f"{case}: {r['detections']} detections | " + ' | '.join(f"{k} {v * 1e3:.0f} ms" for k, v in r['median_s'].items()), flush=True)
            if 'arms' in r: print('  ' + ' | '.join(f"{k} {v['median_per_image_s']:.3f} s/image [{v['range_per_image_s'][0]:.3f}, {v['range_per_image_s'][1]:.3f}], "
                                                  f"{v['detections']} detections, {v['predictions_json_bytes']} JSON bytes" for k, v in r['arms'].items()), flush=True)
            continue
        if case == 'many_detections':
            for conv in module.ema.module.head.cls: conv[-1].bias.data.zero_()   # every pair scores ~0.5: NMS keeps max_det
        if case == 'young_head':
            if not hasattr(capture, 'batches'): trainer.validate(module, datamodule=dm, verbose=False)   # the loop's batches
            outs = young_head(capture.batches, a.seed)
            run = lambda: direct_run(module, outs, capture.batches, device, base, case)
        else:
            run = lambda: trainer_run(trainer, module, dm, capture, device, base, case)
        for _ in range(a.warmup): run()
        r = summarise([run() for _ in range(a.runs)], a.warmup)
        if case != 'young_head': outs = capture.outs   # the last validation's
        c = counts(module, outs, capture.batches, device)
        r.update(how='Validator' if case == 'young_head' else 'Trainer.validate', postprocess_ops=c['ops'], postprocess_host_looks=c['host_looks'])
        if base is not None:
            cb = counts(module, outs, capture.batches, device, lambda: baseline_validator(base, module))
            r.update(baseline_postprocess_ops=cb['ops'], baseline_postprocess_host_looks=cb['host_looks'])
        res['cases'][case] = r
        res.update(images=sum(len(b['img']) for b in capture.batches), batches=len(capture.batches))
        print(f"{case} ({r['how']}): {r['detections']} detections, {r['postprocess_ops']} ops, host looks {r['postprocess_host_looks']} | "
              + ' | '.join(f"{k} {v * 1e3:.0f} ms" for k, v in r['median_s'].items()), flush=True)
    res['load_average_after'] = os.getloadavg()  # other processes on a small machine skew CPU numbers
    tmp.cleanup()
    path = write_result('validation_speed', res, res['device'], a.tag, out=a.out)
    print(f"wrote {path}")


if __name__ == '__main__':
    main()
