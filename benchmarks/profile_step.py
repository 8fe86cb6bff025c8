"""Where does a training step's time go, natively and with the head replayed (`--capture`)?

Runs the real trainer (`lucid fit` through `cli_main`: `LitYolo` + `YoloData` under Lightning) with the reference
settings (`configs/coco128-seg-n.yaml`: nano, batch 4, 640 px, BF16 autocast) and times each training step from
Lightning's hooks, synchronising the device at each: forward + loss (batch start to `on_before_backward`),
backward (to `on_after_backward`), optimiser (from `on_before_optimizer_step` to the batch end: update, schedule,
EMA). The run's own `timing.json` gives the time the loop waited for data. After the timed steps, five steps run
under the profiler for the kernels launched per step and the top host ops. The JSON is named after the device the
run found (`profile_step_b4_<device>.json`, `_replay` with `--capture`).

    python benchmarks/profile_step.py --steps 40 --out benchmarks/results [--capture] [--batch-size 16]
    python benchmarks/profile_step.py --smoke     # CPU, 64 px, a few steps: proves the script runs
"""
import argparse, json, statistics, sys, tempfile, time
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback
from torch.profiler import ProfilerActivity, profile

from lucid_nb.core import device_tag, env_info, repo_root
from lucid_nb.command import cli_main

PARTS = ('forward_loss', 'backward', 'optimizer_ema', 'total')


class StepTimer(Callback):
    "Wall time of each part of each training step (device synchronised at every mark), then a profiled window."
    def __init__(self, warmup:int, steps:int, profiled:int=5):
        self.warmup, self.steps, self.profiled = warmup, steps, profiled
        self.parts, self.prof, self.marks = {k: [] for k in PARTS}, None, {}
    def _mark(self, trainer, name):
        if trainer.strategy.root_device.type == 'cuda': torch.cuda.synchronize()
        self.marks[name] = time.perf_counter()
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.marks = {}; self._mark(trainer, 'start')
        if trainer.global_step == self.warmup + self.steps:
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.prof = profile(activities=acts); self.prof.__enter__()
    def on_before_backward(self, trainer, module, loss): self._mark(trainer, 'backward')
    def on_after_backward(self, trainer, module): self._mark(trainer, 'backward_end')
    def on_before_optimizer_step(self, trainer, module, optimizer): self._mark(trainer, 'optimizer')
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self._mark(trainer, 'end'); m = self.marks
        step = trainer.global_step - 1   # global_step counts the step just taken
        if self.warmup <= step < self.warmup + self.steps and len(m) == 5:
            for k, (a, b) in dict(forward_loss=('start', 'backward'), backward=('backward', 'backward_end'),
                                  optimizer_ema=('optimizer', 'end'), total=('start', 'end')).items():
                self.parts[k].append(m[b] - m[a])
        if self.prof is not None and step == self.warmup + self.steps + self.profiled - 1:
            self.prof.__exit__(None, None, None); trainer.should_stop = True


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--steps', type=int, default=40); p.add_argument('--warmup', type=int, default=10)
    p.add_argument('--batch-size', type=int, default=4); p.add_argument('--out', default='benchmarks/results')
    p.add_argument('--capture', action='store_true', help='replay the head from CUDA graphs (--model.capture_segment_heads true)')
    p.add_argument('--smoke', action='store_true', help='CPU, 64 px, 2 warm-up + 3 timed steps, into a temporary folder')
    p.add_argument('extra', nargs='*', help='extra `lucid fit` arguments, after --')
    a = p.parse_args(argv)
    if a.smoke: a.warmup, a.steps, a.batch_size, a.out = 2, 3, 2, a.out if '--out' in (argv or sys.argv) else tempfile.mkdtemp()
    timer = StepTimer(a.warmup, a.steps)
    config = 'coco128-seg-n-cpu.yaml' if a.smoke else 'coco128-seg-n.yaml'
    args = ['--config', str(repo_root() / 'configs' / config), '--data.batch_size', str(a.batch_size),
            '--trainer.max_steps', str(a.warmup + a.steps + timer.profiled), '--trainer.limit_val_batches', '0',
            '--trainer.enable_progress_bar', 'false', '--trainer.enable_checkpointing', 'false',
            '--trainer.default_root_dir', tempfile.mkdtemp(prefix='profile_step_')]
    if a.capture: args += ['--model.capture_segment_heads', 'true']
    if a.smoke: args += ['--trainer.accelerator', 'cpu', '--data.imgsz', '64', '--data.val_count', '2']
    cli = cli_main([*args, *a.extra], run=False)
    cli.trainer.callbacks.append(timer)
    cli.trainer.fit(cli.model, cli.datamodule)
    run = Path(cli.trainer.log_dir)
    timing = json.loads((run / 'timing.json').read_text())
    ev = timer.prof.key_averages()
    cuda = [e for e in ev if e.device_type == torch.autograd.DeviceType.CUDA]
    table = ev.table(sort_by='self_cpu_time_total', row_limit=20)
    arm = 'replay' if a.capture else 'native'
    res = dict(what=f'{arm} training step of the real trainer (LitYolo under Lightning), parts timed from its hooks with a '
                    'device sync at each', batch_size=a.batch_size, lucid_args=[*args, *a.extra],
               recorder=json.loads((run / 'recorder.json').read_text()) if (run / 'recorder.json').exists() else None,
               steps=a.steps, warmup=a.warmup, env=env_info(),
               median_ms={k: round(statistics.median(v) * 1e3, 2) for k, v in timer.parts.items()},
               min_ms={k: round(min(v) * 1e3, 2) for k, v in timer.parts.items()},
               max_ms={k: round(max(v) * 1e3, 2) for k, v in timer.parts.items()},
               data_wait_seconds=[e['data_wait_seconds'] for e in timing['epochs']], timing=timing,
               kernels_per_step=sum(e.count for e in cuda) / timer.profiled,
               gpu_kernel_ms_per_step=round(sum(e.self_device_time_total for e in cuda) / timer.profiled / 1e3, 2),
               profiler_top_host_ops=table)
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    path = out / f"profile_step_b{a.batch_size}{'_replay' if a.capture else ''}_{device_tag()}.json"
    path.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k not in ('profiler_top_host_ops', 'timing', 'lucid_args')}, indent=1))
    print(f'-> {path}')
    return path


if __name__ == '__main__':
    main()
