"""Run notebooks with every cell (`#| cuda` and `#| slow` included) and save their outputs, figures at 1×.

`nbdev-test --save` does the same, but its shell renders matplotlib figures as 2× "retina" PNGs, which made our
notebooks weigh megabytes. This runs nbdev's own `test_nb` in a shell whose figures are plain PNGs at the figure's
own dpi. On the GPU machine (its own torch; missing wheels carried in `.whl/`):

    python3 benchmarks/run_notebooks.py nbs/06c_recorder_results.ipynb nbs/07b_metrics.ipynb ...

Each notebook is saved only when every cell passed (an output that is both a JPEG and a PNG, as PIL images are,
keeps only the JPEG); the exit status is 1 if any failed. With `--keep-cuda` (and `--keep-slow`)
(e.g. on a CPU machine after editing prose or a cell that reads committed results) the `#| cuda` (`#| slow`) cells
are not run and keep the outputs they have.
"""
import json, sys, time
from pathlib import Path

import nbdev.test
from execnb.shell import CaptureShell


class PlainShell(CaptureShell):
    "nbdev's notebook shell with 1× PNG figures."
    def __init__(self, path=None, mpl_format='png', **kwargs): super().__init__(path, mpl_format=mpl_format, **kwargs)


def drop_png_twins(path: Path) -> int:
    "Remove the PNG of every output that also carries a JPEG (PIL images display as both); returns bytes saved."
    text = path.read_text(); nb = json.loads(text)
    for c in nb['cells']:
        for o in c.get('outputs', []):
            d = o.get('data', {})
            if 'image/jpeg' in d and 'image/png' in d: del d['image/png']
    new = json.dumps(nb, indent=1, ensure_ascii=False) + '\n'
    path.write_text(new)
    return len(text) - len(new)


def main(paths: list) -> int:
    nbdev.test.CaptureShell = PlainShell
    kept = [f for f in ('cuda', 'slow') if f'--keep-{f}' in paths]     # flags whose cells keep the outputs they have
    failed = []
    for p in (Path(x).resolve() for x in paths if not x.startswith('--keep-')):   # test_nb runs in the notebook's folder
        t = time.perf_counter()
        ok, _ = nbdev.test.test_nb(p, skip_flags=kept, force_flags=[f for f in ('cuda', 'slow') if f not in kept],
                                   save=True, cell_timeout=900)
        if ok: drop_png_twins(p)
        print(f"{'PASSED' if ok else 'FAILED'} {p} ({time.perf_counter() - t:.0f} s)", flush=True)
        if not ok: failed.append(p)
    return 1 if failed else 0


if __name__ == '__main__':
    if not sys.argv[1:] or {'-h', '--help'} & set(sys.argv[1:]): print(__doc__); sys.exit(0)
    sys.exit(main(sys.argv[1:]))
