"""Data-pipeline throughput (training images/s) with and without cache and prefetch, on the embedded coco128.

Usage (from the repository root):
    .venv/bin/python benchmarks/data_throughput.py [--imgsz 640] [--batch-size 4] [--epochs 2] [--out benchmarks/results/data_throughput_cpu.json]

Each configuration builds `YoloData` on the embedded data (96 training images by the split rule), runs `--epochs`
training epochs through `train_dataloader()` and reports images/s of the best epoch (the first one warms the page
cache and the allocator). Augmentation is YOLO's default (flip, scale 0.5, translate 0.1) with mosaic off unless the
row says otherwise. `step_ms` > 0 simulates a training step that sleeps (like a GPU step, it releases the GIL) after
each batch, to show what prefetch hides; images/s then counts the whole loop. Setup (decode + cache) is timed apart.
The 1-minute load average before and after is recorded: other processes on a small machine skew the numbers.
"""
import argparse, contextlib, datetime, io, json, os, platform, shlex, sys, tempfile, time
from pathlib import Path

import torch
from lucid_nb.core import env_info
from lucid_nb.data import YoloData


def cpu_name() -> str:
    try:
        for line in Path('/proc/cpuinfo').read_text().splitlines():
            if line.startswith('model name'): return line.split(':', 1)[1].strip()
    except OSError: pass
    return platform.processor() or platform.machine()


def measure(imgsz, batch_size, epochs, cache, prefetch, workers=0, mosaic=0., step_ms=0., cache_dir=None) -> dict:
    dm = YoloData(imgsz=imgsz, batch_size=batch_size, cache=cache, cache_dir=cache_dir, prefetch=prefetch, workers=workers,
                  mosaic=mosaic, max_epochs=100, seed=0)
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()): dm.setup('fit')
    setup_s = time.perf_counter() - t0
    ld, rates = dm.train_dataloader(), []
    for e in range(epochs):
        ld.set_epoch(e); n, t = 0, time.perf_counter()
        for b in ld:
            n += len(b['img'])
            if step_ms: time.sleep(step_ms / 1000)
        rates.append(n / (time.perf_counter() - t))
    dm.teardown()
    return dict(cache=cache, prefetch=prefetch, workers=workers, mosaic=mosaic, step_ms=step_ms, setup_s=round(setup_s, 2),
                images_per_s=round(max(rates), 1), images_per_s_each_epoch=[round(r, 1) for r in rates], images=len(ld.dataset))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--imgsz', type=int, default=640); ap.add_argument('--batch-size', type=int, default=4)
    ap.add_argument('--epochs', type=int, default=2); ap.add_argument('--out', default='benchmarks/results/data_throughput_cpu.json')
    a = ap.parse_args(argv)
    rows, load0 = [], list(os.getloadavg())   # other work on the machine skews the numbers: recorded
    with tempfile.TemporaryDirectory() as tmp:
        configs = [dict(cache=c, prefetch=p) for c in ('none', 'ram', 'disk') for p in (False, True)]
        configs += [dict(cache='ram', prefetch=True, workers=2), dict(cache='ram', prefetch=False, mosaic=1.),
                    dict(cache='ram', prefetch=True, mosaic=1.), dict(cache='ram', prefetch=True, workers=2, mosaic=1.)]
        configs += [dict(cache='ram', prefetch=p, step_ms=20.) for p in (False, True)]
        for cfg in configs:
            r = measure(a.imgsz, a.batch_size, a.epochs, cache_dir=tmp, **cfg)
            rows.append(r)
            print(f"cache {r['cache']:<4} prefetch {str(r['prefetch']):<5} workers {r['workers']} mosaic {r['mosaic']:.0f} "
                  f"step {r['step_ms']:>4.0f} ms: {r['images_per_s']:7.1f} images/s (setup {r['setup_s']:.2f} s)", flush=True)
    i = env_info()
    result = dict(
        what='lucid_nb data pipeline throughput, training loader, embedded coco128 (96 train images)',
        command=' '.join(['.venv/bin/python', 'benchmarks/data_throughput.py'] + [shlex.quote(x) for x in (argv if argv is not None else sys.argv[1:])]),
        imgsz=a.imgsz, batch_size=a.batch_size, epochs=a.epochs,
        target='> 200 images/s at 640 with cache ram, no mosaic, on 2 CPU cores',
        cpu=cpu_name(), cores=os.cpu_count(), load_average_before=load0, load_average_after=list(os.getloadavg()), torch_threads=torch.get_num_threads(), torch=i['torch'], python=i['python'],
        commit=i['commit'], date=datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC'), rows=rows)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + '\n')
    print(f"wrote {a.out}")


if __name__ == '__main__': main()
