"""Data-pipeline throughput (training images/s) on the embedded coco128: loader configurations, or two settings alternating.

Usage (from the repository root):
    python benchmarks/data_throughput.py [--imgsz 640] [--batch-size 4] [--epochs 2] [--augment-on cpu] [--out benchmarks/results]
    python benchmarks/data_throughput.py --ab threads [--threads 0] [--mosaic 1] [--rounds 10]
    python benchmarks/data_throughput.py --ab augment [--batch-size 8] [--rounds 6]

Configurations (default): each builds `YoloData` on the embedded data (96 training images by the split rule), runs
`--epochs` training epochs through `train_dataloader()` and reports images/s of the best epoch (the first one warms the
page cache and the allocator): cache none/ram/disk, prefetch, workers, mosaic. Augmentation is YOLO's default (flip,
scale 0.5, translate 0.1) with mosaic off unless the row says otherwise. `step_ms` > 0 simulates a training step that
sleeps (like a GPU step, it releases the GIL) after each batch, to show what prefetch hides; images/s then counts the
whole loop. Setup (decode + cache) is timed apart. With `--augment-on device` every configuration's loader hands over
device recipes (`nbs/01b_augment_device.ipynb`) and the rows count the loader alone: the samples' pixels are made
later, on the batch's device. Writes `data_throughput_<device>_<commit>[_device].json`.

`--ab threads`: single passes on a shared machine move by 2x, so this alternates full epochs of loaders that differ
only in `threads` (1, and each `--threads` value, `0` meaning the default: up to 8, the CPU count) in one process
(cache in RAM, no workers, no prefetch: the samples' building alone), each setting leading in turn, every setting's
batches checked to be the same bytes as the others' (`lucid_nb.core.digest`, untimed). Reports the median and range of
each and the round-by-round ratio to `threads=1`: `data_throughput_<device>_<commit>_threads[_mosaic].json`.

`--ab augment`: the loader's CPU time per training image with `augment_on` cpu against device, alternating full epochs
in one process (cache in RAM, no workers, no prefetch, one thread: the samples' building alone, as the process's CPU
time, `time.process_time`), without and with mosaic, each arm leading in turn. In the first round every device batch
is made into pixels on this CPU (`build_on_device`, untimed for the loader; its own CPU time is recorded apart) and
checked to be the bytes of the cpu arm's batch. Reports each arm's median and range and the round-by-round ratio:
`data_throughput_<device>_<commit>_augment.json`.

The 1-minute load average before and after is recorded: other processes on a small machine skew the numbers.
"""
import argparse, contextlib, io, os, platform, tempfile, time
from pathlib import Path

import torch
from common import ratios, spread, write_result


def cpu_name() -> str:
    try:
        for line in Path('/proc/cpuinfo').read_text().splitlines():
            if line.startswith('model name'): return line.split(':', 1)[1].strip()
    except OSError: pass
    return platform.processor() or platform.machine()


def loader(imgsz, batch_size, **kw):
    "The embedded data's training loader (set up: decoded and cached), and its setup seconds."
    from lucid_nb.data import YoloData
    dm = YoloData(imgsz=imgsz, batch_size=batch_size, max_epochs=100, seed=0, **kw)
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()): dm.setup('fit')
    return dm, time.perf_counter() - t0


def measure(imgsz, batch_size, epochs, cache, prefetch, workers=0, mosaic=0., step_ms=0., cache_dir=None, augment_on='cpu') -> dict:
    dm, setup_s = loader(imgsz, batch_size, cache=cache, cache_dir=cache_dir, prefetch=prefetch, workers=workers, mosaic=mosaic, augment_on=augment_on)
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


def epoch_rate(ld, epoch: int) -> tuple[float, str]:
    "Images/s of one epoch of `ld`, and the `digest` of its batches (the hashing's own time is not counted)."
    from lucid_nb.core import digest
    ld.set_epoch(epoch); hashes, n, hashing, t = [], 0, 0., time.perf_counter()
    for b in ld:   # each batch dropped after its hash, as a training loop drops it after its step
        t0 = time.perf_counter()
        hashes.append(digest(b))
        n, hashing = n + len(b['img']), hashing + time.perf_counter() - t0
    return n / (time.perf_counter() - t - hashing), digest(hashes)


def threads_ab(a) -> dict:
    "Alternating epochs of `threads=1` and each `--threads` value, same bytes checked every round."
    loaders = {}
    for t in [1] + [t or None for t in a.threads]:
        dm, _ = loader(a.imgsz, a.batch_size, cache='ram', prefetch=False, workers=0, mosaic=a.mosaic, threads=t)
        loaders[str(t or 'default')] = dm.train_dataloader()
    for ld in loaders.values(): epoch_rate(ld, 99)   # warm: first calls, the threads started
    rates = {k: [] for k in loaders}
    for r in range(a.rounds):
        keys = list(loaders); keys = keys[r % len(keys):] + keys[:r % len(keys)]   # each setting leads in turn
        digests = {}
        for k in keys:
            rate, digests[k] = epoch_rate(loaders[k], r)
            rates[k].append(rate)
        if len(set(digests.values())) != 1: raise SystemExit(f'round {r}: the settings built different batches: {digests}')
        print(f'round {r}: ' + ', '.join(f'threads {k} {rates[k][-1]:.1f}' for k in loaders) + ' images/s', flush=True)
    return dict(what='training loader images/s, samples built one by one (threads 1) and by the dataset threads, alternating epochs, same bytes checked',
                mosaic=a.mosaic, rounds=a.rounds, default_threads=loaders.get('default', loaders['1']).dataset.threads,
                images_per_s={k: spread(v, 1) for k, v in rates.items()},
                ratio_to_threads_1={k: ratios(v, rates['1'], 2) for k, v in rates.items() if k != '1'}, runs=rates)


def configurations(a) -> dict:
    "Each loader configuration's best epoch."
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        configs = [dict(cache=c, prefetch=p) for c in ('none', 'ram', 'disk') for p in (False, True)]
        configs += [dict(cache='ram', prefetch=True, workers=2), dict(cache='ram', prefetch=False, mosaic=1.),
                    dict(cache='ram', prefetch=True, mosaic=1.), dict(cache='ram', prefetch=True, workers=2, mosaic=1.)]
        configs += [dict(cache='ram', prefetch=p, step_ms=20.) for p in (False, True)]
        for cfg in configs:
            r = measure(a.imgsz, a.batch_size, a.epochs, cache_dir=tmp, augment_on=a.augment_on, **cfg)
            rows.append(r)
            print(f"cache {r['cache']:<4} prefetch {str(r['prefetch']):<5} workers {r['workers']} mosaic {r['mosaic']:.0f} "
                  f"step {r['step_ms']:>4.0f} ms: {r['images_per_s']:7.1f} images/s (setup {r['setup_s']:.2f} s)", flush=True)
    return dict(what='lucid_nb data pipeline throughput, training loader, embedded coco128 (96 train images)',
                epochs=a.epochs, augment_on=a.augment_on, target='> 200 images/s at 640 with cache ram, no mosaic, on 2 CPU cores', rows=rows)


def timed_epoch(ld, epoch: int, made=None) -> tuple[float, float, int, list]:
    "CPU and wall seconds `ld` takes to hand over one epoch, its images, and (with `made`, untimed) the digest of `made(batch)` of each batch."
    from lucid_nb.core import digest
    ld.set_epoch(epoch); it, cpu, wall, n, digests = iter(ld), 0., 0., 0, []
    while True:
        c0, w0 = time.process_time(), time.perf_counter()
        b = next(it, None)
        cpu, wall = cpu + time.process_time() - c0, wall + time.perf_counter() - w0
        if b is None: return cpu, wall, n, digests
        n += len(b['image_id'])
        if made is not None: digests.append(digest(made(b)))


def augment_ab(a) -> dict:
    "Alternating epochs of `augment_on` cpu and device: the loader's CPU ms per image; round 0 checks the device batches' bytes."
    from lucid_nb.augment_device import build_on_device
    torch.set_num_threads(1)
    res = {}
    for mosaic in (0., 1.):
        lds = {arm: loader(a.imgsz, a.batch_size, cache='ram', prefetch=False, workers=0, threads=1, mosaic=mosaic, augment_on=arm)[0].train_dataloader()
               for arm in ('cpu', 'device')}
        cpu_ms, wall_ms, build = {arm: [] for arm in lds}, {arm: [] for arm in lds}, []
        def made(b):   # the device arm's batch made on this CPU, its CPU time kept apart
            c0 = time.process_time(); out = build_on_device(b); build.append((time.process_time() - c0) / len(b['image_id'])); return out
        for r in range(a.rounds):
            arms, digests = list(lds)[r % 2:] + list(lds)[:r % 2], {}
            for arm in arms:
                cpu, wall, n, digests[arm] = timed_epoch(lds[arm], r, (made if arm == 'device' else (lambda b: b)) if r == 0 else None)
                cpu_ms[arm].append(1e3 * cpu / n); wall_ms[arm].append(1e3 * wall / n)
            if r == 0 and digests['cpu'] != digests['device']: raise SystemExit(f'mosaic {mosaic}: the device batches are not the cpu batches')
            if r == 0: checked = len(digests['cpu'])
            print(f"mosaic {mosaic:.0f} round {r}: " + ', '.join(f"{arm} {cpu_ms[arm][-1]:.2f}" for arm in lds) + ' CPU ms per image', flush=True)
        res[f'mosaic_{mosaic:.0f}'] = dict(cpu_ms_per_image={k: spread(v, 3) for k, v in cpu_ms.items()}, ratio=ratios(cpu_ms['cpu'], cpu_ms['device'], 2),
                                           wall_ms_per_image={k: spread(v, 3) for k, v in wall_ms.items()}, images_per_epoch=len(lds['cpu']) * a.batch_size,
                                           same_bytes_batches_checked=checked,
                                           device_build_on_this_cpu_ms_per_image=spread([1e3 * x for x in build], 1), runs=cpu_ms)
    return dict(what="training loader's CPU time per image, augment_on cpu vs device (the recipe; pixels made later on the device), "
                     'alternating epochs, one thread, RAM cache, no workers, no prefetch', rounds=a.rounds, **res)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--ab', choices=('threads', 'augment'), help='alternate loader settings instead of the configuration table')
    ap.add_argument('--augment-on', choices=('cpu', 'device'), default='cpu', help="configurations: where the samples' pixels are made")
    ap.add_argument('--imgsz', type=int, default=640); ap.add_argument('--batch-size', type=int, default=4)
    ap.add_argument('--epochs', type=int, default=2, help='configurations: epochs each (the best counts)')
    ap.add_argument('--threads', type=int, nargs='+', default=[0], help='--ab threads: the settings beside 1 (0: the default)')
    ap.add_argument('--mosaic', type=float, default=0., help='--ab threads: mosaic probability')
    ap.add_argument('--rounds', type=int, default=6, help='--ab threads: alternating rounds')
    ap.add_argument('--out', default='benchmarks/results')
    a = ap.parse_args(argv)
    load0 = list(os.getloadavg())   # other work on the machine skews the numbers: recorded
    res = {'threads': threads_ab, 'augment': augment_ab}[a.ab](a) if a.ab else configurations(a)
    res.update(imgsz=a.imgsz, batch_size=a.batch_size, cpu=cpu_name(), cores=os.cpu_count(), load_average_before=load0,
               load_average_after=list(os.getloadavg()), torch_threads=torch.get_num_threads())
    tag = (f"{a.ab}{'_mosaic' if a.mosaic and a.ab == 'threads' else ''}" if a.ab else '') or ('device' if a.augment_on == 'device' else '')
    path = write_result('data_throughput', res, 'cpu', tag, out=a.out)
    if a.ab == 'threads': print(res['images_per_s'], res['ratio_to_threads_1'])
    if a.ab == 'augment': print({k: (v['cpu_ms_per_image'], v['ratio']) for k, v in res.items() if k.startswith('mosaic')})
    print(f"-> {path}")


if __name__ == '__main__': main()
