"""The reference benchmark of the recorder (issues 5 and 12): alternating native / replayed `lucid fit` runs.

Each run is a separate process of the reference configuration (`configs/coco128-seg-n.yaml`: embedded data, 96 train
/ 32 val images, nano, 640 px, 10 epochs, bf16-mixed, RAM cache, prefetch and device HSV on), natively and with
each arm of `--arms` in turn (`native`; `head`: `--model.capture_segment_heads true`; `head+optim`: the head and
`--model.capture_optimizer_step true`), in rounds: native, head, head+optim, native, ... For each run it keeps the
whole-process wall time, the fit time, the time of the training part of each epoch (steps incl. data and EMA),
the peak reserved CUDA memory, every state hash and the predictions JSON hash, and the recorder's report. The
summary gives per arm the median (min–max), per round each arm's ratio to native, and whether all hashes matched.

    python benchmarks/recorder_pairs.py --pairs 5 --batch-size 4 --arms native head head+optim --out benchmarks/results [-- extra lucid args]

(`--previous FILE` continues an earlier result file with more rounds, for device sessions shorter than all rounds;
results of other arms than `native head` go to a file named after them, e.g. `recorder_pairs_b4_head_head+optim_...`.)
"""
import argparse, json, statistics, subprocess, sys, time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LUCID = 'import sys; from lucid_nb.trainer import cli_main; cli_main(sys.argv[1:])'


ARMS = {'native': [], 'head': ['--model.capture_segment_heads', 'true'],
        'head+optim': ['--model.capture_segment_heads', 'true', '--model.capture_optimizer_step', 'true']}


def run_once(arm: str, batch_size: int, save_dir: Path, extra: list) -> dict:
    logger = json.dumps({'class_path': 'lightning.pytorch.loggers.CSVLogger',
                         'init_args': {'save_dir': str(save_dir), 'name': arm, 'version': ''}})
    args = [sys.executable, '-c', LUCID, 'fit', '--config', str(ROOT / 'configs' / 'coco128-seg-n.yaml'),
            '--data.batch_size', str(batch_size), '--trainer.logger', logger, '--trainer.enable_progress_bar', 'false',
            *ARMS[arm], *extra]
    t0 = time.perf_counter()
    r = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if r.returncode != 0: raise SystemExit(f"{arm} run failed:\n{r.stderr[-4000:]}")
    run = save_dir / arm
    timing = json.loads((run / 'timing.json').read_text())
    hashes = json.loads((run / 'state_hashes.json').read_text())
    rec = run / 'recorder.json'
    steady = [e['train_seconds'] / e['steps'] for e in timing['epochs'][1:]]   # epoch 0 includes recording, warm-up
    return dict(arm=arm, process_seconds=wall, fit_seconds=timing['fit_seconds'],
                train_seconds=sum(e['train_seconds'] for e in timing['epochs']),
                validation_seconds=sum(e['seconds'] - e['train_seconds'] for e in timing['epochs']),
                step_ms=statistics.median(steady) * 1e3, peak_reserved_mib=timing['peak_reserved_mib'],
                epochs=timing['epochs'], hashes={k: v for k, v in hashes.items() if k != 'env'}, env=hashes['env'],
                recorder=json.loads(rec.read_text()) if rec.exists() else None,
                recorder_log=[l for l in r.stderr.splitlines() if 'capture_segment_heads' in l or 'capture_optimizer_step' in l])


def spread(xs: list) -> dict | None:
    if any(x is None for x in xs): return None   # e.g. no CUDA memory figure on a CPU check run
    return dict(median=statistics.median(xs), min=min(xs), max=max(xs))


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument('--pairs', type=int, default=5); p.add_argument('--batch-size', type=int, default=4)
    p.add_argument('--out', default='benchmarks/results'); p.add_argument('--work', default='/tmp/recorder_pairs')
    p.add_argument('--arms', nargs='+', default=['native', 'head'], choices=list(ARMS), help='arms of each round, native first')
    p.add_argument('--previous', help='a result file of earlier pairs (same settings) to continue')
    p.add_argument('extra', nargs='*', help='extra `lucid fit` arguments, after --')
    a = p.parse_args(argv)
    runs = json.loads(Path(a.previous).read_text())['runs'] if a.previous and Path(a.previous).exists() else []
    if a.arms[0] != 'native': raise SystemExit('--arms: native comes first (the ratios are to it)')
    for r in runs: r['arm'] = {'replay': 'head'}.get(r['arm'], r['arm'])   # result files before the arms were named
    if runs and json.loads(Path(a.previous).read_text())['extra_args'] != a.extra: raise SystemExit('--previous: other settings')
    first = len([r for r in runs if r['arm'] == 'native'])
    for i in range(first, first + a.pairs):
        for arm in a.arms:
            r = run_once(arm, a.batch_size, Path(a.work) / f'b{a.batch_size}' / f'pair{i}', a.extra)
            print(f"round {i} {arm:>10}: process {r['process_seconds']:.1f} s, fit {r['fit_seconds']:.1f} s, "
                  f"train {r['train_seconds']:.1f} s, step {r['step_ms']:.1f} ms, peak {r['peak_reserved_mib']} MiB, "
                  f"all {r['hashes']['all'][:12]}", flush=True)
            runs.append(r)
    names = [arm for arm in ARMS if any(r['arm'] == arm for r in runs)]
    arms = {arm: [r for r in runs if r['arm'] == arm] for arm in names}
    keys = ('process_seconds', 'fit_seconds', 'train_seconds', 'validation_seconds', 'step_ms', 'peak_reserved_mib')
    summary = {arm: {k: spread([r[k] for r in rs]) for k in keys} for arm, rs in arms.items()}
    for arm in names[1:]:
        pairs = list(zip(arms['native'], arms[arm]))
        summary[f'{arm}_over_native'] = {k: spread([None if n[k] is None else b[k] / n[k] for n, b in pairs]) for k in keys}
    summary['all_hashes_equal'] = len({json.dumps(r['hashes'], sort_keys=True) for r in runs}) == 1
    summary['native_runs_equal'] = len({json.dumps(r['hashes'], sort_keys=True) for r in arms['native']}) == 1
    summary['predictions_equal'] = len({r['hashes'].get('predictions') for r in runs}) == 1
    res = dict(what='recorder reference benchmark: `lucid fit` processes, arms alternating in rounds', arms=names,
               config='configs/coco128-seg-n.yaml', batch_size=a.batch_size, pairs=len(arms['native']), extra_args=a.extra,
               date=datetime.now(timezone.utc).isoformat(timespec='seconds'), env=runs[0]['env'], summary=summary, runs=runs)
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    arms_tag = '' if names == ['native', 'head'] else '_' + '_'.join(names[1:])   # e.g. _head_head+optim
    path = out / f'recorder_pairs_b{a.batch_size}{arms_tag}_nvidia-h200.json'
    path.write_text(json.dumps(res, indent=1))
    print(json.dumps(summary, indent=1)); print(f'-> {path}')


if __name__ == '__main__':
    main()
