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

