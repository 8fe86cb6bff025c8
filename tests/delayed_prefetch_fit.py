"""`lucid fit` with the prefetch thread's timing disturbed on purpose, for `test_prefetch_determinism.py`:
`PREFETCH_DELAY=start` sleeps before the producer's first batch, `loop` before every batch (a random 0-60 ms, from a
clock-seeded generator of its own, so the timing differs from run to run), anything else leaves it alone. The
sleeps run in whichever thread builds the batches: the prefetch thread when prefetch is on."""
import os, random, sys, time

from lucid_nb import loader
from lucid_nb.command import cli_main

mode, joined, clock = os.environ.get('PREFETCH_DELAY', ''), loader._joined, random.Random(time.time_ns())

def disturbed(it, counts):
    for k, b in enumerate(joined(it, counts)):
        if mode == 'loop' or (mode == 'start' and k == 0): time.sleep(clock.uniform(0, .06) if mode == 'loop' else .5)
        yield b

loader._joined = disturbed
cli = cli_main(sys.argv[1:], run=False)
cli.trainer.fit(cli.model, cli.datamodule)
