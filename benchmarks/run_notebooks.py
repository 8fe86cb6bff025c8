"""Run notebooks with every cell (`#| cuda` and `#| slow` included) and save their outputs, figures at 1×.

`nbdev-test --save` does the same, but its shell renders matplotlib figures as 2× "retina" PNGs, which made our
notebooks weigh megabytes. This runs nbdev's own `test_nb` in a shell whose figures are plain PNGs at the figure's
own dpi. On the GPU machine (its own torch; missing wheels carried in `.whl/`):

    python3 benchmarks/run_notebooks.py nbs/06_recorder.ipynb nbs/07_metrics.ipynb ...

Each notebook is saved only when every cell passed; the exit status is 1 if any failed.
"""
import sys, time
from pathlib import Path

import nbdev.test
from execnb.shell import CaptureShell


class PlainShell(CaptureShell):
    "nbdev's notebook shell with 1× PNG figures."
    def __init__(self, path=None, mpl_format='png', **kwargs): super().__init__(path, mpl_format=mpl_format, **kwargs)


def main(paths: list) -> int:
    nbdev.test.CaptureShell = PlainShell
    failed = []
    for p in (Path(x).resolve() for x in paths):   # test_nb runs in the notebook's folder
        t = time.perf_counter()
        ok, _ = nbdev.test.test_nb(p, skip_flags=[], force_flags=['cuda', 'slow'], save=True, cell_timeout=900)
        print(f"{'PASSED' if ok else 'FAILED'} {p} ({time.perf_counter() - t:.0f} s)", flush=True)
        if not ok: failed.append(p)
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
