"""Start-up with and without the optional packages Lightning's torchmetrics imports when they are installed.

`import lightning` imports torchmetrics, and torchmetrics imports transformers, scipy.signal and torchvision at once
whenever they are installed, though `lucid` uses none of them. A machine image with them (the lent H200's) pays
seconds for that at every start; an environment holding only lucid_nb's dependencies does not. This measures both
on one machine, in alternating separate processes of a 1-epoch reference fit, from the same installed files:

    full   this interpreter as it is
    lean   a virtual environment (no pip, no system site-packages) whose site-packages links every entry of this
           interpreter's site-packages and `sys.path` folders except the files of the left-out distributions

    python benchmarks/startup_lean.py --rounds 3 --out benchmarks/results [--leave-out transformers scipy torchvision]

It checks first that no distribution lucid_nb needs (pyproject's requirements, followed through theirs) is left out, and
writes `startup_lean_<device>.json`: per run the `timing.json` start-up (process start to the first training step),
the whole process and the modules imported; the summary gives the medians.
"""
import argparse, importlib.metadata as md, json, os, re, site, statistics, subprocess, sys, tempfile, time, tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LUCID = 'import sys; from lucid_nb.cli import main; sys.argv[0] = "lucid"; main()'
PROBE = 'import sys, lightning.pytorch; print("MODULES", " ".join(m for m in ("transformers", "scipy", "torchvision") if m in sys.modules))'


def name_of(req: str) -> str: return re.split(r'[\s;\[<>=!~(]', req.strip(), maxsplit=1)[0].lower().replace('_', '-')


def needed(top: str) -> set:
    "Names of the installed distributions `top` needs, followed through their requirements (extras and markers not taken)."
    seen, todo = set(), [top]
    while todo:
        n = todo.pop()
        if n in seen: continue
        try: dist = md.distribution(n)
        except md.PackageNotFoundError: continue
        seen.add(n)
        todo += [name_of(r) for r in dist.requires or [] if 'extra ==' not in r]
    return seen


def left_out_paths(names: list) -> set:
    "Top-level entries (package folders, modules, .dist-info) of the named installed distributions."
    out = set()
    for n in names:
        try: dist = md.distribution(n)
        except md.PackageNotFoundError: continue
        base = Path(str(dist.locate_file(''))).resolve()
        for f in dist.files or []:
            path = Path(str(dist.locate_file(f))).resolve()
            if path.is_relative_to(base): out.add(path.relative_to(base).parts[0])   # not its scripts in bin/
    return out


def make_lean(folder: Path, leave_out: list) -> Path:
    "A venv in `folder` whose site-packages links everything importable here except `leave_out`'s files."
    subprocess.run([sys.executable, '-m', 'venv', '--without-pip', str(folder)], check=True)
    target = next(folder.glob('lib/python*/site-packages'))
    skip = left_out_paths(leave_out) | {'__pycache__'}
    extra = [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]   # e.g. wheels installed with --target
    sources = [Path(p) for p in [*site.getsitepackages(), site.getusersitepackages(), *extra]]
    for src in [s for s in sources if s.is_dir() and s.resolve() != ROOT]:
        for entry in Path(src).iterdir():
            if entry.name in skip or (target / entry.name).exists(): continue
            (target / entry.name).symlink_to(entry)
    return folder / 'bin' / 'python'


def one_run(python: str, out: Path, env: dict, config: str) -> dict:
    out.mkdir(parents=True)
    logger = json.dumps({'class_path': 'lightning.pytorch.loggers.CSVLogger', 'init_args': {'save_dir': str(out), 'name': 'run', 'version': ''}})
    args = [python, '-c', LUCID, 'fit', '--config', config, '--trainer.max_epochs', '1',
            '--trainer.logger', logger, '--trainer.enable_progress_bar', 'false']
    t0 = time.perf_counter(); r = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env); wall = time.perf_counter() - t0
    if r.returncode: raise SystemExit(f'{python} fit failed:\n{r.stderr[-3000:]}')
    t = json.loads((out / 'run' / 'timing.json').read_text())
    probe = subprocess.run([python, '-c', PROBE], capture_output=True, text=True, cwd=ROOT, env=env).stdout
    return dict(startup_seconds=t['startup_seconds'], process_start_to_fit_start=t['process_start_to_fit_start'],
                process_seconds=wall, optional_modules_imported=probe.split('MODULES', 1)[-1].split())


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--rounds', type=int, default=3); p.add_argument('--out', default='benchmarks/results')
    p.add_argument('--config', default=str(ROOT / 'configs' / 'coco128-seg-n.yaml'))
    p.add_argument('--leave-out', nargs='*', default=['transformers', 'scipy', 'torchvision'])
    a = p.parse_args()
    reqs = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']['dependencies']
    needs = set().union(*(needed(name_of(r)) for r in reqs))
    clash = needs & {n.lower() for n in a.leave_out}
    if clash: raise SystemExit(f'lucid_nb needs {sorted(clash)}: not left out')
    sys.path.insert(0, str(ROOT)); from lucid_nb.core import device_tag, env_info
    work = Path(tempfile.mkdtemp(prefix='startup_lean_'))
    lean = make_lean(work / 'venv', a.leave_out)
    env = dict(os.environ, PYTHONPATH=str(ROOT))   # the checkout itself; nothing else from outside the venv
    warm = 'from lucid_nb.cli import enable_bytecode_cache; enable_bytecode_cache(); import lucid_nb.command, lucid_nb.recorder'
    subprocess.run([str(lean), '-c', warm], check=True, cwd=ROOT, env=env)   # the venv's paths: their bytecode cached once
    runs = []
    for k in range(a.rounds):
        for arm, py in (('full', sys.executable), ('lean', str(lean))):
            r = dict(arm=arm, round=k, **one_run(py, work / f'{arm}{k}', env if arm == 'lean' else dict(os.environ), a.config))
            print(f"round {k} {arm}: start-up {r['startup_seconds']:.2f} s, process {r['process_seconds']:.1f} s, "
                  f"optional modules imported: {' '.join(r['optional_modules_imported']) or 'none'}", flush=True)
            runs.append(r)
    med = {arm: {k: statistics.median(r[k] for r in runs if r['arm'] == arm) for k in ('startup_seconds', 'process_seconds')}
           for arm in ('full', 'lean')}
    res = dict(what=__doc__.splitlines()[0], left_out=a.leave_out, lucid_nb_needs=sorted(needs), rounds=a.rounds,
               summary=med, runs=runs, env=env_info(), date=time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()))
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    path = out / f'startup_lean_{device_tag()}.json'; path.write_text(json.dumps(res, indent=1))
    print('median start-up: full %.2f s, lean %.2f s ->' % (med['full']['startup_seconds'], med['lean']['startup_seconds']), path)


if __name__ == '__main__': main()
