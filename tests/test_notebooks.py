"""Run every notebook in `nbs/` as a test, the way `nbdev-test` does, but against the exported library.

Each exported cell is replaced by an import of everything its module defines, so the lesson and test cells exercise
the code users import (and that code counts towards `--cov=lucid_nb`); all other cells run as written. Cells flagged
with the project's `tst_flags` (`notest slow cuda`) are skipped; set `LUCID_NB_FLAGS="slow cuda"` to run those too
(e.g. on a GPU machine).
"""
import json, os, re
from pathlib import Path

import pytest
from nbdev.config import get_config
from nbdev.test import test_nb as run_notebook

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(p for p in (ROOT / 'nbs').glob('*.ipynb') if not p.name.startswith('_'))
EXPORT = re.compile(r'^#\|[ \t]*export[si]?[ \t]*(\S*)[ \t]*$', re.M)
DEFAULT_EXP = re.compile(r'^#\|[ \t]*default_exp[ \t]+(\S+)[ \t]*$', re.M)


def _import_cell(module: str) -> str:
    return (f"import importlib as _il\n"
            f"globals().update({{k: v for k, v in vars(_il.import_module('lucid_nb.{module}')).items() "
            f"if not k.startswith('__')}})")


def library_notebook(nb: Path) -> Path:
    "A copy of `nb` beside it (nbdev skips names starting with _) whose exported cells import the library instead."
    data = json.loads(nb.read_text())
    src = lambda c: ''.join(c['source'])
    default = next((m.group(1) for c in data['cells'] if c['cell_type'] == 'code' and (m := DEFAULT_EXP.search(src(c)))), None)
    for c in data['cells']:
        m = EXPORT.search(src(c)) if c['cell_type'] == 'code' else None
        if m: c['source'] = _import_cell(m.group(1).removeprefix('lucid_nb.') or default)
    out = nb.with_name(f'_pytest_{nb.name}')
    out.write_text(json.dumps(data))
    return out


def test_notebooks_were_found():
    assert len(NOTEBOOKS) >= 2, f"no notebooks found in {ROOT / 'nbs'}"


@pytest.mark.parametrize('nb', NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook(nb):
    cfg = get_config(ROOT)
    forced = os.environ.get('LUCID_NB_FLAGS', '').split()
    skip = [f for f in cfg.tst_flags.split() if f not in forced]
    copy = library_notebook(nb)
    try: ok, seconds = run_notebook(copy, skip_flags=skip, force_flags=forced, cell_timeout=int(cfg.cell_timeout))
    finally: copy.unlink()
    assert ok, f"{nb.name} failed (its traceback is printed above)"
