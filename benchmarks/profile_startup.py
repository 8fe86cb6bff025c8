"""Where the time before the first training step goes: imports, the CLI, Lightning's set-up, the first step.

Runs the reference configuration (`configs/coco128-seg-n.yaml`) for one training step without validation under
cProfile, and writes the stage times and the 60 most expensive calls (cumulative) to
`profile_startup_<device>.txt` in `--out`:

    python benchmarks/profile_startup.py --out benchmarks/results [-- extra lucid args]
"""
import time
T0 = time.perf_counter()
import argparse, cProfile, io, pstats, re, sys, tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main():
    p = argparse.ArgumentParser(); p.add_argument('--out', default='benchmarks/results')
    p.add_argument('extra', nargs='*'); a = p.parse_args()
    pr = cProfile.Profile(); pr.enable()
    t = {'python start to main': time.perf_counter() - T0}; s = time.perf_counter()
    import torch, lightning
    t['import torch, lightning'] = time.perf_counter() - s; s = time.perf_counter()
    from lucid_nb.command import cli_main
    from lucid_nb.core import device_tag, env_info
    t['import lucid_nb.trainer'] = time.perf_counter() - s; s = time.perf_counter()
    if torch.cuda.is_available(): torch.cuda.init(); torch.zeros(1, device='cuda')
    t['CUDA context'] = time.perf_counter() - s; s = time.perf_counter()
    root = tempfile.mkdtemp(prefix='profile_startup_')   # the run's files (hashes, timing, drawings) go here, not into the cwd
    cli = cli_main(['--config', str(ROOT / 'configs' / 'coco128-seg-n.yaml'), '--trainer.max_steps', '1',
                    '--trainer.default_root_dir', root,
                    '--trainer.limit_val_batches', '0', '--trainer.enable_progress_bar', 'false', '--trainer.logger', 'false',
                    '--trainer.enable_checkpointing', 'false', *a.extra], run=False)
    t['CLI: parse and build model, data, trainer'] = time.perf_counter() - s; s = time.perf_counter()
    cli.trainer.fit(cli.model, cli.datamodule)
    t['fit: set-up + 1 step + end'] = time.perf_counter() - s
    pr.disable()
    buf = io.StringIO(); pstats.Stats(pr, stream=buf).sort_stats('cumulative').print_stats(60)
    env, dev = env_info(), device_tag()
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    text = f"{env}\ncommand: {' '.join(sys.argv)}\n" + ''.join(f"{k:<45} {v:7.2f} s\n" for k, v in t.items()) + buf.getvalue()
    (out / f'profile_startup_{dev}.txt').write_text(text)
    print(text[:3000])


if __name__ == '__main__':
    main()
