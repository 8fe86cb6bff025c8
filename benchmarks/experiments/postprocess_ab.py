"""Which post-processing arm (revision, group and chunk sizes) is faster on the same outputs? Groups of 2^27 0.75x, worth it once expandable segments made them free in the fit (59bca8e's default); the 'regression' was the collector (results/postprocess_ab_nvidia-h200_young{1,}_ca24cc0.json), at ca24cc0.

One validation's post-processing by several arms, alternating on the same model outputs: time, syncs, memory (GPU).

Usage (GPU machine, repository root):
    python benchmarks/experiments/postprocess_ab.py --checkpoint CKPT --arm cf82686 --arm HEAD --arm HEAD:max_pixels=33554432 \
        [--rounds 7] [--precision bf16-mixed] [--out $OUT/results]

An arm is a git revision of this repository (`HEAD`: this checkout's `lucid_nb`, others loaded from `git archive` as in
`validation_speed.py --baseline`; or a folder holding a `lucid_nb/` exported from a revision, for a machine whose clone
lacks that revision: `git archive REV lucid_nb | tar -x -C DIR`), optionally with settings after a colon, comma-separated: `group_pixels=N` (the
`Validator`'s), `max_pixels=N` (the crop pixels per chunk `batch_mask_runs` is called with). The outputs are those of
the checkpoint's EMA network (`--checkpoint`; without it, notebook 07's GPU-cell model: random init, seed 0, class-logit
biases 0) on the 32 embedded validation images, batched as the trainer's validation batches them (`YoloData`
defaults), its forward under the trainer's `--precision` autocast, as `LitYolo.validation_step` runs it. The model
that the validation_ops results name is the reference configuration trained 4 epochs on the CPU:
    lucid fit --config configs/coco128-seg-n.yaml --trainer.accelerator cpu --trainer.precision 32-true \
        --trainer.max_epochs 4 --data.workers 2 --trainer.default_root_dir /tmp/young    # /tmp/young/checkpoints/last.ckpt

The objects alive after setup are frozen (`gc.freeze`), as `FrozenHeap` freezes them at fit start; each run's time in
the cyclic garbage collector is recorded (`gc_runs_s`). Each round post-processes the outputs once with every arm, in a rotated order (round r starts with arm r mod arms),
each arm's `Validator` fed batch by batch, every `update` between device synchronisations (as `validation_step` times
it); `paired_ratio_to_first` is each arm's time over the first arm's in the same round (median, min, max: the
machine's drift between rounds cancels). After the timed rounds, one more run per arm: under `torch.cuda.set_sync_debug_mode('warn')`, the device
synchronisations by source line (`syncs`); from the memory counters, the peak allocated above what was allocated
before (`peak_extra_mib`) and how much the reserved pool grew (`reserved_growth_mib`); and one under torch.profiler:
the host's time in CUDA runtime calls that wait (`cudaStreamSynchronize`, `cudaMemcpyAsync`, ...) and the kernels'
total (`profile`); and one under cProfile (`python_profile`: the functions with the most own time and time
inside). Every arm's results bytes, and its masks' areas and boxes (`mask_stats`, where both arms keep
them), must equal the first arm's. Writes `postprocess_ab_<device><tag>.json`.
"""
import argparse, collections, cProfile, gc, json, pstats, shlex, statistics, sys, time, warnings
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/: validation_speed, common
import validation_speed as vs
import lucid_nb.metrics as M
from lucid_nb.core import device_tag, env_info
from lucid_nb.data import YoloData

SETTINGS = ('group_pixels', 'max_pixels')


class CollectorTime:
    "Seconds the cyclic garbage collector ran (`gc.callbacks`), and its collections by generation."
    def __init__(self): self.seconds, self.by_gen, self._t = 0., collections.Counter(), None; gc.callbacks.append(self)
    def __call__(self, phase, info):
        if phase == 'start': self._t = time.perf_counter()
        elif self._t is not None: self.seconds += time.perf_counter() - self._t; self.by_gen[info['generation']] += 1; self._t = None


def parse_arm(text: str) -> tuple[str, dict]:
    "`REV[:name=value,...]` -> (REV, settings)."
    rev, _, rest = text.partition(':')
    settings = dict(kv.split('=') for kv in rest.split(',') if kv)
    if bad := [k for k in settings if k not in SETTINGS]: raise SystemExit(f"--arm {text}: unknown setting {bad}; allowed: {SETTINGS}")
    return rev, {k: int(v) for k, v in settings.items()}


def arm_runner(mod, settings: dict, cat_ids):
    "A function post-processing (outs, batches) with module `mod` and `settings`: (validator, seconds)."
    def run(outs, batches, device):
        saved = mod.batch_mask_runs
        if 'max_pixels' in settings: mod.batch_mask_runs = partial(saved, max_pixels=settings['max_pixels'])
        try:
            kw = {'group_pixels': settings['group_pixels']} if 'group_pixels' in settings else {}
            return vs.postprocess(lambda: mod.Validator(cat_ids, **kw), outs, batches, device)
        finally: mod.batch_mask_runs = saved
    return run


def syncs(run, outs, batches, device) -> dict:
    "Device synchronisations of one run by source line (`file:line` of the Python call that made them)."
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        torch.cuda.set_sync_debug_mode('warn')
        try: run(outs, batches, device)
        finally: torch.cuda.set_sync_debug_mode(0)
    by_line = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught if 'synchroniz' in str(w.message))
    return dict(total=sum(by_line.values()), by_line=dict(by_line.most_common()))


def memory(run, outs, batches, device) -> dict:
    "Peak allocated above the start, and the reserved pool's growth, over one run (MiB)."
    torch.cuda.synchronize(); a0, r0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    run(outs, batches, device)
    torch.cuda.synchronize()
    return dict(peak_extra_mib=(torch.cuda.max_memory_allocated() - a0) / 2**20, reserved_growth_mib=(torch.cuda.memory_reserved() - r0) / 2**20)


def profile(run, outs, batches, device) -> dict:
    "Host milliseconds in waiting CUDA runtime calls and kernel milliseconds of one run, under torch.profiler."
    from torch.profiler import ProfilerActivity, profile as prof
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        _, wall = run(outs, batches, device)
    rows = {e.key: e for e in p.key_averages()}
    waits = {k: dict(calls=e.count, ms=e.self_cpu_time_total / 1e3) for k, e in rows.items()
             if k.startswith('cuda') and any(s in k for s in ('Synchronize', 'Memcpy', 'HostAlloc', 'EventSync'))}
    kernels = sum(getattr(e, 'self_device_time_total', 0) for e in p.events() if e.device_type.name == 'CUDA') / 1e3
    return dict(wall_ms=wall * 1e3, kernel_ms=kernels, waits=waits)


def python_profile(run, outs, batches, device, top: int = 25) -> dict:
    "One run under cProfile: the functions with the most own time and the most time inside (ms, calls); waits for the device count where they happen."
    prof = cProfile.Profile()
    prof.enable()
    try: run(outs, batches, device)
    finally: prof.disable()
    st = pstats.Stats(prof).stats   # (file, line, name) -> (calls, primitive calls, own time, time inside, callers)
    rows = [(f"{Path(f).name}:{line}({name})", ncalls, tt * 1e3, ct * 1e3) for (f, line, name), (_, ncalls, tt, ct, _) in st.items()]
    pick = lambda k: [dict(function=r[0], calls=r[1], own_ms=round(r[2], 2), inside_ms=round(r[3], 2)) for r in sorted(rows, key=lambda r: -r[k])[:top]]
    return dict(by_own_time=pick(2), by_time_inside=pick(3))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--checkpoint', help="a lucid checkpoint (default: notebook 07's GPU-cell model)")
    p.add_argument('--arm', action='append', required=True, help='REV[:group_pixels=N,max_pixels=N]; HEAD is this checkout')
    p.add_argument('--rounds', type=int, default=7)
    p.add_argument('--precision', default='bf16-mixed', choices=('bf16-mixed', '32-true'))
    p.add_argument('--tag', default='')
    p.add_argument('--out', default='benchmarks/results')
    p.add_argument('--device', default='cuda', help='cpu: a quick check of the script (times only)')
    p.add_argument('--batches', type=int, default=None, help='only the first N validation batches (quick checks)')
    a = p.parse_args()
    device = torch.device(a.device)
    dm = YoloData(prefetch=False); dm.setup('fit')
    cpu_batches = list(dm.val_dataloader())[:a.batches]
    net = vs.eval_net(a.checkpoint, len(dm.cat_ids)).to(device)
    batches = [dm.on_after_batch_transfer({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in b.items()}) for b in cpu_batches]
    with torch.inference_mode(), torch.autocast(device.type, torch.bfloat16, enabled=a.precision == 'bf16-mixed'):
        outs = [net(b['img']) for b in batches]
    arms = []
    for text in a.arm:
        rev, settings = parse_arm(text)
        mod = M if rev == 'HEAD' else vs.load_baseline(rev, 'lucid_nb_ab_' + ''.join(ch if ch.isalnum() else '_' for ch in rev))
        arms.append((text, arm_runner(mod, settings, dm.cat_ids), mod))
    first = None
    for name, run, mod in arms:   # warm-up; every arm's results bytes must equal the first's
        v, _ = run(outs, batches, device)
        body, stats = mod.results_bytes(v.results), getattr(v, 'mask_stats', None)
        if first is None: first, first_stats, detections = body, stats, len(v.results)
        elif body != first: raise SystemExit(f'arm {name}: other results bytes than {arms[0][0]}')
        elif None not in (stats, first_stats) and stats != first_stats: raise SystemExit(f'arm {name}: other mask areas and boxes than {arms[0][0]}')
    gc.collect(); gc.freeze()   # as `FrozenHeap` does at fit start: the collector walks only what the runs make
    times, collector, gc_s, gens = collections.defaultdict(list), CollectorTime(), collections.defaultdict(list), collections.defaultdict(collections.Counter)
    for r in range(a.rounds):
        for k in range(len(arms)):
            name, run, _ = arms[(r + k) % len(arms)]
            g0, n0 = collector.seconds, collector.by_gen.copy()
            times[name].append(run(outs, batches, device)[1])
            gc_s[name].append(collector.seconds - g0); gens[name] += collector.by_gen - n0
        print(f"round {r}: " + ' | '.join(f"{n} {times[n][-1] * 1e3:.0f} ms" for n, *_ in arms), flush=True)
    res = dict(what="one validation's post-processing (Validator.update, batch by batch, synchronised) of the same model outputs "
                    "by each arm, alternating rounds", checkpoint=a.checkpoint or 'notebook 07 GPU-cell model (random init, class biases 0)',
               precision=a.precision, detections=detections, images=sum(len(b['img']) for b in batches), batches=len(batches),
               rounds=a.rounds, arms={})
    base = statistics.median(times[arms[0][0]])
    for name, run, _ in arms:
        ts = times[name]
        paired = [t / b for t, b in zip(ts, times[arms[0][0]])]   # round by round: the machine's drift cancels
        r = dict(median_s=statistics.median(ts), min_s=min(ts), max_s=max(ts), runs_s=ts, ratio_to_first=statistics.median(ts) / base,
                 paired_ratio_to_first=dict(median=statistics.median(paired), min=min(paired), max=max(paired)),
                 gc_runs_s=gc_s[name], gc_collections_by_generation=dict(gens[name]))
        if device.type == 'cuda':
            r.update(syncs=syncs(run, outs, batches, device), memory=memory(run, outs, batches, device), profile=profile(run, outs, batches, device),
                     python_profile=python_profile(run, outs, batches, device))
        res['arms'][name] = r
        if device.type != 'cuda':
            print(f"{name}: median {r['median_s'] * 1e3:.0f} ms, x{r['ratio_to_first']:.2f}, gc {r['gc_runs_s']}", flush=True); continue
        print(f"{name}: median {r['median_s'] * 1e3:.0f} ms ({r['min_s'] * 1e3:.0f}-{r['max_s'] * 1e3:.0f}), round by round x{statistics.median(paired):.2f} ({min(paired):.2f}-{max(paired):.2f}); "
              f"gc {statistics.median(r['gc_runs_s']) * 1e3:.0f} ms {r['gc_collections_by_generation']}; syncs {r['syncs']['total']}; peak +{r['memory']['peak_extra_mib']:.0f} MiB, reserved +{r['memory']['reserved_growth_mib']:.0f}; "
              f"kernels {r['profile']['kernel_ms']:.0f} ms of {r['profile']['wall_ms']:.0f}; waits "
              + ', '.join(f"{k} {w['calls']}x {w['ms']:.0f} ms" for k, w in r['profile']['waits'].items()), flush=True)
    res.update(command=shlex.join([Path(sys.executable).name, *sys.argv]), date=datetime.now(timezone.utc).isoformat(timespec='seconds'),
               device=device_tag() if device.type == 'cuda' else 'cpu', env=env_info())
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    path = out / f'postprocess_ab_{res["device"]}{a.tag}.json'
    path.write_text(json.dumps(res, indent=1) + '\n')
    print('->', path)


if __name__ == '__main__':
    main()
