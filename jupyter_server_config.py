"""JupyterLab's save hook for this project's notebooks: `.venv/bin/jupyter lab --config=jupyter_server_config.py nbs/`.

Saving a notebook in JupyterLab after a re-run on a machine without CUDA used to do three things the repository does
not want (README, "The notebooks in JupyterLab"):

- every PIL image (`08a_draw`'s drawn batches, `09_predict`'s predictions) is displayed as both a JPEG and a PNG, and
  both were saved: `08a_draw.ipynb` grew from 168 to 810 KB. The committed outputs keep the JPEG only.
- every `#| cuda` cell (GPU measurements, made on a lent GPU) ran as "needs a CUDA GPU — skipped", and its outputs
  were lost. A cell flagged `#| cuda` whose new outputs are only that line (or none) keeps the outputs the file had.
- the notebook's metadata and execution counts changed: the save is cleaned as `nbdev-clean` cleans, so a saved
  notebook is a committable one.

The functions use the standard library only (nbdev's cleaning where nbdev is installed); tests/test_docs_site.py
runs them through jupyter_server's own save.
"""
import json
from pathlib import Path

SKIPPED = 'needs a CUDA GPU — skipped'


def _cuda(cell) -> bool:
    src = cell.get('source', '')
    lines = (src if isinstance(src, str) else ''.join(src)).splitlines()
    return any(l.replace(' ', '').rstrip() == '#|cuda' for l in lines if l.startswith('#|'))


def _skipped(outputs) -> bool:
    "No outputs, or only the line `skip_cuda_cells` prints for a `#| cuda` cell on a machine without CUDA."
    text = ''.join(''.join(o.get('text', '')) for o in outputs if o.get('output_type') == 'stream')
    return all(o.get('output_type') == 'stream' for o in outputs) and text.strip() in ('', SKIPPED)


def keep_gpu_outputs(nb: dict, before: dict | None) -> int:
    "Give each `#| cuda` cell that was skipped the outputs it had in `before` (matched by id, else by source)."
    if not before: return 0
    old = [c for c in before.get('cells', []) if c.get('cell_type') == 'code']
    by_id = {c.get('id'): c for c in old if c.get('id')}
    by_src = {''.join(c['source']) if isinstance(c['source'], list) else c['source']: c for c in old}
    n = 0
    for c in nb.get('cells', []):
        if c.get('cell_type') != 'code' or not _cuda(c) or not _skipped(c.get('outputs', [])): continue
        src = ''.join(c['source']) if isinstance(c['source'], list) else c['source']
        was = by_id.get(c.get('id')) or by_src.get(src)
        if was and was.get('outputs'): c['outputs'] = was['outputs']; n += 1
    return n


def drop_png_twins(nb: dict) -> int:
    "Remove the PNG of every output that also carries a JPEG (a PIL image displays as both); returns how many."
    n = 0
    for c in nb.get('cells', []):
        for o in c.get('outputs', []):
            d = o.get('data', {})
            if 'image/jpeg' in d and 'image/png' in d: del d['image/png']; n += 1
    return n


def clean(nb: dict, folder: Path) -> None:
    "Clean as `nbdev-clean` does, with this project's settings (nothing without nbdev)."
    try:
        from nbdev.clean import clean_nb
        from nbdev.config import get_config
    except ImportError: return
    cfg = get_config(path=folder)
    clean_nb(nb, False, cfg.get('allowed_metadata_keys') or [], cfg.get('allowed_cell_metadata_keys') or [],
             cfg.clean_ids, cfg.get('allowed_out_metadata_keys') or [])


def lucid_pre_save(model, path, contents_manager, **kwargs):
    "jupyter_server's pre-save hook: GPU outputs kept, PNG twins dropped, the notebook cleaned."
    if model.get('type') != 'notebook' or not isinstance(model.get('content'), dict): return
    nb, file = model['content'], Path(contents_manager.root_dir) / path
    try: before = json.loads(file.read_text()) if file.is_file() else None
    except (OSError, ValueError): before = None
    keep_gpu_outputs(nb, before)
    drop_png_twins(nb)
    clean(nb, file.parent)


if 'c' in globals():   # read by jupyter_server as its config file
    c.ContentsManager.pre_save_hook = lucid_pre_save  # noqa: F821
