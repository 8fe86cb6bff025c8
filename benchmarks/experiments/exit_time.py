"""How long does a `lucid fit` process take after its last line? 0.14 s with the fast exit against 2.7 s at the ordinary interpreter exit (results/exit_time_cpu{,_ordinary_exit}.json, kept in git history: `git show 8a0701f:benchmarks/results/exit_time_cpu.json`), at 4874aea; `LUCID_NB_FAST_EXIT` is the default.

How long a `lucid fit` process takes around its fit: to the first step, at fit end, and after its last line.

Runs `lucid fit ARGS` (default: a tiny CPU fit) `--runs` times as child processes and timestamps, in this parent
process, every line the child prints (stdout and stderr merged, unbuffered) and the child's end. A small wrapper
(`python -c`) runs `lucid_nb.cli.main` exactly as the `lucid` command does and adds three probe lines:

- `exit-probe: main returned`: the trainer's `main()` is back: Lightning's teardown after `on_fit_end` (data loaders' threads
  and workers closed, loggers finalised) is done;
- `exit-probe: last atexit`: printed by an `atexit` handler registered before anything else, so it runs after every
  other one (multiprocessing's, which reaps worker processes, torch's...) and after the join of non-daemon threads;
- the process end: interpreter finalisation (module and object teardown, CUDA context) and the exit.

Reported per run, in seconds from the child's start (`Popen`): `results_line` ("Results saved to", EpochSummary's
last line at fit end), `main_returned`, `last_atexit`, `end`; and the intervals `teardown` (results line → main
returned), `atexit` (→ last atexit), `finalise` (→ end), `after_last_line` (results line → end); plus the run
folder's `timing.json` (startup_seconds, fit_end_seconds, ...). Medians over runs go to
`<out>/exit_time_<device>[tag].json` (device: `torch.cuda.get_device_name()` or `cpu`).

    python benchmarks/experiments/exit_time.py --runs 3 [--tag _slow_exit] [-- lucid fit args]

`LUCID_NB_FAST_EXIT=0` in the environment (the child inherits it) measures the ordinary interpreter exit.
"""
import argparse, json, os, re, shlex, statistics, subprocess, sys, tempfile, time
from pathlib import Path

TINY = ['--trainer.accelerator', 'cpu', '--trainer.max_epochs', '1', '--trainer.limit_train_batches', '3',
        '--trainer.limit_val_batches', '1', '--data.imgsz', '64', '--data.batch_size', '2', '--data.val_count', '2',
        '--model.max_det', '20']
WRAPPER = """import atexit, sys
atexit.register(lambda: print('exit-probe: last atexit', flush=True))
from lucid_nb.cli import enable_bytecode_cache, main
enable_bytecode_cache()                       # as `main` does, before the heavy imports
import lucid_nb.command as T   # `main` (the trainer's CLI entry), wrapped
command = T.main
def traced():
    try: command()
    finally: print('exit-probe: main returned', flush=True)
T.main = traced
sys.argv = ['lucid', 'fit', *sys.argv[1:]]
main()
"""
MARKS = {'results_line': 'Results saved to', 'main_returned': 'exit-probe: main returned', 'last_atexit': 'exit-probe: last atexit'}


def one_run(args: list, root: Path) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED='1')
    t0 = time.perf_counter()
    logger = json.dumps({'class_path': 'lightning.pytorch.loggers.CSVLogger', 'init_args': {'save_dir': str(root), 'name': 'exit'}})
    p = subprocess.Popen([sys.executable, '-c', WRAPPER, *args, '--trainer.logger', logger],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    marks, tail = {}, []
    for line in p.stdout:
        t = time.perf_counter() - t0
        tail = (tail + [line.rstrip()])[-5:]
        for k, m in MARKS.items():
            if line.startswith(m) or (k == 'results_line' and m in line): marks.setdefault(k, t)
    p.wait(); marks['end'] = time.perf_counter() - t0
    if p.returncode: raise SystemExit(f"lucid fit failed ({p.returncode}): {' | '.join(tail)}")
    r = dict(marks)
    r['teardown'] = marks['main_returned'] - marks['results_line']
    r['atexit'] = marks['last_atexit'] - marks['main_returned']
    r['finalise'] = marks['end'] - marks['last_atexit']
    r['after_last_line'] = marks['end'] - marks['results_line']
    timing = next(root.rglob('timing.json'), None)
    r['timing'] = {k: v for k, v in json.loads(timing.read_text()).items() if k != 'epochs'} if timing else None
    return r


def device_slug() -> str:
    import torch
    if not torch.cuda.is_available(): return 'cpu'
    return re.sub(r'[^a-z0-9]+', '-', torch.cuda.get_device_name().lower()).strip('-')


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--runs', type=int, default=3)
    p.add_argument('--tag', default='')
    p.add_argument('--out', default='benchmarks/results')
    p.add_argument('args', nargs='*', help='lucid fit arguments (default: a tiny CPU fit)')
    a = p.parse_args(argv)
    args = a.args or TINY
    runs = []
    for i in range(a.runs):
        with tempfile.TemporaryDirectory() as d:
            runs.append(one_run(args, Path(d)))
        print(f"run {i}: " + ', '.join(f"{k} {v:.2f}" for k, v in runs[-1].items() if isinstance(v, float)), flush=True)
    keys = [k for k, v in runs[0].items() if isinstance(v, float)]
    tkeys = [k for k, v in (runs[0]['timing'] or {}).items() if isinstance(v, (int, float))]
    from lucid_nb.core import env_info
    res = dict(what='a lucid fit process: seconds from its start to marks, and the intervals after its last line',
               command=shlex.join([Path(sys.executable).name, *sys.argv]), fit_args=args, env=env_info(),
               fast_exit=os.environ.get('LUCID_NB_FAST_EXIT', '1'),
               load_average=os.getloadavg(),
               median_s={k: statistics.median(r[k] for r in runs) for k in keys},
               timing_median_s={k: statistics.median(r['timing'][k] for r in runs if r['timing'] and r['timing'].get(k) is not None)
                                for k in tkeys},
               runs=runs)
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    path = out / f"exit_time_{device_slug()}{a.tag}.json"
    path.write_text(json.dumps(res, indent=1) + '\n')
    print(json.dumps(res['median_s'], indent=1)); print(json.dumps(res['timing_median_s'], indent=1)); print(f"wrote {path}")


if __name__ == '__main__':
    main()
