""""It learns": train the nano segmentation model (or, `--task detect`, the detector) from scratch on the 128 embedded
images (used as both train and validation), 640 px, batch 16, on one GPU, and record box (and mask) mAP per validation
and the wall time.

    python benchmarks/it_learns.py --epochs 100 --val-every 5 --out benchmarks/results
    python benchmarks/it_learns.py --task detect --out benchmarks/results   # it_learns_<device>_<commit>_detect.json
    python benchmarks/it_learns.py --seed 3        # it_learns_<device>_<commit>_seed3.json: one run is one draw; a seed moves
        # box mAP50 from 0.01 to 0.37 (nbs/08c_trainer), so libraries are compared by the median over five seeds or more
    PYTHONPATH=DIR python benchmarks/it_learns.py --tag cpu_base -- --trainer.accelerator cpu ...   # on the CPU, reduced;
        # DIR holds another revision's exported lucid_nb/ (`git archive REV lucid_nb | tar -x -C DIR`): before and after

Writes `it_learns_<device>_<commit>.json` (every validation's 24 COCO numbers, wall times, the exact command,
environment; `common.write_result`) and the same name `.png` (mAP per epoch). Nothing is tuned to a target: the settings are the defaults of
`configs/coco128-seg-n.yaml` apart from batch 16 and the epoch count.
"""
import argparse, json, shlex, sys, tempfile, time
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
    p.add_argument('extra', nargs='*', help='further `lucid fit` arguments, after --')
    a = p.parse_args(argv)
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


if __name__ == '__main__':
    main()
