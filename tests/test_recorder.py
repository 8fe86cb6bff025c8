"""The recorder's bookkeeping on the CPU, through real Lightning fits: replayed training (the head, the optimiser
update, both) is bit-identical to native (across EMA validation, warm-up, clipping and a resume), every fallback is one
clear line, recordings are released on every exit path, moved parameters and optimiser state are re-recorded.
The `EagerGraphs` backend stands in for CUDA graphs (see `06b_recorder`)."""
import contextlib, copy, json, logging
from types import SimpleNamespace

import pytest, torch
from torch import nn
from lightning.pytorch.callbacks import Callback

from lucid_nb.core import digest, synth_batch
from lucid_nb.graphs import step_inputs
from lucid_nb.heads import yolo_seg
from lucid_nb.loss import SegLoss
from lucid_nb.optim import SGDUpdate, build_optimizer, build_schedule
from lucid_nb.graphs import EagerGraphs, head_blocker, nothing_kept
from lucid_nb.heads import model_outputs
from lucid_nb.recorder import (HeadRegion, Recorder, StepRegion, UpdateRegion, head_fit_blocker, step_fit_blocker,
                               update_fit_blocker)

from helpers import StepLosses, StopAfterFirstEpoch, fit, hashes_only, train_trace
from helpers import test_traces_equal as traces_equal   # (not collected as a test)

BF16 = ('--trainer.precision', 'bf16-mixed')
LOGGER = 'lucid_nb.recorder'


def recorded_fit(tmp, *extra, ckpt=None, backend=None, callbacks=()):
    rec = Recorder(backend=EagerGraphs() if backend is None else backend)
    losses = StepLosses()
    cli, run, h = fit(tmp, *BF16, *extra, callbacks=[losses, *callbacks], ckpt=ckpt, recorder=rec)
    return rec.regions['head'], losses.steps, run, h


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
    report = json.loads((run / 'recorder.json').read_text())['head']
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
    report = json.loads((run / 'recorder.json').read_text())['head']
    assert report['replayed_calls'] == 0 and report['native_calls'] == 4


@pytest.mark.parametrize('extra, says', [
    ((), '--trainer.precision=32-true; the recorder covers bf16-mixed'),
    ((*BF16, '--trainer.accumulate_grad_batches', '2'), '--trainer.accumulate_grad_batches=2; the recorder covers 1'),
    ((*BF16, '--trainer.detect_anomaly', 'true'), 'anomaly detection is on (torch.is_anomaly_enabled(), e.g. --trainer.detect_anomaly)'),
])
def test_unsupported_setups_train_natively_with_one_line(tmp_path, caplog, extra, says):
    caplog.set_level(logging.WARNING, LOGGER)
    rec = Recorder(backend=EagerGraphs())
    fit(tmp_path, *extra, recorder=rec)
    rec = rec.regions['head']
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1 and lines[0].endswith(says), lines
    assert rec.replayed == 0 and rec.native == 4 and rec.reasons == {says: 4}


def trainer_stub(**kw):
    t = dict(world_size=1, num_devices=1, strategy=SimpleNamespace(root_device=torch.device('cuda')),
             precision='bf16-mixed', accumulate_grad_batches=1)
    return SimpleNamespace(**{**t, **kw})


def test_fit_blockers(monkeypatch):
    head, module = yolo_seg('n', 4).head, SimpleNamespace(automatic_optimization=True)
    assert head_fit_blocker(trainer_stub(), module, head) is None
    assert 'uses 2 devices' in head_fit_blocker(trainer_stub(world_size=2, num_devices=2), module, head)
    assert 'manual optimisation' in head_fit_blocker(trainer_stub(), SimpleNamespace(automatic_optimization=False), head)
    monkeypatch.setattr(torch, '__version__', '2.8.1+cu128')
    assert head_fit_blocker(trainer_stub(), module, head) == 'torch 2.8.1+cu128 is older than 2.9'


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
    whole = Recorder(backend=EagerGraphs(), optimizer=True); rec, upd = whole.regions['head'], whole.regions['optimizer']
    seen = []
    class Spy(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx): seen.append((rec.graphs, upd.graphs))
    with pytest.raises(RuntimeError, match='injected failure'):
        fit(tmp_path, *BF16, callbacks=[Spy(), FailAtStep(2)], recorder=whole)
    assert rec.graphs is None and upd.graphs is None
    assert all(g is not None and g.released for g in seen[-1])


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
    rec = HeadRegion(backend=EagerGraphs(), max_records=2)
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
    whole = Recorder(backend=EagerGraphs()); rec = whole.regions['head']
    torch.manual_seed(0); model = yolo_seg('n', 4)
    rec.start(model.head)
    for _ in range(2): one_step(model, rec, synth_batch(B=2, S=64, K=4))
    graphs = rec.graphs
    whole.on_load_checkpoint(None, None, {})
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
    b = train_trace(frozen(), batches, HeadRegion(backend=EagerGraphs()))
    traces_equal(a, b)
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
    rec = HeadRegion(backend=EagerGraphs()); rec.start(model.head)
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
    LayoutSwitchingLoss.calls = 0; rec = HeadRegion(backend=EagerGraphs())
    b = train_trace(fresh(), batches, rec, loss_fn=LayoutSwitchingLoss(4))
    traces_equal(a, b)
    assert rec.replayed == 4 and rec.native_backwards == 2   # the contiguous-gradient steps went native


class FailFirstCapture(EagerGraphs):
    "Fails the first capture, as the H200 did when a previous step's graph was still referenced (see 06b_recorder)."
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
    (r,) = json.loads((run / 'recorder.json').read_text())['head']['recordings']
    assert r['parameter_aliases'] and 'legacy stream' in r['first_attempt_error']
    # the aliases were swapped in only while recording: the head holds its own Parameters again
    assert all(type(p) is nn.Parameter for p in rec.head.parameters())


# ---- the optimiser update as a region (`--model.capture_optimizer_step`) ----
WARM = ('--model.warmup_epochs', '1')   # every step of the tiny fit is in warm-up: lr and momentum change each step
OPT_LINE = 'capture_optimizer_step: the update runs natively: '


def optimizer_fit(tmp, opt, *extra, head=False, ckpt=None, callbacks=()):
    rec = Recorder(backend=EagerGraphs(), head=head, optimizer=True)
    losses = StepLosses()
    _, run, h = fit(tmp, '--model.optimizer', opt, *WARM, *extra, callbacks=[losses, *callbacks], ckpt=ckpt, recorder=rec)
    return rec, losses.steps, json.loads((run / 'recorder.json').read_text()), h


def native_fit(tmp, opt, *extra, callbacks=()):
    losses = StepLosses()
    _, _, h = fit(tmp, '--model.optimizer', opt, *WARM, *extra, callbacks=[losses, *callbacks])
    return losses.steps, h


@pytest.mark.parametrize('opt, first_native', [('sgd', 1), ('adamw', 1), ('musgd', 0)])
def test_replayed_update_is_bitwise_native(tmp_path, opt, first_native):
    "Parameters, every optimiser state tensor, the schedule and the EMA: the same bytes after a fit with warm-up."
    steps, h = native_fit(tmp_path / 'native', opt)
    rec, steps_r, report, h_r = optimizer_fit(tmp_path / 'replay', opt)
    assert steps_r == steps and hashes_only(h_r) == hashes_only(h)
    r = report['optimizer']
    assert (r['first_steps_creating_state'], r['recorded_steps'], r['replayed_steps'], r['native_steps']) == \
        (first_native, 1, 3 - first_native, 0), r
    assert rec.regions['optimizer'].graphs is None     # released at fit end


def test_both_regions_with_clipping_are_bitwise_native(tmp_path):
    "Head and update replayed together, gradients clipped by Lightning before the (replayed) update."
    clip = ('--trainer.gradient_clip_val', '0.05', *BF16)
    steps, h = native_fit(tmp_path / 'native', 'sgd', *clip)
    rec, steps_r, report, h_r = optimizer_fit(tmp_path / 'replay', 'sgd', *clip, head=True)
    assert steps_r == steps and hashes_only(h_r) == hashes_only(h)
    assert report['optimizer']['replayed_steps'] == 2 and report['head']['replayed_calls'] == 3, report


def test_resumed_update_is_recorded_again(tmp_path):
    "`load_state_dict` gives new state tensors: the resumed fit records again (after its first step) and ends as native."
    steps, h = native_fit(tmp_path / 'native', 'sgd')
    _, _, first, _ = optimizer_fit(tmp_path, 'sgd', callbacks=[StopAfterFirstEpoch()])
    run = next((tmp_path / 'runs').rglob('last.ckpt'))
    rec, steps_r, report, h_r = optimizer_fit(tmp_path, 'sgd', ckpt=str(run))
    assert steps_r == steps[2:] and hashes_only(h_r) == hashes_only(h)
    r = report['optimizer']
    assert (r['first_steps_creating_state'], r['recorded_steps'], r['replayed_steps']) == (0, 1, 1), r


def test_flag_on_cpu_trains_natively_with_one_line(tmp_path, caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    _, run, h = fit(tmp_path, '--model.capture_optimizer_step', 'true')
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert lines == [OPT_LINE + 'the run trains on cpu; the recorder needs a CUDA GPU']
    r = json.loads((run / 'recorder.json').read_text())
    assert list(r) == ['optimizer'] and r['optimizer']['native_steps'] == 4


def test_accumulation_trains_natively_with_one_line(tmp_path, caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    rec, _, report, _ = optimizer_fit(tmp_path, 'sgd', '--trainer.accumulate_grad_batches', '2')
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert lines == [OPT_LINE + '--trainer.accumulate_grad_batches=2; the recorder covers 1']
    assert report['optimizer']['replayed_steps'] == 0


def test_update_fit_blockers(monkeypatch):
    module = SimpleNamespace(automatic_optimization=True)
    assert update_fit_blocker(trainer_stub(), module) is None
    assert update_fit_blocker(trainer_stub(precision='32-true'), module) is None
    assert 'no grad scaler' in update_fit_blocker(trainer_stub(precision='16-mixed'), module)
    assert 'manual optimisation' in update_fit_blocker(trainer_stub(), SimpleNamespace(automatic_optimization=False))
    assert 'uses 2 devices' in update_fit_blocker(trainer_stub(world_size=2, num_devices=2), module)
    monkeypatch.setattr(torch, '__version__', '2.8.1+cu128')
    assert update_fit_blocker(trainer_stub(), module) == 'torch 2.8.1+cu128 is older than 2.9'


def tiny_pair(name='sgd'):
    "Two identical small nets with their optimisers and schedules (warm-up: lr and momentum change every step)."
    out = []
    for _ in range(2):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Conv2d(8, 4, 1), nn.Flatten(), nn.Linear(4 * 36, 5))
        opt = build_optimizer(net, name, lr=0.05)
        out.append((net, opt, build_schedule(opt, epochs=2, steps_per_epoch=4, warmup_epochs=1, min_warmup_iters=4)))
    return out


def step_both(pair, region, seed, drop=()):
    "One step of the native pair member and of the region's; the parameters in `drop` get no gradient."
    torch.manual_seed(seed)
    grads = [torch.randn_like(p) for p in pair[0][0].parameters()]
    for (net, opt, sched), how in zip(pair, ('native', 'region')):
        for i, (p, g) in enumerate(zip(net.parameters(), grads)): p.grad = None if i in drop else g.clone()
        opt.step() if how == 'native' else region.step(opt)
        sched.step()
    (a, oa, _), (b, ob, _) = pair
    assert digest(a.state_dict()) == digest(b.state_dict()) and digest(oa.state_dict()) == digest(ob.state_dict())



@pytest.mark.parametrize('name, counts', [('sgd', (1, 1, 3, 1)), ('adamw', (1, 2, 2, 1))])
def test_changed_grad_pattern_runs_natively(caplog, name, counts):
    "A step where a parameter has no gradient runs natively; AdamW's step counts then differ, so it records again."
    caplog.set_level(logging.WARNING, LOGGER)
    pair, region = tiny_pair(name), UpdateRegion(EagerGraphs())
    region.start()
    for i in range(3): step_both(pair, region, i)
    step_both(pair, region, 3, drop={0})                   # a frozen conv: its update must not run
    for i in range(4, 6): step_both(pair, region, i)
    assert (region.state_steps, region.recorded, region.replayed, region.native) == counts
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert 'parameters with a gradient changed' in lines[0], lines
    assert lines[1:] == ([] if name == 'sgd' else ["capture_optimizer_step: the optimiser's settings changed (a value baked into the recording, or "
                                                 "which parameters share a step count); recording again"])


def test_moved_state_is_recorded_again(caplog):
    "A `load_state_dict` (new state tensors) between steps: the next step records again and stays bitwise native."
    caplog.set_level(logging.WARNING, LOGGER)
    pair, region = tiny_pair(), UpdateRegion(EagerGraphs())
    region.start()
    for i in range(3): step_both(pair, region, i)
    _, opt, _ = pair[1]
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))   # new state tensors, as from a checkpoint
    for i in range(3, 5): step_both(pair, region, i)
    assert (region.recorded, region.replayed, len(region.recordings)) == (2, 2, 2)
    assert any('recording again' in r.getMessage() for r in caplog.records)


def test_an_update_that_differs_is_caught_when_recorded(monkeypatch, caplog):
    "If the recorded arithmetic differs in one bit from the optimiser's step, the native result is kept and said."
    caplog.set_level(logging.WARNING, LOGGER)
    run = SGDUpdate.run
    def off_by_a_bit(self, grads):
        run(self, grads)
        with torch.no_grad(): self.flat[0].view(-1)[0] = torch.nextafter(self.flat[0].view(-1)[0], torch.tensor(9.))
    monkeypatch.setattr(SGDUpdate, 'run', off_by_a_bit)
    pair, region = tiny_pair(), UpdateRegion(EagerGraphs())
    region.start()
    for i in range(4): step_both(pair, region, i)
    assert region.graphs is None and region.replayed == 0 and region.native == 3   # the recorded step and two more
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1 and 'differs from SGD.step in 1 of' in lines[0], lines


def test_uncapturable_optimiser_and_hooks_run_natively(caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    net = nn.Linear(3, 2); region = UpdateRegion(EagerGraphs()); region.start()
    net.weight.grad, net.bias.grad = torch.ones(2, 3), torch.ones(2)
    region.step(torch.optim.Adam(net.parameters()))
    opt = build_optimizer(net, 'sgd'); h = opt.register_step_post_hook(lambda *a: None)
    region.step(opt); h.remove()
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert lines == [OPT_LINE + 'the optimiser Adam has no recordable update (MuSGD, SGD and AdamW have)',
                     OPT_LINE + 'optimizer step hooks are registered; they would not run on replay']


def test_stepping_puts_the_step_back():
    "`Recorder.stepping` routes `opt.step` only inside the block; an LR scheduler's wrapper on the instance comes back."
    net = nn.Linear(3, 2)
    opt = build_optimizer(net, 'sgd'); build_schedule(opt, epochs=1, steps_per_epoch=2)
    wrapper, rec = vars(opt)['step'], Recorder(EagerGraphs(), head=False, optimizer=True)
    with rec.stepping(opt): assert opt.step is not wrapper
    assert vars(opt)['step'] is wrapper
    plain = build_optimizer(net, 'sgd')
    with rec.stepping(plain): assert 'step' in vars(plain)
    assert 'step' not in vars(plain)
    with Recorder(EagerGraphs()).stepping(plain): assert 'step' not in vars(plain)   # no 'optimizer' region: untouched


# ---- the whole training step as a region (`--model.capture_train_step`) ----
STEP_LINE = 'capture_train_step: the step runs natively: '


def step_fit(tmp, *extra, ckpt=None, backend=None, callbacks=()):
    rec = Recorder(backend=EagerGraphs() if backend is None else backend, step=True)
    losses = StepLosses()
    _, run, h = fit(tmp, *BF16, *extra, callbacks=[losses, *callbacks], ckpt=ckpt, recorder=rec)
    return rec, losses.steps, json.loads((run / 'recorder.json').read_text()), h


def test_whole_step_replayed_fit_is_bitwise_native(native, tmp_path):
    "Forward, loss, backward, update and EMA replayed: every step's loss terms and the final hashes equal native."
    rec, steps, report, h = step_fit(tmp_path)
    assert steps == native[0] and hashes_only(h) == hashes_only(native[1])
    assert (report['step']['replayed_steps'], report['step']['native_steps']) == (4, 0), report['step']
    assert (report['ema']['replayed_updates'], len(report['ema']['recordings'])) == (3, 1), report['ema']
    assert report['optimizer']['replayed_steps'] == 2 and report['head']['replayed_calls'] == 0
    for name in ('step', 'optimizer', 'ema'):   # the recording time split by phase
        r = report[name]['recordings'][0]
        assert 0 < r['warm_up_seconds'] + r['capture_seconds'] <= r['seconds'], (name, r)
    assert all(r.graphs is None for r in rec.regions.values())          # released at fit end


def test_whole_step_resume_is_bitwise_native(native, tmp_path):
    _, _, _, _ = step_fit(tmp_path, callbacks=[StopAfterFirstEpoch()])
    run = next((tmp_path / 'runs' / 'tiny').iterdir())
    rec, steps, report, h = step_fit(tmp_path, ckpt=str(run / 'checkpoints' / 'last.ckpt'))
    assert steps == native[0][2:] and hashes_only(h) == hashes_only(native[1])
    assert report['step']['replayed_steps'] == 2 and report['ema']['replayed_updates'] == 1


def test_whole_step_with_clipping_is_bitwise_native(tmp_path):
    "Clipping edits the replayed gradients natively, between the backward and the update."
    clip = ('--trainer.gradient_clip_val', '0.5')
    losses = StepLosses()
    _, _, h = fit(tmp_path / 'native', *BF16, *clip, callbacks=[losses])
    rec, steps, report, h2 = step_fit(tmp_path / 'step', *clip)
    assert steps == losses.steps and hashes_only(h2) == hashes_only(h)
    assert report['step']['replayed_steps'] == 4


def test_whole_step_falls_back_on_cpu_with_one_line(tmp_path, caplog):
    "One line for the option, not one per region it turns on (`--verbose true` gives those: `test_quiet.py`)."
    caplog.set_level(logging.WARNING, LOGGER)
    _, run, _ = fit(tmp_path, *BF16, '--model.capture_train_step', 'true')
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert lines == ['capture_train_step: the whole training step runs natively: the run trains on cpu; the recorder needs a CUDA GPU']
    report = json.loads((run / 'recorder.json').read_text())
    assert report['step']['native_steps'] == 4 and report['ema']['native_updates'] == 4


def test_whole_step_unsupported_setups(tmp_path, caplog):
    "32-true and a hooked module: the step runs natively (the head and update regions still replay what they can)."
    caplog.set_level(logging.WARNING, LOGGER)
    rec = Recorder(backend=EagerGraphs(), step=True)
    fit(tmp_path, recorder=rec)
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert lines == ['capture_train_step: the head and the step run natively: --trainer.precision=32-true; the recorder covers bf16-mixed']
    assert rec.regions['step'].native == 4 and rec.regions['ema'].replayed == 3
    model = yolo_seg('n', 4)
    model.backbone.layers[0].register_forward_hook(lambda *a: None)
    assert 'model.backbone.layers.0 has module hooks' in step_fit_blocker(trainer_stub(), SimpleNamespace(automatic_optimization=True), model)


def test_whole_step_recording_failure_trains_natively(native, tmp_path, caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    rec, steps, report, h = step_fit(tmp_path, backend=FailingBackend())
    assert steps == native[0] and hashes_only(h) == hashes_only(native[1])    # the warm-up's BN drift was undone
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.getMessage().startswith(STEP_LINE)]
    assert lines == [STEP_LINE + 'recording failed (RuntimeError: operation not permitted when stream is capturing)']
    assert report['step']['native_steps'] == 4 and report['step']['record_error']


def test_whole_step_released_on_exception(tmp_path):
    whole = Recorder(backend=EagerGraphs(), step=True)
    seen = []
    class Spy(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx): seen.append(whole.regions['step'].graphs)
    with pytest.raises(RuntimeError, match='injected failure'):
        fit(tmp_path, *BF16, callbacks=[Spy(), FailAtStep(2)], recorder=whole)
    assert all(r.graphs is None for r in whole.regions.values()) and seen[-1].released
    with pytest.raises(RuntimeError, match='released'): seen[-1].backward(seen[-1].generation, torch.ones(()))


def fresh_model(seed=0):
    torch.manual_seed(seed); return yolo_seg('n', 4)


def test_whole_step_traces_partial_batch_and_none_grads(caplog):
    "Step by step: loss terms and every gradient (None where native is None), an empty image, a partial last batch."
    caplog.set_level(logging.WARNING, LOGGER)
    def model():
        m = fresh_model(); m.head.box[2].requires_grad_(False)   # a frozen branch: None grads, natively and replayed
        m.register_parameter('unused', nn.Parameter(torch.zeros(3)))   # not reached by the loss: None
        return m
    batches = [synth_batch(B=2, S=64, K=4, seed=s, empty=(s == 1)) for s in range(3)] + [synth_batch(B=1, S=64, K=4, seed=3)]
    a = train_trace(model(), batches)
    rec = StepRegion(backend=EagerGraphs())
    b = train_trace(model(), batches, rec)
    traces_equal(a, b)
    assert b['steps'][0]['grads']['unused'] is None and b['steps'][0]['grads']['head.box.2.0.conv.weight'] is None
    shapes = [tuple(tuple(v.shape) for v in step_inputs(x).values()) for x in batches]
    assert (rec.replayed, rec.native, len(rec.seen)) == (4, 0, len(set(shapes)))   # each new set of shapes recorded once
    one = StepRegion(backend=EagerGraphs(), max_shapes=1)
    traces_equal(a, train_trace(model(), batches, one))
    assert (one.replayed, one.native) == (shapes.count(shapes[0]), 4 - shapes.count(shapes[0]))
    assert [r.getMessage() for r in caplog.records][0].startswith(STEP_LINE + "the batch's shapes took more than 1 values (now img ")


def test_whole_step_gradients_are_copied_not_stolen():
    "`.grad` never aliases the recording's static gradients; zero_grad(set_to_none=False) accumulates as natively."
    batches = [synth_batch(B=2, S=64, K=4, seed=s) for s in range(3)]
    a = train_trace(fresh_model(), batches, set_to_none=False)
    rec = StepRegion(backend=EagerGraphs())
    traces_equal(a, train_trace(fresh_model(), batches, rec, set_to_none=False))
    model = fresh_model(); rec = StepRegion(backend=EagerGraphs()); rec.start(model)
    loss_fn = SegLoss(4)
    def step_fn(b):
        losses = loss_fn(model_outputs(model, b['img']), b); return losses, sum(losses.values())
    b = synth_batch(B=2, S=64, K=4); b['img'] = b['img'].float() / 255
    with torch.autocast('cpu', dtype=torch.bfloat16): _, total = rec.losses(model, step_fn, b)
    total.backward()
    static = {g.data_ptr() for g in rec.graphs.static_grads if g is not None}
    assert not static & {p.grad.data_ptr() for p in model.parameters() if p.grad is not None}
    with torch.autocast('cpu', dtype=torch.bfloat16): rec.losses(model, step_fn, b)
    with torch.autocast('cpu', dtype=torch.bfloat16):   # a second forward before the backward: native, with a reason
        rec.losses(model, step_fn, b)
    assert 'a second training forward before the backward of the first' in rec.reasons


def test_nothing_kept_fails_only_a_block_that_keeps_memory():
    held = [0]
    with nothing_kept(lambda: held[0], 'the block'): held[0] += 0
    with pytest.raises(RuntimeError, match='the block kept 512 bytes allocated there after it ended'):
        with nothing_kept(lambda: held[0], 'the block'): held[0] += 512
    with pytest.raises(ValueError):   # the block's own error, not a check on its half-done state
        with nothing_kept(lambda: held[0], 'the block'): held[0] += 512; raise ValueError


class LendingEager(EagerGraphs):
    "`EagerGraphs` that counts the blocks run in what it lends."
    def __init__(self): super().__init__(); self.lent = 0
    @contextlib.contextmanager
    def lending(self):
        self.lent += 1; yield


class ValidationBatches(Callback):
    "Counts validation batches, and those of the sanity check."
    def __init__(self): self.seen = self.sanity = 0
    def on_validation_batch_end(self, trainer, module, *args): self.seen += 1; self.sanity += trainer.sanity_checking


def test_validation_batches_run_in_the_memory_the_whole_step_lends(tmp_path):
    "Every validation batch after the recording (not the sanity check's, before it) runs in `Recorder.lending()`."
    backend, batches = LendingEager(), ValidationBatches()
    rec, _, report, _ = step_fit(tmp_path, backend=backend, callbacks=[batches])
    assert report['step']['replayed_steps'] == 4
    assert backend.lent == batches.seen - batches.sanity > 0, (backend.lent, batches.seen, batches.sanity)
    assert isinstance(Recorder(backend=LendingEager(), step=True).lending(), contextlib.nullcontext)   # nothing recorded


def test_whole_step_in_channels_last_order_equals_native():
    "A network in channels-last memory order (`--model.channels_last`): the replayed step equals its native step, step by step."
    import torch as T
    cl = lambda: fresh_model().to(memory_format=T.channels_last)
    assert all(p.is_contiguous(memory_format=T.channels_last) for p in cl().parameters() if p.dim() == 4)
    batches = [synth_batch(B=2, S=64, K=4, seed=s) for s in range(3)]
    traces_equal(train_trace(cl(), batches), train_trace(cl(), batches, StepRegion(backend=EagerGraphs())))


def test_whole_step_with_the_largest_instance_count():
    "Images of 100 instances each (13 groups an image) and of 1: the replayed step equals native, each set of shapes recorded once."
    from lucid_nb.core import group_instances
    def full(seed):   # every image holds M = 100 instances: its own, repeated
        b = synth_batch(B=2, S=64, M=100, K=4, seed=seed, grouped=False)
        idx = torch.arange(100)[None] % b['valid'].sum(1, keepdim=True)
        per = [{k: b[k][i, j].numpy() for k in ('boxes', 'cls', 'masks')} for i, j in enumerate(idx)]
        return dict(b, **{k: torch.from_numpy(v) for k, v in group_instances(per, 16).items()})
    batches = [full(0), synth_batch(B=2, S=64, M=1, K=4, seed=1), full(2)]
    assert batches[0]['owner'].tolist() == [0] * 13 + [1] * 13 + [0] * 2   # 26 groups, padded to 28
    rec = StepRegion(backend=EagerGraphs())
    traces_equal(train_trace(fresh_model(), batches), train_trace(fresh_model(), batches, rec))
    assert (rec.replayed, rec.native, len(rec.seen)) == (3, 0, 2)
