"""The recorder's bookkeeping on the CPU, through real Lightning fits: replayed training is bit-identical to native
(across EMA validation and a resume), every fallback is one clear line, recordings are released on every exit path,
moved parameters are re-recorded. The `EagerGraphs` backend stands in for CUDA graphs (see `06_recorder`)."""
import json, logging
from types import SimpleNamespace

import pytest, torch
from torch import nn
from lightning.pytorch.callbacks import Callback

from lucid_nb.core import synth_batch
from lucid_nb.model import yolo_seg
from lucid_nb.loss import SegLoss
from lucid_nb.recorder import (EagerGraphs, HeadRecorder, fit_blocker, head_blocker, model_outputs,
                               train_trace)
from lucid_nb import recorder

from helpers import StepLosses, StopAfterFirstEpoch, fit, hashes_only

BF16 = ('--trainer.precision', 'bf16-mixed')
LOGGER = 'lucid_nb.recorder'


def recorded_fit(tmp, *extra, ckpt=None, backend=None, callbacks=()):
    rec = HeadRecorder(backend=EagerGraphs() if backend is None else backend)
    losses = StepLosses()
    cli, run, h = fit(tmp, *BF16, *extra, callbacks=[rec, losses, *callbacks], ckpt=ckpt)
    return rec, losses.steps, run, h


@pytest.fixture(scope='module')
def native(tmp_path_factory):
    "A native 2-epoch bf16 fit: train, EMA validation, train, EMA validation."
    losses = StepLosses()
    _, run, h = fit(tmp_path_factory.mktemp('native'), *BF16, callbacks=[losses])
    return losses.steps, h


def test_replayed_fit_is_bitwise_native(native, tmp_path):
    rec, steps, run, h = recorded_fit(tmp_path)
    assert steps == native[0] and len(steps) == 4
    assert hashes_only(h) == hashes_only(native[1])       # model, optimiser, scheduler, EMA, loss, predictions JSON
    report = json.loads((run / 'recorder.json').read_text())
    assert (report['layout_probe_calls'], report['replayed_calls'], report['native_calls']) == (1, 3, 0)
    assert report['backend'] == 'eager' and report['native_backwards_of_replayed_calls'] == 0
    assert len(report['recordings']) == 1 and rec.graphs is None   # released at fit end


def test_resumed_replayed_fit_is_bitwise_native(native, tmp_path):
    _, _, run, _ = recorded_fit(tmp_path, callbacks=[StopAfterFirstEpoch()])
    rec, steps, _, h = recorded_fit(tmp_path, ckpt=str(run / 'checkpoints' / 'last.ckpt'))
    assert steps == native[0][2:] and hashes_only(h) == hashes_only(native[1])
    assert (rec.probes, rec.replayed) == (1, 1) and len(rec.recordings) == 1


def test_flag_adds_the_recorder_and_falls_back_on_cpu(tmp_path, caplog):
    "On the CPU `--model.capture_segment_heads true` trains natively and says why, once."
    caplog.set_level(logging.WARNING, LOGGER)
    cli, run, _ = fit(tmp_path, '--model.capture_segment_heads', 'true')
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert lines == ['capture_segment_heads: the head runs natively: the run trains on cpu; the recorder needs a CUDA GPU']
    report = json.loads((run / 'recorder.json').read_text())
    assert report['replayed_calls'] == 0 and report['native_calls'] == 4


@pytest.mark.parametrize('extra, says', [
    ((), '--trainer.precision=32-true; the recorder covers bf16-mixed'),
    ((*BF16, '--trainer.accumulate_grad_batches', '2'), '--trainer.accumulate_grad_batches=2; the recorder covers 1'),
    ((*BF16, '--trainer.detect_anomaly', 'true'), 'anomaly detection is on (--trainer.detect_anomaly)'),
])
def test_unsupported_setups_train_natively_with_one_line(tmp_path, caplog, extra, says):
    caplog.set_level(logging.WARNING, LOGGER)
    rec = HeadRecorder(backend=EagerGraphs())
    fit(tmp_path, *extra, callbacks=[rec])
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1 and lines[0].endswith(says), lines
    assert rec.replayed == 0 and rec.native == 4 and rec.reasons == {says: 4}


def trainer_stub(**kw):
    t = dict(world_size=1, num_devices=1, strategy=SimpleNamespace(root_device=torch.device('cuda')),
             precision='bf16-mixed', accumulate_grad_batches=1, _detect_anomaly=False)
    return SimpleNamespace(**{**t, **kw})


def test_fit_blockers(monkeypatch):
    head, module = yolo_seg('n', 4).head, SimpleNamespace(automatic_optimization=True)
    assert fit_blocker(trainer_stub(), module, head) is None
    assert 'uses 2 devices' in fit_blocker(trainer_stub(world_size=2, num_devices=2), module, head)
    assert 'manual optimisation' in fit_blocker(trainer_stub(), SimpleNamespace(automatic_optimization=False), head)
    monkeypatch.setattr(torch, '__version__', '2.8.1+cu128')
    assert fit_blocker(trainer_stub(), module, head) == 'torch 2.8.1+cu128 is older than 2.9'


def test_head_blockers():
    head = yolo_seg('n', 4).head
    assert head_blocker(head) is None
    head.cls[1][0][0].bn.momentum = None
    assert 'head.cls.1.0.0.bn has momentum=None' in head_blocker(head)
    head = yolo_seg('n', 4).head
    head.proto.cv2 = nn.Sequential(head.proto.cv2, nn.Dropout(0.1))
    assert 'dropout' in head_blocker(head)
    head = yolo_seg('n', 4).head
    handle = head.box[0].register_forward_hook(lambda *a: None)
    assert 'head.box.0 has module hooks' in head_blocker(head)
    handle.remove()
    handle = nn.modules.module.register_module_forward_hook(lambda *a: None)
    try: assert 'global module hooks' in head_blocker(head)
    finally: handle.remove()
    head.box[0][0].bn.running_mean.requires_grad_(True)
    assert 'buffer requires grad' in head_blocker(head)
    assert 'no predict' in head_blocker(nn.Linear(2, 2))


class FailAtStep(Callback):
    def __init__(self, step): self.step = step
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step: raise RuntimeError('injected failure')


def test_released_on_exception(tmp_path):
    rec = HeadRecorder(backend=EagerGraphs())
    seen = []
    class Spy(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx): seen.append(rec.graphs)
    with pytest.raises(RuntimeError, match='injected failure'):
        fit(tmp_path, *BF16, callbacks=[rec, Spy(), FailAtStep(2)])
    assert rec.graphs is None and seen[-1] is not None and seen[-1].released


class FailingBackend(EagerGraphs):
    def capture(self, fn): raise RuntimeError('operation not permitted when stream is capturing')


def test_recording_failure_trains_natively(native, tmp_path, caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    rec, steps, _, h = recorded_fit(tmp_path, backend=FailingBackend())
    assert steps == native[0] and hashes_only(h) == hashes_only(native[1])    # the warm-up's BN drift was undone
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert lines == ['capture_segment_heads: the head runs natively: recording failed '
                     '(RuntimeError: operation not permitted when stream is capturing)']
    assert (rec.probes, rec.native) == (1, 3)


def one_step(model, rec, batch):
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = model_outputs(model, batch['img'].float() / 255, rec)
    sum(t.float().sum() for t in out['box']).backward()


def test_moved_parameters_are_recorded_again(caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    torch.manual_seed(0); model = yolo_seg('n', 4)
    rec = HeadRecorder(backend=EagerGraphs(), max_records=2)
    rec.start(model.head)
    batch = synth_batch(B=2, S=64, K=4)
    one_step(model, rec, batch); one_step(model, rec, batch)     # learn the gradient layouts; record and replay
    first = rec.graphs
    # new tensors: the recorded addresses are stale
    model.head.load_state_dict({k: v.clone() for k, v in model.head.state_dict().items()}, assign=True)
    one_step(model, rec, batch)
    assert rec.graphs is not first and first.released and len(rec.recordings) == 2 and rec.replayed == 2
    model.head.load_state_dict({k: v.clone() for k, v in model.head.state_dict().items()}, assign=True)
    one_step(model, rec, batch)
    assert rec.native == 1 and 'stopped after 2 recordings' in rec.blocked
    assert any('recording again' in r.getMessage() for r in caplog.records)


def test_checkpoint_load_releases():
    rec = HeadRecorder(backend=EagerGraphs())
    torch.manual_seed(0); model = yolo_seg('n', 4)
    rec.start(model.head)
    for _ in range(2): one_step(model, rec, synth_batch(B=2, S=64, K=4))
    graphs = rec.graphs
    rec.on_load_checkpoint(None, None, {})
    assert rec.graphs is None and graphs.released
    with pytest.raises(RuntimeError, match='released'): graphs.backward(graphs.generation, ())


def test_frozen_branch_and_frozen_features():
    "Parameters that do not train get no gradient, and features that need none get none, as natively."
    def frozen():
        torch.manual_seed(0); m = yolo_seg('n', 4)
        m.head.box[2].requires_grad_(False); m.backbone.requires_grad_(False); m.neck.requires_grad_(False)
        return m
    batches = [synth_batch(B=2, S=64, K=4, seed=s) for s in range(2)]
    a = train_trace(frozen(), batches)
    b = train_trace(frozen(), batches, HeadRecorder(backend=EagerGraphs()))
    recorder.test_traces_equal(a, b)
    assert all(b['steps'][0]['grads'][n] is None for n in b['steps'][0]['grads'] if n.startswith(('head.box.2', 'backbone')))


class LayoutSwitchingLoss(SegLoss):
    "The segmentation loss; every other call multiplies the outputs by 1 first, so their gradients arrive contiguous."
    calls = 0
    def forward(self, out, batch):
        LayoutSwitchingLoss.calls += 1
        if self.calls % 2: out = {k: v * 1 if torch.is_tensor(v) else [t * 1 for t in v] for k, v in out.items()}
        return super().forward(out, batch)


def test_gradient_layouts_are_learned_and_checked():
    "The recording's gradient inputs copy the loss's strided layout; a backward laid out otherwise runs natively."
    torch.manual_seed(0); model = yolo_seg('n', 4)
    rec = HeadRecorder(backend=EagerGraphs()); rec.start(model.head)
    batch = synth_batch(B=2, S=64, K=4)
    for _ in range(2):
        with torch.autocast('cpu', dtype=torch.bfloat16):
            sum(SegLoss(4)(model_outputs(model, batch['img'].float() / 255, rec), batch).values()).backward()
    layouts = dict(zip(rec.graphs.names, rec.graphs.grad_layouts))
    box1 = rec.graphs.static_out[rec.graphs.names.index('box1')]
    assert layouts['box1'][0] != box1.stride()            # a strided view of the concatenated gradient
    def fresh(): torch.manual_seed(0); return yolo_seg('n', 4)
    batches = [synth_batch(B=2, S=64, K=4, seed=s) for s in range(5)]
    LayoutSwitchingLoss.calls = 0; a = train_trace(fresh(), batches, loss_fn=LayoutSwitchingLoss(4))
    LayoutSwitchingLoss.calls = 0; rec = HeadRecorder(backend=EagerGraphs())
    b = train_trace(fresh(), batches, rec, loss_fn=LayoutSwitchingLoss(4))
    recorder.test_traces_equal(a, b)
    assert rec.replayed == 4 and rec.native_backwards == 2   # the contiguous-gradient steps went native


class FailFirstCapture(EagerGraphs):
    "Fails the first capture, as the H200 did when a previous step's graph was still referenced (see 06_recorder)."
    failed = False
    def capture(self, fn):
        if not self.failed:
            self.failed = True
            raise RuntimeError('CUDA error: operation would make the legacy stream depend on a capturing blocking stream')
        return super().capture(fn)


def test_failed_recording_is_retried_with_parameter_aliases(native, tmp_path):
    rec, steps, run, h = recorded_fit(tmp_path, backend=FailFirstCapture())
    assert steps == native[0] and hashes_only(h) == hashes_only(native[1])
    assert (rec.probes, rec.replayed, rec.native) == (1, 3, 0)
    (r,) = json.loads((run / 'recorder.json').read_text())['recordings']
    assert r['parameter_aliases'] and 'legacy stream' in r['first_attempt_error']
    # the aliases were swapped in only while recording: the head holds its own Parameters again
    assert all(type(p) is nn.Parameter for p in rec.head.parameters())
