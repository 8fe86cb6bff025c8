"""The reference run, phase by phase: alternating `lucid fit` processes (one per arm) and, optionally, Ultralytics.

Each run is a separate process of the reference configuration (`configs/coco128-seg-n.yaml`: the embedded data,
96 train / 32 val images, nano, 640 px, 10 epochs, bf16-mixed, RAM cache, prefetch, device HSV), at the batch size
given. Arms, run in turn (arm 1, arm 2, ..., arm 1, arm 2, ...):

    native      the configuration as it is
    head        --model.capture_segment_heads true
    optim       --model.capture_optimizer_step true
    head+optim  both (the seed's replay configuration)
    step        --model.capture_train_step true
    <arm>-pageable  that arm with --data.pin_memory false (batches left in pageable memory: the copy waits for the GPU)
    native-val16, step-val16  that arm with validation batches of 16 images (--data.val_batch_size 16)
    native-g26, native-g27, step-g26, step-g27  that arm with validation's groups of 2^26 / 2^27 pixels
                (--model.val_group_pixels; default 2^25): fewer host calls, more memory
    native-expandable, step-expandable, native-g27-expandable, step-g27-expandable  that arm with
                PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True set explicitly (lucid's default since 2026-12-03:
                the allocator's segments grow instead of adding new ones, so validation fits in what training reserved)
    native-classic, step-classic, native-g27-classic, step-g27-classic  that arm with LUCID_NB_EXPANDABLE_SEGMENTS=0
                (PyTorch's allocator defaults: the library before 2026-12-03)
    native-cl, step-cl  that arm with the network in channels-last memory order (--model.channels_last true)
    native-detect, step-detect  that arm training the YOLO11 detector of the same size (--model.task detect): boxes only
    native-26, step-26  that arm training YOLO26 of the same size and task (--model.family yolo26): end to end
    <arm>@base  that arm on another library, exported into $LUCID_NB_BASELINE (before and after a change in one call)
    ul          Ultralytics yolo11n-seg on the same split, batch, size and epochs (`ultralytics_run.py`; left out where
                `ultralytics` does not import)

For a lucid run it keeps the whole-process wall time (measured from outside), the phases of `timing.json`
(start-up to the first training step, the first step alone, data preparation, per-epoch training with its data
stall, per-epoch validation split into forward / post-processing / evaluation, fit end), peak reserved CUDA memory,
every state hash and the recorder's report (with the seconds spent recording, all regions). The summary gives per arm the median (min–max) and per round each arm's ratio to the
first arm and to Ultralytics, and whether the hashes of all lucid runs matched.

    python benchmarks/reference_run.py --batch-size 4 --rounds 5 --arms native,head+optim,ul [--out benchmarks/results] [-- extra lucid args]

The result file is `reference_run_b<batch>_<device>_<commit>[_<part>].json` (`common.write_result`; the commit is the
lucid runs' library), rewritten after every run. A series split over several calls of the GPU machine (each call at
most 10 minutes) numbers its rounds on and writes parts (`gpu_session.sh ref4x2@3`: `--first-round 3 --part r3`),
then joins them into the file without a part:

    python benchmarks/reference_run.py --rounds 3 --part r0 ...; python benchmarks/reference_run.py --rounds 2 --first-round 3 --part r3 ...
    python benchmarks/reference_run.py --merge benchmarks/results/reference_run_b4_<device>_<commit>_r{0,3}.json [--arms native,ul]
"""
import argparse, json, os, statistics, subprocess, sys, tempfile, time
from datetime import datetime, timezone
from pathlib import Path

from common import LUCID, REFERENCE_CONFIG, ROOT, device_of, env, spread, write_result
ARMS = {'native': [], 'head': ['--model.capture_segment_heads', 'true'], 'optim': ['--model.capture_optimizer_step', 'true'],
        'head+optim': ['--model.capture_segment_heads', 'true', '--model.capture_optimizer_step', 'true'],
        'step': ['--model.capture_train_step', 'true']}
ARMS.update({f'{arm}-pageable': [*args, '--data.pin_memory', 'false'] for arm, args in list(ARMS.items())})   # batches not pinned
ARMS.update({f'{arm}-val16': [*args, '--data.val_batch_size', '16'] for arm in ('native', 'step') for args in [ARMS[arm]]})
ARMS.update({f'{arm}-g{k}': [*args, '--model.val_group_pixels', str(2**k)]   # validation's groups of 2^k pixels
             for arm in ('native', 'step') for k in (26, 27) for args in [ARMS[arm]]})
ARMS.update({f'{arm}-cl': [*ARMS[arm], '--model.channels_last', 'true'] for arm in ('native', 'step')})   # NHWC memory order
ARMS.update({f'{arm}-detect': [*ARMS[arm], '--model.task', 'detect'] for arm in ('native', 'step')})   # the detector
ARMS.update({f'{arm}-26': [*ARMS[arm], '--model.family', 'yolo26'] for arm in ('native', 'step')})   # YOLO26
# arms run with the CUDA caching allocator's expandable segments (less fragmentation), the library unchanged
EXPANDABLE, CLASSIC = {'PYTORCH_CUDA_ALLOC_CONF': 'expandable_segments:True'}, {'LUCID_NB_EXPANDABLE_SEGMENTS': '0'}
ARM_ENV = {f'{arm}-{kind}': env for arm in ('native', 'step', 'native-g27', 'step-g27')
           for kind, env in (('expandable', EXPANDABLE), ('classic', CLASSIC))}
ARMS.update({arm: ARMS[arm.rsplit('-', 1)[0]] for arm in ARM_ENV})


# `<arm>@base`: that arm on another library, exported into the folder $LUCID_NB_BASELINE (`git archive REV lucid_nb
# ':!lucid_nb/embedded' | tar -x -C DIR`), run from there so that it imports first: before and after in one call
BASE = '@base'


def lucid_args(arm: str, batch_size: int, save_dir: Path, extra: list) -> list:
    logger = json.dumps({'class_path': 'lightning.pytorch.loggers.CSVLogger',
                         'init_args': {'save_dir': str(save_dir), 'name': arm, 'version': ''}})
    return [sys.executable, '-c', LUCID, 'fit', '--config', str(REFERENCE_CONFIG),
            '--data.batch_size', str(batch_size), '--trainer.logger', logger, '--trainer.enable_progress_bar', 'false',
            *ARMS[arm.removesuffix(BASE)], *extra]


def arm_cwd(arm: str) -> Path:
    "Where an arm's process starts: the checkout, or $LUCID_NB_BASELINE for an `@base` arm."
    if not arm.endswith(BASE): return ROOT
    base = os.environ.get('LUCID_NB_BASELINE')
    if not base or not (Path(base) / 'lucid_nb').is_dir(): raise SystemExit(f"{arm}: set LUCID_NB_BASELINE to a folder holding an exported lucid_nb/")
    return Path(base)


def run_lucid(arm: str, batch_size: int, save_dir: Path, extra: list) -> dict:
    args = lucid_args(arm, batch_size, save_dir, extra)
    t0 = time.perf_counter()
    r = subprocess.run(args, capture_output=True, text=True, cwd=arm_cwd(arm), env={**os.environ, **ARM_ENV.get(arm.removesuffix(BASE), {})})
    wall = time.perf_counter() - t0
    if r.returncode != 0: raise SystemExit(f"{arm} run failed:\n{r.stderr[-4000:]}")
    run = save_dir / arm
    t = json.loads((run / 'timing.json').read_text())
    hashes = json.loads((run / 'state_hashes.json').read_text())
    rec = run / 'recorder.json'
    recorder = json.loads(rec.read_text()) if rec.exists() else None
    later = t['epochs'][1:] or t['epochs']          # epoch 0 includes recording and warm-up
    val = [e['validation'] for e in t['epochs'] if e.get('validation')]
    return dict(arm=arm, command=' '.join(args[3:]), process_seconds=wall, fit_seconds=t['fit_seconds'],
                startup_seconds=t.get('startup_seconds'), data_setup_seconds=t.get('data_setup_seconds'),
                first_step_seconds=t.get('first_step_seconds'), recording_seconds=recording_seconds(recorder),
                fit_end_seconds=t.get('fit_end_seconds'),
                train_seconds=sum(e['train_seconds'] for e in t['epochs']),
                data_wait_seconds=sum(e.get('data_wait_seconds') or 0 for e in t['epochs']),
                validation_seconds=sum(e['seconds'] - e['train_seconds'] for e in t['epochs']),
                validation_epoch_seconds=statistics.median(sum(v[k] for k in ('forward', 'postprocess', 'evaluate')) for v in val[1:] or val) if val else None,
                validation_parts={k: statistics.median(v[k] for v in val[1:] or val) for k in ('forward', 'postprocess', 'evaluate')} if val else None,
                step_ms=statistics.median(e['train_seconds'] / e['steps'] for e in later) * 1e3,
                peak_reserved_mib=t['peak_reserved_mib'], timing=t,
                hashes={k: v for k, v in hashes.items() if k != 'env'}, env=hashes['env'],
                recorder=recorder,
                fallback_lines=[l for l in r.stderr.splitlines() if 'capture_' in l])


def recording_seconds(recorder: dict | None) -> float | None:
    "Seconds the fit spent recording, all regions (warm-up and capture; recorder.json), None without a recorder."
    if not recorder: return None
    return sum(r['seconds'] for region in recorder.values() if isinstance(region, dict) for r in region.get('recordings') or [])


def run_ul(batch_size: int, work: Path) -> dict:
    "One `ultralytics_run.py` process on the reference split, batch and epochs: its phases as a lucid run's keys."
    out = work / f'ul_b{batch_size}.json'
    args = [sys.executable, str(ROOT / 'benchmarks' / 'ultralytics_run.py'), '--batch', str(batch_size),
            '--data', 'lucid_nb/embedded/coco128', '--json', str(out)]
    t0 = time.perf_counter()
    r = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if r.returncode != 0 or not out.exists(): raise SystemExit(f"ultralytics run failed:\n{(r.stdout + r.stderr)[-4000:]}")
    res = json.loads(out.read_text())
    train, ev = [e['train_seconds'] for e in res['epochs']], [e['validation_seconds'] for e in res['epochs'] if 'validation_seconds' in e]
    return dict(arm='ul', command=' '.join(args[1:]), process_seconds=wall, ul_process_s=res['process_seconds'],
                train_seconds=sum(train), validation_seconds=sum(ev),
                validation_epoch_seconds=statistics.median(ev[1:] or ev) if ev else None,
                step_ms=1e3 * statistics.median(train[1:]) / (res['iterations'] / len(train)) if len(train) > 1 else None,
                peak_reserved_mib=res.get('peak_reserved_mib'), raw=res)


def ul_importable() -> bool:
    "Whether `ultralytics` imports in a fresh process here (offline: no settings file written to the home folder)."
    r = subprocess.run([sys.executable, '-c', 'import ultralytics'], capture_output=True, cwd=ROOT,
                       env={**os.environ, 'YOLO_OFFLINE': '1', 'YOLO_CONFIG_DIR': tempfile.mkdtemp(prefix='ycfg')})
    return r.returncode == 0


def summarize(runs: list, arms: list) -> dict:
    "Median and range per arm and key, ratios per round against the first arm (and Ultralytics), and hash equality."
    keys = ('process_seconds', 'fit_seconds', 'startup_seconds', 'first_step_seconds', 'recording_seconds',
            'data_setup_seconds', 'fit_end_seconds', 'train_seconds',
            'data_wait_seconds', 'validation_seconds', 'validation_epoch_seconds', 'step_ms', 'peak_reserved_mib')
    by_arm = {arm: [r for r in runs if r['arm'] == arm] for arm in arms}
    summary = {arm: {k: spread([r.get(k) for r in rs]) for k in keys} for arm, rs in by_arm.items()}
    ratio = lambda x, y, k: None if x.get(k) is None or not y.get(k) else x[k] / y[k]
    for ref in [arms[0]] + (['ul'] if 'ul' in arms and arms[0] != 'ul' else []):
        same_round = lambda r: next((q for q in by_arm[ref] if q['round'] == r['round']), {})   # {}: not run yet in that round
        summary[f'over_{ref}'] = {arm: {k: spread([ratio(r, same_round(r), k) for r in rs])
                                        for k in ('process_seconds', 'train_seconds', 'step_ms', 'peak_reserved_mib')}
                                  for arm, rs in by_arm.items() if arm != ref}
    lucid_runs = [r for r in runs if 'hashes' in r]
    summary['all_hashes_equal'] = len({json.dumps(r['hashes'], sort_keys=True) for r in lucid_runs}) == 1
    summary['predictions_equal'] = len({r['hashes'].get('predictions') for r in lucid_runs}) == 1
    return summary


def merge(paths: list, out: Path, arms: list | None = None) -> Path:
    "One result of several calls' results (the same batch size and arms, or only `arms` of each; rounds numbered on): runs joined, summary redone."
    parts = [json.loads(Path(q).read_text()) for q in paths]
    if arms:
        if any(a not in q['arms'] for q in parts for a in arms): raise SystemExit('reference_run --merge: a part lacks one of --arms')
        parts = [dict(q, arms=arms, runs=[r for r in q['runs'] if r['arm'] in arms]) for q in parts]
    first = parts[0]
    if any((q['batch_size'], q['arms']) != (first['batch_size'], first['arms']) for q in parts):
        raise SystemExit('reference_run --merge: the parts differ in batch size or arms')
    runs = [r for q in parts for r in q['runs']]
    if len({r['round'] for r in runs}) * len(first['arms']) != len(runs): raise SystemExit('reference_run --merge: round numbers repeat')
    res = dict(first, rounds=len({r['round'] for r in runs}), command=[q['command'] for q in parts],
               date=[q['date'] for q in parts], envs=[q['env'] for q in parts], summary=summarize(runs, first['arms']), runs=runs)
    device = Path(paths[0]).stem.removeprefix(f"reference_run_b{first['batch_size']}_").split('_')[0]  # the parts' device
    commits = sorted({r['env'].get('commit') for r in runs if r.get('env')}) or ['unknown']   # the runs' library
    return write_result(f"reference_run_b{first['batch_size']}", res, device, out=out, commit='+'.join(commits))


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument('--rounds', type=int, default=5); p.add_argument('--batch-size', type=int, default=4)
    p.add_argument('--first-round', type=int, default=0, help='number of the first round (rounds split over calls)')
    p.add_argument('--part', default='', help='result file tag for one call of a split series (e.g. r3; merged by --merge)')
    p.add_argument('--merge', nargs='+', help='join these result files of one series into one (no runs)')
    p.add_argument('--arms', help='the arms to run (default: native,head+optim,ul); with --merge, the arms to keep of each part (default: all)')
    p.add_argument('--out', default='benchmarks/results')
    p.add_argument('--work', default='/tmp/reference_run')
    p.add_argument('extra', nargs='*', help='extra `lucid fit` arguments, after --')
    a = p.parse_args(argv)
    if a.merge: print('->', merge(a.merge, Path(a.out), a.arms and a.arms.split(','))); return
    arms = (a.arms or 'native,head+optim,ul').split(',')
    if 'ul' in arms and not ul_importable(): arms.remove('ul'); print('ultralytics does not import here: the ul arm is left out')
    device, runs = device_of(), []
    for i in range(a.first_round, a.first_round + a.rounds):
        for arm in arms:
            r = run_ul(a.batch_size, Path(a.work)) if arm == 'ul' else run_lucid(arm, a.batch_size, Path(a.work) / f'b{a.batch_size}' / f'round{i}', a.extra)
            r['round'] = i; runs.append(r)
            print(f"round {i} {arm:>10}: process {r['process_seconds']:.1f} s, train {r['train_seconds']:.1f} s, "
                  f"val/epoch {r['validation_epoch_seconds'] or float('nan'):.2f} s, step {r['step_ms'] or float('nan'):.1f} ms, "
                  f"startup {r.get('startup_seconds') or float('nan'):.1f} s, peak {r['peak_reserved_mib']} MiB"
                  + (f", all {r['hashes']['all'][:12]}" if 'hashes' in r else ''), flush=True)
            summary = summarize(runs, arms)   # written after every run: a call cut short keeps what it measured
            lucid_runs = [r for r in runs if 'hashes' in r]
            res = dict(what='the reference run, phase by phase, alternating processes per arm', batch_size=a.batch_size,
                       rounds=len({r['round'] for r in runs}), arms=arms, extra_args=a.extra,
                       command=' '.join([sys.executable, *sys.argv]), date=datetime.now(timezone.utc).isoformat(timespec='seconds'),
                       env=lucid_runs[0]['env'] if lucid_runs else env(), summary=summary, runs=runs)
            path = write_result(f'reference_run_b{a.batch_size}', res, device, a.part, out=a.out,
                                commit=lucid_runs[0]['env'].get('commit') if lucid_runs else None)
    print(json.dumps(summary, indent=1)); print(f'-> {path}')


if __name__ == '__main__':
    main()
