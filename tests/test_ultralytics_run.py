"""`benchmarks/ultralytics_run.py`, the comparator, in the parts that run without Ultralytics: its `polars` stand-in
(the trainer reads its results.csv back through it) and its epoch clock (the figures callers turn into images/s)."""
import importlib.util, sys
from pathlib import Path
from types import SimpleNamespace

BENCH = Path(__file__).resolve().parent.parent / 'benchmarks'


def script(name: str):
    "A benchmark script read from its file, `benchmarks/` kept off the import path."
    spec = importlib.util.spec_from_file_location(name, BENCH / f'{name}.py')
    module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)
    return module


# the comparator runs in Ultralytics' environment, without `lucid_nb`: its helpers stay in its own file
ultralytics_run = script('ultralytics_run')


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


def test_scale_fit_parts_merge_with_ultralytics_compiled_as_an_anchor(tmp_path, monkeypatch):
    "`scale.py merge` joins fit results of several calls; each lucid arm is held against `ul` and `ul-compile` per round."
    import json
    for sibling in ('common', 'reference_run'):   # what `scale.py` imports beside it, as when it runs
        monkeypatch.setitem(sys.modules, sibling, script(sibling))
    scale = script('scale')
    monkeypatch.setattr(scale, 'RESULTS', tmp_path)
    run = lambda arm, b, ips, **kw: dict(arm=arm, batch=b, round=0, images_per_s=ips, process_seconds=10., peak_reserved_mib=1.,
                                         steady_data_wait_seconds=0., startup_seconds=1., **kw)
    env = dict(device='GPU', commit='abc1234')
    part = lambda name, arms, batches, runs: (tmp_path / name).write_text(json.dumps(dict(
        n=64, epochs=2, close_mosaic=0, arms=arms, batches=batches, runs=runs, env=env, command='scale.py fit')))
    part('scale_gpu-x_abc1234_fit_n64.json', ['step', 'ul'], [64], [run('step', 64, 300., hashes={'all': 'h'}), run('ul', 64, 200.)])
    part('scale_gpu-x_abc1234_fit_n64_ulc.json', ['ul-compile'], [64], [run('ul-compile', 64, 250.)])
    part('scale_gpu-x_abc1234_fit_n64_b32.json', ['step'], [32], [run('step', 32, 280., hashes={'all': 'h2'})])
    out = scale.merge_fits([tmp_path / f'scale_gpu-x_abc1234_fit_n64{t}.json' for t in ('', '_ulc', '_b32')], 'fit_n64')
    assert out.name == 'scale_gpu-x_abc1234_fit_n64.json'   # the parts' device and commit, not this machine's
    got = json.loads(out.read_text())
    assert got['arms'] == ['step', 'ul', 'ul-compile'] and got['batches'] == [32, 64] and len(got['runs']) == 4
    s = got['summary']['b64']
    assert s['over_ul']['step'] == [1.5] and s['over_ul']['ul-compile'] == [1.25] and s['over_ul_compile'] == {'step': [1.2]}
    assert got['summary']['b32']['over_ul'] is None and [p['file'] for p in got['parts']][1] == 'scale_gpu-x_abc1234_fit_n64_ulc.json'
