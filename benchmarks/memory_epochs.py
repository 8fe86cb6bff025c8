"""Epoch by epoch, where a whole reference fit's peak reserved GPU memory is reached: training or validation, which pool.

`memory_probe.py` traces one epoch; the reference run's peak comes later (validation grows as the model learns to
detect). This runs the whole reference fit (`configs/coco128-seg-n.yaml`, 10 epochs) through the real trainer and, at
the end of each epoch's training batches and of each validation, reads the allocator's peak allocated and reserved
memory since the last reading (then resets them) and the reserved memory per pool (the default pool; the recorded
CUDA graphs' private pool), and each validation's seconds (synchronised at its start and end). At each validation's
first batch, after the trainer gave the allocator's unused cache back, it reads what the allocator still holds
(reserved, allocated, segments, free bytes inside partly used segments): what training leaves reserved is the floor
validation's own blocks are added to.

    LUCID_NB_EXPANDABLE_SEGMENTS=0 python benchmarks/memory_epochs.py --tag classic   # PyTorch's allocator defaults

The allocator is set up as `lucid` sets it (expandable segments, unless `PYTORCH_ALLOC_CONF` /
`PYTORCH_CUDA_ALLOC_CONF` is set or `LUCID_NB_EXPANDABLE_SEGMENTS=0`); before 2026-12-04 this script ran at PyTorch's
defaults unless the variable was set by hand.

    python benchmarks/memory_epochs.py --out benchmarks/results --tag native_b16 -- --data.batch_size 16

`peak_reserved_mib` is the largest reading: the process's peak, as `reference_run.py` reads it once at the end.
"""
import argparse, collections, json, os, time
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

ROOT = Path(__file__).resolve().parent.parent
MiB = 2 ** 20


def reserved_by_pool() -> dict:
    "Reserved MiB now, per allocator pool: `default`, or `graphs` (private pools, where recorded CUDA graphs live)."
    by = collections.Counter()
    for seg in torch.cuda.memory_snapshot():
        by['default' if tuple(seg.get('segment_pool_id') or (0, 0)) == (0, 0) else 'graphs'] += seg['total_size']
    return {k: round(v / MiB, 1) for k, v in sorted(by.items())}


def allocator_now() -> dict:
    "What the allocator holds now: reserved and allocated MiB, its segments, and the free bytes inside partly used segments."
    st = torch.cuda.memory_stats()
    return dict(reserved_now_mib=st.get('reserved_bytes.all.current', 0) / MiB,
                allocated_now_mib=st.get('allocated_bytes.all.current', 0) / MiB,
                segments=st.get('segment.all.current', 0),
                inactive_split_mib=st.get('inactive_split_bytes.all.current', 0) / MiB, by_pool=reserved_by_pool())


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


def main():
    p = argparse.ArgumentParser(); p.add_argument('--out', default='benchmarks/results')
    p.add_argument('--tag', default='', help='result file suffix (memory_epochs_<device>_<tag>.json)')
    p.add_argument('extra', nargs='*'); a = p.parse_args()
    from lucid_nb.allocator import ALLOCATOR_VARIABLES, allocator_defaults
    allocator_defaults()   # the allocator `lucid` sets up (its fit here runs in this process, not through `lucid`)
    import lucid_nb
    from lucid_nb.command import cli_main
    from lucid_nb.core import device_tag, env_info
    if not torch.cuda.is_available(): raise SystemExit('memory_epochs: reads the CUDA allocator; run it on a CUDA GPU')
    peaks = EpochPeaks()
    cli = cli_main(['--config', str(ROOT / 'configs' / 'coco128-seg-n.yaml'), '--trainer.enable_progress_bar', 'false',
                    '--trainer.logger', 'false', '--trainer.enable_checkpointing', 'false', *a.extra], run=False)
    cli.trainer.callbacks.append(peaks)
    cli.trainer.fit(cli.model, cli.datamodule)
    top = max((r for r in peaks.readings if 'peak_reserved_mib' in r), key=lambda r: r['peak_reserved_mib'])
    res = dict(env=env_info(), extra_args=a.extra, library=str(Path(lucid_nb.__file__).parent),
               environment={k: v for k, v in os.environ.items() if k.startswith('LUCID_NB_') or k in ALLOCATOR_VARIABLES},
               peak_reserved_mib=top['peak_reserved_mib'], peak_at=dict(epoch=top['epoch'], phase=top['phase']),
               readings=peaks.readings)
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    path = out / f"memory_epochs_{device_tag()}{'_' + a.tag if a.tag else ''}.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"{a.tag or 'run'}: peak reserved {top['peak_reserved_mib']:.0f} MiB at epoch {top['epoch']} {top['phase']} -> {path}")


if __name__ == '__main__':
    main()
