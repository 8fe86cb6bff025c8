"""Where does a validation epoch's time go? (the reference run spends most of its fit time validating)

Fits the reference configuration for a few epochs (so the EMA model makes realistic detections at conf 0.001), then
runs one `trainer.validate` under cProfile and writes the top functions by cumulative and by own time.

    python benchmarks/profile_validation.py --epochs 3 --out benchmarks/results -- --data.workers 4
    python benchmarks/profile_validation.py --smoke --out /tmp/pv     # CPU, tiny: proves the script runs

The JSON is named after the device the run found (`profile_validation_<device>.json`).
"""
import argparse, cProfile, io, json, pstats, time
from pathlib import Path

import torch

from lucid_nb.core import device_tag, env_info
from lucid_nb.command import cli_main

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument('--epochs', type=int, default=3); p.add_argument('--out', default='benchmarks/results')
    p.add_argument('--smoke', action='store_true', help='CPU, 64 px, 1 epoch of 2 batches: proves the script runs')
    p.add_argument('extra', nargs='*')
    a = p.parse_args(argv)
    smoke = ['--config', str(ROOT / 'configs' / 'coco128-seg-n-cpu.yaml'), '--trainer.accelerator', 'cpu', '--data.imgsz', '64',
             '--data.batch_size', '2', '--data.val_count', '2', '--trainer.limit_train_batches', '2', '--model.max_det', '20'] if a.smoke else []
    if a.smoke: a.epochs = 1
    cli = cli_main(['--config', str(ROOT / 'configs' / 'coco128-seg-n.yaml'), *smoke, '--trainer.max_epochs', str(a.epochs),
                    '--trainer.enable_progress_bar', 'false', '--trainer.logger', json.dumps(
                        {'class_path': 'lightning.pytorch.loggers.CSVLogger', 'init_args': {'save_dir': '/tmp/profile_validation'}}),
                    *a.extra], run=False)
    cli.trainer.fit(cli.model, cli.datamodule)
    prof = cProfile.Profile()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync(); t0 = time.perf_counter()
    prof.enable(); cli.trainer.validate(cli.model, cli.datamodule, verbose=False); prof.disable()
    sync(); seconds = time.perf_counter() - t0
    tables = {}
    for key in ('cumulative', 'tottime'):
        s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats(key).print_stats(30); tables[key] = s.getvalue()
    n = len(cli.model.validator.results)
    res = dict(what='one validation epoch of the reference run under cProfile (32 images, conf 0.001, max_det 300)',
               epochs_trained=a.epochs, seconds=seconds, detections=n, env=env_info(), **tables)
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    path = out / f'profile_validation_{device_tag()}.json'; path.write_text(json.dumps(res, indent=1))
    print(f"validation: {seconds:.2f} s, {n} detections"); print(tables['cumulative'][:6000]); print(tables['tottime'][:4000]); print(f'-> {path}')


if __name__ == '__main__':
    main()
