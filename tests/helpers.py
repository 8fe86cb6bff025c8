"""Helpers shared by the trainer and recorder tests: a tiny CPU run of the `lucid` CLI."""
import json, os, sys, time
from pathlib import Path

from lightning.pytorch.callbacks import Callback

from lucid_nb.core import digest
from lucid_nb.trainer import cli_main, main

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


def fit(tmp: Path, *extra, callbacks=(), ckpt=None, epochs: int = 2, version: str | None = None):
    cli = cli_main(tiny(tmp, *extra, epochs=epochs, version=version)[1:], run=False)
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
    "Run the `lucid` command in this process (`main()`, as the console script does); returns its exit status."
    monkeypatch.setattr(sys, 'argv', ['lucid', *args])
    try: main()
    except SystemExit as e: return e.code
    return 0


class WaitForSignal(Callback):
    """Holds a `lucid` subprocess at the first batch of epoch 1 until a signal comes (SIGTERM sets Lightning's flag,
    SIGINT raises), after touching `$WAIT_MARKER`: a signal sent then lands here, not in some library's cleanup."""
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if (trainer.current_epoch, batch_idx) != (1, 0): return
        Path(os.environ['WAIT_MARKER']).touch()
        deadline = time.monotonic() + 300
        while not trainer.received_sigterm and time.monotonic() < deadline: time.sleep(0.05)
