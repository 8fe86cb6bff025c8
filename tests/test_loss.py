"""Checks of `lucid_nb.loss` that need a longer run or a property the notebook `04_loss` does not teach (the notebook
holds the lessons, references and edge cases)."""
import pytest, torch

from lucid_nb.core import synth_batch
from lucid_nb.data import YoloData
from lucid_nb.loss import SegLoss, synth_head_out, task_loss


def real_batch(n=2, S=128, task='segment'):
    "The first `n` validation images of the embedded data, letterboxed to `S` by the data pipeline, as the trainer gets them."
    dm = YoloData(imgsz=S, batch_size=n, val_count=n, workers=0, prefetch=False, task=task)
    dm.setup('fit')
    return dm.on_after_batch_transfer(next(iter(dm.val_dataloader())))


@pytest.mark.parametrize('task', ['segment', 'detect'])
def test_overfit_real_batch_nano_128px(task):
    "The nano model fits two real images: the total halves and every term falls (a broken gradient path fails)."
    from lucid_nb.heads import yolo
    torch.manual_seed(0)
    batch = real_batch(2, 128, task)
    assert batch['valid'].any(1).all() and ('masks' in batch) == (task == 'segment')
    model, loss_fn = yolo('n', task=task).train(), task_loss(task)
    opt, hist = torch.optim.Adam(model.parameters(), lr=2e-3), []
    for _ in range(15):
        opt.zero_grad(); losses = loss_fn(model(batch['img']), batch); sum(losses.values()).backward(); opt.step()
        hist.append({k: v.item() for k, v in losses.items()})
    first, last = hist[0], hist[-1]
    assert sum(last.values()) < 0.5 * sum(first.values()), (first, last)
    for k in first: assert last[k] < 0.8 * first[k], (k, first[k], last[k])


def test_gains_scale_their_terms():
    out, batch = synth_head_out(B=2, S=64, seed=1), synth_batch(B=2, S=64, seed=1)
    base = SegLoss()(out, batch)
    doubled = SegLoss(box=15., cls=1., dfl=3., seg=15.)(out, batch)
    for k in base: torch.testing.assert_close(doubled[k], 2 * base[k])



# ---- the same loss as Ultralytics 8.4.190 on the same head outputs and batches (fixtures/make_ultralytics_loss.py)

import importlib.util, json
from pathlib import Path
from lucid_nb.core import digest

FIX = Path(__file__).parent / 'fixtures'
_spec = importlib.util.spec_from_file_location('make_ultralytics_loss', FIX / 'make_ultralytics_loss.py')
MUL = importlib.util.module_from_spec(_spec); _spec.loader.exec_module(MUL)   # the lucid side of the fixture's recipe
UL = json.loads((FIX / 'ultralytics_loss.json').read_text())
RTOL = 1e-4          # of each term and of each gradient block, fp32 (measured: 4.4e-7 and 1.4e-5 at most)
GRAD_FLOOR = 1e-6    # of a head output's largest block norm: blocks of zero gradient may differ by this


def test_ultralytics_loss_fixture_is_small_and_covers_the_cases():
    assert (FIX / 'ultralytics_loss.json').stat().st_size < 2**20 and UL['versions']['ultralytics'] == '8.4.190'
    cases = UL['cases']
    assert {c['task'] for c in cases} == {'segment', 'detect'} and {c['batch'] for c in cases} == {4, 16}
    assert {c['weights'] for c in cases} == {'yolo11n-seg-random.pt', 'yolo11n-seg-coco128.pt', 'yolo11n-random.pt'}
    assert {c['variant'] for c in cases} == {'plain', 'no_instances', 'whole_masks'}
    assert max(c['ultralytics_network_gap'] for c in cases) < 1e-4     # Ultralytics' network gives lucid's head outputs
    assert max(c['instances'] for c in cases) >= 150 and min(c['instances'] for c in cases) == 0


@pytest.mark.parametrize('b', MUL.BATCHES, ids=lambda b: MUL.name(b, '')[:-1])
def test_loss_equals_ultralytics(b):
    "lucid's four terms and their gradients on each head output equal Ultralytics' on the same outputs and batch."
    want = [c for c in UL['cases'] if all(c[k] == b[k] for k in ('weights', 'task', 'batch', 'mosaic', 'index'))]
    assert [c['variant'] for c in want] == list(b['variants'])
    raw, batch = MUL.lucid_batch(b)
    assert digest(raw) == want[0]['batch_digest'], 'not the batch the fixture was made on: remake it'
    out = MUL.head_outputs(b, batch['img'])
    leaves = [t for v in out.values() for t in (v if isinstance(v, list) else [v])]
    for c in want:
        for t in leaves: t.grad = None
        vb = MUL.variant_batch(batch, c['variant'])
        if c['variant'] == 'no_instances': assert not vb['valid'].any()
        terms = MUL.lucid_loss(b, c['variant'])(out, vb)
        got = {k: v.item() for k, v in terms.items()}
        assert got.keys() == c['terms'].keys(), (got, c['terms'])
        for k, w in c['terms'].items(): assert abs(got[k] - w) <= RTOL * abs(w), (c['name'], k, got[k], w)
        sum(terms.values()).backward()
        for k, blocks in MUL.grad_norms(out, len(batch['img'])).items():
            ref = c['grad_norms'][k]; top = max(max(r) for r in ref)
            for i, (g_img, w_img) in enumerate(zip(blocks, ref)):
                for g, w in zip(g_img, w_img): assert abs(g - w) <= RTOL * w + GRAD_FLOOR * top, (c['name'], k, i, g, w)
