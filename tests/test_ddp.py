"""Lightning's DDP on two CPU processes (gloo): a fit that ends cleanly with the same hashes on every process,
validation that scores the whole set once (the same numbers and predictions as one process), and the recorder's
replay under DDP (the same hashes as native DDP)."""
import json, os, subprocess, sys
from pathlib import Path
from types import SimpleNamespace

import pytest, torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lucid_nb.trainer import ddp_blocker
from helpers import LUCID, TINY

HERE = Path(__file__).resolve().parent
DDP = ['--trainer.devices', '2', '--trainer.strategy', 'ddp']
# 5 validation images in batches of 2: process 0 validates 2 batches (3 images), process 1 one (2 images)
RUN = [*TINY, '--data.val_count', '5', '--trainer.precision', 'bf16-mixed', '--trainer.max_epochs', '2']
ENV = dict(os.environ, OMP_NUM_THREADS='1')   # one thread per process, also for the single-process run it is compared with


def lucid(tmp:Path, *args, cmd=(str(LUCID),), env=ENV)->subprocess.CompletedProcess:
    r = subprocess.run([*cmd, *args], cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def run_dir(tmp:Path, arm:str)->Path:
    runs = sorted((tmp/arm/'lucid').iterdir())
    assert [p.name for p in runs] == ['version_0'], f"one run folder expected, found {runs}"   # no stray folder of rank 1
    return runs[0]


@pytest.fixture(scope='module')
def native(tmp_path_factory):
    "A 2-process DDP fit through the `lucid` console script."
    tmp = tmp_path_factory.mktemp('ddp')
    r = lucid(tmp, 'fit', *RUN, *DDP, '--trainer.default_root_dir', 'native')
    return tmp, r, run_dir(tmp, 'native')


def test_fit_ends_cleanly_with_equal_hashes(native):
    tmp, r, run = native
    assert 'sync_dist' not in r.stderr, 'an epoch-level metric is logged without sync_dist'
    for f in ('checkpoints/last.ckpt', 'checkpoints/best.ckpt', 'predictions.json', 'val_metrics.jsonl', 'state_hashes.json',
              'timing.json', 'curves.png', 'train_batch.jpg'):
        assert (run/f).exists(), f
    assert not (run/'lucid.lock').exists() and not list(run.rglob('*.tmp'))
    assert len((run/'val_metrics.jsonl').read_text().splitlines()) == 2            # one line per epoch, from rank 0 only
    assert sum(l.startswith('epoch ') for l in r.stdout.splitlines()) == 2
    ranks = json.loads((run/'state_hashes.json').read_text())['ranks']
    assert len(ranks) == 2 and ranks[0] == ranks[1], ranks                       # model, optimiser, scheduler, EMA
    assert set(ranks[0]) == {'model', 'optimizer', 'scheduler', 'ema'}


def _validation(run:Path)->tuple:
    line = json.loads((run/'val_metrics.jsonl').read_text().splitlines()[-1])
    return {k: v for k, v in line.items() if '/' in k or k.startswith('mAP') or k in ('predictions_sha256', 'classes')}, (run/'predictions.json').read_bytes()


def test_two_process_validate_equals_one_process(native):
    tmp, _, run = native
    ckpt = ['--ckpt_path', str(run/'checkpoints'/'last.ckpt')]
    lucid(tmp, 'validate', *RUN, *DDP, *ckpt, '--trainer.default_root_dir', 'val2')
    lucid(tmp, 'validate', *RUN, *ckpt, '--trainer.default_root_dir', 'val1')
    two, one = _validation(run_dir(tmp, 'val2')), _validation(run_dir(tmp, 'val1'))
    assert len([k for k in one[0] if '/' in k]) == 24 and json.loads(one[1]), 'no detections: the comparison would be empty'
    assert two == one


def test_replay_under_ddp_equals_native(native, tmp_path):
    "The recorder's CPU stand-in replays head and update on every process; DDP's all-reduce still gets the gradients."
    _, _, run = native
    report = tmp_path/'report'; report.mkdir()
    lucid(tmp_path, *RUN, *DDP, '--trainer.default_root_dir', 'replayed', cmd=(sys.executable, str(HERE/'ddp_replay.py')),
          env=dict(ENV, DDP_REPORT=str(report)))
    for rank in (0, 1):
        rep = json.loads((report/f'rank{rank}.json').read_text())
        assert rep['head']['blocked'] is None and rep['head']['replayed_calls'] > 0, rep
        assert rep['optimizer']['blocked'] is None and rep['optimizer']['replayed_steps'] > 0, rep
    strip = lambda h: {k: v for k, v in h.items() if k != 'env'}
    replayed = json.loads((run_dir(tmp_path, 'replayed')/'state_hashes.json').read_text())
    assert strip(replayed) == strip(json.loads((run/'state_hashes.json').read_text()))


def test_unsupported_ddp_setups_are_refused():
    cpu = DDPStrategy(parallel_devices=[torch.device('cpu')] * 2)
    trainer = lambda s: SimpleNamespace(world_size=2, strategy=s)
    plain, synced = nn.Sequential(nn.BatchNorm2d(3)), nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(3)))
    assert ddp_blocker(SimpleNamespace(world_size=1), plain, 'predict') is None
    assert ddp_blocker(trainer(cpu), plain, 'fit') is None
    assert 'FSDPStrategy' in ddp_blocker(trainer(type('FSDPStrategy', (), {})()), plain, 'fit')
    assert '--trainer.devices 1' in ddp_blocker(trainer(cpu), plain, 'predict')
    assert '--trainer.sync_batchnorm' in ddp_blocker(trainer(cpu), synced, 'fit')
