"""`benchmarks/ultralytics_run.py`, the comparator, in the parts that run without Ultralytics: its `polars` stand-in
(the trainer reads its results.csv back through it) and its epoch clock (the figures callers turn into images/s)."""
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / 'benchmarks'))
import ultralytics_run   # noqa: E402


def test_polars_stand_in_reads_and_writes_results_csv(tmp_path):
    pl = ultralytics_run.polars_stand_in()
    csv = b'epoch, time, metrics/mAP50(B)\n1, 2.5, 0.0\n2, 4.75, 0.125\n'   # Ultralytics pads its header with spaces
    got = pl.read_csv(csv, infer_schema_length=None).to_dict(as_series=False)
    assert got == {'epoch': [1.0, 2.0], 'time': [2.5, 4.75], 'metrics/mAP50(B)': [0.0, 0.125]}
    assert pl.DataFrame({'a': [1, 2], 'b': ['x', 'y']}).write_csv() == 'a,b\r\n1,x\r\n2,y\r\n'
    pl.DataFrame({'a': [1]}).write_csv(tmp_path / 'f.csv')
    assert pl.read_csv(tmp_path / 'f.csv').to_dict() == {'a': [1.0]}


def test_epoch_clock_rows(monkeypatch):
    now = iter([0.0, 1.0, 1.5, 3.0, 3.25, 4.0, 6.0, 9.0])
    monkeypatch.setattr(ultralytics_run.time, 'perf_counter', lambda: next(now))
    clock = ultralytics_run.EpochClock(sync=lambda: None)
    tr = SimpleNamespace(epoch=0, train_loader=SimpleNamespace(dataset=range(8)))
    clock.epoch_start(tr)                                     # 0.0
    clock.batch_start(tr); clock.batch_end(tr)               # waited 1.0, ends at 1.5
    clock.batch_start(tr); clock.batch_end(tr)               # waited 1.5, ends at 3.25
    clock.epoch_end(tr); clock.fit_epoch_end(tr); clock.fit_epoch_end(tr)   # 4.0; validation to 6.0; best.pt's 9.0 ignored
    assert clock.rows() == [dict(epoch=0, batches=2, data_wait_seconds=2.5, train_seconds=4.0, images=8,
                                 validation_seconds=2.0)]
