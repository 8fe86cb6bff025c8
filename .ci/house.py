#!/usr/bin/env python3
"""The house rules CI checks that need more than a grep (standard library only; run from the repository root).

    python .ci/house.py sidebar       # nbs/sidebar.yml lists exactly the pages: every nbs/*.ipynb, nothing else
    python .ci/house.py benchmarks    # benchmarks/ holds at most 10 scripts and 40 result files (rule below)
    python .ci/house.py cells [--strict]   # export cells over 60 lines, listed; --strict: fail on any
    python .ci/house.py paths         # no tracked text file names a path of one machine (a checkout, a home folder)

Each check prints its offenders one a line and exits 1 when it fails.
"""
import json, re, subprocess, sys
from pathlib import Path

MAX_SCRIPTS, MAX_RESULTS, MAX_EXPORT_LINES = 10, 40, 60
EXPORT = re.compile(r'^#\|\s*(export|exports)\b')
DEF = re.compile(r'^(?:async\s+)?(?:def|class)\s+(\w+)')


def pages(nbs: Path = Path('nbs')) -> list:
    "The notebooks the docs render: nbs/*.ipynb not starting with `_` or `.` (nbdev's rule)."
    return sorted(p.name for p in nbs.glob('*.ipynb') if not p.name.startswith(('_', '.')))


def sidebar_entries(path: Path) -> list:
    "Every `- entry` of a sidebar.yml, sections' names left out."
    return [m.group(1) for m in re.finditer(r'^\s*-\s+(?!section:)(\S+)\s*$', path.read_text(), re.M)]


def check_sidebar(nbs: Path = Path('nbs')) -> list:
    entries, want = sidebar_entries(nbs / 'sidebar.yml'), pages(nbs)
    return ([f'{nbs}/sidebar.yml lists {e}, which is not a notebook page' for e in entries if e not in want]
            + [f'{nbs}/sidebar.yml leaves out {p}' for p in want if p not in entries])


def benchmark_scripts(bench: Path = Path('benchmarks')) -> list:
    "The rule: a script is a *.py or *.sh file anywhere under benchmarks/ (experiments/ included), except common.py."
    return sorted(str(p.relative_to(bench)) for p in bench.rglob('*') if p.suffix in ('.py', '.sh')
                  and p.name != 'common.py' and 'results' not in p.relative_to(bench).parts)


def benchmark_results(bench: Path = Path('benchmarks')) -> list:
    "The rule: a result is any file under benchmarks/results/."
    return sorted(str(p.relative_to(bench)) for p in (bench / 'results').rglob('*') if p.is_file())


def check_benchmarks(bench: Path = Path('benchmarks')) -> list:
    scripts, results = benchmark_scripts(bench), benchmark_results(bench)
    print(f'benchmarks: {len(scripts)} scripts (at most {MAX_SCRIPTS}), {len(results)} results (at most {MAX_RESULTS})')
    bad = []
    if len(scripts) > MAX_SCRIPTS: bad.append(f'{len(scripts)} scripts in {bench}/, over {MAX_SCRIPTS}: ' + ' '.join(scripts))
    if len(results) > MAX_RESULTS: bad.append(f'{len(results)} files in {bench}/results/, over {MAX_RESULTS}: '
                                              'keep the latest per script, device and batch (git keeps the rest)')
    return bad


def export_cell_lengths(nb: Path) -> list:
    "(cell number, lines, first name defined) of each export cell: lines without `#|` directives and trailing blank lines."
    out = []
    for i, cell in enumerate(json.loads(nb.read_text())['cells']):
        src = ''.join(cell['source']) if isinstance(cell['source'], list) else cell['source']
        lines = src.splitlines()
        if cell['cell_type'] != 'code' or not any(EXPORT.match(l) for l in lines): continue
        body = [l for l in lines if not l.startswith('#|')]
        while body and not body[-1].strip(): body.pop()
        name = next((m.group(1) for l in body for m in [DEF.match(l)] if m), '')
        out.append((i, len(body), name))
    return out


def check_cells(nbs: Path = Path('nbs'), limit: int = MAX_EXPORT_LINES) -> list:
    return [f'{nb}: cell {i} ({name or "no definition"}) is an export cell of {n} lines, over {limit}'
            for nb in sorted(nbs.glob('*.ipynb')) for i, n, name in export_cell_lengths(nb) if n > limit]


# A path that exists on one machine only: a checkout, a home folder, pytest's temporary folders. Written into a
# committed file it means nothing elsewhere, and tells where someone worked. A path a script chooses on any machine
# (`/tmp/reference_run`) is an instruction, not one of these.
MACHINE_PATH = re.compile(r'(?<![\w.~/-])(?:/work/|/root/|/home/\w|/Users/\w|/tmp/pytest)')
PATHS_ALLOWED = {   # file: why the machine paths in it stay
    'tests/test_docs_site.py': "examples of machine paths that the docs check must find in a page",
    'tests/test_house.py': "examples of machine paths that this check must find",
    '.ci/house.py': "the patterns of this check",
}


def tracked_files() -> list:
    "The files git tracks here, relative to the repository root."
    out = subprocess.run(['git', 'ls-files', '-z'], capture_output=True, text=True, check=True).stdout
    return [f for f in out.split('\0') if f]


def machine_paths(path: Path) -> list:
    "(line number, path) of each machine path in a text file; [] for a binary or unreadable one."
    try: text = path.read_text(encoding='utf-8')
    except (OSError, UnicodeDecodeError): return []
    if '\0' in text: return []
    return [(i, m.group(0)) for i, line in enumerate(text.splitlines(), 1) for m in MACHINE_PATH.finditer(line)]


def check_paths(files: list | None = None) -> list:
    files = tracked_files() if files is None else files
    return [f'{f}:{i}: {p}... is a path of one machine: write it relative to the repository, or as an example'
            for f in files if str(f) not in PATHS_ALLOWED for i, p in machine_paths(Path(f))]


def main(argv: list) -> int:
    checks = {'sidebar': check_sidebar, 'benchmarks': check_benchmarks, 'cells': check_cells, 'paths': check_paths}
    if not argv or argv[0] not in checks: print(__doc__); return 2
    bad = checks[argv[0]]()
    for line in bad: print(line)
    if argv[0] == 'cells':
        print(f'{len(bad)} export cells over {MAX_EXPORT_LINES} lines' + ('' if '--strict' in argv else ' (reported, not failing yet)'))
        return 1 if bad and '--strict' in argv else 0
    return 1 if bad else 0


if __name__ == '__main__': sys.exit(main(sys.argv[1:]))
