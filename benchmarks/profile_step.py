"""Where does a training step's time go, natively and with the head replayed (`--capture`)?

On one GPU, with the reference settings (nano, batch 4, 640 px, BF16 autocast, SGD), runs training steps by hand —
data, forward, loss, backward, optimiser + schedule, EMA — and reports per part the median wall time (synchronised
before and after the part) over the timed steps, the kernels launched per step, and the profiler's top host ops.

    python benchmarks/profile_step.py --steps 40 --out benchmarks/results [--capture] [--batch-size 16]
"""
import argparse, json, statistics, time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from lucid_nb.core import env_info
from lucid_nb.data import YoloData
from lucid_nb.trainer import LitYolo
from lucid_nb.optim import build_optimizer, build_schedule
from lucid_nb.recorder import HeadRegion, model_outputs


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument('--steps', type=int, default=40); p.add_argument('--warmup', type=int, default=10)
    p.add_argument('--batch-size', type=int, default=4); p.add_argument('--out', default='benchmarks/results')
    p.add_argument('--capture', action='store_true', help='replay the head through a HeadRegion (CUDA graphs)')
    a = p.parse_args(argv)
    dev = torch.device('cuda')
    dm = YoloData(batch_size=a.batch_size, workers=4); dm.setup('fit')
    lit = LitYolo(num_classes=dm.num_classes).to(dev)
    model, loss_fn = lit.model.train(), lit.loss_fn
    opt = build_optimizer(model, 'sgd'); sched = build_schedule(opt, epochs=10, steps_per_epoch=24)
    batches = iter(dm.train_dataloader())
    recorder = HeadRegion() if a.capture else None
    if recorder: recorder.start(model.head)

    def sync(): torch.cuda.synchronize()
    parts = {k: [] for k in ('data', 'forward', 'loss', 'backward', 'optimizer', 'ema', 'total')}
    def step(timed):
        nonlocal batches
        t = [time.perf_counter()]
        try: b = next(batches)
        except StopIteration:
            dm.train_dataloader().set_epoch(1); batches = iter(dm.train_dataloader()); b = next(batches)
        b = {k: v.to(dev, non_blocking=True) for k, v in b.items()}; b['img'] = b['img'].float() / 255
        sync(); t.append(time.perf_counter())
        with torch.autocast('cuda', torch.bfloat16):
            out = model_outputs(model, b['img'], recorder); sync(); t.append(time.perf_counter())
            losses = loss_fn(out, b); loss = sum(losses.values()) * b['img'].shape[0]; sync(); t.append(time.perf_counter())
        opt.zero_grad(set_to_none=True); loss.backward(); sync(); t.append(time.perf_counter())
        opt.step(); sched.step(); sync(); t.append(time.perf_counter())
        lit.ema.update(model); sync(); t.append(time.perf_counter())
        if timed:
            for k, i in zip(('data', 'forward', 'loss', 'backward', 'optimizer', 'ema'), range(6)): parts[k].append(t[i + 1] - t[i])
            parts['total'].append(t[-1] - t[0])

    for _ in range(a.warmup): step(False)
    for _ in range(a.steps): step(True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5): step(False)
    ev = prof.key_averages()
    kernels = sum(e.count for e in ev if e.device_type == torch.autograd.DeviceType.CUDA) / 5
    cuda_ms = sum(e.self_device_time_total for e in ev if e.device_type == torch.autograd.DeviceType.CUDA) / 5 / 1e3
    table = ev.table(sort_by='self_cpu_time_total', row_limit=20)
    arm = 'replay' if a.capture else 'native'
    res = dict(what=f'{arm} training step, parts timed with a sync before and after each', batch_size=a.batch_size,
               recorder=recorder.report() if recorder else None,
               steps=a.steps, env=env_info(), median_ms={k: round(statistics.median(v) * 1e3, 2) for k, v in parts.items()},
               min_ms={k: round(min(v) * 1e3, 2) for k, v in parts.items()}, max_ms={k: round(max(v) * 1e3, 2) for k, v in parts.items()},
               kernels_per_step=kernels, gpu_kernel_ms_per_step=round(cuda_ms, 2), profiler_top_host_ops=table)
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    (out / f"profile_step_b{a.batch_size}{'_replay' if a.capture else ''}_nvidia-h200.json").write_text(json.dumps(res, indent=1))
    print(table); print(json.dumps({k: v for k, v in res.items() if k != 'profiler_top_host_ops'}, indent=1))
    dm.teardown()


if __name__ == '__main__':
    main()
