"""`lucid fit` with the recorder's CPU stand-in (`EagerGraphs`) replaying the head and the optimiser update, for
`test_ddp.py`: Lightning's DDP launcher starts this script again for every further process. Each process writes the
recorder's report to `$DDP_REPORT/rank<N>.json`."""
import json, os, sys
from pathlib import Path

from lucid_nb.graphs import EagerGraphs
from lucid_nb.recorder import Recorder
from lucid_nb.command import cli_main

cli = cli_main(sys.argv[1:], run=False)
cli.model.recorder = Recorder(backend=EagerGraphs(), head=True, optimizer=True)
cli.trainer.fit(cli.model, cli.datamodule)
Path(os.environ['DDP_REPORT'], f'rank{cli.trainer.global_rank}.json').write_text(json.dumps(cli.model.recorder.report()))
