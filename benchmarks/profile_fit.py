"""Where a reference fit's time and memory go: a training step by part, the seconds before the first step, each
epoch's peak memory, and (for `scale.py profile`) a step's kernel time by part and kernel family.

    python benchmarks/profile_fit.py step [--arm native|head|step] [--batch-size 4] [--steps 40] [--smoke] [-- lucid args]
    python benchmarks/profile_fit.py startup [-- lucid args]
    python benchmarks/profile_fit.py memory [--tag step] [-- --model.capture_train_step true]

Each mode runs the real trainer (`cli_main`: `LitYolo` + `YoloData` under Lightning) in this process with the reference
settings (`configs/coco128-seg-n.yaml`: nano, 640 px, bf16-mixed, RAM cache) and one callback.

`step`: each training step timed from Lightning's hooks, the device synchronised at each: forward + loss (batch start
to `on_before_backward`), backward (to `on_after_backward`), optimiser (from `on_before_optimizer_step` to the batch
end: update, schedule, EMA); the run's `timing.json` gives the time the loop waited for data. After the timed steps,
five steps under the profiler: kernels launched per step and the top host ops. `--arm head`: the head replayed from
CUDA graphs, `--arm step`: the whole step. `--smoke`: CPU, 64 px, a few steps, into a temporary folder. Writes
`profile_step_b<batch>_<device>_<commit>[_head|_step].json`.

`startup`: one training step without validation under cProfile: the stage times (process start, imports, CUDA context,
CLI, Lightning's set-up with the step) and the 60 most expensive calls (cumulative). The whole process's start to the
first step as `lucid` starts (bytecode cache, lean imports, collector paused) is `reference_run.py`'s `startup_seconds`.
Writes `profile_startup_<device>_<commit>.json`. This file imports only the standard library before `main`: the
callbacks, which need Lightning, are made on first use, so the imports are timed here.

`memory` (CUDA): the whole 10-epoch fit; at the end of each epoch's training and of each validation, the allocator's
peak allocated and reserved memory since the last reading (then reset) and the reserved memory per pool (the default
pool; the recorded CUDA graphs' private pool), and each validation's seconds. At each validation's first batch, after the
trainer gave the allocator's unused cache back, what the allocator still holds (reserved, allocated, segments, free bytes
inside partly used segments): the floor validation's own blocks are added to. The allocator is set up as `lucid` sets it
(expandable segments, unless `PYTORCH_ALLOC_CONF` / `PYTORCH_CUDA_ALLOC_CONF` is set or `LUCID_NB_EXPANDABLE_SEGMENTS=0`:
PyTorch's defaults). `peak_reserved_mib` is the largest reading: the process's peak, as `reference_run.py` reads it once
at the end. Writes `memory_epochs_<device>_<commit>_<tag>.json`.

`KernelProfile` (`scale.py profile` gives it to `lucid fit` as `--trainer.callbacks '{"class_path":
"profile_fit.KernelProfile", "init_args": {...}}'` with `benchmarks/` on `PYTHONPATH`): after `warmup` steps it times
`timed` steps (device synchronised at both ends, no profiler), then runs `torch.profiler` over `steps` steps, each
step's parts in `record_function` ranges: forward (batch start to the loss module's call), loss (to the backward),
backward, optimizer (Lightning's `on_before_optimizer_step` to the batch end: the update and the schedule), ema
(`module.ema.update`). Kernels are put in the part whose range holds the host call that launched them (backward's
kernels are launched from autograd's own thread while the main thread waits in its range); those of no range (batch
copy, HSV, logging, a replayed graph) count as `outside` / `unattributed`. Without CUDA the same is done with the host
operators' own (self) CPU time. With `parts=False` (the whole step replayed) only the total and the families are
reported. It writes one JSON to `out`.
"""
import time
T0 = time.perf_counter()   # `startup`'s clock starts with the process
import argparse, bisect, collections, cProfile, io, json, os, pstats, re, statistics, tempfile
from pathlib import Path

from common import CPU_CONFIG, REFERENCE_CONFIG, mark_loss_and_ema, write_result

MiB = 2 ** 20
ARMS = {'native': [], 'head': ['--model.capture_segment_heads', 'true'], 'step': ['--model.capture_train_step', 'true']}
STEP_PARTS = ('forward_loss', 'backward', 'optimizer_ema', 'total')   # `step`'s hook-timed parts
PARTS = ('forward', 'loss', 'backward', 'optimizer', 'ema')
# kernel (CUDA) or operator (CPU) name -> family, first match wins (lower-cased names)
FAMILIES = (
    ('copy/cast', r'copy|memcpy|::cat$'),
    ('batchnorm', r'batch_?norm|(^|[^a-z])bn_'),
    ('gemm/conv', r'gemm|conv(?!ert)|cutlass|xmma|cudnn|winograd|implicit|[dw]grad|fprop|nchwtonhwc|nhwctonchw|(^|[^a-z])sm\d+_'
                  r'|::(add|b)?mm$|matmul|linear'),
    ('elementwise', r'elementwise|multi_tensor|foreach|pointwise|::(add|sub|mul|div|sigmoid|silu|exp|log|pow|clamp|clamp_min'
                    r'|clamp_max|where|neg|sqrt|rsqrt|abs|fill|zero|lerp|addcmul|addcdiv|relu|tanh|lt|gt|le|ge|eq|ne|masked_fill'
                    r'|sign|floor|ceil|round|reciprocal|maximum|minimum|threshold|softplus|bitwise_\w+|logical_\w+)_?$'),
    ('reduction', r'reduce|softmax|topk|sort|radix|scan|_pool|(^|[^a-z])(sum|mean|amax|amin|argmax|argmin|max|min|norm'
                  r'|cumsum|std|var|all|any)([^a-z]|$)'),
)


def family(name: str) -> str:
    low = name.lower()
    return next((f for f, pat in FAMILIES if re.search(pat, low)), 'other')


def analyse(prof, cuda: bool, steps: int, batch: int) -> dict:
    "Kernel (CPU: operator self) microseconds per image: total, by part, by family, by part and family; the top names."
    from torch.autograd import DeviceType
    ev, cpu = prof.events(), DeviceType.CPU
    ranges = sorted((e.time_range.start, e.time_range.end, e.name) for e in ev if e.device_type == cpu and e.name in PARTS)
    starts = [r[0] for r in ranges]
    def part_of(t):
        i = bisect.bisect_right(starts, t) - 1
        return ranges[i][2] if i >= 0 and t < ranges[i][1] else 'outside'
    annotations = {e.name for e in ev if getattr(e, 'is_user_annotation', False)} | set(PARTS)   # ranges, Optimizer.step#...
    skip = lambda e: e.name in annotations or e.name.startswith('ProfilerStep') or getattr(e, 'is_user_annotation', False)
    if cuda:   # (launch time, name, us): kernels by the host operator that launched them; every device event for totals
        launched = [(e.time_range.start, k.name, k.duration) for e in ev if e.device_type == cpu and not e.is_async for k in e.kernels]
        work = [(None, e.name, e.time_range.elapsed_us()) for e in ev if e.device_type != cpu and not skip(e)]
    else:
        launched = work = [(e.time_range.start, e.name, e.self_cpu_time_total) for e in ev
                           if e.device_type == cpu and not e.is_async and not skip(e)]
    n = steps * batch
    per = lambda us: round(us / n, 3)
    total = sum(w[2] for w in work)
    by_part, by_part_family = collections.Counter(), collections.defaultdict(collections.Counter)
    for t, name, us in launched:
        p = part_of(t); by_part[p] += us; by_part_family[p][family(name)] += us
    by_family, by_name, count = collections.Counter(), collections.Counter(), collections.Counter()
    for _, name, us in work: by_family[family(name)] += us; by_name[name] += us; count[name] += 1
    return dict(
        clock='cuda kernel' if cuda else 'cpu operator self', steps=steps, batch_size=batch, images=n,
        total_us_per_image=per(total), calls_per_step=round(len(work) / steps, 1),
        by_part_us_per_image={p: per(by_part[p]) for p in (*PARTS, 'outside') if p in by_part},
        unattributed_us_per_image=per(total - sum(by_part.values())),   # device work no host operator launched (graph replay)
        by_family_us_per_image={f: per(us) for f, us in by_family.most_common()},
        by_part_family_us_per_image={p: {f: per(us) for f, us in c.most_common()} for p, c in by_part_family.items()},
        top=[dict(name=k[:160], family=family(k), us_per_image=per(us), calls_per_step=round(count[k] / steps, 1))
             for k, us in by_name.most_common(25)])


def reserved_by_pool() -> dict:
    "Reserved MiB now, per allocator pool: `default`, or `graphs` (private pools, where recorded CUDA graphs live)."
    import torch
    by = collections.Counter()
    for seg in torch.cuda.memory_snapshot():
        by['default' if tuple(seg.get('segment_pool_id') or (0, 0)) == (0, 0) else 'graphs'] += seg['total_size']
    return {k: round(v / MiB, 1) for k, v in sorted(by.items())}


def allocator_now() -> dict:
    "What the allocator holds now: reserved and allocated MiB, its segments, and the free bytes inside partly used segments."
    import torch
    st = torch.cuda.memory_stats()
    return dict(reserved_now_mib=st.get('reserved_bytes.all.current', 0) / MiB,
                allocated_now_mib=st.get('allocated_bytes.all.current', 0) / MiB,
                segments=st.get('segment.all.current', 0),
                inactive_split_mib=st.get('inactive_split_bytes.all.current', 0) / MiB, by_pool=reserved_by_pool())


def _callbacks() -> dict:
    "The callbacks (Lightning `Callback`s), made on first use: importing this file costs no torch or Lightning import."
    import torch
    from lightning.pytorch.callbacks import Callback
    from torch.profiler import ProfilerActivity, profile, record_function

    class StepTimer(Callback):
        "Wall time of each part of each training step (device synchronised at every mark), then a profiled window."
        def __init__(self, warmup:int, steps:int, profiled:int=5):
            self.warmup, self.steps, self.profiled = warmup, steps, profiled
            self.parts, self.prof, self.marks = {k: [] for k in STEP_PARTS}, None, {}
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

    class EpochPeaks(Callback):
        "The allocator's peaks since the last reading, at each epoch's training end and validation end."
        def __init__(self): self.readings = []
        def _read(self, trainer, phase):
            torch.cuda.synchronize()
            self.readings.append(dict(epoch=trainer.current_epoch, phase=phase,
                                      peak_allocated_mib=torch.cuda.max_memory_allocated() / MiB,
                                      peak_reserved_mib=torch.cuda.max_memory_reserved() / MiB,
                                      reserved_now_mib=torch.cuda.memory_reserved() / MiB, by_pool=reserved_by_pool()))
            torch.cuda.reset_peak_memory_stats()
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx == trainer.num_training_batches - 1: self._read(trainer, 'training')
        def on_validation_start(self, trainer, module):
            torch.cuda.synchronize(); self.started = time.perf_counter()
        def on_validation_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
            if batch_idx or trainer.sanity_checking: return
            torch.cuda.synchronize()   # after `LitYolo.on_validation_epoch_start` gave the allocator's unused cache back
            self.readings.append(dict(epoch=trainer.current_epoch, phase='validation start', **allocator_now()))
        def on_validation_end(self, trainer, module):
            if trainer.sanity_checking: return
            self._read(trainer, 'validation'); self.readings[-1]['seconds'] = time.perf_counter() - self.started

    class KernelProfile(Callback):
        "Time `timed` steps after `warmup`, then profile `steps` steps with their parts in ranges; the analysis into `out`."
        def __init__(self, out: str, warmup: int = 8, timed: int = 20, steps: int = 5, parts: bool = True):
            self.out, self.warmup, self.timed, self.steps, self.parts = Path(out), warmup, timed, steps, parts
            self.prof, self.range, self.batches, self.t0, self.timed_seconds, self.batch_size = None, None, 0, None, None, None

        def _sync(self):
            if self.cuda: torch.cuda.synchronize()
            return time.perf_counter()

        def _open(self, name: str):
            self._close()
            if self.prof is not None: self.range = record_function(name); self.range.__enter__()

        def _close(self):
            if self.range is not None: self.range.__exit__(None, None, None); self.range = None

        def on_train_start(self, trainer, module):
            self.cuda = trainer.strategy.root_device.type == 'cuda'
            self.hooked = []
            if not self.parts: return
            self.hooked = mark_loss_and_ema(module, self._open, self._close)

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            i, w, t, k = self.batches, self.warmup, self.timed, self.steps
            self.batches += 1
            if i == w: self.t0 = self._sync()
            if i == w + t:
                self.timed_seconds = self._sync() - self.t0
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
                self.prof = profile(activities=acts); self.prof.__enter__()
            if i == w + t + k: self._finish(batch)
            if self.parts: self._open('forward')

        def on_before_backward(self, trainer, module, loss):
            if self.parts: self._open('backward')

        def on_after_backward(self, trainer, module): self._close()

        def on_before_optimizer_step(self, trainer, module, optimizer):
            if self.parts: self._open('optimizer')

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self._close()
            if self.batch_size is None: self.batch_size = len(batch['img'])

        def _finish(self, batch):
            self._close(); self._sync()
            self.prof.__exit__(None, None, None)
            res = analyse(self.prof, self.cuda, self.steps, self.batch_size)
            self.prof = None
            res.update(warmup=self.warmup, timed_steps=self.timed, timed_seconds=self.timed_seconds,
                       timed_images_per_s=self.timed * self.batch_size / self.timed_seconds,
                       timed_step_ms=1e3 * self.timed_seconds / self.timed, ranges=self.parts, hooked=self.hooked,
                       peak_reserved_mib=torch.cuda.max_memory_reserved() / 2**20 if self.cuda else None)
            self.out.parent.mkdir(parents=True, exist_ok=True); self.out.write_text(json.dumps(res, indent=1))

        def on_train_end(self, trainer, module):
            if self.prof is not None or not self.out.exists():
                raise RuntimeError(f'KernelProfile: the fit ended after {self.batches} batches, before the profiled window '
                                   f'(warmup {self.warmup} + timed {self.timed} + profiled {self.steps} steps) was over')

    return dict(StepTimer=StepTimer, EpochPeaks=EpochPeaks, KernelProfile=KernelProfile)


_CALLBACKS = {}


def callback(name: str):
    "A callback class by name, made on first use."
    if not _CALLBACKS: _CALLBACKS.update(_callbacks())
    return _CALLBACKS[name]


def __getattr__(name: str):
    "`profile_fit.KernelProfile` (and the others) for a class path given to `lucid fit`."
    if name in ('StepTimer', 'EpochPeaks', 'KernelProfile'): return callback(name)
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def step(a) -> Path:
    "A training step by part (hooks, device synchronised), then five steps under the profiler."
    from lucid_nb.command import cli_main
    if a.capture: a.arm = 'head'
    if a.smoke: a.warmup, a.steps, a.batch_size, a.out = 2, 3, 2, a.out or tempfile.mkdtemp()
    timer = callback('StepTimer')(a.warmup, a.steps)
    args = ['--config', str(CPU_CONFIG if a.smoke else REFERENCE_CONFIG), '--data.batch_size', str(a.batch_size),
            '--trainer.max_steps', str(a.warmup + a.steps + timer.profiled), '--trainer.limit_val_batches', '0',
            '--trainer.enable_progress_bar', 'false', '--trainer.enable_checkpointing', 'false',
            '--trainer.default_root_dir', tempfile.mkdtemp(prefix='profile_step_'), *ARMS[a.arm]]
    if a.smoke: args += ['--trainer.accelerator', 'cpu', '--data.imgsz', '64', '--data.val_count', '2']
    cli = cli_main([*args, *a.extra], run=False)
    cli.trainer.callbacks.append(timer)
    cli.trainer.fit(cli.model, cli.datamodule)
    import torch
    run = Path(cli.trainer.log_dir)
    timing = json.loads((run / 'timing.json').read_text())
    ev = timer.prof.key_averages()
    cuda = [e for e in ev if e.device_type == torch.autograd.DeviceType.CUDA]
    res = dict(what=f'{a.arm} training step of the real trainer (LitYolo under Lightning), parts timed from its hooks with a '
                    'device sync at each', arm=a.arm, batch_size=a.batch_size, lucid_args=[*args, *a.extra],
               recorder=json.loads((run / 'recorder.json').read_text()) if (run / 'recorder.json').exists() else None,
               steps=a.steps, warmup=a.warmup,
               median_ms={k: round(statistics.median(v) * 1e3, 2) for k, v in timer.parts.items()},
               min_ms={k: round(min(v) * 1e3, 2) for k, v in timer.parts.items()},
               max_ms={k: round(max(v) * 1e3, 2) for k, v in timer.parts.items()},
               data_wait_seconds=[e['data_wait_seconds'] for e in timing['epochs']], timing=timing,
               kernels_per_step=sum(e.count for e in cuda) / timer.profiled,
               gpu_kernel_ms_per_step=round(sum(e.self_device_time_total for e in cuda) / timer.profiled / 1e3, 2),
               profiler_top_host_ops=ev.table(sort_by='self_cpu_time_total', row_limit=20))
    path = write_result(f'profile_step_b{a.batch_size}', res, tag='' if a.arm == 'native' else a.arm, out=a.out or 'benchmarks/results')
    print(json.dumps({k: v for k, v in res.items() if k not in ('profiler_top_host_ops', 'timing', 'lucid_args')}, indent=1))
    print(f'-> {path}'); return path


def startup(a) -> Path:
    "One training step without validation under cProfile: seconds by stage from the process's start, the costliest calls."
    pr = cProfile.Profile(); pr.enable()
    t = {'python start to main': time.perf_counter() - T0}; s = time.perf_counter()
    import torch, lightning
    t['import torch, lightning'] = time.perf_counter() - s; s = time.perf_counter()
    from lucid_nb.command import cli_main
    t['import lucid_nb.command'] = time.perf_counter() - s; s = time.perf_counter()
    if torch.cuda.is_available(): torch.cuda.init(); torch.zeros(1, device='cuda')
    t['CUDA context'] = time.perf_counter() - s; s = time.perf_counter()
    root = tempfile.mkdtemp(prefix='profile_startup_')   # the run's files (hashes, timing, drawings) go here, not into the cwd
    cli = cli_main(['--config', str(REFERENCE_CONFIG), '--trainer.max_steps', '1', '--trainer.default_root_dir', root,
                    '--trainer.limit_val_batches', '0', '--trainer.enable_progress_bar', 'false', '--trainer.logger', 'false',
                    '--trainer.enable_checkpointing', 'false', *a.extra], run=False)
    t['CLI: parse and build model, data, trainer'] = time.perf_counter() - s; s = time.perf_counter()
    cli.trainer.fit(cli.model, cli.datamodule)
    t['fit: set-up + 1 step + end'] = time.perf_counter() - s
    pr.disable()
    buf = io.StringIO(); pstats.Stats(pr, stream=buf).sort_stats('cumulative').print_stats(60)
    path = write_result('profile_startup', dict(what='seconds before the first training step, by stage, under cProfile',
                                                stages_s=t, lightning=lightning.__version__, extra_args=a.extra, cprofile_cumulative=buf.getvalue()),
                        out=a.out or 'benchmarks/results')
    print(''.join(f"{k:<45} {v:7.2f} s\n" for k, v in t.items()) + buf.getvalue()[:2000] + f'-> {path}'); return path


def memory(a) -> Path:
    "The whole reference fit with the allocator read at each epoch's training end, validation start and validation end."
    from lucid_nb.allocator import ALLOCATOR_VARIABLES, allocator_defaults
    allocator_defaults()   # the allocator `lucid` sets up (its fit here runs in this process, not through `lucid`)
    import torch, lucid_nb
    from lucid_nb.command import cli_main
    if not torch.cuda.is_available(): raise SystemExit('profile_fit memory: reads the CUDA allocator; run it on a CUDA GPU')
    peaks = callback('EpochPeaks')()
    cli = cli_main(['--config', str(REFERENCE_CONFIG), '--trainer.enable_progress_bar', 'false',
                    '--trainer.logger', 'false', '--trainer.enable_checkpointing', 'false', *a.extra], run=False)
    cli.trainer.callbacks.append(peaks)
    cli.trainer.fit(cli.model, cli.datamodule)
    top = max((r for r in peaks.readings if 'peak_reserved_mib' in r), key=lambda r: r['peak_reserved_mib'])
    res = dict(extra_args=a.extra, library=str(Path(lucid_nb.__file__).parent),
               environment={k: v for k, v in os.environ.items() if k.startswith('LUCID_NB_') or k in ALLOCATOR_VARIABLES},
               peak_reserved_mib=top['peak_reserved_mib'], peak_at=dict(epoch=top['epoch'], phase=top['phase']),
               readings=peaks.readings)
    path = write_result('memory_epochs', res, tag=a.tag, out=a.out or 'benchmarks/results')
    print(f"{a.tag or 'run'}: peak reserved {top['peak_reserved_mib']:.0f} MiB at epoch {top['epoch']} {top['phase']} -> {path}")
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0].replace('\n', ' '))
    sub = p.add_subparsers(dest='mode', required=True)
    shared = argparse.ArgumentParser(add_help=False)
    shared.add_argument('--out', help='folder of the result file (default benchmarks/results; step --smoke: a temporary one)')
    shared.add_argument('extra', nargs='*', help='extra `lucid fit` arguments, after --')
    s = sub.add_parser('step', parents=[shared], help='a training step by part, then its kernels')
    s.add_argument('--steps', type=int, default=40); s.add_argument('--warmup', type=int, default=10)
    s.add_argument('--batch-size', type=int, default=4)
    s.add_argument('--arm', choices=tuple(ARMS), default='native', help='what is replayed from CUDA graphs: nothing, the head, the whole step')
    s.add_argument('--capture', action='store_true', help='the same as --arm head')
    s.add_argument('--smoke', action='store_true', help='CPU, 64 px, 2 warm-up + 3 timed steps')
    sub.add_parser('startup', parents=[shared], help='the seconds before the first training step, under cProfile')
    m = sub.add_parser('memory', parents=[shared], help="each epoch's peak memory, by pool (CUDA)")
    m.add_argument('--tag', default='', help='result file tag (memory_epochs_<device>_<commit>_<tag>.json), e.g. native, step_b16')
    a = p.parse_args(argv)
    return dict(step=step, startup=startup, memory=memory)[a.mode](a)


if __name__ == '__main__':
    main()
