"""The training loader's images/s with each batch's samples built one by one and by the dataset's threads, alternating.

Two `YoloData` of the embedded data, the same settings (cache in RAM, no workers, no prefetch: the building alone)
except `threads` (1, and each `--threads` value, `0` meaning the default: up to 8, the CPU count), time full training
epochs in turn, so every setting sees the same machine state; every setting's batches must be the same bytes as the
first's. Writes the median and range of each, and the round-by-round ratio to `threads=1`:

    python benchmarks/sample_threads_ab.py [--threads 0 2] [--mosaic 0] [--rounds 6] [--out benchmarks/results]
"""
import argparse, contextlib, io, json, os, statistics, sys, time
from datetime import datetime, timezone
from pathlib import Path

import torch
from lucid_nb.core import device_tag, digest, env_info
from lucid_nb.data import YoloData


def epoch_rate(ld, epoch: int) -> tuple[float, str]:
    "Images/s of one epoch of `ld`, and the `digest` of its batches (the hashing's own time is not counted)."
    ld.set_epoch(epoch); hashes, n, hashing, t = [], 0, 0., time.perf_counter()
    for b in ld:   # each batch dropped after its hash, as a training loop drops it after its step
        t0 = time.perf_counter()
        hashes.append(digest(b))
        n, hashing = n + len(b['img']), hashing + time.perf_counter() - t0
    return n / (time.perf_counter() - t - hashing), digest(hashes)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--threads', type=int, nargs='+', default=[0]); ap.add_argument('--mosaic', type=float, default=0.)
    ap.add_argument('--rounds', type=int, default=6); ap.add_argument('--imgsz', type=int, default=640)
    ap.add_argument('--batch-size', type=int, default=4); ap.add_argument('--out', default='benchmarks/results')
    a = ap.parse_args(argv)
    settings = [1] + [t or None for t in a.threads]
    loaders = {}
    for t in settings:
        dm = YoloData(imgsz=a.imgsz, batch_size=a.batch_size, cache='ram', prefetch=False, workers=0, mosaic=a.mosaic,
                      max_epochs=100, seed=0, threads=t)
        with contextlib.redirect_stdout(io.StringIO()): dm.setup('fit')
        loaders[str(t or 'default')] = dm.train_dataloader()
    for ld in loaders.values(): epoch_rate(ld, 99)   # warm: first calls, the threads started
    rates, load0 = {k: [] for k in loaders}, list(os.getloadavg())
    for r in range(a.rounds):
        keys = list(loaders); keys = keys[r % len(keys):] + keys[:r % len(keys)]   # each setting leads in turn
        digests = {}
        for k in keys:
            rate, digests[k] = epoch_rate(loaders[k], r)
            rates[k].append(rate)
        if len(set(digests.values())) != 1: raise SystemExit(f'round {r}: the settings built different batches: {digests}')
        print(f'round {r}: ' + ', '.join(f'threads {k} {rates[k][-1]:.1f}' for k in loaders) + ' images/s', flush=True)
    spread = lambda xs: dict(median=round(statistics.median(xs), 1), min=round(min(xs), 1), max=round(max(xs), 1))
    base = rates['1']
    result = dict(what='training loader images/s, samples built one by one (threads 1) and by the dataset threads, alternating epochs, same bytes checked',
                  command=' '.join(['python', 'benchmarks/sample_threads_ab.py'] + (argv if argv is not None else sys.argv[1:])),
                  imgsz=a.imgsz, batch_size=a.batch_size, mosaic=a.mosaic, rounds=a.rounds, cores=os.cpu_count(),
                  default_threads=loaders.get('default', loaders['1']).dataset.threads,
                  load_average_before=load0, load_average_after=list(os.getloadavg()), torch_threads=torch.get_num_threads(),
                  images_per_s={k: spread(v) for k, v in rates.items()},
                  ratio_to_threads_1={k: spread([x / y for x, y in zip(v, base)]) for k, v in rates.items() if k != '1'},
                  runs=rates, env=env_info(), date=datetime.now(timezone.utc).isoformat(timespec='seconds'))
    out = Path(a.out) / f"sample_threads_ab_{device_tag()}{'_mosaic' if a.mosaic else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True); out.write_text(json.dumps(result, indent=1) + '\n')
    print(json.dumps(result['images_per_s']), json.dumps(result['ratio_to_threads_1']), '->', out)


if __name__ == '__main__': main()
