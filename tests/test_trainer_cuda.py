"""The trainer on a CUDA GPU: a whole Lightning training step runs without one host synchronisation; validation
starts with the training step's cached memory given back; batches arrive pinned, so their copy does not wait for the GPU.

CUDA's sync-debug mode ('error') makes every operation that would make the host wait for the device raise. It is
switched on from the start of one training batch to the start of the next (forward, loss, backward, optimiser,
scheduler, EMA, logging, progress bar, the next batch's fetch and transfer), for every step that is not one of
Lightning's `log_every_n_steps` logging steps, where reading the logged values back is what logging means.
"""
import pytest, torch
from lightning.pytorch.callbacks import Callback

from helpers import fit

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')]


class SyncGuard(Callback):
    "Sync-debug mode 'error' between the starts of consecutive training batches, past the first two of an epoch."
    def __init__(self): self.guarded = 0

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        torch.cuda.set_sync_debug_mode(0)
        if 2 <= batch_idx < trainer.num_training_batches - 1:   # the last batch's end syncs for the epoch timing
            torch.cuda.set_sync_debug_mode('error'); self.guarded += 1

    def on_train_epoch_end(self, trainer, module): torch.cuda.set_sync_debug_mode(0)
    def on_exception(self, trainer, module, exc): torch.cuda.set_sync_debug_mode(0)


def test_no_host_sync_inside_training_steps(tmp_path):
    guard = SyncGuard()
    try:
        fit(tmp_path, '--trainer.accelerator', 'gpu', '--trainer.precision', 'bf16-mixed', '--trainer.limit_train_batches', '8',
            '--trainer.log_every_n_steps', '100', '--trainer.enable_progress_bar', 'true', '--data.batch_size', '2',
            '--data.imgsz', '128', callbacks=[guard])
    finally: torch.cuda.set_sync_debug_mode(0)
    assert guard.guarded == 2 * 5, guard.guarded   # 2 epochs × batches 2..6 ran guarded


class CacheAtValidation(Callback):
    "The allocator's reserved and allocated bytes after the last training batch and at the first validation batch."
    def __init__(self): self.at = {}
    def _read(self, name):
        torch.cuda.synchronize(); self.at.setdefault(name, (torch.cuda.memory_reserved(), torch.cuda.memory_allocated()))
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx == trainer.num_training_batches - 1: self._read('trained')
    def on_validation_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
        if not trainer.sanity_checking: self._read('validating')


def test_validation_starts_with_the_training_cache_given_back(tmp_path):
    probe = CacheAtValidation()
    fit(tmp_path, '--trainer.accelerator', 'gpu', '--trainer.limit_train_batches', '4', '--data.batch_size', '4',
        '--data.imgsz', '256', callbacks=[probe], epochs=1)
    (reserved, allocated), (reserved_val, allocated_val) = probe.at['trained'], probe.at['validating']
    assert reserved - allocated > 8 * 2**20, probe.at           # training left its freed blocks cached...
    assert reserved_val < reserved and reserved_val - allocated_val < (reserved - allocated) / 2, probe.at   # ...given back


def test_batches_are_pinned_so_their_copy_does_not_wait_for_the_gpu():
    "A pinned batch's copy is queued behind running GPU work; a pageable one's waits for it (the reason to pin)."
    import lightning as L
    from lucid_nb.data import YoloData
    dm = YoloData(imgsz=640, batch_size=2, workers=0)   # the batch of the reference run's size, pinned
    dm.trainer = L.Trainer(accelerator='gpu', devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    try: pinned = next(iter(dm.train_dataloader()))
    finally: dm.teardown()
    assert all(v.is_pinned() for v in pinned.values())
    pageable = {k: v.clone() for k, v in pinned.items()}
    assert not any(v.is_pinned() for v in pageable.values())
    busy = {}
    for name, batch in (('pinned', pinned), ('pageable', pageable)):
        torch.cuda.synchronize(); torch.cuda._sleep(2 ** 30)   # about half a second of GPU work queued
        moved = {k: v.to('cuda', non_blocking=True) for k, v in batch.items()}
        busy[name] = not torch.cuda.current_stream().query()  # the copy returned while the GPU was still sleeping
        torch.cuda.synchronize()
        assert all(torch.equal(moved[k].cpu(), v) for k, v in batch.items())
    assert busy == {'pinned': True, 'pageable': False}, busy
    dm.trainer = L.Trainer(accelerator='cpu', devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    try: assert dm.train_dataloader().pin_device is None   # nothing to pin for on the CPU
    finally: dm.teardown()
