"""Where does validation's post-processing go in the H200 fit, part by part? The RLE strings (2.8 -> 0.12 s in the most ragged epoch once packed on the device) and NMS's host looks (311 -> 162) were the cost (latest: results/validation_parts_nvidia-h200_6f0f86c.json), at 6f0f86c.

Validation's post-processing of the reference run split by part, per epoch, synchronised (a diagnostic).

Usage (GPU machine, repository root): python benchmarks/experiments/validation_parts.py [lucid fit options...]
Runs `lucid fit --config configs/coco128-seg-n.yaml` in this process with `lucid_nb.metrics`' NMS, mask runs, RLE
strings, COCO results, `Validator.update` and `Validator.compute` wrapped in `torch.cuda.synchronize()` timers, and
counts per validation epoch: NMS candidates and host looks (`tolist` of a CUDA tensor), RLE counts, the training and
validation memory peaks. `BASELINE_NMS=<git revision>`: that revision's `greedy_keep` also runs on every NMS call's
inputs, right after this checkout's (timed as `greedy_keep_baseline`, its answer checked equal). It prints a cProfile of all `Validator.update` calls (by internal time) and the run's
hashes, and writes `$OUT/validation_parts.json` (epoch -> numbers). Validation epoch `$KERNEL_EPOCH` (default 5) runs under
torch.profiler: per part, host and GPU kernel milliseconds (`kernel_profile`) and the top kernels. The timers add device synchronisations, so the parts
add up to more than an unsynchronised validation takes; the split, not the sum, is the point.
"""
import cProfile, collections, glob, io, json, os, pstats, sys, time
from lucid_nb.cli import enable_bytecode_cache; enable_bytecode_cache()
import torch
import lucid_nb.metrics as M
import lucid_nb.command as T

EP = collections.defaultdict(lambda: collections.defaultdict(float))   # validation epoch -> name -> seconds or count
epoch, looks = [0], [0]                                                  # the epoch validating; host looks so far
profile = cProfile.Profile()

def timed(name, f):
    "`f`, its synchronised time added to the epoch's `name`."
    def w(*a, **k):
        torch.cuda.synchronize(); t = time.perf_counter()
        r = f(*a, **k)
        torch.cuda.synchronize(); EP[epoch[0]][name] += time.perf_counter() - t
        return r
    return w

def counted_tolist(t, _tolist=torch.Tensor.tolist):
    if t.is_cuda: looks[0] += 1
    return _tolist(t)

BASELINE = os.environ.get('BASELINE_NMS')   # a git revision: its greedy_keep also runs on every call's inputs, timed and compared
if BASELINE:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # benchmarks/
    from common import load_baseline
    baseline_keep = load_baseline(BASELINE, 'lucid_nb_nms_baseline').greedy_keep

def greedy(boxes, cls, *a, _keep=M.greedy_keep, **k):
    EP[epoch[0]]['candidates'] += float((cls >= 0).sum()); EP[epoch[0]]['nms_calls'] += 1
    torch.cuda.synchronize(); t = time.perf_counter()
    n0 = looks[0]; r = _keep(boxes, cls, *a, **k); EP[epoch[0]]['looks'] += looks[0] - n0
    torch.cuda.synchronize(); EP[epoch[0]]['greedy_keep'] += time.perf_counter() - t
    if BASELINE:   # the revision's, on the same inputs, right after (same machine state); its answer must be the same
        t = time.perf_counter(); n0 = looks[0]; b = baseline_keep(boxes, cls, *a, **k); torch.cuda.synchronize()
        EP[epoch[0]]['greedy_keep_baseline'] += time.perf_counter() - t; EP[epoch[0]]['looks_baseline'] += looks[0] - n0
        kept, count = r
        assert torch.equal(count, b[1]) and all(torch.equal(kept[i, :c], b[0][i, :c]) for i, c in enumerate(count.tolist())), 'NMS differs from the baseline'
    return r

def runs_counted(*a, _runs=M.runs_from_starts, **k):
    c, r = _runs(*a, **k); EP[epoch[0]]['counts'] += len(c); return c, r

def profiled(f):
    def w(*a, **k):
        profile.enable()
        try: return f(*a, **k)
        finally: profile.disable()
    return w

KERNEL_EPOCH = int(os.environ.get('KERNEL_EPOCH', 5))   # the validation epoch that runs under torch.profiler
kernels = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])

def ranged(name, f):
    "`f` as a named range of the profiler's trace (its kernels attributed to it)."
    def w(*a, **k):
        with torch.profiler.record_function(name): return f(*a, **k)
    return w

def val_start(self, *a, _hook=T.LitYolo.on_validation_epoch_start):
    epoch[0] = self.current_epoch
    EP[epoch[0]]['train_peak_alloc_mib'] = torch.cuda.max_memory_allocated() / 2**20
    EP[epoch[0]]['reserved_before_val_mib'] = torch.cuda.memory_reserved() / 2**20
    torch.cuda.reset_peak_memory_stats()
    if epoch[0] == KERNEL_EPOCH: torch.cuda.synchronize(); kernels.start()
    return _hook(self, *a)

def val_end(self, *a, _hook=T.LitYolo.on_validation_epoch_end):
    EP[epoch[0]]['val_peak_alloc_mib'] = torch.cuda.max_memory_allocated() / 2**20
    EP[epoch[0]]['val_peak_reserved_mib'] = torch.cuda.max_memory_reserved() / 2**20
    if epoch[0] == KERNEL_EPOCH:   # kernel time against wall time of each range, before the evaluation (the hook)
        torch.cuda.synchronize(); kernels.stop()
        table = kernels.key_averages().table(sort_by='self_device_time_total', row_limit=25)
        ranges = {e.key: dict(host_ms=e.cpu_time_total / 1e3, device_ms=e.device_time_total / 1e3)
                  for e in kernels.key_averages() if e.key in RANGES}
        EP[epoch[0]]['kernel_profile'] = ranges
        print(f"== validation epoch {KERNEL_EPOCH} under torch.profiler (host and kernel ms per range)", ranges, table[:8000], sep='\n')
    r = _hook(self, *a); torch.cuda.reset_peak_memory_stats(); return r

torch.Tensor.tolist = counted_tolist
M.greedy_keep, M.runs_from_starts = greedy, runs_counted
for name in ('nms', 'batch_mask_runs', 'rle_strings', 'coco_results'): setattr(M, name, ranged(name, timed(name, getattr(M, name))))
M.Validator.update = profiled(ranged('update', timed('update', M.Validator.update)))
RANGES = ('nms', 'batch_mask_runs', 'rle_strings', 'coco_results', 'update', 'batch')
_forward = T.LitYolo._validate_batch
T.LitYolo._validate_batch = lambda self, batch: ranged('batch', _forward)(self, batch)
M.Validator.compute = timed('compute', M.Validator.compute)
T.LitYolo.on_validation_epoch_start, T.LitYolo.on_validation_epoch_end = val_start, val_end

sys.argv = ['lucid', 'fit', '--config', 'configs/coco128-seg-n.yaml'] + sys.argv[1:]
try: T.main()
except SystemExit: pass
text = io.StringIO(); pstats.Stats(profile, stream=text).sort_stats('tottime').print_stats(30); print(text.getvalue()[:6000])
for f in sorted(glob.glob('runs/*/*/state_hashes.json')): h = json.load(open(f)); print(f, h['all'][:12], h.get('predictions', '-')[:12])
for f in sorted(glob.glob('runs/*/*/timing.json')): print(f, json.load(open(f))['peak_reserved_mib'])
out = {e: dict(v) for e, v in EP.items()}
for e, v in out.items(): print(e, {k: round(x, 3) if isinstance(x, float) else x for k, x in v.items()})
json.dump(out, open(os.path.join(os.environ.get('OUT', '/tmp'), 'validation_parts.json'), 'w'), indent=1)
