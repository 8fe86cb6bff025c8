"""`.ci/house.py`: the house rules CI checks (sidebar, benchmarks' budget, export cells' length, machine paths), on
small folders made here and on this checkout."""
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


def test_this_checkout_keeps_the_house_rules(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert house.check_sidebar() == []
    assert house.check_benchmarks() == []


def test_the_comparator_is_in_the_repository():
    "The `ul` arms run `benchmarks/ultralytics_run.py`, not a copy of an outside tool kept out of git."
    scripts = [p for p in (ROOT / 'benchmarks').iterdir() if p.suffix in ('.py', '.sh')]
    assert [p.name for p in scripts if '.ulcmp' in p.read_text()] == []
    for name in ('reference_run.py', 'scale.py'): assert "'ultralytics_run.py'" in (ROOT / 'benchmarks' / name).read_text()


def test_machine_paths_are_found_in_text_files_only(tmp_path):
    bad, fine, blob = tmp_path / 'bad.json', tmp_path / 'fine.py', tmp_path / 'blob.bin'
    bad.write_text('{"config": "/work/wt/configs/a.yaml"}\nx = "/home/me/data"\n')
    fine.write_text("out = tmp/root/'lucid'   # a folder made under tmp\nrun = '/tmp/reference_run'\nsee = '~/data'\n")
    blob.write_bytes(b'\0/root/x')
    assert house.machine_paths(bad) == [(1, '/work/'), (2, '/home/m')]
    assert house.machine_paths(fine) == [] and house.machine_paths(blob) == []
    assert [line.split(': ')[0] for line in house.check_paths([bad, fine, blob])] == [f'{bad}:1', f'{bad}:2']


def test_this_checkout_names_no_machine_path(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert house.check_paths() == []
