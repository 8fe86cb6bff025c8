"""Peak memory of validation's post-processing (`Validator.update`) of one batch, on the CPU, by resident set size.

Usage (repository root): .venv/bin/python benchmarks/postprocess_memory.py [--batch 32] [--runs 3] [--lib DIR] [--out FILE]

The batch is the first `--batch` embedded validation images at 640 px (their real sizes and letterboxes) with head
outputs like a young model's (`validation_speed.young_head`: every (anchor, class) pair above conf 0.001, so NMS
cuts each image to `max_nms` candidates and keeps 300 detections, each with a mask). A thread samples the process's
resident set (`/proc/self/statm`) every millisecond while `Validator.update` runs; the peak above the resident set
just before is what the post-processing's temporaries took (large allocations are mapped one by one and unmapped
when freed, `mallopt`, and the heap is trimmed before each run) (the same tensors it makes on a GPU, where they come from
the caching allocator instead). `--lib DIR` imports `lucid_nb` from DIR (e.g. a `git worktree` of an earlier commit)
to compare code versions in separate processes; every run prints the sha256 of the results, which must agree.
"""
import argparse, ctypes, hashlib, json, os, sys, threading, time
from pathlib import Path

LIBC = ctypes.CDLL('libc.so.6')
LIBC.mallopt(-3, 128 * 1024)   # M_MMAP_THRESHOLD fixed at 128 KiB: every large tensor is its own mapping, gone when freed

ap = argparse.ArgumentParser()
ap.add_argument('--batch', type=int, default=32)
ap.add_argument('--runs', type=int, default=3)
ap.add_argument('--lib', default=None, help='import lucid_nb from this folder')
ap.add_argument('--out', default=None, help='append one JSON line here')
args = ap.parse_args()
if args.lib: sys.path.insert(0, args.lib)
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from lucid_nb.data import YoloData
from lucid_nb.metrics import Validator, results_bytes
from validation_speed import young_head

PAGE = os.sysconf('SC_PAGE_SIZE')
def rss() -> int: return int(Path('/proc/self/statm').read_text().split()[1]) * PAGE

def peak_during(f) -> tuple[int, object]:
    "Peak resident bytes above the level before `f()`, sampled every millisecond, and what `f` returned."
    base, peak, done = rss(), [0], threading.Event()
    def sample():
        while not done.is_set(): peak[0] = max(peak[0], rss()); time.sleep(.001)
    t = threading.Thread(target=sample); t.start()
    try: r = f()
    finally: done.set(); t.join()
    return max(peak[0], rss()) - base, r

torch.set_num_threads(2)
dm = YoloData(prefetch=False, val_batch_size=args.batch); dm.setup('fit')
batch = dm.on_after_batch_transfer(next(iter(dm.val_dataloader())), 0)
head = young_head([batch], seed=0)[0]
peaks, digest = [], None
for _ in range(args.runs):
    v = Validator(dm.cat_ids)
    LIBC.malloc_trim(0)   # what earlier runs freed goes back to the system: the next peak is this run's own
    peak, _ = peak_during(lambda: v.update(head, batch))
    peaks.append(peak / 2**20)
    digest = hashlib.sha256(results_bytes(v.results)).hexdigest()[:16]
import subprocess
commit = subprocess.run(['git', '-C', args.lib or str(Path(__file__).resolve().parent), 'rev-parse', '--short', 'HEAD'],
                        capture_output=True, text=True).stdout.strip() or None
line = dict(lib=args.lib or 'this checkout', commit=commit, batch=args.batch, images=len(batch['image_id']), detections=len(v.results),
            peak_mib=[round(p, 1) for p in peaks], results_sha256=digest, torch=torch.__version__,
            date=time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()))
print(json.dumps(line))
if args.out:
    with open(args.out, 'a') as f: f.write(json.dumps(line) + '\n')
