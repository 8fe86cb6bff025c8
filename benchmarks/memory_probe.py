"""Where the reference run's peak GPU memory goes: training steps vs validation, allocated vs reserved.

Runs one epoch of the reference configuration (`configs/coco128-seg-n.yaml`) through the real trainer and reads the
CUDA allocator's peaks after the training batches and after the validation, then lists the live blocks at the
training peak and at the validation peak (from the allocator's memory history) by the line of lucid_nb code that made
them, the reserved memory by pool (the default pool, and the private pool of the recorded CUDA graphs), and, at the
moment the most memory was reserved, what was reserved and allocated in each pool, by code:

    python benchmarks/memory_probe.py --out benchmarks/results [-- extra lucid args]
"""
import argparse, bisect, collections, json
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

ROOT = Path(__file__).resolve().parent.parent
MiB = 2 ** 20
MAX_EVENTS = 2_000_000   # the allocator's trace; more than one epoch makes (checked below)


class Peaks(Callback):
    "Allocator peaks at the end of the training batches and of the validation."
    def __init__(self): self.at = {}
    def _read(self, name):
        torch.cuda.synchronize()
        self.at[name] = dict(allocated_mib=torch.cuda.max_memory_allocated() / MiB, reserved_mib=torch.cuda.max_memory_reserved() / MiB)
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx == trainer.num_training_batches - 1:
            self._read('training'); self.snapshot = torch.cuda.memory._snapshot()
    def on_validation_end(self, trainer, module):
        self._read('validation'); self.val_snapshot = torch.cuda.memory._snapshot()


def _where(frames: list) -> str:
    f = next((f for f in frames if 'lucid_nb' in f['filename']), frames[0] if frames else None)
    return f"{Path(f['filename']).name}:{f['line']} {f['name']}" if f else '?'


def live_at_peak(snapshot: dict, n: int = 15, after: int = 0) -> dict:
    """Replay the allocator's trace; at the moment the most memory was allocated (among the events from index `after`
    on), group the live blocks by the code that made them."""
    live, total, best, best_live = {}, 0, -1, {}
    for i, e in enumerate(snapshot['device_traces'][0]):
        if e['action'] == 'alloc': live[e['addr']] = (e['size'], _where(e.get('frames') or []), i >= after); total += e['size']
        elif e['action'] in ('free_completed',) and e['addr'] in live: total -= live.pop(e['addr'])[0]
        else: continue
        if i >= after and total > best: best, best_live = total, dict(live)
    by, new = collections.Counter(), collections.Counter()
    for size, where, made_after in best_live.values():
        by[where] += size
        if made_after: new[where] += size
    top = lambda c: [(k, round(v / MiB, 1)) for k, v in c.most_common(n)]
    return dict(peak_traced_mib=round(best / MiB, 1), by_code=top(by), made_in_phase_mib=round(sum(new.values()) / MiB, 1),
                made_in_phase_by_code=top(new))


def reserved_by_pool(snapshot: dict) -> dict:
    "Reserved MiB per allocator pool: `default`, or the id of a private pool (the recorded CUDA graphs share one)."
    by = collections.Counter()
    for seg in snapshot['segments']:
        pool = tuple(seg.get('segment_pool_id') or (0, 0))
        by['default' if pool == (0, 0) else str(pool)] += seg['total_size']
    return {k: round(v / MiB, 1) for k, v in by.items()}


def reserved_at_peak(snapshot: dict, n: int = 12) -> dict:
    """Replay the trace's segment allocations and frees; at the moment the most memory was reserved, the segments then
    alive by pool (named from the snapshot's segments, or 'freed since' for those given back later, e.g. by
    `empty_cache`) and the blocks then allocated in them, by pool and by the code that made them."""
    def replay(stop=None):
        segs, live, total, used, best, when = {}, {}, 0, 0, (-1, -1), -1
        for i, e in enumerate(snapshot['device_traces'][0]):
            if i == stop: break
            act = e['action']
            if act == 'segment_alloc': segs[e['addr']] = e['size']; total += e['size']
            elif act == 'segment_free' and e['addr'] in segs: total -= segs.pop(e['addr'])
            elif act == 'alloc': live[e['addr']] = (e['size'], e.get('frames') or []); used += e['size']
            elif act == 'free_completed' and e['addr'] in live: used -= live.pop(e['addr'])[0]
            else: continue
            if (total, used) > best: best, when = (total, used), i   # the fullest moment of the most reserved
        return best[0], when, segs, live
    best, when, _, _ = replay()
    _, _, segs, live = replay(when + 1)   # the state just after that event
    pool_of = {s['address']: 'default' if tuple(s.get('segment_pool_id') or (0, 0)) == (0, 0) else str(tuple(s['segment_pool_id']))
               for s in snapshot['segments']}
    starts = sorted(segs)
    def segment(addr):
        i = bisect.bisect_right(starts, addr) - 1
        return starts[i] if i >= 0 and addr < starts[i] + segs[starts[i]] else None
    reserved, allocated, by_code = collections.Counter(), collections.Counter(), collections.defaultdict(collections.Counter)
    for a, size in segs.items(): reserved[pool_of.get(a, 'freed since')] += size
    for a, (size, frames) in live.items():
        s, where = segment(a), _where(frames)
        pool = pool_of.get(s, 'freed since') if s is not None else '?'
        allocated[pool] += size; by_code[pool][where] += size
    mib = lambda c: {k: round(v / MiB, 1) for k, v in c.items()}
    return dict(reserved_mib=round(best / MiB, 1), reserved_by_pool=mib(reserved), allocated_by_pool=mib(allocated),
                allocated_by_code={p: [(k, round(v / MiB, 1)) for k, v in c.most_common(n)] for p, c in by_code.items()})


def main():
    p = argparse.ArgumentParser(); p.add_argument('--out', default='benchmarks/results')
    p.add_argument('--tag', default='', help='result file suffix, e.g. the option probed (memory_probe_<device>_<tag>.json)')
    p.add_argument('extra', nargs='*'); a = p.parse_args()
    from lucid_nb.command import cli_main
    from lucid_nb.core import device_tag, env_info
    if not torch.cuda.is_available(): raise SystemExit('memory_probe: reads the CUDA allocator; run it on a CUDA GPU')
    torch.cuda.memory._record_memory_history(max_entries=MAX_EVENTS)
    peaks = Peaks()
    cli = cli_main(['--config', str(ROOT / 'configs' / 'coco128-seg-n.yaml'), '--trainer.max_epochs', '1',
                    '--trainer.enable_progress_bar', 'false', '--trainer.logger', 'false', '--trainer.enable_checkpointing', 'false',
                    *a.extra], run=False)
    cli.trainer.callbacks.append(peaks)
    cli.trainer.fit(cli.model, cli.datamodule)
    env, dev = env_info(), device_tag()
    n_train, n_all = (len(s['device_traces'][0]) for s in (peaks.snapshot, peaks.val_snapshot))
    if n_all >= MAX_EVENTS: raise SystemExit(f'memory_probe: the trace wrapped ({n_all} events); raise MAX_EVENTS')
    res = dict(env=env, extra_args=a.extra, peaks=peaks.at, training_peak=live_at_peak(peaks.snapshot),
               validation_peak=live_at_peak(peaks.val_snapshot, after=n_train),
               reserved_by_pool=dict(training=reserved_by_pool(peaks.snapshot), validation=reserved_by_pool(peaks.val_snapshot)),
               at_reserved_peak=reserved_at_peak(peaks.val_snapshot),
               stats={k: v / MiB for k, v in torch.cuda.memory_stats().items() if k.endswith('bytes.all.peak')})
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    (out / f"memory_probe_{dev}{'_' + a.tag if a.tag else ''}.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == '__main__':
    main()
