"""`scale.py profile`'s in-fit callback: a training step's kernel time per image, by part and by kernel family.

Given to `lucid fit` as `--trainer.callbacks '{"class_path": "scale_profile.KernelProfile", "init_args": {...}}'` with
`benchmarks/` on `PYTHONPATH`. After `warmup` steps it times `timed` steps (device synchronised at both ends, no
profiler), then runs `torch.profiler` over `steps` steps, each step's parts in `record_function` ranges: forward (batch
start to the loss module's call), loss (to the backward), backward, optimizer (Lightning's `on_before_optimizer_step` to
the batch end: the update and the schedule), ema (`module.ema.update`). Kernels are put in the part whose range holds
the host call that launched them (backward's kernels are launched from autograd's own thread while the main thread waits
in its range); those of no range (batch copy, HSV, logging, a replayed graph) count as `outside` / `unattributed`.
Without CUDA the same is done with the host operators' own (self) CPU time. With `parts=False` (the whole step replayed
from CUDA graphs) only the total and the families are reported. It writes one JSON to `out`.
"""
import bisect, collections, json, re, time
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

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
        loss = getattr(module, 'loss_fn', None)
        if isinstance(loss, torch.nn.Module):
            loss.register_forward_pre_hook(lambda *_: self._open('loss')); self.hooked.append('loss')
        ema = getattr(module, 'ema', None)
        if callable(getattr(ema, 'update', None)):
            update = ema.update
            def timed_update(*args, **kwargs):
                self._open('ema')
                try: return update(*args, **kwargs)
                finally: self._close()
            ema.update = timed_update; self.hooked.append('ema')

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
