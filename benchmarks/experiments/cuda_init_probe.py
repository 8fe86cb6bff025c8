"""Could CUDA's initialisation overlap the imports? Not usefully: a driver thread (ctypes) made the first conv later, torch.cuda.init() in a thread saved ~0.2 s of 3.6 (results/cuda_init_probe_nvidia-h200.json), at 217e64a; not adopted.

Could the CUDA initialisation overlap the imports? A start-up experiment (a diagnostic, no library code uses it).

Three kinds of fresh process, alternating, 3 rounds: `plain` imports torch, torchmetrics, Lightning and the trainer
(as `lucid` does), then initialises CUDA and makes its first tensor; `ctypes` starts the driver (`cuInit`) and
retains the device's primary context in a thread through ctypes, which releases the GIL, while the imports run;
`torchthread` calls `torch.cuda.init()` and makes a tensor in a thread. Marks are seconds since the child started.

    python benchmarks/experiments/cuda_init_probe.py      # writes $OUT/results/cuda_init_probe.json (OUT defaults to /tmp)
"""
import os, subprocess, sys, json

from lucid_nb.core import env_info

CHILD = r'''
import os, sys, time, threading, ctypes
T0 = time.perf_counter(); marks = {}
def mark(k): marks[k] = round(time.perf_counter() - T0, 3)
mode = sys.argv[1]
from lucid_nb.cli import enable_bytecode_cache, lean_imports; enable_bytecode_cache()
with lean_imports():
    import torch; mark('torch')
    th = None
    def driver():
        t = time.perf_counter(); cu = ctypes.CDLL('libcuda.so.1'); r = cu.cuInit(0); marks['bg_cuInit'] = round(time.perf_counter() - t, 3)
        dev = ctypes.c_int(); cu.cuDeviceGet(ctypes.byref(dev), 0); ctx = ctypes.c_void_p()
        t = time.perf_counter(); r2 = cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev); marks['bg_ctx'] = round(time.perf_counter() - t, 3)
        marks['bg_rc'] = (r, r2)
    def torch_init():
        t = time.perf_counter(); torch.cuda.init(); torch.empty(1, device='cuda'); marks['bg_torch'] = round(time.perf_counter() - t, 3)
    if mode == 'ctypes': th = threading.Thread(target=driver, daemon=True); th.start()
    if mode == 'torchthread': th = threading.Thread(target=torch_init, daemon=True); th.start()
    import torchmetrics; mark('torchmetrics')
    import lightning.pytorch; mark('lightning')
    import lucid_nb.command; mark('lucid_nb.command')
if th: th.join(); mark('joined')
torch.cuda.init(); mark('torch.cuda.init')
x = torch.empty(1, device='cuda'); torch.cuda.synchronize(); mark('first tensor')
torch.nn.functional.conv2d(torch.ones(1,3,64,64,device='cuda'), torch.ones(8,3,3,3,device='cuda')); torch.cuda.synchronize(); mark('first conv')
print('JSON', __import__('json').dumps(dict(mode=mode, **marks)))
'''
res = []
for _ in range(3):
    for mode in ['plain', 'ctypes', 'torchthread']:
        p = subprocess.run([sys.executable, '-c', CHILD, mode], capture_output=True, text=True)
        line = [l for l in p.stdout.splitlines() if l.startswith('JSON')]
        print(mode, line[0][5:] if line else p.stderr[-1500:], flush=True)
        if line: res.append(json.loads(line[0][5:]))
out = os.environ.get('OUT', '/tmp'); os.makedirs(f'{out}/results', exist_ok=True)
json.dump(dict(env=env_info(), runs=res), open(f'{out}/results/cuda_init_probe.json', 'w'), indent=1)
