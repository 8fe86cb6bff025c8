"""`--data.augment_on device` (`nbs/01b_augment_device.ipynb`): the loader hands over recipes whose samples, made on the
batch's device, are the CPU path's batches byte for byte, the same per seed and epoch however the batch's pieces are
built, without a host sync or a draw from a global generator; a tiny CPU fit ends with the CPU path's state hashes in
separate processes, and with the whole step replayed (the recorder's CPU stand-in) as natively. On a CUDA GPU the
same, made there (`pytest -m cuda`)."""
import contextlib, io, json, os, subprocess, sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np, pytest, torch

from lucid_nb.augment_device import build_on_device
from lucid_nb.core import assert_no_host_sync, digest
from lucid_nb.data import YoloData, YoloLoader
from lucid_nb.graphs import EagerGraphs
from lucid_nb.recorder import Recorder

from helpers import StepLosses, fit, hashes_only, lucid_main, tiny

ROOT = Path(__file__).resolve().parent.parent


def datamodule(augment_on, seed=3, **kw):
    "16 training images at 128 px, batch 4; mosaic on for epochs 0-1, off for epoch 2 (`close_mosaic`)."
    dm = YoloData(imgsz=128, batch_size=4, seed=seed, val_count=112, prefetch=False, max_epochs=3, close_mosaic=1, augment_on=augment_on, **kw)
    with contextlib.redirect_stdout(io.StringIO()): dm.setup('fit')
    return dm


def epoch(ld, e, make=lambda b: b):
    ld.set_epoch(e)
    return [digest(make(b)) for b in ld]


@pytest.fixture(scope='module')
def arms():
    return {arm: datamodule(arm) for arm in ('cpu', 'device')}


@pytest.mark.parametrize('e', [0, 2], ids=['mosaic', 'no_mosaic'])
def test_device_batches_are_the_cpu_batches(arms, e):
    def made(b):
        with assert_no_host_sync(): return build_on_device(b)
    cpu, device = arms['cpu'].train_dataloader(), arms['device'].train_dataloader()
    assert epoch(device, e, made) == epoch(cpu, e)


def test_same_bytes_per_seed_and_epoch(arms):
    "A recipe batch depends on the seed and the epoch only: not on the pieces that build it, nor on a global generator."
    ds = arms['device']._train
    one = YoloLoader(ds, 4, seed=3, prefetch=False)
    before = (torch.get_rng_state(), np.random.get_state()[1].copy())
    first = epoch(one, 1, build_on_device)
    assert torch.equal(torch.get_rng_state(), before[0]) and np.array_equal(np.random.get_state()[1], before[1])
    assert epoch(datamodule('device').train_dataloader(), 1, build_on_device) == first      # another datamodule, the same seed
    for pieces in (2, 3):   # loader workers each build a piece of a batch; joined, the same samples
        assert epoch(YoloLoader(ds, 4, seed=3, prefetch=False, pieces=pieces), 1, build_on_device) == first
    assert epoch(one, 0, build_on_device) != first
    assert epoch(datamodule('device', seed=4).train_dataloader(), 1, build_on_device) != first


def lucid_fit(tmp, name, *extra):
    "A tiny `lucid fit` in its own process; its state hashes."
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join([str(ROOT), *filter(None, [os.environ.get('PYTHONPATH')])])}
    code = 'import sys; from lucid_nb.cli import main; sys.argv[0] = "lucid"; main()'
    p = subprocess.run([sys.executable, '-c', code, *tiny(tmp, *extra, version=name)], env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"{name}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    return hashes_only(json.loads((tmp / 'runs' / 'tiny' / name / 'state_hashes.json').read_text()))


def test_device_fit_is_the_cpu_fit_in_separate_processes(tmp_path):
    runs = {'device_a': ('--data.augment_on', 'device'), 'device_b': ('--data.augment_on', 'device'), 'cpu': ('--data.augment_on', 'cpu')}
    with ThreadPoolExecutor(2) as ex:
        got = dict(zip(runs, ex.map(lambda n: lucid_fit(tmp_path, n, *runs[n]), runs)))
    assert got['device_a'] == got['device_b'] == got['cpu'], got


def test_replayed_step_is_native_with_device_augmentation(tmp_path):
    "The device augmentation runs before the step: the whole step replayed (EagerGraphs) gives the native step's bytes."
    args = ('--trainer.precision', 'bf16-mixed', '--data.augment_on', 'device')
    native = StepLosses()
    _, _, h = fit(tmp_path / 'native', *args, callbacks=[native])
    replayed, rec = StepLosses(), Recorder(backend=EagerGraphs(), step=True)
    _, run, h2 = fit(tmp_path / 'step', *args, callbacks=[replayed], recorder=rec)
    assert replayed.steps == native.steps and len(native.steps) == 4 and hashes_only(h2) == hashes_only(h)
    assert json.loads((run / 'recorder.json').read_text())['step']['replayed_steps'] == 4


def test_bad_augment_on_is_one_line(tmp_path, monkeypatch, capsys):
    with pytest.raises(ValueError, match="augment_on='gpu' is not allowed: use one of 'cpu', 'device'"): YoloData(augment_on='gpu')
    monkeypatch.chdir(tmp_path)
    assert lucid_main(monkeypatch, 'fit', '--trainer.max_epochs', '1', '--data.augment_on', 'gpu') == 2
    lines = [l for l in capsys.readouterr().err.splitlines() if 'error' in l.lower()]
    assert len(lines) == 1 and lines[0].startswith('lucid: error:') and 'augment_on' in lines[0], lines


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')
def test_gpu_build_is_the_cpu_build(arms):
    "Made on the GPU, the CPU's bytes, with no synchronisation (`set_sync_debug_mode('error')`)."
    ld = arms['device'].train_dataloader()
    for e in (0, 2):
        ld.set_epoch(e)
        for b in ld:
            gpu = {k: v.cuda() for k, v in b.items()}
            torch.cuda.synchronize(); torch.cuda.set_sync_debug_mode('error')
            try: made = build_on_device(gpu)
            finally: torch.cuda.set_sync_debug_mode('default')
            assert digest(made) == digest(build_on_device(b))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')
def test_gpu_fit_native_and_replayed_with_device_augmentation(tmp_path):
    gpu = ('--trainer.accelerator', 'gpu', '--trainer.devices', '1', '--trainer.precision', 'bf16-mixed', '--data.imgsz', '320',
           '--data.batch_size', '4', '--data.augment_on', 'device')
    runs = {arm: ('--model.capture_train_step', str(arm == 'step').lower()) for arm in ('native', 'step')}
    got = {n: lucid_fit(tmp_path, n, *gpu, *runs[n]) for n in runs}
    assert got['native'] == got['step'], got
