"""What does one training step move and compute per image, counted on the CPU (calls, bytes, FLOPs, peak bytes alive)?

Runs the real trainer (`lucid fit` through `cli_main`: `LitYolo` + `YoloData` under Lightning) with the GPU
configuration (`configs/coco128-seg-n.yaml`: nano, 640 px, bf16-mixed, the embedded data, RAM cache) on the CPU, with
mosaic on in every epoch (`--data.close_mosaic 0`), no loader workers and no validation. After `--warmup` steps (the
optimiser's momentum exists, the EMA's pairs are cached) one step runs under two `TorchDispatchMode`s: `lucid_nb.testing.OpCost` counts
every aten op, `lucid_nb.testing.TensorBytes` the bytes of the storages the step makes that are alive at once (peak
per part; the weights, EMA and optimiser state held before the step are `resident_mb`). Lightning's
bf16-mixed on the CPU is `torch.autocast('cpu', torch.bfloat16)` around `training_step`, as on the GPU (CUDA's autocast
also casts a few ops' inputs up to float32 — exp, log, pow, sum, softmax, ... — which the CPU's does not: those casts
are missing here).

Parts are marked by the step's own hooks, as `profile_fit.KernelProfile` marks them on the GPU: forward (batch start
to the loss module's call: a forward pre-hook on `module.loss_fn`), loss (to Lightning's `on_before_backward`),
backward (to `on_before_optimizer_step`), optimizer (to `module.ema.update`), ema (that call). The step total is these
five; `input` (`YoloData.on_after_batch_transfer`: uint8 to float, HSV jitter) is counted beside it, outside the total.
The optimiser takes its `foreach` path as it does on CUDA (`torch.optim` picks the per-tensor loop for CPU tensors):
the same arithmetic, in the number of calls the GPU launches.

Per op (`OpCost`): calls, except views (`OpOverload.is_view`, `inplace_view` ops, `_unsafe_view`), metadata queries and
bare allocations (`empty*`, `resize_`, `set_`), which launch no kernel; so the step's call count is the native
kernel-launch count (give or take ops that launch several kernels). Bytes read: each input tensor's bytes (a strided
or broadcast tensor counts the span it touches), each distinct storage at most its size once per op; bytes written: the
outputs and the arguments the op mutates, the same way (an in-place op reads and writes its tensor; `copy_`, `fill_`,
`zero_` only write it; an indexed write (`index_put_`, `scatter_`...) writes at most its source's bytes). FLOPs:
`torch.utils.flop_counter.flop_registry`'s formulas (convolutions and matrix products and their backward; 0 for the
rest). Families (`family`): conv/matmul, batch norm, casts/copies (`_to_copy`, `copy_`, `clone`, `cat`), elementwise
(ops tagged pointwise, `_foreach_*`), reductions (tagged reduction, softmax, pooling, sort/topk), indexing/gather, other.
A cast's name carries its dtypes (`_to_copy f32>bf16`). Per image = per step / batch size (calls stay per step).

`--gpu-profile FILE` puts the ranking of families by CPU-counted bytes beside a GPU profile's ranking by kernel time:
a `scale.py profile` result (`by_family_us_per_image`, its families mapped to these) or a `profile_fit.py step` result (its
top host operators' self CUDA time, classified here by operator name; the operators the table leaves out are `unlisted`).
Writes `step_cost_b<batch>_cpu_<commit>[_<tag>].json` (`common.write_result`); a short table last.

    python benchmarks/step_cost.py --tag before [--batch 8] [--imgsz 640] [--gpu-profile benchmarks/results/profile_step_b16_nvidia-h200.json]
    python benchmarks/step_cost.py --smoke     # batch 2, 64 px, into a temporary folder: proves the script runs
"""
import argparse, collections, json, re, sys, tempfile, time
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

from common import REFERENCE_CONFIG, mark_loss_and_ema, write_result
from lucid_nb.testing import FAMILIES, OpCost, family   # the op counter, shared with tests/test_step_cost.py

PARTS = ('forward', 'loss', 'backward', 'optimizer', 'ema')
OUTSIDE = ('input',)   # counted beside the step, not in its total
MB = 1e6


# --------------------------------------------------------------------------------------------------- the counted step
class StepCost(Callback):
    "Counts training step `step` (0-based) of the fit it is given to, part by part (the module docstring's boundaries)."
    def __init__(self, step: int = 1):
        self.step, self.started, self.cost, self.alive, self.hooked = step, 0, None, None, []
        self.peak, self.live_at_end, self.seconds, self.done = {}, {}, None, False

    def _counting(self) -> bool: return self.cost is not None and not self.done

    def _part(self, name: str):
        "Close the current part (its peak of bytes alive) and open `name`."
        if not self._counting(): return
        old = self.cost.part
        self.peak[old] = max(self.peak.get(old, 0), self.alive.peak); self.live_at_end[old] = self.alive.live
        self.alive.reset(); self.cost.part = name

    def _start(self, part: str):
        from lucid_nb.testing import TensorBytes
        t, m = self.trainer, self.module   # the bytes held before the step: weights, EMA, optimiser state
        self.resident = sum(v.nbytes for v in m.state_dict().values() if isinstance(v, torch.Tensor)) + sum(
            v.nbytes for opt in t.optimizers for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
        dm = t.datamodule
        self.mosaic = dict(probability=dm.hparams.mosaic, until_epoch=getattr(dm._train, 'mosaic_until', None), epoch=t.current_epoch)
        self.cost, self.alive = OpCost(), TensorBytes()
        self.cost.__enter__(); self.alive.__enter__()
        self.cost.part, self.t0 = part, time.perf_counter()

    def _stop(self):
        if not self._counting(): return
        self._part('outside'); self.seconds = time.perf_counter() - self.t0
        self.alive.__exit__(None, None, None); self.cost.__exit__(None, None, None)
        self.done = True

    def setup(self, trainer, module, stage):
        self.trainer, self.module = trainer, module
        dm = trainer.datamodule
        transfer = dm.on_after_batch_transfer
        def counted_transfer(batch, *args, **kwargs):
            if trainer.training and self.started == self.step and self.cost is None: self._start('input')
            return transfer(batch, *args, **kwargs)
        dm.on_after_batch_transfer = counted_transfer; self.hooked.append('input')

    def on_train_start(self, trainer, module):
        for opt in trainer.optimizers:   # the foreach path, as torch.optim takes it for CUDA tensors
            for g in opt.param_groups:
                if 'foreach' in g and g['foreach'] is None: g['foreach'] = True
        self.hooked += mark_loss_and_ema(module, self._part, self._stop, required='step_cost')

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if self.started == self.step:
            self.batch_size = len(batch['img'])
            if self.cost is None: self._start('forward')
            self._part('forward')
        self.started += 1

    def on_before_backward(self, trainer, module, loss): self._part('backward')
    def on_before_optimizer_step(self, trainer, module, optimizer): self._part('optimizer')
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self.started == self.step + 1: trainer.should_stop = True
    def on_train_end(self, trainer, module):
        if not self.done: self._stop()   # no EMA update came (then `ema` is empty: see `hooked`)


# ----------------------------------------------------------------------------------------------------------- analysis
def summarise(cb: StepCost) -> dict:
    "Per step and per image: by part, by family, by part and family; the ops; peak bytes alive; host syncs."
    B = cb.batch_size
    ops = [dict(part=p, op=n, family=family(n), calls=c, read_bytes=r, written_bytes=w, flops=f)
           for (p, n), (c, r, w, f) in cb.cost.ops.items()]
    ops.sort(key=lambda o: -(o['read_bytes'] + o['written_bytes']))
    def agg(rows):
        c, r, w, f = (sum(o[k] for o in rows) for k in ('calls', 'read_bytes', 'written_bytes', 'flops'))
        return dict(calls=c, read_mb=round(r / B / MB, 3), written_mb=round(w / B / MB, 3), bytes_mb=round((r + w) / B / MB, 3),
                    gflop=round(f / B / 1e9, 4))
    step = [o for o in ops if o['part'] in PARTS]
    total = agg(step)
    by_family = {f: agg([o for o in step if o['family'] == f]) for f in FAMILIES}
    for f, v in by_family.items(): v['bytes_share'] = round(v['bytes_mb'] / total['bytes_mb'], 4) if total['bytes_mb'] else 0
    return dict(
        batch_size=B, total=total, op_count=total['calls'],
        by_part={p: agg([o for o in ops if o['part'] == p]) for p in (*PARTS, *OUTSIDE)},
        by_family=by_family,
        by_part_family={p: {f: agg([o for o in ops if o['part'] == p and o['family'] == f]) for f in FAMILIES} for p in (*PARTS, *OUTSIDE)},
        peak_bytes_alive=dict(step_mb=round(max(cb.peak.get(p, 0) for p in PARTS) / MB, 1),
                              per_image_mb=round(max(cb.peak.get(p, 0) for p in PARTS) / B / MB, 1),
                              by_part_mb={p: round(cb.peak.get(p, 0) / MB, 1) for p in (*PARTS, *OUTSIDE)},
                              live_at_part_end_mb={p: round(cb.live_at_end.get(p, 0) / MB, 1) for p in (*PARTS, *OUTSIDE)},
                              resident_mb=round(cb.resident / MB, 1)),
        host_syncs={p: cb.cost.syncs[p] for p in (*PARTS, *OUTSIDE) if cb.cost.syncs[p]},
        ops=ops)


# ----------------------------------------------------------------------------------------------- the GPU's ranking
GPU_FAMILIES = {'gemm/conv': 'conv/matmul', 'batchnorm': 'batch norm', 'copy/cast': 'casts/copies', 'elementwise': 'elementwise',
                'reduction': 'reductions', 'other': 'other'}   # `profile_fit.FAMILIES` -> these


def _profile_table(text: str) -> tuple[dict, float]:
    "A `profile_fit.py step` table: self CUDA microseconds of each listed operator, and the table's self CUDA total."
    unit = dict(us=1, ms=1e3, s=1e6)
    def us(cell):
        m = re.fullmatch(r'([\d.]+)(us|ms|s)', cell.strip())
        return float(m[1]) * unit[m[2]] if m else None
    lines = text.splitlines()
    head = next(l for l in lines if 'Self CUDA' in l and 'Name' in l)
    cols = re.split(r'\s{2,}', head.strip()); col = cols.index('Self CUDA')
    rows = {}
    for l in lines:
        cells = re.split(r'\s{2,}', l.strip())
        if len(cells) == len(cols) and cells[0] != 'Name' and us(cells[col]) is not None: rows[cells[0]] = us(cells[col])
    m = re.search(r'Self CUDA time total:\s*([\d.]+(?:us|ms|s))', text)
    return rows, (us(m[1]) if m else sum(rows.values()))


def gpu_shares(path: Path) -> dict:
    "Family shares of a GPU profile's kernel time (and of its parts where it has them), from a result JSON."
    d = json.loads(Path(path).read_text())
    if 'by_family_us_per_image' in d:   # `scale.py profile`
        fam, tot = collections.Counter(), d['total_us_per_image']
        for k, us in d['by_family_us_per_image'].items(): fam[GPU_FAMILIES.get(k, 'other')] += us
        parts = d.get('by_part_us_per_image') or {}
        kind = f"scale.py profile, batch {d.get('batch_size')}, {d.get('clock')}"
    elif 'profiler_top_host_ops' in d:   # `profile_fit.py step`
        rows, tot = _profile_table(d['profiler_top_host_ops'])
        fam = collections.Counter()
        for name, us in rows.items(): fam[family(name) if name.startswith('aten::') else 'other'] += us
        fam['unlisted'] = max(tot - sum(rows.values()), 0)
        parts = d.get('median_ms') or {}
        kind = f"profile_fit.py step, batch {d.get('batch_size')}, self CUDA time of the top host operators"
    else: raise SystemExit(f'--gpu-profile {path}: neither a `scale.py profile` nor a `profile_fit.py step` result')
    parts = {k: v for k, v in parts.items() if k in (*PARTS, 'forward_loss', 'optimizer_ema')}   # the step's own parts
    ptot = sum(parts.values())
    return dict(file=str(path), kind=kind, device=(d.get('env') or {}).get('device'),
                family_share={f: round(us / tot, 4) for f, us in fam.most_common()} if tot else {},
                part_share={p: round(v / ptot, 4) for p, v in parts.items()} if ptot else {})


def comparison(res: dict, gpu: dict) -> list[dict]:
    "Each family's share of the CPU-counted bytes and of the GPU's kernel time, with both ranks."
    cpu = {f: v['bytes_share'] for f, v in res['by_family'].items()}
    g = gpu['family_share']
    rank = lambda d: {f: i + 1 for i, f in enumerate(sorted((f for f in d if f != 'unlisted'), key=lambda f: -d[f]))}
    rc, rg = rank(cpu), rank(g)
    return [dict(family=f, cpu_bytes_share=cpu.get(f), cpu_rank=rc.get(f), gpu_time_share=g.get(f), gpu_rank=rg.get(f))
            for f in sorted(set(cpu) | set(g), key=lambda f: (rc.get(f, 99), f))]


# -------------------------------------------------------------------------------------------------------------- main
def lucid_args(a, root: str) -> list:
    return ['--config', str(REFERENCE_CONFIG), '--trainer.accelerator', 'cpu', '--trainer.devices', '1',
            '--trainer.precision', 'bf16-mixed', '--data.batch_size', str(a.batch), '--data.imgsz', str(a.imgsz),
            '--data.workers', '0', '--data.close_mosaic', '0', '--trainer.max_epochs', '1000',
            '--trainer.max_steps', str(a.warmup + 1), '--trainer.limit_val_batches', '0',
            '--trainer.enable_checkpointing', 'false', '--trainer.enable_progress_bar', 'false',
            '--trainer.enable_model_summary', 'false', '--trainer.logger', 'false', '--trainer.default_root_dir', root]


def table(res: dict) -> str:
    t, B = res['total'], res['batch_size']
    pk = res['peak_bytes_alive']
    lines = [f"step_cost: batch {B}, {res['imgsz']} px, bf16 autocast, counted on the CPU ({res['env'].get('commit')}): "
             f"{t['calls']:,} ops a step (native kernel launches), peak {pk['step_mb']:,.0f} MB alive ({pk['per_image_mb']:,.0f} MB an image)",
             'largest ops (MB/img read + written, calls/step): ' + '; '.join(
                 f"{o['part']} {o['op']} {(o['read_bytes'] + o['written_bytes']) / B / MB:,.0f} ({o['calls']})" for o in res['ops'][:8]),
             f"{'part':<12}{'calls/step':>11}{'MB/img r+w':>12}{'read':>9}{'written':>9}{'GFLOP/img':>11}{'peak MB':>9}"]
    for p in (*PARTS, 'step', *OUTSIDE):
        v = t if p == 'step' else res['by_part'][p]
        peak = pk['step_mb'] if p == 'step' else pk['by_part_mb'][p]
        lines.append(f"{p + (' (outside)' if p in OUTSIDE else ''):<12}{v['calls']:>11,}{v['bytes_mb']:>12,.1f}{v['read_mb']:>9,.1f}"
                     f"{v['written_mb']:>9,.1f}{v['gflop']:>11.2f}{peak:>9,.0f}")
    lines.append(f"{'family':<16}{'calls/step':>11}{'MB/img r+w':>12}{'share':>8}{'GFLOP/img':>11}")
    for f, v in sorted(res['by_family'].items(), key=lambda kv: -kv[1]['bytes_mb']):
        lines.append(f"{f:<16}{v['calls']:>11,}{v['bytes_mb']:>12,.1f}{v['bytes_share']:>8.1%}{v['gflop']:>11.2f}")
    if res.get('gpu_comparison'):
        g = res['gpu_profile']
        lines.append(f"CPU-counted bytes against GPU kernel time ({g['kind']}; {g['device']}):")
        lines.append(f"{'family':<16}{'CPU bytes':>10}{'rank':>6}{'GPU time':>10}{'rank':>6}")
        for r in res['gpu_comparison']:
            s = lambda x: '-' if x is None else f'{x:.1%}'
            lines.append(f"{r['family']:<16}{s(r['cpu_bytes_share']):>10}{r['cpu_rank'] or '-':>6}{s(r['gpu_time_share']):>10}{r['gpu_rank'] or '-':>6}")
        if g['part_share']:
            cpu_parts = {p: res['by_part'][p]['bytes_mb'] / t['bytes_mb'] for p in PARTS}
            lines.append('parts, CPU bytes: ' + ', '.join(f'{p} {v:.0%}' for p, v in cpu_parts.items())
                         + ' | GPU: ' + ', '.join(f'{p} {v:.0%}' for p, v in g['part_share'].items()))
    return '\n'.join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--batch', type=int, default=8, help='training batch size (default 8)')
    p.add_argument('--imgsz', type=int, default=640)
    p.add_argument('--warmup', type=int, default=1, help='uncounted steps before the counted one (default 1)')
    p.add_argument('--tag', default='', help='appended to the result file name (before, after_<lever>)')
    p.add_argument('--out', default=None, help='results folder (default benchmarks/results; --smoke: a temporary one)')
    p.add_argument('--gpu-profile', type=Path, help='a `scale.py profile` or `profile_fit.py step` result: its kernel time by family beside the counts')
    p.add_argument('--smoke', action='store_true', help='batch 2, 64 px, into a temporary folder')
    p.add_argument('extra', nargs='*', help='extra `lucid fit` arguments, after --')
    a = p.parse_args(argv)
    if a.gpu_profile is not None and not a.gpu_profile.is_file():
        p.error(f'--gpu-profile {a.gpu_profile}: no such file; give a `scale.py profile` or `profile_fit.py step` result JSON')
    if a.smoke: a.batch, a.imgsz, a.out = 2, 64, a.out or tempfile.mkdtemp(prefix='step_cost_')
    gpu = gpu_shares(a.gpu_profile) if a.gpu_profile else None
    from lucid_nb.command import cli_main
    cb = StepCost(a.warmup)
    args = [*lucid_args(a, tempfile.mkdtemp(prefix='step_cost_fit_')), *a.extra]
    t0 = time.perf_counter()
    cli = cli_main(args, run=False)
    cli.trainer.callbacks.append(cb)
    cli.trainer.fit(cli.model, cli.datamodule)
    if not cb.done: raise SystemExit(f'step_cost: the fit ended after {cb.started} batches, before step {a.warmup} was counted')
    res = dict(what='one training step of the real trainer counted on the CPU by a dispatch mode: aten calls, bytes read and '
                    'written, FLOPs, peak bytes alive; per image by part and op family', imgsz=a.imgsz, warmup=a.warmup,
               counted_step=a.warmup, mosaic=cb.mosaic, precision='bf16-mixed (autocast cpu bf16)',
               optimizer=type(cli.trainer.optimizers[0]).__name__, hooked=cb.hooked, lucid_args=args,
               counted_seconds=round(cb.seconds, 2), process_seconds=round(time.perf_counter() - t0, 1), **summarise(cb))
    if gpu: res.update(gpu_profile=gpu, gpu_comparison=comparison(res, gpu))
    path = write_result(f'step_cost_b{res["batch_size"]}', res, device='cpu', tag=a.tag, out=a.out)
    res['env'] = json.loads(path.read_text())['env']
    print(f'-> {path}')
    print(table(res))
    return path


if __name__ == '__main__':
    sys.exit(0 if main() else 1)
