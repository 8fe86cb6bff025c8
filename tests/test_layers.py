"""No import loops: every module imports only from modules below it (allocator → core → coco → augment → loader → data | model →
heads → loss / metrics / optim → recorder → trainer → predict → cli), at the top of the file or inside a function."""
import re
from pathlib import Path

LAYER = dict(allocator=-1, core=0, coco=1, augment=1.25, loader=1.5, data=1.75, model=1, heads=2, loss=3, metrics=3, optim=3, graphs=3.5, recorder=4, trainer=5, predict=6, cli=7, testing=8)
PKG = Path(__file__).resolve().parent.parent / 'lucid_nb'


def imports(path: Path) -> set:
    text = path.read_text()
    return set(re.findall(r'^\s*from (?:lucid_nb)?\.?(\w+) import', text, re.M)) & LAYER.keys() - {path.stem}


def test_every_import_goes_down():
    found = {p.stem: imports(p) for p in PKG.glob('*.py') if p.stem in LAYER}
    assert found.keys() == LAYER.keys()
    up = [f"{m} imports {d}" for m, deps in found.items() for d in deps if LAYER[d] >= LAYER[m]]
    assert not up, up
