"""Is this checkout's augmentation faster than a revision's, in alternating epochs? Yes: 1.07x (1.08x with mosaic) against 7bba5a8's (results/augment_ab_cpu_vs_7bba5a8.json), at 8f6e371.

The training loader's images/s with this checkout's augmentation and with a git revision's, alternating in one process.

A throughput figure from one pass is at the mercy of a shared machine's load (one pass of the same loader moved by
2x between runs here). This script builds the training loader of the embedded data once (cache in RAM, no workers,
no prefetch: the augmentation alone, on this process's threads) and times full epochs, switching the loader's
`build_sample` between this checkout's `lucid_nb.augment` and the revision's `lucid_nb/augment.py` (loaded as a
module of the package) every epoch, so both see the same machine state. Both must give the same batches, byte for
byte; the result is the median and range of each, and their ratio:

    python benchmarks/experiments/augment_ab.py --baseline REV [--mosaic 0] [--epochs 6] [--out benchmarks/results]
"""
import argparse, importlib.util, json, statistics, subprocess, sys, time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def revision_module(rev: str):
    "`lucid_nb/augment.py` at `rev`, imported as `lucid_nb.augment_<rev>` (its relative imports resolve in the package)."
    src = subprocess.run(['git', 'show', f'{rev}:lucid_nb/augment.py'], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    name = f'lucid_nb.augment_{rev}'
    spec = importlib.util.spec_from_loader(name, loader=None)
    mod = importlib.util.module_from_spec(spec); mod.__package__ = 'lucid_nb'
    sys.modules[name] = mod
    exec(compile(src, f'{rev}:lucid_nb/augment.py', 'exec'), mod.__dict__)
    return mod


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument('--baseline', required=True); p.add_argument('--mosaic', type=float, default=0.)
    p.add_argument('--epochs', type=int, default=6); p.add_argument('--imgsz', type=int, default=640)
    p.add_argument('--out', default='benchmarks/results')
    a = p.parse_args(argv)
    import lucid_nb.loader as loader
    from lucid_nb.core import device_tag, digest, env_info
    from lucid_nb.data import YoloData
    arms = {'this checkout': loader.build_sample, a.baseline: revision_module(a.baseline).build_sample}
    dm = YoloData(imgsz=a.imgsz, batch_size=4, cache='ram', prefetch=False, workers=0, mosaic=a.mosaic); dm.setup('fit')
    ld = dm.train_dataloader()
    rates = {k: [] for k in arms}
    for _ in ld: pass                                     # the cache filled, the first epoch's costs paid
    for epoch in range(a.epochs):
        for name, fn in arms.items():
            loader.build_sample = fn
            t0 = time.perf_counter(); n = sum(len(b['img']) for b in ld)
            rates[name].append(n / (time.perf_counter() - t0))
    def batches_digest(fn, epoch):                       # untimed: the same epoch's batches, hashed
        loader.build_sample = fn; ld.set_epoch(epoch)
        return digest([digest(b) for b in ld])
    same = all(batches_digest(arms['this checkout'], e) == batches_digest(arms[a.baseline], e) for e in range(2))
    spread = lambda xs: dict(median=statistics.median(xs), min=min(xs), max=max(xs), n=len(xs))
    mine, base = spread(rates['this checkout']), spread(rates[a.baseline])
    res = dict(what='training loader images/s, this checkout vs a revision, alternating epochs in one process',
               command=' '.join([sys.executable, *sys.argv]), baseline=a.baseline, imgsz=a.imgsz, mosaic=a.mosaic,
               cache='ram', workers=0, prefetch=False, torch_threads=torch.get_num_threads(), env=env_info(),
               images_per_s={'this checkout': mine, a.baseline: base}, ratio_of_medians=mine['median'] / base['median'],
               same_batches=same, per_epoch=rates)
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    path = out / f"augment_ab_{device_tag()}_vs_{a.baseline}{'_mosaic' if a.mosaic else ''}.json"
    path.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: res[k] for k in ('images_per_s', 'ratio_of_medians', 'same_batches')}, indent=1)); print('->', path)
    if not same: raise SystemExit('augment_ab: the two give different batches')


if __name__ == '__main__':
    main()
