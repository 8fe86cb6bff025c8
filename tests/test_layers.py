"""No import loops: every module imports only from modules below it, at the top of the file or inside a function, in
any form (`import lucid_nb.x`, `from lucid_nb import x`, `from .x import y`, `importlib.import_module('lucid_nb.x')`),
and the notebooks sort in that order, so each can be read knowing only the ones before it."""
import ast, json, re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / 'lucid_nb'
PACKAGE = 'lucid_nb'
# allocator → core → arguments → tasks → coco → yolo → augment → augment_device → cache → loader → images → data → data_command | model → heads → checkpoints → weights → yolo26 → loss / optim / masks → loss26 → metrics / ema / graphs →
# recorder → draw → messages → run_folder → saving → run_artifacts → trainer → predict → command → cli → testing → showdoc (the docs' renderer)
LAYER = dict(allocator=-1, core=0, arguments=0.25, tasks=0.5, coco=1, yolo=1.1, augment=1.25, augment_device=1.375, cache=1.45, loader=1.5, images=1.6, data=1.75, data_command=1.8, model=1, heads=2, checkpoints=2.25, weights=2.5, yolo26=2.75, loss=3, loss26=3.25, optim=3,
             masks=3, metrics=3.5, ema=3.5, graphs=3.5, recorder=4, draw=4.5, messages=4.6, run_folder=4.65, saving=4.7, run_artifacts=4.75, trainer=5, predict=6,
             command=6.5, cli=7, testing=8, showdoc=9)
IMPORTERS = {'import_module', '__import__'}


def _named(name: str) -> str | None:
    "The package module a dotted name reaches (`lucid_nb.x.y` → `x`); the package itself is `lucid_nb`; others None."
    parts = name.split('.')
    if parts[0] != PACKAGE: return None
    return parts[1] if len(parts) > 1 else PACKAGE


def imported(source: str) -> set:
    "Every module of the package that `source` (a module of the package) imports, in any form and at any depth."
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {_named(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:   # relative: `from .x import y` or `from . import x`
                found |= {node.module.split('.')[0]} if node.module else {a.name for a in node.names}
            elif node.module == PACKAGE:
                found |= {a.name for a in node.names}
            elif node.module:
                found.add(_named(node.module))
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in IMPORTERS and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                target = node.args[0].value
                found.add(target.lstrip('.').split('.')[0] if target.startswith('.') else _named(target))
    return found - {None}


def test_every_import_form_is_read():
    forms = {'import lucid_nb': PACKAGE, 'import lucid_nb.trainer as t': 'trainer', 'from lucid_nb import trainer': 'trainer',
             'from lucid_nb.trainer import x': 'trainer', 'from . import trainer': 'trainer', 'from .trainer import x': 'trainer',
             "import importlib\nimportlib.import_module('lucid_nb.trainer')": 'trainer',
             "from importlib import import_module\nimport_module('.trainer', 'lucid_nb')": 'trainer',
             "def f():\n    import lucid_nb.trainer": 'trainer', "__import__('lucid_nb.trainer')": 'trainer'}
    for src, module in forms.items(): assert imported(src) == {module}, src
    assert imported('import os, torch\nfrom pathlib import Path') == set()


def test_every_import_goes_down():
    found = {p.stem: imported(p.read_text()) for p in PKG.glob('*.py') if p.stem in LAYER}
    assert found.keys() == LAYER.keys(), f"modules without a layer: {sorted(set(p.stem for p in PKG.glob('*.py')) - LAYER.keys() - {'__init__', '_modidx'})}"
    up = [f"{m} imports {d}" for m, deps in found.items() for d in sorted(deps - {m})
          if d == PACKAGE or LAYER.get(d, float('inf')) >= LAYER[m]]
    assert not up, up


def notebook_of() -> dict:
    "Each module's notebook (by its `#| default_exp`)."
    out = {}
    for nb in sorted((ROOT / 'nbs').glob('[0-9]*.ipynb')):
        for cell in json.loads(nb.read_text())['cells']:
            m = re.search(r'^#\|\s*default_exp\s+(\S+)', ''.join(cell['source']), re.M)
            if m: out[m.group(1)] = nb.name; break
    return out


def test_notebooks_sort_in_layer_order():
    nbs = notebook_of()
    assert set(nbs) == LAYER.keys(), sorted(set(nbs) ^ LAYER.keys())
    late = [f"{nbs[m]} ({m}) imports {d}, whose {nbs[d]} sorts after it" for m in LAYER
            for d in imported((PKG / f'{m}.py').read_text()) - {m, PACKAGE} if nbs[d] > nbs[m]]
    assert not late, late


def test_no_module_imports_another_modules_private_name():
    "A name another module needs is public (`from .x import _y` hides a dependency the docs and `__all__` miss)."
    private = [f"{p.stem} imports {node.module}.{a.name}" for p in sorted(PKG.glob('*.py'))
               for node in ast.walk(ast.parse(p.read_text())) if isinstance(node, ast.ImportFrom) and node.level
               for a in node.names if a.name.startswith('_') and not a.name.startswith('__')]
    assert not private, private
