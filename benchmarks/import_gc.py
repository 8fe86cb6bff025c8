"""What the garbage collector costs while `lucid` starts: alternating fresh processes, collector on or paused.

Each child imports the trainer as the `lucid` command does (under `lean_imports`), with Python's collector as it is
(`on`), under `lucid_nb.cli.collector_paused` (`paused`: off during the imports, then what is alive frozen) or off
during the imports and switched back on without the freeze (`unfrozen`, with `--modes`), then
builds the command line's model, data module and `Trainer` without fitting (`cli_main(..., run=False)`). It records
the seconds to the end of the imports and to the built `Trainer`, from the child's first line, and (`unfrozen`) how
many tracked containers the imports made (`gc.get_count()[0]` while the collector was off).

    python benchmarks/import_gc.py --rounds 8 [--modes on,paused,unfrozen] [--config configs/coco128-seg-n-cpu.yaml] [--out benchmarks/results]

Writes `import_gc_<device>.json` (medians, ranges, every run, env) to `--out`.
"""
import argparse, json, statistics, subprocess, sys, tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r'''
import time; T0 = time.perf_counter()
import contextlib, gc, json, sys
from lucid_nb.cli import collector_paused, enable_bytecode_cache, lean_imports
enable_bytecode_cache()
if sys.argv[1] == 'unfrozen': gc.disable()
with lean_imports(), (collector_paused() if sys.argv[1] == 'paused' else contextlib.nullcontext()):
    from lucid_nb.command import cli_main
made = gc.get_count()[0] if sys.argv[1] == 'unfrozen' else None   # containers made since the collector went off
gc.enable()
imports = time.perf_counter() - T0
cli_main(['--config', sys.argv[2], '--trainer.max_steps', '1', '--trainer.logger', 'false',
          '--trainer.default_root_dir', sys.argv[3]], run=False)
print('JSON', json.dumps(dict(mode=sys.argv[1], imports=imports, built=time.perf_counter() - T0, containers_made=made)))
'''


def child(mode: str, config: str) -> dict:
    with tempfile.TemporaryDirectory() as root:
        r = subprocess.run([sys.executable, '-c', CHILD, mode, config, root], capture_output=True, text=True, cwd=ROOT)
    line = [l for l in r.stdout.splitlines() if l.startswith('JSON ')]
    if r.returncode or not line: raise SystemExit(f'{mode} child failed:\n{r.stderr[-3000:]}')
    return json.loads(line[0][5:])


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--rounds', type=int, default=8); p.add_argument('--out', default='benchmarks/results')
    p.add_argument('--config', default=str(ROOT / 'configs' / 'coco128-seg-n-cpu.yaml'))
    p.add_argument('--modes', default='on,paused', help='on, paused, unfrozen (see above), alternated in this order')
    a = p.parse_args(); modes = a.modes.split(',')
    from lucid_nb.core import device_tag, env_info
    child('on', a.config)   # a first process reads every library from disk: not counted
    runs = [dict(child(mode, a.config), round=i) for i in range(a.rounds) for mode in modes]
    summary = {mode: {k: dict(median=statistics.median(r[k] for r in runs if r['mode'] == mode),
                              min=min(r[k] for r in runs if r['mode'] == mode), max=max(r[k] for r in runs if r['mode'] == mode))
                      for k in ('imports', 'built')} for mode in modes}
    res = dict(what='seconds from a child process start to its imports done and to its built Trainer, by collector mode',
               command=' '.join([sys.executable, *sys.argv]), config=a.config, rounds=a.rounds,
               date=datetime.now(timezone.utc).isoformat(timespec='seconds'), env=env_info(), summary=summary, runs=runs)
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    path = out / f'import_gc_{device_tag()}.json'
    path.write_text(json.dumps(res, indent=1))
    for mode, s in summary.items():
        print(f"{mode:>7}: imports {s['imports']['median']:.2f} s ({s['imports']['min']:.2f}-{s['imports']['max']:.2f}), "
              f"built {s['built']['median']:.2f} s ({s['built']['min']:.2f}-{s['built']['max']:.2f})")
    print('->', path)


if __name__ == '__main__':
    main()
