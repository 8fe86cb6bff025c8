"""How many bytes of tensors does one validation's post-processing hold at once, by revision? 194 MiB on a 1-epoch model's outputs, 185 on a 4-epoch model's (results/validation_memory_cpu_young{1,}_edb5b8f.json, kept in git history: `git show 627a9b1:benchmarks/results/validation_memory_cpu_young_edb5b8f.json`), at edb5b8f.

How much tensor memory one validation's post-processing holds at once: a device-independent count, by revision.

Feeds the `young_head` outputs of `validation_speed.py` (a young model's head at 640 px: 300 detections per image,
ragged masks) for the 32 embedded validation images, batch by batch as the trainer's validation does (`YoloData`
defaults: batches of 8), to the `Validator` of this checkout and of each `--baseline` revision, and counts through
torch's dispatch the bytes of the tensors the operations make, each from its making until it is freed (views and
in-place results add nothing): the most alive at once is the post-processing's peak. On a GPU the caching allocator
rounds every block up and keeps freed blocks, so its peak is higher, but it grows with these bytes; the inputs (the
head's outputs, the batch) exist before and are not counted. Every revision's results bytes must equal this
checkout's.

    python benchmarks/experiments/validation_memory.py [--baseline REV ...] [--checkpoint CKPT] [--group-pixels N] [--tag T] [--out benchmarks/results]

`--checkpoint`: the outputs of that checkpoint's EMA network on the same batches instead of `young_head`'s (as
`validation_ops.py --checkpoint`: a real young model's masks, whose run counts differ from the synthetic head's).
The result `validation_memory_cpu_young1.json` used the reference configuration trained 1 epoch on the CPU:
    lucid fit --config configs/coco128-seg-n.yaml --trainer.accelerator cpu --trainer.precision 32-true \
        --trainer.max_epochs 1 --data.workers 2 --trainer.default_root_dir /tmp/young1    # its checkpoints/last.ckpt
Writes `validation_memory_<device><tag>.json` (peaks in MiB, per batch and overall, env, command) to `--out`.
"""
import argparse, json, sys
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/: validation_speed, common
import validation_speed as vs
from lucid_nb.testing import TensorBytes
import lucid_nb.metrics as M
from lucid_nb.core import device_tag, env_info
from lucid_nb.data import YoloData


def peaks(metrics, outs, batches, cat_ids, group_pixels=None) -> tuple[list, bytes]:
    "Peak MiB of each batch's `Validator.update` (tensors made during it), and the results bytes."
    v, per_batch = metrics.Validator(cat_ids, **({} if group_pixels is None else dict(group_pixels=group_pixels))), []
    with TensorBytes() as c, torch.no_grad():
        for o, b in zip(outs, batches):
            c.reset(); start = c.live
            v.update(o, b)
            per_batch.append(round((c.peak - start) / 2**20, 1))
    return per_batch, metrics.results_bytes(v.results)


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--baseline', nargs='*', default=[], help='git revisions to compare with this checkout')
    p.add_argument('--checkpoint', help="a lucid checkpoint: its EMA network's outputs instead of young_head's")
    p.add_argument('--group-pixels', type=int, help="every revision's `Validator(group_pixels=...)` (default: its own)")
    p.add_argument('--tag', default='', help='added to the result file name')
    p.add_argument('--out', default='benchmarks/results'); a = p.parse_args()
    dm = YoloData(prefetch=False); dm.setup('fit')
    batches = list(dm.val_dataloader())
    if a.checkpoint:
        net = vs.eval_net(a.checkpoint, len(dm.cat_ids))
        with torch.no_grad(): outs = [net(dm.on_after_batch_transfer(b)['img']) for b in batches]
    else: outs = vs.young_head(batches)
    revs = {'checkout': M, **{rev: vs.load_baseline(rev, f'lucid_nb_{i}') for i, rev in enumerate(a.baseline)}}
    res, want = {}, None
    for rev, metrics in revs.items():
        per_batch, got = peaks(metrics, outs, batches, dm.cat_ids, a.group_pixels)
        want = want or got
        if got != want: raise SystemExit(f'{rev}: other results bytes than the checkout')
        res[rev] = dict(peak_mib=max(per_batch), per_batch_mib=per_batch)
        print(f'{rev}: peak {max(per_batch)} MiB of tensors made during a batch (per batch {per_batch})')
    out = dict(what=f"most bytes of tensors alive at once during Validator.update (made by it), {a.checkpoint or 'young_head'} outputs, "
                    "32 images in batches of 8, by revision; same results bytes in each"
                    + (f"; group_pixels {a.group_pixels}" if a.group_pixels else ''),
               revisions=res, command=' '.join([sys.executable, *sys.argv]),
               date=datetime.now(timezone.utc).isoformat(timespec='seconds'), env=env_info())
    path = Path(a.out); path.mkdir(parents=True, exist_ok=True); path = path / f'validation_memory_{device_tag()}{a.tag}.json'
    path.write_text(json.dumps(out, indent=1)); print(f'-> {path}')


if __name__ == '__main__': main()
