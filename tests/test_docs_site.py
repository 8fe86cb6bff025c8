"""The docs site and the notebooks in JupyterLab (issue 59, items 7 and 8): `.ci/docs_site.py`'s prepare and check
steps on small sites made here, JupyterLab's save hook (`jupyter_server_config.py`) through jupyter_server's own save,
and what this checkout's notebooks must carry: a kernelspec, README's commands, the reference run README cites."""
import importlib.util, json, re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
URL = 'https://lucid-nb.github.io/lucid_nb/'


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    return mod


site = _load('docs_site', ROOT / '.ci' / 'docs_site.py')
hook = _load('jupyter_server_config', ROOT / 'jupyter_server_config.py')


def html_page(path: Path, body: str, head: str = ''):
    path.write_text(f'<!DOCTYPE html><html><head>{head}</head><body>{body}</body></html>')


def test_check_finds_dead_links_and_anchors(tmp_path):
    (tmp_path / 'site_libs').mkdir(); (tmp_path / 'site_libs' / 'x.css').write_text('')
    html_page(tmp_path / 'index.html', '<h2 id="top">A</h2><a href="model.html#conv">ok</a> <a href="model.html#gone">1</a>'
              f' <a href="missing.html">2</a> <a href="{URL}model.html#conv">ok</a> <a href="{URL}nope.html">3</a>'
              ' <a href="https://example.com/x.html#q">external</a> <a href="#top">ok</a> <a href="#bottom">4</a>'
              ' <img src="images/x.png"> <a href="../outside.html">5</a>', head='<link href="site_libs/x.css" rel="stylesheet">')
    html_page(tmp_path / 'model.html', '<section id="conv"><h3 data-anchor-id="conv">Conv</h3></section><a name="old">x</a>'
              '<a href="index.html#top">ok</a> <a href="#old">ok</a>')
    assert site.check_site(tmp_path, URL) == [
        'index.html: dead anchor: model.html#gone', 'index.html: dead link: missing.html',
        f'index.html: dead link: {URL}nope.html', 'index.html: dead anchor: #bottom', 'index.html: dead link: images/x.png',
        'index.html: link outside the site: ../outside.html']
    (tmp_path / 'images').mkdir(); (tmp_path / 'images' / 'x.png').write_bytes(b'')
    assert len(site.check_site(tmp_path, URL)) == 5
    assert site.check_site(tmp_path / 'images', URL) == [f'{tmp_path / "images"}: no pages (did the build fail?)']


def test_check_finds_warnings_tracebacks_and_machine_paths(tmp_path):
    R, H = 'root', 'home'   # folders of the examples below, written apart so that this file names no machine path
    html_page(tmp_path / 'metrics.html', '<pre><code>/opt/venv/lib/python3.12/site-packages/fastcore/docments.py:499:'
              ' UserWarning: docments unavailable</code></pre><p>Results saved to /tmp/tmp9um2zhfh/runs/tiny</p>')
    html_page(tmp_path / 'optim.html', '<pre>&lt;ipython-input-30-02cce8e3063f&gt;:25: UserWarning: Detected call</pre>'
              '<pre>Traceback (most recent call last):\n  File "x"</pre>')
    html_page(tmp_path / 'prose.html', '<p>a <code>UserWarning</code> from site-packages is nothing a user can act on; '
              f'https://example.com/{H}/x and ~/tmp/ and runs/tmp/x are not machine paths</p>'
              f'<script>const p = "/{R}/x"</script><style>/* /{H}/x */</style>')
    html_page(tmp_path / 'predict.html', '<pre>python3 -m venv /tmp/ulvenv &amp;&amp; /tmp/ulvenv/bin/pip install x</pre>')
    assert [b.split(' rendered')[0] for b in site.check_site(tmp_path)] == [
        'metrics.html: a warning', 'metrics.html: a machine path', 'optim.html: a warning', 'optim.html: a traceback']
    assert '(3x)' in site.check_site(tmp_path)[1] and '/opt/venv/lib' in site.check_site(tmp_path)[1]
    assert [k[0] for k in site.KEPT] == ['predict.html']   # kept, with its reason: a command's scratch venv


def notebook(path: Path, *cells: dict):
    path.write_text(json.dumps(dict(cells=list(cells), metadata={}, nbformat=4, nbformat_minor=5)))


def raw(s): return dict(cell_type='raw', metadata={}, source=s)
def md(s): return dict(cell_type='markdown', metadata={}, source=s)
def code(s, *outputs): return dict(cell_type='code', metadata={}, source=s, outputs=list(outputs), execution_count=None)
def markdown_output(s): return dict(output_type='execute_result', metadata={}, execution_count=None, data={'text/markdown': s})


def test_prepare_names_pages_relinks_and_folds(tmp_path):
    proc, nbs = tmp_path / '_proc', tmp_path / 'nbs'
    proc.mkdir(); nbs.mkdir()
    (nbs / 'nbdev.yml').write_text(f'website:\n  site-url: "{URL.rstrip("/")}"\n')
    (proc / '_quarto.yml').write_text('format:\n  html:\n    code-fold: true   # the project folds\n')
    (proc / 'sidebar.yml').write_text('website:\n  sidebar:\n    contents:\n      - index.ipynb\n      - section: Parts\n'
                                      '        contents:\n          - 02_model.ipynb\n          - 04_loss.ipynb\n')
    notebook(proc / '02_model.ipynb', raw('---\noutput-file: model.html\ntitle: Model\n---\n'),
             md('See [`04_loss`](04_loss.ipynb) and [the loss](04_loss.html#dfl).'),
             code('#| echo: false\n#| output: asis\nshow_doc(Conv)', markdown_output('---\n\n### Conv {#conv}\n\n```python\n# x\n```')),
             code('#| echo: false\n#| output: asis\nshow_doc(_f)', markdown_output('### \\_f {#_f}')),
             code('x = 1\nx'), code('#| code-fold: show\ny = 2'), code('#| include: false\nz = 3'), code('#| hide\n'))
    notebook(proc / '04_loss.ipynb', raw('---\noutput-file: loss.html\n---\n'),
             md(f'[`Conv`]({URL}model.html#conv), [`Conv.forward`]({URL}model.html#conv.forward), '
                f'[`_private`]({URL}model.html#_private), [`_f`]({URL}model.html#_f), [text]({URL}model.html#nowhere)\n\n'
                '## DFL\n\nThe term.'))
    notebook(proc / 'index.ipynb', raw('---\ncode-fold: false\noutput-file: index.html\n---\n'), code('import lucid_nb'))
    line = site.prepare(proc, nbs)
    assert line.split('\n')[0].endswith('1 go to their class, 1 (private names) are left as code; 1 code cells fold'), line
    assert line.split('\n')[1].startswith('docs: folded as long: 1 API entries'), line
    assert sorted(p.name for p in proc.glob('*.ipynb')) == ['index.ipynb', 'loss.ipynb', 'model.ipynb']
    cells = json.loads((proc / 'model.ipynb').read_text())['cells']
    assert 'output-file' not in ''.join(cells[0]['source']) and 'title: Model' in ''.join(cells[0]['source'])
    assert cells[1]['source'] == 'See [`04_loss`](loss.ipynb) and [the loss](loss.html#dfl).'
    assert [c['source'].split('\n')[:2] for c in cells[4:6]] == [['#| code-fold: true', 'x = 1'], ['#| code-fold: show', 'y = 2']]
    assert cells[2]['source'].startswith('#| echo: false\n#| output: asis\nshow_doc') and cells[6]['source'] == '#| include: false\nz = 3'
    assert json.loads((proc / 'loss.ipynb').read_text())['cells'][1]['source'] == (
        '[`Conv`](model.html#conv), [`Conv.forward`](model.html#conv), `_private`, [`_f`](model.html#_f), '
        '[text](model.html#nowhere)\n\n## DFL\n\nThe term.')   # text that is not a symbol's code keeps its link: check flags it
    assert json.loads((proc / 'index.ipynb').read_text())['cells'][1]['source'] == 'import lucid_nb'   # the page opts out
    assert '- model.ipynb\n          - loss.ipynb' in (proc / 'sidebar.yml').read_text()
    notebook(proc / '01_model.ipynb', raw('---\noutput-file: model.html\n---\n'))
    try: site.prepare(proc, nbs); raise AssertionError('two pages named model')
    except SystemExit as e: assert 'two pages would be named model' in str(e)


def test_long_parts_fold_under_a_summary_line():
    "An API entry keeps its heading (and anchor) and docstring in view; long tables and outputs fold; short ones stay."
    entry = ('---\n\n### in\\_boxes {#in_boxes}\n\n```python\ndef in_boxes(a, b)->T:\n```\n\n*Anchor centres.*\n\n'
             '<details class="params">\n<summary>2 parameters</summary>\n\n| Parameter | Details |\n|---|---|\n'
             '| `a` | x |\n| `b` | y |\n| **Returns** `T` | z |\n\n</details>')
    out = site.fold_api(entry)
    summary, body = out.split('</summary>')
    assert summary.startswith('<details class="api">\n<summary>') and '### in\\_boxes {#in_boxes}' in summary
    assert '*Anchor centres.*' in summary and 'signature, 2 parameters and what it returns' in summary
    assert 'def in_boxes' in body and '| `b` | y |' in body and 'details class="params"' not in body
    assert site.fold_api('Some **Markdown** result') is None
    table = '| a | b |\n|---|---|\n' + ''.join(f'| {i} | `x` |\n' for i in range(9))
    text, n = site.fold_tables(f'Before.\n\n{table}\nAfter.')
    assert n == 1 and '<summary>a table of 9 rows (a · b)</summary>' in text and text.endswith('After.')
    assert site.fold_tables('| a |\n|---|\n| 1 |\n') == ('| a |\n|---|\n| 1 |\n', 0)
    assert site.fold_tables(f'```\n{table}```\n')[1] == 0   # a table in a code block is code
    long = dict(output_type='stream', name='stdout', text=[f'epoch {i}\n' for i in range(13)])
    f = site.fold_output(long)
    assert f['output_type'] == 'display_data' and '<summary>13 lines of output<code>epoch 0</code>' in f['data']['text/html']
    assert site.fold_output(dict(output_type='stream', name='stdout', text='one\ntwo\n')) is None
    nb = dict(cells=[md(':::: {.callout-note collapse="true"}'), code('x', long), md('::::'), code('y', long)])
    assert site.fold_long(nb) == dict(entries=0, tables=0, outputs=1)   # the one in a collapsed callout is folded already
    assert nb['cells'][1]['outputs'][0] is long and nb['cells'][3]['outputs'][0]['output_type'] == 'display_data'


def test_the_height_estimate_leaves_out_what_folds_hide(tmp_path):
    "CI has no browser: the page-length check estimates a page's height from its HTML, closed folds left out."
    para = '<p>' + 'word ' * 160 + '</p>'   # 800 characters: 10 lines of 24 px and a margin
    open_page, folded = f'<main>{para}</main>', f'<main><details><summary>More</summary>{para * 50}</details></main>'
    assert site.Height(open_page).px == 10 * 24 + 16 and site.Height(folded).px == 24 + 12
    assert site.Height(f'<main>{para * 50}</main>').px == 50 * 256
    html_page(tmp_path / 'long.html', f'<main>{para * 50}</main>'); html_page(tmp_path / 'short.html', open_page)
    assert site.screens(tmp_path) == {'long.html': 16.4, 'short.html': 0.7}
    assert site.check_screens(tmp_path) == ['long.html: about 16.4 screens, over 10 (fold or split it: issue 59)']


def test_every_notebook_names_the_python3_kernel():
    "JupyterLab opens a notebook without a kernelspec with a 'Select Kernel' dialog."
    want = {'display_name': 'python3', 'language': 'python', 'name': 'python3'}
    assert {p.name: json.loads(p.read_text())['metadata'].get('kernelspec') for p in sorted((ROOT / 'nbs').glob('*.ipynb'))
            if json.loads(p.read_text())['metadata'].get('kernelspec') != want} == {}


def _gpu_notebook(cuda_out: str, image: dict, count=None) -> dict:
    cell = lambda i, s, outs: dict(cell_type='code', id=i, metadata={}, source=s, outputs=outs, execution_count=count)
    stream = lambda t: dict(output_type='stream', name='stdout', text=t)
    return dict(nbformat=4, nbformat_minor=5, metadata=dict(kernelspec=dict(display_name='Python 3 (ipykernel)', language='python',
                name='python3'), language_info=dict(name='python')),
                cells=[cell('a1', '#| cuda\nprint(env_card())', [stream(cuda_out)]),
                       cell('b2', 'show(img)', [dict(output_type='display_data', metadata={}, data=image)]),
                       cell('c3', '#| slow\nprint(1)', [stream('1\n')])])


@pytest.mark.filterwarnings('ignore:Overriding existing pre_save_hook')   # jupyter_server sets a configured hook twice
def test_save_hook_keeps_gpu_outputs_drops_png_twins_and_cleans(tmp_path):
    "The hook as JupyterLab runs it: jupyter_server reads the config file, and its contents manager saves the notebook."
    import nbformat
    from traitlets.config.loader import PyFileConfigLoader
    from jupyter_server.services.contents.filemanager import FileContentsManager
    from lucid_nb.core import cuda_cell_skipped
    assert hook.SKIPPED in cuda_cell_skipped(['#| cuda\n', 'x\n'])[0]   # the line a skipped cell prints, as the hook knows it
    (tmp_path / 'pyproject.toml').write_text((ROOT / 'pyproject.toml').read_text())   # nbdev's settings for the clean
    committed = _gpu_notebook('NVIDIA H200 | torch 2.11.0+cu130\n', {'image/jpeg': '/9j/4AAQ', 'text/plain': '<PIL.Image>'})
    (tmp_path / 'n.ipynb').write_text(json.dumps(committed))
    rerun = _gpu_notebook(hook.SKIPPED + '\n', {'image/jpeg': '/9j/4AAQ', 'image/png': 'iVBORw0K', 'text/plain': '<PIL.Image>'}, 3)
    rerun['cells'][2]['source'] = '#| slow\nprint(2)'
    cfg = PyFileConfigLoader('jupyter_server_config.py', path=str(ROOT)).load_config()
    cm = FileContentsManager(config=cfg, root_dir=str(tmp_path))
    cm.save(dict(type='notebook', format='json', content=nbformat.from_dict(rerun)), 'n.ipynb')
    saved = json.loads((tmp_path / 'n.ipynb').read_text())
    assert ''.join(saved['cells'][0]['outputs'][0]['text']) == 'NVIDIA H200 | torch 2.11.0+cu130\n'   # the GPU's outputs, kept
    assert sorted(saved['cells'][1]['outputs'][0]['data']) == ['image/jpeg', 'text/plain']  # one format
    assert ''.join(saved['cells'][2]['source']) == '#| slow\nprint(2)' and saved['cells'][2]['execution_count'] is None
    assert saved['metadata'] == {'kernelspec': {'display_name': 'python3', 'language': 'python', 'name': 'python3'}}
    ran = _gpu_notebook('NVIDIA H100 | torch 2.11.0\n', {'image/jpeg': '/9j/4AAQ'})   # a run on a GPU replaces them
    assert hook.keep_gpu_outputs(ran, saved) == 0 and ran['cells'][0]['outputs'][0]['text'].startswith('NVIDIA H100')


def _joined(text: str) -> str: return re.sub(r'\\\n\s*', '', text)


def _shell_lines(markdown: str) -> list:
    "The commands of a Markdown text's sh blocks, each wrapped command as one line, comments left out."
    blocks = re.findall(r'```sh\n(.*?)```', markdown, re.S)
    return [l.split('  #')[0].strip() for b in blocks for l in _joined(b).splitlines() if l.strip() and not l.startswith('#')]


def test_the_index_page_gives_readmes_commands():
    "README and the site's first page agree: each command of the index is README's, as CI runs it (wrapped or not)."
    readme = (ROOT / 'README.md').read_text()
    index = '\n'.join(''.join(c['source']) for c in json.loads((ROOT / 'nbs' / 'index.ipynb').read_text())['cells']
                      if c['cell_type'] == 'markdown')
    ours = _shell_lines(readme)
    theirs = [l for l in _shell_lines(index) if '--data.predict_images my_images/' not in l]   # the page's reader: own images
    assert len(theirs) >= 6 and [l for l in theirs if l not in ours] == []


def test_the_recorder_results_page_shows_the_reference_run_readme_cites():
    "One source: the recorder results page reads the series README's Measured table names and shows that table."
    readme = (ROOT / 'README.md').read_text()
    tag = re.search(r'benchmarks/results/reference_run_b\{4,16\}_nvidia-h200_(\w+)\.json', readme).group(1)
    for b in (4, 16): assert (ROOT / 'benchmarks' / 'results' / f'reference_run_b{b}_nvidia-h200_{tag}.json').is_file()
    cells = json.loads((ROOT / 'nbs' / '06c_recorder_results.ipynb').read_text())['cells']
    cell = next(c for c in cells if c['cell_type'] == 'code' and 'LATEST =' in ''.join(c['source']))
    assert "read_text().split('reference_run_b{4,16}_nvidia-h200')" in ''.join(cell['source'])
    first = ''.join(cell['outputs'][0]['data']['text/markdown'])
    assert f'| batch 4, {tag} |' in first and f'| batch 16, {tag} |' in first, 'rerun the cell: README cites another series'


def test_the_screenshots_beside_the_check_are_small_jpegs():
    "`.ci/docs_site.py shots` made them from a headless browser: the index, a parameters table, a page with a figure."
    shots = {name: ROOT / 'nbs' / 'images' / 'docs' / name for name, *_ in site.SHOTS}
    assert all(p.read_bytes()[:3] == b'\xff\xd8\xff' for p in shots.values())
    assert sum(p.stat().st_size for p in shots.values()) < 400_000
