"""The recorder's bitwise and lifecycle claims on a real GPU (`pytest -m cuda`; skipped where there is none).

Trainer-level: a fit with `--model.capture_segment_heads true` equals the native fit step by step (loss bytes) and at
the end (model, optimiser, scheduler, EMA, loss, predictions JSON), across EMA validation and a save/resume, within
one process and across processes with deterministic cuDNN settings. Step-level: gradients of every parameter,
including a batch with an image without instances. The whole step (`--model.capture_train_step true`): the same, plus
a batch with 100 instances in every image and a resume. Optimiser update: MuSGD, SGD and AdamW recorded vs their own `step`
over warm-up steps, and a fit with both captures on equal to the native fit."""
import json, os, subprocess, sys
from pathlib import Path

import pytest, torch

from lucid_nb.core import group_instances, synth_batch
from lucid_nb.heads import yolo_seg
from lucid_nb.core import digest
from lucid_nb.optim import build_optimizer, build_schedule
from lucid_nb.graphs import CudaGraphs, pool_allocated
from lucid_nb.recorder import EmaRegion, HeadRegion, StepRegion, UpdateRegion
from lucid_nb.ema import ModelEMA

from helpers import StepLosses, StopAfterFirstEpoch, fit, hashes_only, tiny, train_trace
from helpers import test_traces_equal as traces_equal   # (not collected as a test)

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')]

GPU = ('--trainer.accelerator', 'gpu', '--trainer.devices', '1', '--trainer.precision', 'bf16-mixed',
       '--trainer.limit_train_batches', '6', '--data.imgsz', '320', '--data.batch_size', '4', '--data.val_count', '8')
CAPTURE = ('--model.capture_segment_heads', 'true')
BOTH = (*CAPTURE, '--model.capture_optimizer_step', 'true')
WHOLE = ('--model.capture_train_step', 'true')


def fresh_nano():
    torch.manual_seed(0); return yolo_seg('n', 80).cuda()


def replay_equals_native(batches, region):
    "Train fresh nano models on `batches` twice natively (the control) and once through `region`: every trace equal."
    native, control = train_trace(fresh_nano(), batches), train_trace(fresh_nano(), batches)
    replay = train_trace(fresh_nano(), batches, region)
    traces_equal(native, control)
    traces_equal(native, replay)


def gpu_fit(tmp, *extra, ckpt=None, callbacks=()):
    losses = StepLosses()
    cli, run, h = fit(tmp, *GPU, *extra, callbacks=[losses, *callbacks], ckpt=ckpt)
    return losses.steps, run, h


@pytest.fixture(scope='module')
def native(tmp_path_factory):
    torch.backends.cudnn.benchmark = False
    return gpu_fit(tmp_path_factory.mktemp('native'))


def test_fit_replay_equals_native(native, tmp_path):
    steps, run, h = gpu_fit(tmp_path, *CAPTURE)
    assert len(steps) == 12 and steps == native[0]
    assert hashes_only(h) == hashes_only(native[2])
    report = json.loads((run / 'recorder.json').read_text())['head']
    assert report['backend'] == 'cuda' and (report['layout_probe_calls'], report['replayed_calls']) == (1, 11), report
    assert report['native_calls'] == 0 and report['native_backwards_of_replayed_calls'] == 0, report


def test_resumed_replay_equals_native(native, tmp_path):
    _, run, _ = gpu_fit(tmp_path, *CAPTURE, callbacks=[StopAfterFirstEpoch()])
    steps, run2, h = gpu_fit(tmp_path, *CAPTURE, ckpt=str(run / 'checkpoints' / 'last.ckpt'))
    assert steps == native[0][6:] and hashes_only(h) == hashes_only(native[2])
    assert json.loads((run2 / 'recorder.json').read_text())['head']['replayed_calls'] == 5


def test_step_gradients_with_an_empty_image():
    torch.backends.cudnn.benchmark = False
    batches = [synth_batch(B=4, S=640, M=16, K=80, seed=s, empty=True) for s in range(4)]
    rec = HeadRegion()
    replay_equals_native(batches, rec)
    assert (rec.probes, rec.replayed, rec.native, rec.native_backwards) == (1, 3, 0, 0), rec.report()


def test_cross_process_hashes(tmp_path):
    "Native and replayed fits in separate processes, cuDNN deterministic (`warn`: the nearest-upsample backward has no deterministic kernel), with the CUDA allocator's defaults and with its expandable segments (`lucid`'s default): the same hashes and predictions JSON."
    env = {k: v for k, v in os.environ.items() if k not in ('PYTORCH_ALLOC_CONF', 'PYTORCH_CUDA_ALLOC_CONF')}
    env.update(CUBLAS_WORKSPACE_CONFIG=':4096:8')
    expandable = dict(env, PYTORCH_CUDA_ALLOC_CONF='expandable_segments:True')
    hashes = {}
    for arm, extra, arm_env in (('native', (), env), ('replay', CAPTURE, env), ('whole_step', WHOLE, env),
                                ('native_expandable', (), expandable), ('whole_step_expandable', WHOLE, expandable)):
        runs = tmp_path / arm
        args = [sys.executable, '-c', 'import sys; from lucid_nb.command import cli_main; cli_main(sys.argv[1:])',
                *tiny(runs, *GPU, '--trainer.deterministic', 'warn', *extra)]
        r = subprocess.run(args, capture_output=True, text=True, env=arm_env, cwd=Path(__file__).parent.parent)
        assert r.returncode == 0, r.stderr[-3000:]
        written = json.loads(next(runs.rglob('state_hashes.json')).read_text())
        assert written['env']['allocator'] == arm_env.get('PYTORCH_CUDA_ALLOC_CONF'), written['env']
        hashes[arm] = hashes_only(written)
    assert len({json.dumps(h, sort_keys=True) for h in hashes.values()}) == 1 and 'predictions' in hashes['native']


@pytest.mark.parametrize('name', ['musgd', 'sgd', 'adamw'])
def test_update_replay_equals_native(name):
    "The recorded update of each optimiser vs its own `step`, 8 warm-up steps (lr, momentum change): every tensor equal."
    nets = [fresh_nano(), fresh_nano()]
    opts = [build_optimizer(n, name) for n in nets]
    scheds = [build_schedule(o, epochs=2, steps_per_epoch=8, warmup_epochs=1, min_warmup_iters=8) for o in opts]
    region = UpdateRegion(); region.start()
    for i in range(8):
        g = torch.Generator(device='cuda').manual_seed(i)
        grads = [torch.randn(p.shape, device='cuda', generator=g) * 1e-2 for p in nets[0].parameters()]
        for n in nets:
            for p, gr in zip(n.parameters(), grads): p.grad = gr.clone()
        opts[0].step(); region.step(opts[1])
        for s in scheds: s.step()
        assert digest(nets[0].state_dict()) == digest(nets[1].state_dict()), f"step {i}: parameters differ"
        assert digest(opts[0].state_dict()) == digest(opts[1].state_dict()), f"step {i}: optimiser state differs"
    r = region.report()
    assert r['backend'] == 'cuda' and r['replayed_steps'] >= 5 and r['native_steps'] == 0, r


def test_ema_replay_equals_native():
    "A ModelEMA built beside a GPU model (its factory on the GPU) replays its update from a graph, every byte as native."
    live = fresh_nano()
    emas = [ModelEMA(live, fresh_nano, tau=5.) for _ in range(2)]
    assert all(e.count.device == live.head.cls[0][-1].bias.device for e in emas)
    region = EmaRegion(); region.start()
    for i in range(6):
        with torch.no_grad(): torch._foreach_add_(list(live.parameters()), 1e-3 * (i + 1))
        emas[0].update(live); region.update(emas[1], live)
        assert digest(emas[0].state_dict()) == digest(emas[1].state_dict()), f"update {i}: the averages differ"
        assert torch.equal(emas[0].count, emas[1].count) and emas[0].updates == emas[1].updates
    r = region.report()
    assert r['backend'] == 'cuda' and r['replayed_updates'] == 5 and r['native_updates'] == 0, r


def test_fit_with_both_captures_equals_native(native, tmp_path):
    steps, run, h = gpu_fit(tmp_path, *BOTH)
    assert steps == native[0] and hashes_only(h) == hashes_only(native[2])
    report = json.loads((run / 'recorder.json').read_text())
    assert report['head']['replayed_calls'] == 11 and report['optimizer']['replayed_steps'] == 10, report
    assert report['optimizer']['native_steps'] == 0 and report['optimizer']['recorded_steps'] == 1, report


def test_fit_with_the_whole_step_replayed_equals_native(native, tmp_path):
    "Forward, loss, backward, update and EMA from CUDA graphs: every step's loss terms and the final hashes equal native."
    steps, run, h = gpu_fit(tmp_path, *WHOLE)
    assert steps == native[0] and hashes_only(h) == hashes_only(native[2])
    report = json.loads((run / 'recorder.json').read_text())
    assert report['step']['backend'] == 'cuda' and report['step']['replayed_steps'] == 12, report['step']
    assert report['step']['native_steps'] == 0 and not report['step']['recordings'][0]['parameter_aliases'], report['step']
    assert report['ema']['replayed_updates'] == 11 and report['ema']['native_updates'] == 0, report['ema']
    assert report['optimizer']['replayed_steps'] == 10 and report['head']['replayed_calls'] == 0, report


def test_resumed_whole_step_replay_equals_native(native, tmp_path):
    _, run, _ = gpu_fit(tmp_path, *WHOLE, callbacks=[StopAfterFirstEpoch()])
    steps, run2, h = gpu_fit(tmp_path, *WHOLE, ckpt=str(run / 'checkpoints' / 'last.ckpt'))
    assert steps == native[0][6:] and hashes_only(h) == hashes_only(native[2])
    assert json.loads((run2 / 'recorder.json').read_text())['step']['replayed_steps'] == 6


def every_slot_filled(batch:dict)->dict:
    "A padded batch (`grouped=False`) with `M` instances in every image (its own repeated in order), in groups."
    n = batch['valid'].sum(1, keepdim=True)                                # (B,1), at least 1
    idx = torch.arange(batch['valid'].shape[1])[None] % n                  # (B,M)
    per = [{k: batch[k][b, i].numpy() for k in ('boxes', 'cls', 'masks')} for b, i in enumerate(idx)]
    return dict(batch, **{k: torch.from_numpy(v) for k, v in group_instances(per, batch['masks'].shape[-1]).items()})


@pytest.mark.parametrize('slots, empty', [(16, True), (100, False)])
def test_whole_step_gradients(slots, empty):
    "Every step's loss terms and every parameter's gradient, native vs the whole step replayed (an image without instances; 100 instances)."
    torch.backends.cudnn.benchmark = False
    batches = [synth_batch(B=4, S=640, M=slots, K=80, seed=s, empty=empty) for s in range(4)]
    if not empty: batches = [every_slot_filled(synth_batch(B=4, S=640, M=slots, K=80, seed=s, grouped=False)) for s in range(4)]
    rec = StepRegion()
    replay_equals_native(batches, rec)
    assert (rec.replayed, rec.native) == (4, 0) and rec.report()['shapes'] >= 1, rec.report()


def test_lending_the_graphs_pool():
    "A block run in `CudaGraphs.lending` takes the graphs' scratch memory, reserves nothing new, and may keep nothing."
    graphs, x = CudaGraphs(warmup_iters=1), torch.randn(1 << 20, device='cuda')
    f = lambda: ((x * 2).sin() + 1,)   # two 4 MiB temporaries freed inside the capture: scratch in the pool
    graphs.warm_up(f)
    graph, (out,) = graphs.capture(f)
    graphs.replay(graph); expected = out.clone()
    segments = lambda: [(s['address'], s['address'] + s['total_size']) for s in torch.cuda.memory_snapshot(graphs.pool.id)]
    reserved, allocated = sum(b - a for a, b in segments()), pool_allocated(graphs.pool)
    with graphs.lending():
        y = torch.full((1 << 20,), 7., device='cuda')
        assert any(a <= y.data_ptr() < b for a, b in segments())   # in the graphs' pool
        del y
    assert sum(b - a for a, b in segments()) == reserved and pool_allocated(graphs.pool) == allocated
    graphs.replay(graph); torch.cuda.synchronize()
    assert torch.equal(out, expected)   # the replay rewrote its scratch before reading it
    with pytest.raises(RuntimeError, match="lent the recorded graphs' memory pool kept"):
        with graphs.lending(): kept = torch.empty(1 << 20, device='cuda')


def test_fine_tuning_replayed_equals_native(tmp_path):
    """Fine-tuning with `--model.weights` (an Ultralytics YOLO11n-seg `.pt`, then a lucid checkpoint), natively and
    with the whole step replayed, each fit in its own process: every state hash equal within each start."""
    def run(name, *extra):
        runs = tmp_path / name
        args = [sys.executable, '-c', 'import sys; from lucid_nb.command import cli_main; cli_main(sys.argv[1:])',
                *tiny(runs, *GPU, *extra)]
        r = subprocess.run(args, capture_output=True, text=True, cwd=Path(__file__).parent.parent)
        assert r.returncode == 0, r.stderr[-3000:]
        return hashes_only(json.loads(next(runs.rglob('state_hashes.json')).read_text())), next(runs.rglob('last.ckpt'))
    pt = str(Path(__file__).parent / 'fixtures' / 'yolo11n-seg-random.pt')
    native, ckpt = run('pt_native', '--model.weights', pt)
    assert run('pt_step', '--model.weights', pt, *WHOLE)[0] == native
    native2, _ = run('ckpt_native', '--model.weights', str(ckpt))
    assert run('ckpt_step', '--model.weights', str(ckpt), *WHOLE)[0] == native2 and native2 != native
