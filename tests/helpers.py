"""Helpers shared by the tests (and a few benchmarks): a tiny CPU run of the `lucid` CLI, a count of tensor bytes alive."""
import json, os, sys, time, weakref
from pathlib import Path

from lightning.pytorch.callbacks import Callback

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lucid_nb.core import digest, state_hashes
from lucid_nb.loss import SegLoss
from lucid_nb.recorder import model_outputs
from lucid_nb.command import cli_main
from lucid_nb.cli import run

ROOT = Path(__file__).resolve().parent.parent
TINY = ['--trainer.accelerator', 'cpu', '--trainer.num_sanity_val_steps', '0', '--trainer.limit_train_batches', '2',
        '--trainer.enable_progress_bar', 'false', '--trainer.enable_model_summary', 'false',
        '--data.imgsz', '64', '--data.batch_size', '2', '--data.val_count', '2', '--data.close_mosaic', '1',
        '--model.warmup_epochs', '0', '--model.max_det', '20', '--seed_everything', '0']


def tiny(tmp: Path, *extra: str, sub: str = 'fit', epochs: int = 2, version: str | None = None) -> list:
    "Arguments of a tiny `lucid` run logging to `tmp/runs/tiny/<version>` (the next `version_N` when None)."
    logger = ['--trainer.logger', json.dumps({'class_path': 'lightning.pytorch.loggers.CSVLogger',
                                              'init_args': {'save_dir': str(tmp / 'runs'), 'name': 'tiny', 'version': version}})]
    return [sub, *TINY, '--trainer.max_epochs', str(epochs), *logger, *extra]


class StopAfterFirstEpoch(Callback):
    "Ends fit after epoch 0 (after its validation and checkpoint), as an interrupted run would."
    def on_validation_end(self, trainer, module):
        if trainer.current_epoch == 0: trainer.should_stop = True


def fit(tmp: Path, *extra, callbacks=(), ckpt=None, epochs: int = 2, version: str | None = None, recorder=None):
    cli = cli_main(tiny(tmp, *extra, epochs=epochs, version=version)[1:], run=False)
    if recorder is not None: cli.model.recorder = recorder   # e.g. `Recorder(backend=EagerGraphs())`
    cli.trainer.callbacks.extend(callbacks)
    cli.trainer.fit(cli.model, cli.datamodule, ckpt_path=ckpt)
    run = Path(cli.trainer.log_dir)
    return cli, run, json.loads((run / 'state_hashes.json').read_text())


def hashes_only(h: dict) -> dict: return {k: v for k, v in h.items() if k != 'env'}




class StepLosses(Callback):
    "Bytes of every step's loss terms, to compare runs step by step and not only at the end."
    def __init__(self): self.steps = []
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.steps.append(digest(module.last_losses))


LUCID = Path(sys.executable).parent / 'lucid'   # the console script of this environment


def lucid_main(monkeypatch, *args) -> int:
    "Run the `lucid` command in this process (`lucid_nb.cli.run`, as the console script does before it exits); returns its exit status."
    monkeypatch.setattr(sys, 'argv', ['lucid', *args])
    return run()


class WaitForSignal(Callback):
    """Holds a `lucid` subprocess at the first batch of epoch 1 until a signal comes (SIGTERM sets Lightning's flag,
    SIGINT raises), after touching `$WAIT_MARKER`: a signal sent then lands here, not in some library's cleanup."""
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if (trainer.current_epoch, batch_idx) != (1, 0): return
        trainer.checkpoint_callback.wait()   # epoch 0's checkpoints, written in the background, are on disk
        Path(os.environ['WAIT_MARKER']).touch()
        deadline = time.monotonic() + 300
        while not trainer.received_sigterm and time.monotonic() < deadline: time.sleep(0.05)


# The recorder's parity harness: a short SGD run, native or with the head (or the whole step) replayed (`06b_recorder`).
def train_trace(model:nn.Module,                 # trained in place
                batches:list[dict],              # batches in the padded format (`img` uint8)
                recorder=None,                   # a `HeadRegion` or a `StepRegion`; None: native
                lr:float=0.01,
                loss_fn=None,                    # default `SegLoss(model.head.num_classes)`
                set_to_none:bool=True,           # `zero_grad(set_to_none=...)`
               )->dict:
    "Per-step loss bytes and gradient digests (None for a None grad), and final state hashes, of a short SGD run."
    dev = next(model.parameters()).device
    loss_fn = loss_fn or SegLoss(model.head.num_classes)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True)
    whole = callable(getattr(recorder, 'losses', None))   # a `StepRegion` (duck-typed: notebooks define their own class)
    head = None if whole else recorder
    def step_fn(b):
        losses = loss_fn(model_outputs(model, b['img'], head), b)
        return losses, sum(losses.values())
    if recorder is not None: recorder.start(model if whole else model.head)
    model.train()
    steps = []
    for batch in batches:
        b = {k: v.to(dev) for k, v in batch.items()}
        b['img'] = b['img'].float() / 255
        if whole: recorder.new_batch()
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            losses, loss = recorder.losses(model, step_fn, b) if whole else step_fn(b)
        opt.zero_grad(set_to_none=set_to_none)
        loss.backward()
        steps.append(dict(loss=digest(loss.detach()), terms=digest({k: v.detach() for k, v in losses.items()}),
                          grads={n: None if p.grad is None else digest(p.grad) for n, p in model.named_parameters()}))
        opt.step()
        del loss, losses  # as Lightning does: the next step's recording must not see this step's autograd graph
    if recorder is not None: recorder.release()
    return dict(steps=steps, state=state_hashes(model=model, optimizer=opt))

def test_traces_equal(a:dict, b:dict):
    "Fail unless two `train_trace` results are identical; the message names the first step and tensor that differ."
    for i, (sa, sb) in enumerate(zip(a['steps'], b['steps'])):
        assert sa['loss'] == sb['loss'], f"step {i}: loss bytes differ"
        assert sa['terms'] == sb['terms'], f"step {i}: loss terms differ"
        for n in sa['grads']:
            ga, gb = sa['grads'][n], sb['grads'][n]
            assert (ga is None) == (gb is None), f"step {i}: {n}.grad is {ga and 'set'} vs {gb and 'set'}"
            assert ga == gb, f"step {i}: {n}.grad bytes differ"
    assert len(a['steps']) == len(b['steps']), "traces have different lengths"
    assert a['state'] == b['state'], f"final state hashes differ: {a['state']} vs {b['state']}"


class TensorBytes(TorchDispatchMode):
    "Bytes of the tensors operations make under it, each counted until it is freed: alive now (`live`) and at most (`peak`, since the start or the last `reset`)."
    def __init__(self): super().__init__(); self.live = self.peak = 0

    def reset(self): self.peak = self.live

    def _freed(self, n): self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in [*args, *(kwargs or {}).values()] if isinstance(a, torch.Tensor)}
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if not isinstance(t, torch.Tensor) or t._base is not None or t.untyped_storage().data_ptr() in inputs: continue   # a view or in place: nothing new
            n = t.untyped_storage().nbytes(); self.live += n; self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._freed, n)
        return out
