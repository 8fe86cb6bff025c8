"""Helpers shared by the tests (and a few benchmarks): a tiny CPU run of the `lucid` CLI, a count of tensor bytes alive."""
import json, os, sys, time
from pathlib import Path

from lightning.pytorch.callbacks import Callback

import torch

from lucid_nb.core import digest
from lucid_nb.command import cli_main
from lucid_nb.cli import run
from lucid_nb.testing import TINY, TensorBytes, fit, hashes_only, test_traces_equal, tiny, train_trace   # shared with notebooks and benchmarks

# what the tests take from here: this file's own helpers, and the library's test helpers passed on
__all__ = ['ROOT', 'LUCID', 'lucid_main', 'StopAfterFirstEpoch', 'StepLosses', 'REPLAY_ARMS', 'replayed_fits_are_native',
           'WaitForSignal', 'WaitAtSetup', 'FullDisk',
           'CheckpointTiming', 'SpoilValidationImage', 'start_lucid', 'signal_at_line', 'cli_main', 'TINY', 'TensorBytes', 'fit', 'hashes_only', 'test_traces_equal', 'tiny', 'train_trace']

ROOT = Path(__file__).resolve().parent.parent


class StopAfterFirstEpoch(Callback):
    "Ends fit after epoch 0 (after its validation and checkpoint), as an interrupted run would."
    def on_validation_end(self, trainer, module):
        if trainer.current_epoch == 0: trainer.should_stop = True


class StepLosses(Callback):
    "Bytes of every step's loss terms, to compare runs step by step and not only at the end."
    def __init__(self): self.steps = []
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.steps.append(digest(module.last_losses))


# a fit natively, with the head's calls replayed and with the whole step replayed from CUDA graphs
REPLAY_ARMS = {'native': (), 'head': ('--model.capture_segment_heads', 'true'), 'step': ('--model.capture_train_step', 'true')}


def replayed_fits_are_native(tmp: Path, *args: str, steps: int = 12):
    """The tiny fit of `args` in each of `REPLAY_ARMS` on the GPU: the same loss bytes at every one of its `steps`
    steps and the same state hashes, the head and the step replayed throughout (at least 10 times, never natively)."""
    torch.backends.cudnn.benchmark = False
    runs = {}
    for arm, extra in REPLAY_ARMS.items():
        losses = StepLosses()
        _, run, h = fit(tmp / arm, *args, *extra, callbacks=[losses])
        runs[arm] = (losses.steps, hashes_only(h), json.loads((run / 'recorder.json').read_text()) if extra else None)
    assert len(runs['native'][0]) == steps and all(r[0] == runs['native'][0] for r in runs.values())
    assert all(r[1] == runs['native'][1] for r in runs.values()) and 'predictions' in runs['native'][1]
    head, step = runs['head'][2]['head'], runs['step'][2]['step']
    assert head['backend'] == 'cuda' and head['replayed_calls'] >= 10 and head['native_calls'] == 0, head
    assert step['backend'] == 'cuda' and step['replayed_steps'] >= 10 and step['native_steps'] == 0, step


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


class WaitAtSetup(Callback):
    """Holds a `lucid` subprocess in the trainer's set-up (its data read, the fit loop not started) until a signal
    comes, after touching `$WAIT_MARKER`."""
    def setup(self, trainer, module, stage):
        Path(os.environ['WAIT_MARKER']).touch()
        time.sleep(300)


class FullDisk(Callback):
    """Every checkpoint write from epoch `$FULL_DISK_EPOCH` (default 0) on fails with ENOSPC part-way, as on a disk that
    fills up: torch reports it as '[enforce fail at inline_container.cc] unexpected pos', the OSError its context. The
    free space the writer measures is `$FREE_MB` MB."""
    def on_train_epoch_start(self, trainer, module):
        import errno, lucid_nb.saving as saving
        if trainer.current_epoch < int(os.environ.get('FULL_DISK_EPOCH', '0')) or getattr(saving, '_full', False): return
        class Full:   # takes 4 KB, then the disk is full
            n = 0
            def write(self, b):
                self.n += len(b)
                if self.n > 4096: raise OSError(errno.ENOSPC, 'No space left on device')
                return len(b)
            def flush(self): pass
        def fail(state, path):
            Path(path).parent.mkdir(parents=True, exist_ok=True); open(path, 'wb').close()   # made; nothing fits in it
            torch.save(state, Full())
        saving.write_checkpoint_file, saving._full = fail, True
        if 'FREE_MB' in os.environ: saving.disk_free = lambda folder: int(os.environ['FREE_MB']) * 2**20


class CheckpointTiming(Callback):
    """Slows a checkpoint's copy to the host (`$SLOW_COPY` s, on the main thread) or its write (`$SLOW_WRITE` s, in the
    writer's thread), and touches `$MARKERS/copying`, `$MARKERS/writing` as they start and `$MARKERS/stopping` when
    the fit stops on an exception: a signal sent after a marker lands inside that stage."""
    def setup(self, trainer, module, stage):
        import threading, lucid_nb.saving as saving
        marks, copy, write = Path(os.environ['MARKERS']), float(os.environ.get('SLOW_COPY', 0)), float(os.environ.get('SLOW_WRITE', 0))
        apply, save = saving.apply_to_collection, saving.write_checkpoint_file
        def slow_apply(*a, **k):
            if copy and threading.current_thread() is threading.main_thread(): (marks / 'copying').touch(); time.sleep(copy)
            return apply(*a, **k)
        def slow_save(state, path):
            (marks / 'writing').touch(); time.sleep(write); return save(state, path)
        saving.apply_to_collection, saving.write_checkpoint_file = slow_apply, slow_save
        self.marks = marks
    def on_exception(self, trainer, module, exception): (self.marks / 'stopping').touch()


class SpoilValidationImage(Callback):
    """As training starts (the data set up and checked), overwrites the first validation image with bytes that are no
    image: with `--data.cache none` the first validation stops with a data error naming the file, in the middle of a fit."""
    def on_train_start(self, trainer, module): trainer.datamodule.val_records[0].path.write_bytes(b'not an image any more')


# ---- the fault harness: a real `lucid fit` in its own process, signalled at a line it prints ----
# A campaign starts here: `start_lucid` runs the tiny fit with stdout line by line, `signal_at_line` sends a signal the
# moment a line begins with a prefix (or, with a delay, after it); the tests then read the run folder (checkpoints by
# the safe reader, `state_hashes.json` against an uninterrupted run). `tests/test_faults_trainer.py` holds the trials.
TESTS = Path(__file__).resolve().parent


def start_lucid(tmp: Path, *extra, epochs: int = 3, version: str | None = 'v', env: dict | None = None):
    "A tiny `lucid fit` subprocess (one torch thread, `tests/` importable for callbacks) whose stdout arrives line by line."
    import subprocess
    env = {**os.environ, 'PYTHONUNBUFFERED': '1', 'OMP_NUM_THREADS': '1',
           'PYTHONPATH': os.pathsep.join([str(TESTS), os.environ.get('PYTHONPATH', '')]), **(env or {})}
    return subprocess.Popen([str(LUCID), *tiny(tmp, *extra, epochs=epochs, version=version)], cwd=tmp, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def signal_at_line(proc, prefix: str, sig, delay: float = 0.) -> tuple[str, str]:
    "Send `sig` `delay` s after a stdout line starting with `prefix` arrives; the process's stdout and stderr to its end."
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(prefix): time.sleep(delay); proc.send_signal(sig); break
    out, err = proc.communicate(timeout=300)
    return ''.join(seen) + out, err
