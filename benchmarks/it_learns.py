""""It learns": train the nano segmentation model (or, `--task detect`, the detector) from scratch on the 128 embedded
images (used as both train and validation), 640 px, batch 16, on one GPU, and record box (and mask) mAP per validation
and the wall time.

    python benchmarks/it_learns.py --epochs 100 --val-every 5 --out benchmarks/results
    python benchmarks/it_learns.py --task detect --out benchmarks/results   # it_learns_<device>_<commit>_detect.json
    python benchmarks/it_learns.py --seed 3        # it_learns_<device>_<commit>_seed3.json: one run is one draw; a seed moves
        # box mAP50 from 0.01 to 0.37 (nbs/08c_trainer), so libraries are compared by the median over five seeds or more
    PYTHONPATH=DIR python benchmarks/it_learns.py --tag cpu_base -- --trainer.accelerator cpu ...   # on the CPU, reduced;
        # DIR holds another revision's exported lucid_nb/ (`git archive REV lucid_nb | tar -x -C DIR`): before and after
    python benchmarks/it_learns.py --library ultralytics --seed 3 [--task detect]   # Ultralytics' own trainer, same protocol:
        # it_learns_<device>_<commit>_ultralytics[_detect]_seed3.json, its last.pt scored by lucid's COCOeval
    OMP_NUM_THREADS=1 python benchmarks/it_learns.py --young --ultralytics-python /tmp/ulvenv/bin/python \
        --ultralytics-pythonpath /tmp/tvstub     # it_learns_cpu_<commit>_young.json: issue 57's CPU proxy, both libraries
        # (--into benchmarks/results/it_learns_nvidia-h100-80gb-hbm3_fa65bad_seeds.json: as that file's key young_cpu)

`--young` is issue 57's CPU proxy of the young model (the protocol of `tests/test_young_model.py`, 10 epochs): from
scratch on the embedded set split as lucid splits it by default (96 train, the last 32 by file name validate), 160 px,
batch 8, 10 epochs, the library defaults otherwise (lucid's match Ultralytics' loss, SGD, schedule, clipping at 10 and
init), validated at the last epoch only, at each of `--seeds` (0-4), one process a run, one run at a time; with
`--ultralytics-python`, Ultralytics' own trainer (`ultralytics_run.py`, `val=False`) on the same split at the same seeds.
It records each epoch's mean training loss terms (lucid's `train/<term>_epoch` of metrics.csv, Ultralytics'
`train/<term>_loss` of results.csv) and writes one JSON for both libraries (`nbs/08c_trainer` plots it); `--into F`
puts it into the it_learns result F as its key `young_cpu` instead (the committed one:
`it_learns_nvidia-h100-80gb-hbm3_fa65bad_seeds.json`, beside that file's other CPU checks).

Writes `it_learns_<device>_<commit>.json` (every validation's 24 COCO numbers, wall times, the exact command,
environment; `common.write_result`) and the same name `.png` (mAP per epoch). Nothing is tuned to a target: the settings are the defaults of
`configs/coco128-seg-n.yaml` apart from batch 16 and the epoch count.
"""
import argparse, csv, json, os, shlex, shutil, subprocess, sys, tempfile, time
from pathlib import Path

import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot as plt

from common import REFERENCE_CONFIG, env, write_result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--epochs', type=int, default=100)
    p.add_argument('--val-every', type=int, default=5, help='validate every N epochs (COCOeval of 128 images costs seconds)')
    p.add_argument('--batch-size', type=int, default=16)
    p.add_argument('--workers', type=int, default=4)
    p.add_argument('--out', default='benchmarks/results')
    p.add_argument('--run-root', default=None, help='where the run folder goes (default: a temporary folder)')
    p.add_argument('--task', default='segment', choices=('segment', 'detect'), help='--model.task (detect: box mAP only)')
    p.add_argument('--seed', type=int, default=None, help='--seed_everything and --data.seed (default: the configuration\'s, 0); tags the file seed<N>')
    p.add_argument('--tag', default='', help='appended to the result file name (e.g. cpu_before)')
    p.add_argument('--young', action='store_true', help="issue 57's CPU proxy: 160 px, batch 8, 10 epochs, lucid's split, loss per epoch")
    p.add_argument('--seeds', type=int, nargs='+', default=[0, 1, 2, 3, 4], help='--young: the seeds (default 0-4)')
    p.add_argument('--ultralytics-python', help="--young, --library ultralytics: an interpreter with Ultralytics 8.4.190, to run its trainer beside lucid")
    p.add_argument('--ultralytics-pythonpath', default='', help="--young: prepended to that interpreter's PYTHONPATH (e.g. a torchvision stub)")
    p.add_argument('--into', help="--young: put the result, as its key `young_cpu`, into this existing it_learns JSON instead of a file of its own")
    p.add_argument('--library', default='lucid', choices=('lucid', 'ultralytics'),
                   help="ultralytics: its own trainer (`ultralytics_run.py`) on the same protocol, its last.pt then scored by lucid's COCOeval")
    p.add_argument('--imgsz', type=int, default=640, help='--library ultralytics: both its training and the scoring (default 640; a CPU smoke run: less)')
    p.add_argument('extra', nargs='*', help='further `lucid fit` arguments, after --')
    a = p.parse_args(argv)
    if a.young: return young(a, argv)
    if a.library == 'ultralytics': return ultralytics_learns(a, argv)
    from lucid_nb.core import EMBEDDED_ANNOTATIONS, EMBEDDED_IMAGES
    from lucid_nb.command import cli_main
    run_root = Path(a.run_root or tempfile.mkdtemp()) / 'runs'
    args = ['fit', '--config', str(REFERENCE_CONFIG),
            '--data.train_images', str(EMBEDDED_IMAGES), '--data.train_annotations', str(EMBEDDED_ANNOTATIONS),
            '--data.val_images', str(EMBEDDED_IMAGES), '--data.val_annotations', str(EMBEDDED_ANNOTATIONS),
            '--data.batch_size', str(a.batch_size), '--data.workers', str(a.workers),
            '--trainer.max_epochs', str(a.epochs), '--trainer.check_val_every_n_epoch', str(a.val_every),
            '--trainer.enable_progress_bar', 'false', '--model.max_det', '100',
            *(['--model.task', a.task] if a.task != 'segment' else []),   # the default: a library before tasks runs it too
            *(['--seed_everything', str(a.seed), '--data.seed', str(a.seed)] if a.seed is not None else []),
            '--trainer.logger.init_args.save_dir', str(run_root), *a.extra]
    t0 = time.perf_counter()
    cli = cli_main(args)
    wall = time.perf_counter() - t0
    run = Path(cli.trainer.log_dir)
    vals = [json.loads(l) for l in (run / 'val_metrics.jsonl').read_text().splitlines()]
    result = dict(what=f'nano {a.task} from scratch, 128 embedded images as train and val, 640 px, bf16-mixed', task=a.task,
                  command='python benchmarks/it_learns.py ' + ' '.join(map(shlex.quote, argv or sys.argv[1:])),
                  lucid_args=args, epochs=a.epochs, batch_size=a.batch_size, wall_seconds=round(wall, 1),
                  env=env(), state_hashes=json.loads((run / 'state_hashes.json').read_text()),
                  timing=json.loads((run / 'timing.json').read_text()),
                  validations=[{k: v for k, v in d.items()} for d in vals])
    path = write_result('it_learns', result, out=a.out, tag='_'.join(t for t in (a.task if a.task != 'segment' else '', a.tag,
                                                                    f'seed{a.seed}' if a.seed is not None else '') if t))
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (('bbox/mAP50', 'box mAP50'), ('bbox/mAP50-95', 'box mAP50-95'),
                       ('segm/mAP50', 'mask mAP50'), ('segm/mAP50-95', 'mask mAP50-95')):
        if key not in vals[0]: continue   # a detector's: boxes only
        ax.plot([d['epoch'] + 1 for d in vals], [d[key] for d in vals], marker='.', label=label)
    ax.set(xlabel='epoch', ylabel='COCO mAP (EMA weights)', title=f"nano {a.task}, coco128 train=val, {cli.datamodule.hparams.imgsz} px, batch {a.batch_size} — {result['env']['device']}")
    ax.legend(); fig.tight_layout(); fig.savefig(path.with_suffix('.png'), dpi=110)
    last = vals[-1]
    masks = f", mask mAP50 {last['segm/mAP50']:.3f} mAP50-95 {last['segm/mAP50-95']:.3f}" if 'segm/mAP50' in last else ''
    print(f"wall {wall:.0f} s; last validation (epoch {last['epoch'] + 1}): box mAP50 {last['bbox/mAP50']:.3f} "
          f"mAP50-95 {last['bbox/mAP50-95']:.3f}{masks} -> {path}")


def run_ultralytics(a, args: list, out: Path, stderr=None) -> tuple[dict, float]:
    """`ultralytics_run.py args --json out` in `--ultralytics-python` (default: this interpreter), its PYTHONPATH led
    by `--ultralytics-pythonpath`: its result and the process's wall seconds."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (a.ultralytics_pythonpath, os.environ.get('PYTHONPATH', '')) if x))
    t0 = time.perf_counter()
    subprocess.run([a.ultralytics_python or sys.executable, str(Path(__file__).with_name('ultralytics_run.py')), *args,
                    '--json', str(out)], check=True, stdout=subprocess.DEVNULL, stderr=stderr, env=env)
    return json.loads(out.read_text()), time.perf_counter() - t0


def ultralytics_learns(a, argv) -> Path:
    """The it-learns protocol with Ultralytics' own trainer (`ultralytics_run.py`: its defaults, `val=False`, so it
    validates the last epoch only) on the same 128 images as train and val, epochs, batch and 640 px, at `--seed`; its
    `last.pt` (the EMA weights, stripped as it strips them) is then scored by `lucid validate`, the COCOeval lucid's
    runs are scored by, so both libraries' numbers come from one evaluator. Its own final mAP and each epoch's loss terms
    (`results.csv`) are kept beside."""
    from lucid_nb.core import EMBEDDED_ANNOTATIONS, EMBEDDED_IMAGES
    from lucid_nb.command import cli_main
    root = Path(a.run_root or tempfile.mkdtemp(prefix='learns_ul_'))
    seed = 0 if a.seed is None else a.seed
    args = ['--data', str(Path(EMBEDDED_IMAGES).parent), '--val-count', '0', '--batch', str(a.batch_size),
            '--epochs', str(a.epochs), '--workers', str(a.workers), '--seed', str(seed), '--no-val', '--imgsz', str(a.imgsz),
            '--model', 'yolo11n-seg.yaml' if a.task == 'segment' else 'yolo11n.yaml', '--project', str(root / 'ul')]
    ul, wall = run_ultralytics(a, args, root / 'ul.json')
    weights = root / 'ul' / 'r' / 'weights' / 'last.pt'
    scored = ['validate', '--config', str(REFERENCE_CONFIG), '--model.weights', str(weights),
              '--data.val_images', str(EMBEDDED_IMAGES), '--data.val_annotations', str(EMBEDDED_ANNOTATIONS),
              '--data.batch_size', str(a.batch_size), '--data.imgsz', str(a.imgsz), '--model.max_det', '100',
              '--trainer.enable_progress_bar', 'false',
              *(['--model.task', a.task] if a.task != 'segment' else []),
              '--trainer.logger.init_args.save_dir', str(root / 'runs'), *a.extra]
    cli = cli_main(scored)
    val = json.loads((Path(cli.trainer.log_dir) / 'val_metrics.jsonl').read_text().splitlines()[-1])
    val['epoch'] = a.epochs - 1
    last = ul['results'][-1] if ul['results'] else {}
    result = dict(what=f"Ultralytics' yolo11n {a.task} trainer from scratch, the it-learns protocol, its last.pt scored by lucid's COCOeval",
                  task=a.task, library='ultralytics', version=ul['ultralytics'],
                  command='python benchmarks/it_learns.py ' + ' '.join(map(shlex.quote, argv or sys.argv[1:])),
                  ultralytics_args=args, lucid_validate_args=scored, epochs=a.epochs, batch_size=a.batch_size,
                  wall_seconds=round(wall, 1), env=env(), validations=[val],
                  ultralytics_own_final={k: v for k, v in last.items() if k.startswith('metrics/')},
                  ultralytics_epochs=[dict(epoch=int(r['epoch']), **{t: r[f'train/{t}_loss'] for t in TERMS if f'train/{t}_loss' in r})
                                      for r in ul['results']],
                  ultralytics_peak_reserved_mib=ul['peak_reserved_mib'])
    path = write_result('it_learns', nameless(result, a), out=a.out,
                        tag='_'.join(t for t in ('ultralytics', a.task if a.task != 'segment' else '', a.tag, f'seed{seed}') if t))
    masks = f", mask mAP50 {val['segm/mAP50']:.3f} mAP50-95 {val['segm/mAP50-95']:.3f}" if 'segm/mAP50' in val else ''
    print(f"wall {wall:.0f} s; last validation (epoch {a.epochs}): box mAP50 {val['bbox/mAP50']:.3f} "
          f"mAP50-95 {val['bbox/mAP50-95']:.3f}{masks} -> {path}")
    if not a.run_root: shutil.rmtree(root, ignore_errors=True)
    return path


YOUNG = ['--data.imgsz', '160', '--data.batch_size', '8', '--trainer.accelerator', 'cpu', '--trainer.enable_progress_bar', 'false',
         '--trainer.enable_model_summary', 'false', '--model.max_det', '100']   # tests/test_young_model.py's, without its seed
TERMS = ('box', 'seg', 'cls', 'dfl')


def lucid_young(a, seed: int, root: Path) -> dict:
    "One `lucid fit` of the proxy in its own process: each epoch's mean loss terms from its metrics.csv."
    args = ['fit', *YOUNG, '--trainer.max_epochs', str(a.epochs), '--trainer.check_val_every_n_epoch', str(a.epochs),
            '--seed_everything', str(seed), '--data.seed', str(seed), *a.extra]
    t0 = time.perf_counter()
    subprocess.run([sys.executable, '-c', 'from lucid_nb.cli import main; main()', *args, '--trainer.default_root_dir', str(root)],
                   check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    metrics = next(root.rglob('metrics.csv'))
    rows = [r for r in csv.DictReader(metrics.open()) if r.get('train/seg_epoch')]
    return dict(library='lucid', seed=seed, command=shlex.join(['lucid', *args]),
                wall_seconds=round(wall, 1), epochs=[dict(epoch=int(r['epoch']) + 1, **{t: float(r[f'train/{t}_epoch']) for t in TERMS})
                                                     for r in rows])


def ultralytics_young(a, seed: int, root: Path) -> dict:
    "One run of Ultralytics' trainer (`ultralytics_run.py`) on the same split: each epoch's loss terms from its results.csv."
    from lucid_nb.core import EMBEDDED_IMAGES
    args = ['--data', str(Path(EMBEDDED_IMAGES).parent), '--val-count', '32', '--imgsz', '160', '--batch', '8', '--epochs', str(a.epochs),
            '--workers', '0', '--device', 'cpu', '--seed', str(seed), '--no-val']
    res, wall = run_ultralytics(a, args, root / 'ul.json', stderr=subprocess.DEVNULL)
    return dict(library='ultralytics', seed=seed, version=res['ultralytics'], torch=res['torch'],
                command=shlex.join(['python', 'benchmarks/ultralytics_run.py', *args]), wall_seconds=round(wall, 1),
                epochs=[dict(epoch=int(r['epoch']), **{t: r[f'train/{t}_loss'] for t in TERMS}) for r in res['results']])


def young(a, argv) -> Path:
    "Issue 57's CPU proxy at each seed, lucid and (with `--ultralytics-python`) Ultralytics, one run at a time; one JSON."
    a.epochs = 10 if a.epochs == 100 else a.epochs   # the proxy's 10 unless asked otherwise
    runs, libs = [], [('lucid', lucid_young)] + ([('ultralytics', ultralytics_young)] if a.ultralytics_python else [])
    for seed in a.seeds:
        for name, fn in libs:
            runs.append(r := fn(a, seed, Path(tempfile.mkdtemp(prefix=f'young_{name}_{seed}_'))))
            print(f"{name} seed {seed}: seg loss " + ' '.join(f"{e['seg']:.2f}" for e in r['epochs']) + f" ({r['wall_seconds']:.0f} s)", flush=True)
    LN2 = 0.6931471805599453
    summary = {}
    for seed in a.seeds:
        by = {r['library']: r['epochs'] for r in runs if r['seed'] == seed}
        summary[seed] = {f'{lib}_seg_epoch1': e[0]['seg'] for lib, e in by.items()} | {f'{lib}_seg_last': e[-1]['seg'] for lib, e in by.items()}
        if 'ultralytics' in by: summary[seed]['epoch1_ratio_lucid_over_ultralytics'] = by['lucid'][0]['seg'] / by['ultralytics'][0]['seg']
    result = dict(what="issue 57's CPU proxy: nano segment from scratch, embedded coco128 (96 train / 32 val by file name), 160 px, "
                       f"batch 8, {a.epochs} epochs, library defaults, CPU fp32; each epoch's mean training loss terms",
                  command='python benchmarks/it_learns.py ' + ' '.join(map(shlex.quote, argv or sys.argv[1:])),
                  epochs=a.epochs, batch_size=8, imgsz=160, seeds=a.seeds, stall=7.5 * LN2, terms=list(TERMS),
                  env=env(), runs=runs, summary=summary)
    path = write_result('it_learns', nameless(result, a), out=a.out, tag='_'.join(t for t in ('young', a.tag) if t))
    if a.into: path = combine(path, Path(a.into))
    for seed, s in summary.items(): print(seed, {k: round(v, 3) for k, v in s.items()})
    print(path)
    return path


def nameless(x, a):
    "`x` with the Ultralytics interpreter and its PYTHONPATH as names (`common.portable` knows only this checkout's paths)."
    names = [(v, k) for v, k in ((a.ultralytics_python, 'ULTRALYTICS_PYTHON'), (a.ultralytics_pythonpath, 'ULTRALYTICS_PYTHONPATH')) if v]
    if isinstance(x, str):
        for v, k in names: x = x.replace(v, k)
        return x
    if isinstance(x, dict): return {k: nameless(v, a) for k, v in x.items()}
    if isinstance(x, list): return [nameless(v, a) for v in x]
    return x


def combine(young_json: Path, into: Path, key: str = 'young_cpu') -> Path:
    "`young_json` (its own env and command inside) as `into[key]`, atomically; `young_json` removed (the results' cap)."
    from lucid_nb.core import atomic_write
    d = json.loads(into.read_text())
    d[key] = json.loads(young_json.read_text())
    atomic_write(into, (json.dumps(d, indent=1, default=str) + '\n').encode())
    young_json.unlink()
    return into


if __name__ == '__main__':
    main()
