"""`.ci/house.py`: the house rules CI checks (sidebar, benchmarks' budget, export cells' length, the documents' budgets,
long lines and `;` joins, machine paths), on small folders made here and on this checkout."""
import importlib.util, json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location('house', ROOT / '.ci' / 'house.py')
house = importlib.util.module_from_spec(spec); spec.loader.exec_module(house)


def notebook(path: Path, *sources: str):
    cells = [dict(cell_type='code', source=s, metadata={}, outputs=[], execution_count=None) for s in sources]
    path.write_text(json.dumps(dict(cells=cells, metadata={}, nbformat=4, nbformat_minor=5)))


def test_sidebar_lists_pages_only(tmp_path):
    for name in ('index.ipynb', '01_a.ipynb', '_scratch.ipynb'): notebook(tmp_path / name)
    (tmp_path / 'sidebar.yml').write_text('website:\n  sidebar:\n    contents:\n      - index.ipynb\n      - sidebar.yml\n'
                                          '      - section: images\n        contents:\n          - images/x.png\n')
    assert house.check_sidebar(tmp_path) == [f'{tmp_path}/sidebar.yml lists sidebar.yml, which is not a notebook page',
                                             f'{tmp_path}/sidebar.yml lists images/x.png, which is not a notebook page',
                                             f'{tmp_path}/sidebar.yml leaves out 01_a.ipynb']
    (tmp_path / 'sidebar.yml').write_text('website:\n  sidebar:\n    contents:\n      - index.ipynb\n      - 01_a.ipynb\n')
    assert house.check_sidebar(tmp_path) == []


def test_benchmark_budget_counts_experiments_not_common(tmp_path):
    (tmp_path / 'results').mkdir(); (tmp_path / 'experiments').mkdir()
    for name in ('common.py', 'a.py', 'b.sh', 'README.md', 'experiments/c.py'): (tmp_path / name).write_text('')
    for i in range(house.MAX_RESULTS): (tmp_path / 'results' / f'r{i}.json').write_text('{}')
    assert house.benchmark_scripts(tmp_path) == ['a.py', 'b.sh', 'experiments/c.py']
    assert house.check_benchmarks(tmp_path) == []
    (tmp_path / 'results' / 'one_more.log').write_text('')
    for i in range(house.MAX_SCRIPTS - 2): (tmp_path / f's{i}.py').write_text('')
    bad = house.check_benchmarks(tmp_path)
    assert len(bad) == 2 and bad[0].startswith(f'{house.MAX_SCRIPTS + 1} scripts') and 'over 40' in bad[1]


def test_export_cells_counted_without_directives(tmp_path):
    long = '#| export\n' + 'def f():\n' + '    x = 1\n' * 60 + '\n\n'
    notebook(tmp_path / 'n.ipynb', '#| export\ndef g(): pass', long, 'def not_exported():\n' + 'pass\n' * 99, '#| exports\nclass C: pass\n')
    assert house.export_cell_lengths(tmp_path / 'n.ipynb') == [(0, 1, 'g'), (1, 61, 'f'), (3, 1, 'C')]
    assert house.check_cells(tmp_path) == [f'{tmp_path}/n.ipynb: cell 1 (f) is an export cell of 61 lines, over 60']


def _documents(root: Path, readme: int = 100, bench: str = 'x\n', changelog: str = '- one line\n'):
    (root / 'benchmarks').mkdir(exist_ok=True)
    (root / 'README.md').write_text('x' * readme); (root / 'benchmarks' / 'README.md').write_text(bench)
    (root / 'CHANGELOG.md').write_text('# Changelog\n\n## [0.2.0] - 2026-12-07\n\n### Added\n' + changelog)


def test_documents_fail_over_their_budgets(tmp_path):
    _documents(tmp_path, changelog='- one line\n- two\n  lines\n- three\n  lines\n  here\n- another\n')
    assert house.changelog_entries((tmp_path / 'CHANGELOG.md').read_text()) == [
        (6, ['- one line']), (7, ['- two', '  lines']), (9, ['- three', '  lines', '  here']), (12, ['- another'])]
    assert house.check_documents(tmp_path) == ['CHANGELOG.md:9 is an entry of 3 lines, over 2']
    _documents(tmp_path, readme=house.MAX_DOC_BYTES + 1, bench='ok\n' + 'y' * 301 + '\n', changelog='- ' + 'z' * 119 + '\n')
    assert house.check_documents(tmp_path) == [f'README.md is 15,001 bytes, over 15,000: link to the details, do not repeat them',
                                               'benchmarks/README.md:2 is 301 characters, over 300',
                                               'CHANGELOG.md:6 is 121 characters, over 120']
    _documents(tmp_path, readme=house.MAX_DOC_BYTES, bench='y' * 300 + '\n', changelog='- ' + 'z' * 118 + '\n')
    assert house.check_documents(tmp_path) == []
    (tmp_path / 'README.md').write_text('# lucid_nb\n## The first hour\n```sh\n# not a heading\n```\n[a](#the-first-hour) '
                                        '[b](benchmarks/README.md) [c](#not-a-heading) [d](gone.md) [e](https://x.org/y#z)\n'
                                        '[f](benchmarks/README.md#current-figures)')
    (tmp_path / 'benchmarks' / 'README.md').write_text('# Benchmarks\n## Current figures\n[back](../README.md#lucid_nb)\n')
    assert house.check_documents(tmp_path) == ['README.md:6: dead anchor: #not-a-heading', 'README.md:6: dead link: gone.md']


def test_semicolon_joins_spare_guards_and_line_ends():
    src = ('a = 1; b = 2\n'                        # a join
           'if a: b = 3; return\n'                 # a one-line guard
           'if a: b = 3; c = 4\n'                  # not a guard: nothing leaves
           "s = 'x; y'  # c; d\n"                 # in a string and a comment
           'plt.plot(a);\n'                       # a notebook's output suppressed
           '%time x = 1; y = 2\n'                  # IPython
           'for i in a:\n    if i: continue; x\n'  # the guard's last statement must leave
           'while a:\n    if a: a -= 1; break\n')
    assert house.semicolon_joins(src) == [1, 3, 8]


def test_line_figures_count_library_and_unexported_cells(tmp_path, capsys):
    (tmp_path / 'lucid_nb').mkdir(); (tmp_path / 'nbs').mkdir()
    (tmp_path / 'lucid_nb' / 'm.py').write_text('x = 1; y = 2\n\n' + 'z = "' + 'w' * 100 + '"\n')
    (tmp_path / 'lucid_nb' / '_modidx.py').write_text('d = "' + 'w' * 200 + '"\n')   # generated: not counted
    notebook(tmp_path / 'nbs' / 'n.ipynb', '#| export\nx = 1; y = 2', '#| hide\nif x: y = 1; return\nq = 1; r = 2', 'ok = 1')
    assert house.line_figures(tmp_path) == {'lucid_nb/m.py': dict(lines=2, long=1, joins=1),
                                            'nbs/n.ipynb': dict(lines=3, long=0, joins=1)}
    assert house.check_lines(tmp_path) == ['20.0% of code lines are over 100 characters, over 5%',
                                           '2 `;` joins outside one-line guards']
    assert 'library: 1 of 2 code lines over 100 characters (50.0%), 1 `;` joins' in capsys.readouterr().out
    (tmp_path / 'lucid_nb' / 'm.py').write_text('x = 1\n' * 20 + 'z = "' + 'w' * 100 + '"\n')
    notebook(tmp_path / 'nbs' / 'n.ipynb', 'ok = 1')
    assert house.check_lines(tmp_path) == []   # 1 of 22 lines: under 5 %


def test_this_checkout_keeps_the_house_rules(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert house.check_sidebar() == []
    assert house.check_benchmarks() == []
    assert house.check_documents() == []


def test_the_comparator_is_in_the_repository():
    "The `ul` arms run `benchmarks/ultralytics_run.py`, not a copy of an outside tool kept out of git."
    scripts = [p for p in (ROOT / 'benchmarks').iterdir() if p.suffix in ('.py', '.sh')]
    assert [p.name for p in scripts if '.ulcmp' in p.read_text()] == []
    for name in ('reference_run.py', 'scale.py'): assert "'ultralytics_run.py'" in (ROOT / 'benchmarks' / name).read_text()


def test_machine_paths_are_found_in_text_files_only(tmp_path):
    W, R, H = 'work', 'root', 'home'   # the examples' folders, written apart: this file names no machine path itself
    bad, fine, blob = tmp_path / 'bad.json', tmp_path / 'fine.py', tmp_path / 'blob.bin'
    bad.write_text(f'{{"config": "/{W}/wt/configs/a.yaml"}}\nx = "/{H}/me/data"\n')
    fine.write_text(f"out = tmp/{R}/'lucid'   # a folder made under tmp\nrun = '/tmp/reference_run'\nsee = '~/data'\n")
    blob.write_bytes(f'\0/{R}/x'.encode())
    assert house.machine_paths(bad) == [(1, f'/{W}/'), (2, f'/{H}/m')]
    assert house.machine_paths(fine) == [] and house.machine_paths(blob) == []
    assert [line.split(': ')[0] for line in house.check_paths([bad, fine, blob])] == [f'{bad}:1', f'{bad}:2']


def test_this_checkout_names_no_machine_path(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert house.check_paths() == []
