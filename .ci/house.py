#!/usr/bin/env python3
"""The house rules CI checks that need more than a grep (standard library only; run from the repository root).

    python .ci/house.py sidebar       # nbs/sidebar.yml lists exactly the pages: every nbs/*.ipynb, nothing else
    python .ci/house.py benchmarks    # benchmarks/ holds at most 10 scripts and 40 result files (rule below)
    python .ci/house.py cells [--strict]   # export cells over 60 lines, listed; --strict: fail on any
    python .ci/house.py documents     # READMEs within 15 KB, their links live; CHANGELOG entries of 1-2 lines
    python .ci/house.py lines [--strict]   # code lines over 100 characters and `;` joins (rules below); --strict: fail
    python .ci/house.py paths         # no tracked text file names a path of one machine (a checkout, a home folder)

Each check prints its offenders one a line and exits 1 when it fails.
"""
import ast, io, json, re, subprocess, sys, tokenize
from pathlib import Path

MAX_SCRIPTS, MAX_RESULTS, MAX_EXPORT_LINES = 10, 40, 60
MAX_DOC_BYTES, MAX_DOC_LINE = 15_000, 300          # README.md, benchmarks/README.md: bytes (15 KB), characters a line
MAX_ENTRY_LINES, MAX_ENTRY_WIDTH = 2, 120           # a CHANGELOG entry: lines, characters a line
MAX_CODE_WIDTH, MAX_LONG_SHARE = 100, 0.05          # code lines: characters; the share allowed over them
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


def changelog_entries(text: str) -> list:
    "(line number, lines) of each entry of a CHANGELOG: a `- ` line and the indented lines that continue it."
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith('- '): out.append((n, [line]))
        elif out and line.startswith('  ') and line.strip() and n == out[-1][0] + len(out[-1][1]): out[-1][1].append(line)
    return out


def anchors(md: str) -> set:
    "The anchors GitHub gives a Markdown file's headings: lower case, punctuation but `-` and `_` dropped, spaces as `-`."
    return {re.sub(r'[^\w\- ]', '', m.group(1).strip().lower()).replace(' ', '-')
            for m in re.finditer(r'^#{1,6}\s+(.+?)\s*#*$', re.sub(r'```.*?```', '', md, flags=re.S), re.M)}


def dead_links(root: Path, doc: str) -> list:
    "The relative links `[text](path#anchor)` of a Markdown file whose file or heading is not there (URLs not followed)."
    bad, text = [], (root / doc).read_text()
    for n, line in enumerate(text.splitlines(), 1):
        for target in re.findall(r'\]\(([^)\s]+)\)', line):
            if re.match(r'[a-z]+:', target): continue
            path, _, anchor = target.partition('#')
            file = (root / doc).parent / path if path else root / doc
            if not file.exists(): bad.append(f'{doc}:{n}: dead link: {target}')
            elif anchor and file.suffix == '.md' and anchor not in anchors(file.read_text()):
                bad.append(f'{doc}:{n}: dead anchor: {target}')
    return bad


def check_documents(root: Path = Path('.')) -> list:
    """README.md and benchmarks/README.md at most 15 KB (the latter no line over 300 characters), their relative links
    and anchors live; CHANGELOG entries of 1-2 lines."""
    bad = []
    for doc in ('README.md', 'benchmarks/README.md'):
        size = (root / doc).stat().st_size
        if size > MAX_DOC_BYTES: bad.append(f'{doc} is {size:,} bytes, over {MAX_DOC_BYTES:,}: link to the details, do not repeat them')
        bad += dead_links(root, doc)
    for n, line in enumerate((root / 'benchmarks/README.md').read_text().splitlines(), 1):
        if len(line) > MAX_DOC_LINE: bad.append(f'benchmarks/README.md:{n} is {len(line)} characters, over {MAX_DOC_LINE}')
    for n, lines in changelog_entries((root / 'CHANGELOG.md').read_text()):
        if len(lines) > MAX_ENTRY_LINES: bad.append(f'CHANGELOG.md:{n} is an entry of {len(lines)} lines, over {MAX_ENTRY_LINES}')
        bad += [f'CHANGELOG.md:{n + i} is {len(l)} characters, over {MAX_ENTRY_WIDTH}' for i, l in enumerate(lines)
                if len(l) > MAX_ENTRY_WIDTH]
    return bad


EXPORTED = re.compile(r'^#\|\s*(export|exports|exporti)\b', re.M)
LEAVES = (ast.Return, ast.Raise, ast.Continue, ast.Break)


def code_sources(root: Path = Path('.')) -> list:
    """(name, source) of the code a reader scans: each `lucid_nb/*.py` but the generated `_modidx.py`, and each code cell
    of `nbs/*.ipynb` that is not exported (an exported cell's lines are the library's already), without its `#|` lines."""
    out = [(str(p.relative_to(root)), p.read_text()) for p in sorted((root / 'lucid_nb').glob('*.py')) if p.name != '_modidx.py']
    for nb in sorted((root / 'nbs').glob('*.ipynb')):
        for i, cell in enumerate(json.loads(nb.read_text())['cells']):
            src = ''.join(cell['source']) if isinstance(cell['source'], list) else cell['source']
            if cell['cell_type'] != 'code' or EXPORTED.search(src): continue
            out.append((f'{nb.relative_to(root)}#{i}', '\n'.join('' if l.startswith('#|') else l for l in src.splitlines())))
    return out


def semicolon_joins(src: str) -> list:
    """Line numbers of the `;` joins in `src`: a `;` between two statements on one line. Not a join: a `;` that ends
    its line (a notebook's output suppressed), one in a string or comment, and the one-line guard, a line
    `if <test>: <statements>` (no `else`) whose last statement leaves: `return`, `raise`, `continue` or `break`.
    IPython's `%` and `!` lines are read as blank."""
    src = '\n'.join('' if l.lstrip().startswith(('%', '!')) else l for l in src.splitlines()) + '\n'
    try: tree = ast.parse(src)
    except SyntaxError: tree = None
    guards = {n.lineno for n in ast.walk(tree) if isinstance(n, ast.If) and n.lineno == n.end_lineno and not n.orelse
              and isinstance(n.body[-1], LEAVES)} if tree else set()
    try: toks = list(tokenize.generate_tokens(io.StringIO(src).readline))
    except (tokenize.TokenError, SyntaxError): return []
    return [t.start[0] for t, nxt in zip(toks, toks[1:]) if t.type == tokenize.OP and t.string == ';'
            and nxt.type not in (tokenize.NEWLINE, tokenize.NL, tokenize.COMMENT, tokenize.ENDMARKER)
            and t.start[0] not in guards]


def line_figures(root: Path = Path('.')) -> dict:
    """Per file (a notebook's cells together): code lines (not blank), lines over 100 characters, `;` joins."""
    figs = {}
    for name, src in code_sources(root):
        f = figs.setdefault(name.split('#')[0], dict(lines=0, long=0, joins=0))
        lines = [l for l in src.splitlines() if l.strip()]
        f['lines'] += len(lines); f['long'] += sum(len(l) > MAX_CODE_WIDTH for l in lines)
        f['joins'] += len(semicolon_joins(src))
    return figs


def check_lines(root: Path = Path('.'), worst: int = 8) -> list:
    "The figures and the worst files printed; the breaches of the budget returned (at most 5 % long lines, no joins)."
    figs = line_figures(root)
    for part, pre in (('library', 'lucid_nb/'), ('notebooks', 'nbs/'), ('all', '')):
        fs = [f for k, f in figs.items() if k.startswith(pre)]
        n, long, joins = (sum(f[k] for f in fs) for k in ('lines', 'long', 'joins'))
        print(f'{part}: {long:,} of {n:,} code lines over {MAX_CODE_WIDTH} characters ({long / max(n, 1):.1%}), {joins} `;` joins')
    for key, what in (('long', f'lines over {MAX_CODE_WIDTH}'), ('joins', '`;` joins')):
        top = sorted((f[key], k) for k, f in figs.items() if f[key])[::-1][:worst]
        print(f'most {what}: ' + ', '.join(f'{k} {v}' for v, k in top))
    n, long, joins = (sum(f[k] for f in figs.values()) for k in ('lines', 'long', 'joins'))
    return ([f'{long / n:.1%} of code lines are over {MAX_CODE_WIDTH} characters, over {MAX_LONG_SHARE:.0%}']
            if long > MAX_LONG_SHARE * n else []) + ([f'{joins} `;` joins outside one-line guards'] if joins else [])


# A path that exists on one machine only: a checkout, a home folder, pytest's temporary folders. Written into a
# committed file it means nothing elsewhere, and tells where someone worked. A path a script chooses on any machine
# (`/tmp/reference_run`) is an instruction, not one of these.
MACHINE_PATH = re.compile(r'(?<![\w.~/-])/(?:(?:work|root)/|(?:home|Users)/\w|tmp/pytest)')
PATHS_ALLOWED = {}   # file: why the machine paths in it stay (none: examples are written so that they name none)


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
    checks = {'sidebar': check_sidebar, 'benchmarks': check_benchmarks, 'cells': check_cells,
              'documents': check_documents, 'lines': check_lines, 'paths': check_paths}
    if not argv or argv[0] not in checks: print(__doc__); return 2
    bad = checks[argv[0]]()
    for line in bad: print(line)
    if argv[0] == 'cells':
        print(f'{len(bad)} export cells over {MAX_EXPORT_LINES} lines' + ('' if '--strict' in argv else ' (reported, not failing yet)'))
        return 1 if bad and '--strict' in argv else 0
    if argv[0] == 'lines':
        if bad and '--strict' not in argv: print('(reported, not failing yet)')
        return 1 if bad and '--strict' in argv else 0
    return 1 if bad else 0


if __name__ == '__main__': sys.exit(main(sys.argv[1:]))
