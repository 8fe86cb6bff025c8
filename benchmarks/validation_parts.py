"""Validation's post-processing of the reference run split by part, per epoch, synchronised (a diagnostic).

Usage (GPU machine, repository root): python benchmarks/validation_parts.py [lucid fit options...]
Runs `lucid fit --config configs/coco128-seg-n.yaml` in this process with `lucid_nb.metrics`' NMS, mask runs, RLE
strings, COCO results, `Validator.update` and `Validator.compute` wrapped in `torch.cuda.synchronize()` timers, and
counts per validation epoch: NMS candidates and host looks (`tolist` of a CUDA tensor), RLE counts, the training and
validation memory peaks. It prints a cProfile of all `Validator.update` calls (by internal time) and the run's
hashes, and writes `$OUT/val_timeline.json` (epoch -> numbers). The timers add device synchronisations, so the parts
add up to more than an unsynchronised validation takes; the split, not the sum, is the point.
"""
import collections, json, os, sys, time
from lucid_nb.cli import enable_bytecode_cache; enable_bytecode_cache()
import torch
import lucid_nb.metrics as M
import lucid_nb.trainer as T
EP = collections.defaultdict(lambda: collections.defaultdict(float))
cur = [0]
def timed(name, f):
    def w(*a, **k):
        torch.cuda.synchronize(); t = time.perf_counter()
        r = f(*a, **k)
        torch.cuda.synchronize(); EP[cur[0]][name] += time.perf_counter() - t
        return r
    return w
gk = M.greedy_keep
def greedy(boxes, cls, *a, **k):
    EP[cur[0]]['candidates'] += float((cls >= 0).sum()); EP[cur[0]]['nms_calls'] += 1
    n0 = calls[0]; r = gk(boxes, cls, *a, **k); EP[cur[0]]['looks'] += calls[0] - n0
    return r
calls = [0]
tl = torch.Tensor.tolist
def tolist(t):
    if t.is_cuda: calls[0] += 1
    return tl(t)
torch.Tensor.tolist = tolist
M.greedy_keep = greedy
M.nms = timed('nms', M.nms); M.mask_runs = timed('mask_runs', M.mask_runs); M.rle_strings = timed('rle_strings', M.rle_strings)
M.coco_results = timed('coco_results', M.coco_results)
M.Validator.update = timed('update', M.Validator.update)
M.Validator.compute = timed('compute', M.Validator.compute)
on = T.LitYolo.on_validation_epoch_start if hasattr(T.LitYolo, 'on_validation_epoch_start') else None
import cProfile, pstats, io
prof = cProfile.Profile()
def start(self, *a):
    cur[0] = self.current_epoch
    EP[cur[0]]['train_peak_alloc_mib'] = torch.cuda.max_memory_allocated() / 2**20
    EP[cur[0]]['reserved_before_val_mib'] = torch.cuda.memory_reserved() / 2**20
    torch.cuda.reset_peak_memory_stats()
    if on: return on(self, *a)
ve = T.LitYolo.on_validation_epoch_end
def vend(self, *a):
    EP[cur[0]]['val_peak_alloc_mib'] = torch.cuda.max_memory_allocated() / 2**20
    EP[cur[0]]['val_peak_reserved_mib'] = torch.cuda.max_memory_reserved() / 2**20
    r = ve(self, *a); torch.cuda.reset_peak_memory_stats(); return r
T.LitYolo.on_validation_epoch_end = vend
up = M.Validator.update
def profiled(*a, **k):
    prof.enable()
    try: return up(*a, **k)
    finally: prof.disable()
M.Validator.update = profiled
rr = M.rle_runs
def rle_runs(*a, **k):
    c, r = rr(*a, **k); EP[cur[0]]['counts'] += len(c); return c, r
M.rle_runs = rle_runs
T.LitYolo.on_validation_epoch_start = start
sys.argv = ['lucid', 'fit', '--config', 'configs/coco128-seg-n.yaml'] + sys.argv[1:]
try: T.main()
except SystemExit: pass
st = io.StringIO(); pstats.Stats(prof, stream=st).sort_stats('tottime').print_stats(30); print(st.getvalue()[:6000])
import glob
for f in sorted(glob.glob('runs/*/*/state_hashes.json')): print(f, json.load(open(f))['all'][:12], json.load(open(f))['predictions'][:12])
for f in sorted(glob.glob('runs/*/*/timing.json')): print(f, json.load(open(f))['peak_reserved_mib'])
out = {e: dict(v) for e, v in EP.items()}
for e, v in out.items(): print(e, {k: round(x, 3) for k, x in v.items()})
json.dump(out, open(os.path.join(os.environ.get('OUT', '/tmp'), 'val_timeline.json'), 'w'), indent=1)
