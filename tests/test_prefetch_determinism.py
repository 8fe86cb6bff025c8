"""Identical fits end with identical bytes whatever the prefetch thread's timing: the same tiny fit in separate
processes, with the producer delayed at its start, at every batch or not at all, with 0 and 2 loader workers, ends
with the `state_hashes.json` of the same fit without prefetch (`nbs/01c_loader.ipynb` says what the thread may not
share). On a CUDA GPU the same for the native step and the whole step replayed (`pytest -m cuda`)."""
import json, os, subprocess, sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest, torch

from helpers import hashes_only, tiny

SCRIPT = Path(__file__).with_name('delayed_prefetch_fit.py')


def run_fit(tmp: Path, name: str, delay: str, *extra: str) -> dict:
    "One `lucid fit` in its own process (its prefetch disturbed as `delay` says); its state hashes."
    env = {**os.environ, 'PREFETCH_DELAY': delay, 'PYTHONPATH': os.pathsep.join([str(SCRIPT.parent.parent), *filter(None, [os.environ.get('PYTHONPATH')])])}
    args = tiny(tmp, '--data.val_count', '4', '--trainer.limit_train_batches', '3', *extra, version=name)
    p = subprocess.run([sys.executable, str(SCRIPT), *args[1:]], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"{name}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    return hashes_only(json.loads((tmp / 'runs' / 'tiny' / name / 'state_hashes.json').read_text()))


def all_equal_to_no_prefetch(tmp: Path, runs: dict, *extra: str):
    "Run the fit without prefetch, then `runs` (name → (delay, args)) two at a time: every hash set equals the first."
    reference = run_fit(tmp, 'no_prefetch', '', '--data.prefetch', 'false', *extra)
    with ThreadPoolExecutor(2) as ex:   # two at once: each run's threads compete with the other's for the cores
        got = dict(zip(runs, ex.map(lambda n: run_fit(tmp, n, runs[n][0], *runs[n][1], *extra), runs)))
    for name, h in got.items(): assert h == reference, f"{name} ended with other bytes than the fit without prefetch"


def test_prefetch_timing_changes_no_byte(tmp_path):
    runs = {f'w{w}_{d or "plain"}': (d, ('--data.workers', str(w))) for w in (0, 2) for d in ('', 'start', 'loop')}
    all_equal_to_no_prefetch(tmp_path, runs)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')
def test_prefetch_timing_changes_no_byte_on_the_gpu(tmp_path):
    gpu = ('--trainer.accelerator', 'gpu', '--trainer.devices', '1', '--trainer.precision', 'bf16-mixed', '--data.imgsz', '320',
           '--data.batch_size', '4', '--data.workers', '2')
    runs = {f'{arm}_{d or "plain"}': (d, ('--model.capture_train_step', str(arm == 'step').lower()))
            for arm in ('native', 'step') for d in ('', 'start', 'loop')}
    all_equal_to_no_prefetch(tmp_path, runs, *gpu)
