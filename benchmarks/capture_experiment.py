"""The experiment that found why a head recording failed in our step harness on the H200 (2026-11-30).

Case A: `train_trace` as it was (the previous step's `loss` still referenced while the next step records);
case B: the same steps with `del loss` after each step; case C: as A with 100 instance slots.
H200 result (torch 2.11): A and C failed with cudaErrorStreamCaptureImplicit ("operation would make the legacy stream
depend on a capturing blocking stream") in the backward capture; B recorded and replayed. `train_trace` now drops
its references, and the recorder retries a failed recording with parameter aliases (06b_recorder).

    python benchmarks/capture_experiment.py A|B|C
"""
import sys, torch
from pathlib import Path
from lucid_nb.core import synth_batch
from lucid_nb.heads import yolo_seg
from lucid_nb.loss import SegLoss
from lucid_nb.recorder import HeadRegion, model_outputs
from lucid_nb.testing import train_trace
torch.backends.cudnn.benchmark = False
case = sys.argv[1]
M = 100 if case == 'C' else 16
bs = [synth_batch(B=4, S=640, M=M, K=80, seed=s, empty=True) for s in range(3)]
torch.manual_seed(0); m = yolo_seg('n', 80).cuda(); rec = HeadRegion()
if case in ('A', 'C'): train_trace(m, bs, rec)
else:
    rec.start(m.head); lf = SegLoss(80); opt = torch.optim.SGD(m.parameters(), lr=0.01)
    for b in bs:
        b = {k: v.cuda() for k, v in b.items()}
        with torch.autocast('cuda', dtype=torch.bfloat16):
            loss = sum(lf(model_outputs(m, b['img'].float() / 255, rec), b).values())
        opt.zero_grad(); loss.backward(); opt.step(); del loss
r = rec.report(); print(case, r['replayed_calls'], (r['record_error'] or '').strip().splitlines()[-5:-4])
