#!/usr/bin/env python3
"""The docs site: prepare the processed notebooks for smalldocs, then check the built site (standard library only;
run from the repository root; `measure` and `shots` need chromium and PIL).

    python .ci/docs_site.py prepare _proc        # after nbdev-proc-nbs, before smalldocs
    python .ci/docs_site.py check _proc/_docs    # after smalldocs: dead internal links and anchors; warnings,
                                                 # tracebacks and machine paths rendered into a page; a page over
                                                 # 10 screens (1280x800), estimated without a browser
    python .ci/docs_site.py measure _proc/_docs  # each page's height in 1280x800 screens, code blocks wider than
                                                 # their column
    python .ci/docs_site.py shots _proc/_docs nbs/images/docs   # the screenshots beside this check

`prepare` does what Quarto would and smalldocs does not:
- pages take the names nbdev links to. nbdev links each symbol to `<output-file>#<name>` (`02_model.ipynb` is
  `model.html`), smalldocs names a page after its notebook, and so 789 symbol links of the site were dead. Each
  processed notebook is renamed to its `output-file`; links that name a notebook (the sidebar,
  `[04_loss](04_loss.ipynb)`) follow, and links to the site's own address (`site-url`, nbs/nbdev.yml) become
  relative. A symbol link to an anchor no page has goes to its class (a method without docs of its own) or, for a
  private `_name` whose docs nbdev never shows, becomes plain code;
- cells fold: with `code-fold` in `_quarto.yml` (or a page's front matter) Quarto folds every code cell of the page,
  smalldocs only a cell that says so itself, so each shown code cell gets the option.
- long parts fold (issue 59: no page over 10 screens): each API entry to one line (name, docstring) with its signature
  and parameters inside; a Markdown table over 8 rows or 1200 characters and a text output over 12 lines under a
  summary line. Figures, short tables and outputs stay in view; the notebooks are not touched.

`check` estimates each page's height from the HTML (`Height`: wrapped text, lines of code, rows, picture sizes; what
a closed fold hides left out), since CI has no browser; on the 36 pages it is at most 7 % under `measure` and 10 %
over it (27 pages within 4 %). A page over 10 screens fails, but for those in LONG, long from prose, each at most its number there.

`check` prints its findings one a line and exits 1 when there are any; KEPT lists what is kept, and why.
"""
import html, json, os, re, subprocess, sys, tempfile
from html.parser import HTMLParser
from pathlib import Path, PurePosixPath
from urllib.parse import unquote

FRONT_OUT = re.compile(r'^output-file:\s*(\S+)\s*$', re.M)
SITE_URL = re.compile(r'^\s*site-url:\s*"?([^"\s]+)"?\s*$', re.M)

# What must never be rendered into a page. A warning as the `warnings` module prints it (`file.py:12: UserWarning: ...`,
# `<ipython-input-3-...>:25: ...`), a traceback, and a path of the machine that built the site.
RENDERED = [
    ('a warning', re.compile(r':\d+: \w*Warning: ')),
    ('a warning', re.compile(r'<ipython-input-\d+-[0-9a-f]+>')),
    ('a traceback', re.compile(r'Traceback \(most recent call last\)')),
    ('a machine path', re.compile(r'(?<![\w.~/-])/(?:root|work|tmp|home|Users|opt)/[\w.~-]')),
    ('a machine path', re.compile(r'[/\\](?:site|dist)-packages[/\\]')),
]

# Text that matches a pattern above and is kept, with why: (page, the text at the match, the reason).
KEPT = [
    ('predict.html', '/tmp/ulvenv', "the command that makes the parity fixture installs Ultralytics into a scratch "
     "venv outside the checkout on purpose (never into the project's venv): an instruction, not a build machine's path"),
]


def site_url(nbs: Path = Path('nbs')) -> str:
    "The site's own address, from nbs/nbdev.yml, with a trailing slash."
    m = SITE_URL.search((nbs / 'nbdev.yml').read_text()) if (nbs / 'nbdev.yml').exists() else None
    return m.group(1).rstrip('/') + '/' if m else ''


# ----------------------------------------------------------------------------------------------------- prepare

def output_names(proc: Path) -> dict:
    "{notebook stem: output-file stem} for each processed notebook whose front matter names another file."
    out = {}
    for nb in sorted(proc.glob('*.ipynb')):
        cells = json.loads(nb.read_text())['cells']
        front = ''.join(cells[0]['source']) if cells and cells[0]['cell_type'] == 'raw' else ''
        m = FRONT_OUT.search(front)
        if m and Path(m.group(1)).stem != nb.stem: out[nb.stem] = Path(m.group(1)).stem
    return out


def pandoc_id(text: str) -> str:
    "A heading's id as Pandoc (and smalldocs) make it: lower case, punctuation but `_-.` gone, spaces to hyphens."
    text = re.sub(r'\[([^\]]*)\]\([^)]*\)', r'\1', text).replace('`', '')
    out = '-'.join(''.join(c.lower() for c in text if c.isalnum() or c.isspace() or c in '_-.').split())
    return out[next((i for i, c in enumerate(out) if c.isalpha()), len(out)):] or 'section'


def heading_ids(markdown: str) -> set:
    "The ids of a Markdown text's headings (`## Text {#id}` keeps its own id), fenced code left out."
    text = re.sub(r'(?ms)^(`{3,}|~{3,}).*?^\1', '', markdown)
    return {m.group(3) or pandoc_id(m.group(1)) for m in re.finditer(r'(?m)^#{1,6}\s+(.*?)(\s+\{#([^}\s]+)[^}]*\})?\s*$', text)}


def relink(text: str, names: dict, url: str = '', ids: dict = None, note: list = None) -> str:
    """Point links that name a notebook (`x.ipynb`, `x.html`, with or without `#anchor`) at its new name; make links to
    `url` relative. With `ids` ({page stem: its heading ids}), a symbol link to an anchor the page lacks goes to the
    class (`#musgd.update` -> `#musgd`: a method with no docs of its own), or is dropped, its code kept (nbdev links a
    private `_name`, whose docs it never shows); `note` collects what was changed."""
    if url: text = text.replace(f'](' + url, '](').replace(f'href="{url}', 'href="')
    if names:
        alt = '|'.join(re.escape(k) for k in sorted(names, key=len, reverse=True))
        text = re.sub(rf'(?<![\w/.-])({alt})\.(ipynb|html)\b', lambda m: f'{names[m.group(1)]}.{m.group(2)}', text)
    if not ids: return text

    def fix(m):
        label, page, frag = m.group(1), m.group(2), m.group(3)
        have = ids.get(page)
        if have is None or frag in have: return m.group(0)
        parent = frag.rpartition('.')[0]
        if parent in have:
            if note is not None: note.append(f'{page}.html#{frag} -> #{parent}')
            return f'[{label}]({page}.html#{parent})'
        if re.fullmatch(r'`[^`]+`', label):
            if note is not None: note.append(f'{page}.html#{frag} -> no link')
            return label
        return m.group(0)
    return re.sub(r'\[(`[^`\]]+`|[^\]]+)\]\(([\w-]+)\.html#([^)\s]+)\)', fix, text)


def markdown_parts(nb: dict):
    "(holder, key) of every Markdown text of a notebook: markdown cells' `source`, code cells' `text/markdown` outputs."
    for c in nb['cells']:
        if c['cell_type'] == 'markdown': yield c, 'source'
        for o in c.get('outputs', []):
            if 'text/markdown' in o.get('data', {}): yield o['data'], 'text/markdown'


def rename_pages(proc: Path, nbs: Path = Path('nbs')) -> tuple:
    """Rename each processed notebook to its `output-file` and rewrite the links and the sidebar to match.
    Returns ({old stem: new stem}, [the symbol links moved or dropped])."""
    names, url = output_names(proc), site_url(nbs)
    taken = {nb.stem for nb in proc.glob('*.ipynb')} - set(names)
    clash = sorted(v for v in names.values() if v in taken or list(names.values()).count(v) > 1)
    if clash: raise SystemExit(f'docs: two pages would be named {", ".join(clash)}: give them distinct output-file names')
    books = {nb: json.loads(nb.read_text()) for nb in sorted(proc.glob('*.ipynb'))}
    ids = {names.get(nb.stem, nb.stem): set().union(*(heading_ids(''.join(h[k])) for h, k in markdown_parts(d)))
           for nb, d in books.items()}
    note = []
    for nb, d in books.items():
        if d['cells'] and d['cells'][0]['cell_type'] == 'raw':   # the front matter: the file now has the name it asked for
            d['cells'][0]['source'] = [l for l in ''.join(d['cells'][0]['source']).splitlines(True) if not FRONT_OUT.match(l)]
        for holder, key in markdown_parts(d): holder[key] = relink(''.join(holder[key]), names, url, ids, note)
        new = proc / f'{names.get(nb.stem, nb.stem)}.ipynb'
        new.write_text(json.dumps(d, indent=1, ensure_ascii=False))
        if new != nb: nb.unlink()
    for yml in proc.glob('*.yml'): yml.write_text(relink(yml.read_text(), names))
    return names, note


FOLD = re.compile(r'^\s*code-fold:\s*(\w+)', re.M)
OPTION = re.compile(r'^#\|\s*([\w-]+)\s*:\s*(.*?)\s*$')


def fold_cells(nb: dict, default: str = 'false') -> int:
    """Give each code cell whose code is shown the page's `code-fold` (its front matter's, else `default`, the project's);
    returns the cells changed. Quarto folds every cell of such a page; smalldocs folds only a cell that says so itself.
    A cell with its own `code-fold`, or whose code is not shown (`echo: false`, `include: false`), is left as it is."""
    cells = nb['cells']
    front = ''.join(cells[0]['source']) if cells and cells[0]['cell_type'] == 'raw' else ''
    m = FOLD.search(front)
    value = (m.group(1) if m else default).lower()
    if value not in ('true', 'show'): return 0
    n = 0
    for c in cells:
        if c['cell_type'] != 'code': continue
        lines = ''.join(c['source']).splitlines(True)
        k = next((i for i, l in enumerate(lines) if not l.startswith('#|')), len(lines))
        opts = dict(OPTION.match(l).groups() for l in lines[:k] if OPTION.match(l))
        if not ''.join(lines[k:]).strip() or 'code-fold' in opts or 'false' in (opts.get('echo'), opts.get('include')): continue
        c['source'] = ''.join(lines[:k]) + f'#| code-fold: {value}\n' + ''.join(lines[k:])
        n += 1
    return n


# What folds when a page would be long (issue 59: a page over 10 screens is split or folded). Measured in headless
# chromium at 1280x800, the height of the 22 long pages was, in this order: API entries (show_doc: heading,
# signature, docstring, parameters; 600 of them, ~250 px each), prose, long tables, long outputs. Folded here, in the
# processed notebooks, so the notebooks stay as they are; a fold inside a collapsed callout is left alone.
OUTPUT_LINES, OUTPUT_WIDTH = 12, 72   # a text output over 12 lines, a line of 72 characters wrapping, folds
TABLE_ROWS, TABLE_CHARS = 8, 1200   # a Markdown table over this many rows, or characters, folds under its header
ANSI = re.compile(r'\x1b\[[0-9;]*[A-Za-z]')
API = re.compile(r'\A\s*---[ \t]*\n\s*\n(#{2,6} [^\n]+)\n\s*\n((`{3,})[^\n]*\n.*?\n\3)[ \t]*(?:\n|\Z)(.*)\Z', re.S)
TABLE = re.compile(r'(?m)^(\|.*)\n(\|[-:| ]+\|)[ \t]*\n((?:\|.*(?:\n|\Z))*)((?:[ \t]*\n)?: .*(?:\n|\Z))?')
FENCED = re.compile(r'(?ms)^(`{3,}|~{3,}).*?^\1[ \t]*$')


def plain_text(markdown: str) -> str:
    "Markdown inline text as plain text, for a summary line: links to their label, code and emphasis marks dropped."
    text = re.sub(r'\[([^\]]*)\]\([^)]*\)', r'\1', markdown)
    return ' '.join(re.sub(r'\\(.)', r'\1', re.sub(r'(?<!\\)[`*]', '', text)).split())


def fold_api(markdown: str):
    """A show_doc entry (`---`, heading, signature, docstring, parameters) as a fold whose summary is the heading and the
    docstring's first paragraph, and whose body is the signature, the rest of the docstring and the parameters (their
    own fold opened: one click shows them all); None for any other Markdown. The heading, and its anchor, stay in view."""
    m = API.match(markdown)
    if not m: return None
    head, sig, rest = m.group(1), m.group(2), m.group(4).strip('\n')
    blocks = [b for b in re.split(r'\n[ \t]*\n', rest) if b.strip()] if rest.strip() else []
    doc = blocks.pop(0) if blocks and blocks[0].startswith('*') else ''
    body = '\n\n'.join(blocks)
    body = re.sub(r'<details class="params">\s*<summary>[^<]*</summary>\s*', '', body).replace('</details>', '').strip()
    rows = [r for r in re.findall(r'(?m)^\|(?![-:| ]+\|\s*$).*', body)][1:]   # the table's rows, its header left out
    n = sum(not r.startswith('| **Returns**') for r in rows)
    more = ['signature'] + [f'{n} parameter{"s" * (n != 1)}'] * bool(n) + ['what it returns'] * any(
        r.startswith('| **Returns**') for r in rows) + ['more'] * bool(re.sub(r'(?m)^\|.*$', '', body).strip())
    more = ', '.join(more[:-1]) + ' and ' + more[-1] if len(more) > 1 else more[0]
    return (f'<details class="api">\n<summary>\n\n{head}\n\n' + (f'{doc}\n\n' if doc else '')
            + f'<p class="api-more">{html.escape(more)}</p>\n\n</summary>\n\n{sig}\n\n' + (f'{body}\n\n' if body else '')
            + '</details>\n')


def fold_tables(markdown: str) -> tuple:
    "Each long Markdown table (and its `: caption`) in a fold whose summary names its rows and columns; (text, tables folded)."
    spans = [m.span() for m in FENCED.finditer(markdown)]
    n = 0

    def fold(m):
        nonlocal n
        body = [r for r in m.group(3).splitlines() if r.strip()]
        inside = markdown[:m.start()].count('<details') > markdown[:m.start()].count('</details>')
        if (len(body) <= TABLE_ROWS and len(m.group(0)) <= TABLE_CHARS) or inside or any(a <= m.start() < b for a, b in spans):
            return m.group(0)
        n += 1
        cols = [plain_text(c) for c in re.split(r'(?<!\\)\|', m.group(1).strip().strip('|'))]
        cap = plain_text(m.group(4).strip()[1:]) if m.group(4) else ''
        what = f'{cap}: ' if cap else ''
        summary = f'{what}a table of {len(body)} rows ({" · ".join(c for c in cols if c)})'
        return f'<details class="table">\n<summary>{html.escape(summary)}</summary>\n\n{m.group(0).rstrip()}\n\n</details>\n'
    return TABLE.sub(fold, markdown), n


def fold_output(out: dict):
    "A text output (a stream, or a result shown as text only) over OUTPUT_LINES lines as a fold; None for any other."
    data = out.get('data', {})
    if out.get('output_type') == 'stream': text, kind = out.get('text', ''), out.get('name', 'stdout')
    elif out.get('output_type') in ('display_data', 'execute_result') and list(data) == ['text/plain']:
        text, kind = data['text/plain'], 'display'
    else: return None
    text = ANSI.sub('', ''.join(text)).rstrip('\n')
    lines = text.split('\n')
    if sum(1 + len(l) // OUTPUT_WIDTH for l in lines) <= OUTPUT_LINES: return None   # the lines it shows, wrapped
    first = next((l.strip() for l in lines if l.strip()), '')
    first = first if len(first) <= 60 else first[:59] + '…'
    fold = (f'<details class="output output-{kind}">\n<summary>{len(lines)} lines of output'
            f'<code>{html.escape(first)}</code></summary>\n<pre><code>{html.escape(text)}</code></pre>\n</details>')
    return dict(output_type='display_data', metadata={}, data={'text/html': fold, 'text/plain': text})


def fold_long(nb: dict) -> dict:
    """Fold what makes a page long: show_doc entries, Markdown tables over TABLE_ROWS rows or TABLE_CHARS characters,
    text outputs over OUTPUT_LINES lines; what lies in a collapsed callout is already folded and stays as it is.
    Returns {what: how many}."""
    n = dict(entries=0, tables=0, outputs=0)
    divs = []   # the fenced divs open at this point: True for a collapsed callout
    for c in nb['cells']:
        hidden = any(divs)
        if c['cell_type'] == 'markdown':
            src = ''.join(c['source'])
            if not hidden:
                src, k = fold_tables(src); n['tables'] += k
                c['source'] = src
            for l in FENCED.sub('', src).splitlines():
                if re.match(r'^:{3,}\s*\{', l): divs.append(bool(re.search(r'collapse="?true', l)))
                elif re.match(r'^:{3,}\s*$', l) and divs: divs.pop()
        if c['cell_type'] != 'code' or hidden: continue
        for i, o in enumerate(c.get('outputs', [])):
            md = o.get('data', {}).get('text/markdown')
            if md is not None:
                api = fold_api(''.join(md))
                if api: o['data']['text/markdown'] = api; n['entries'] += 1; continue
                o['data']['text/markdown'], k = fold_tables(''.join(md)); n['tables'] += k
                continue
            f = fold_output(o)
            if f: c['outputs'][i] = f; n['outputs'] += 1
    return n


def prepare(proc: Path, nbs: Path = Path('nbs')) -> str:
    "The steps between nbdev-proc-nbs and smalldocs: pages take their output-file names, cells fold as Quarto's would."
    names, note = rename_pages(proc, nbs)
    q = proc / '_quarto.yml'
    m = FOLD.search(q.read_text()) if q.exists() else None
    folded, long = 0, dict(entries=0, tables=0, outputs=0)
    for nb in sorted(proc.glob('*.ipynb')):
        d = json.loads(nb.read_text())
        k, more = fold_cells(d, m.group(1) if m else 'false'), fold_long(d)
        if k or any(more.values()): nb.write_text(json.dumps(d, indent=1, ensure_ascii=False))
        folded += k
        for w in long: long[w] += more[w]
    moved = sum('-> #' in n for n in note)
    return (f'docs: {len(names)} pages take their output-file name; of the symbol links to an anchor no page has, '
            f'{moved} go to their class, {len(note) - moved} (private names) are left as code; {folded} code cells fold\n'
            f'docs: folded as long: {long["entries"]} API entries (signature and parameters), {long["tables"]} tables over '
            f'{TABLE_ROWS} rows or {TABLE_CHARS} characters, {long["outputs"]} outputs over {OUTPUT_LINES} lines')


# ----------------------------------------------------------------------------------------------------- check

class Page(HTMLParser):
    "The ids, the links and the visible text (code included, scripts and styles not) of one HTML page."
    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.ids, self.links, self.text, self._skip = set(), [], [], 0
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for k in ('id', 'name') if tag in ('a', 'map') else ('id',):
            if a.get(k): self.ids.add(a[k])
        for k in ('href', 'src'):
            if a.get(k) and tag in ('a', 'img', 'link', 'script', 'iframe', 'source'): self.links.append(a[k])
        if tag in ('script', 'style'): self._skip += 1

    def handle_endtag(self, tag):
        if tag in ('script', 'style') and self._skip: self._skip -= 1

    def handle_data(self, data):
        if not self._skip: self.text.append(data)


def internal_target(href: str, page: PurePosixPath, url: str):
    "(path from the site root, anchor) of an internal link, or None for an external one."
    if url and href.startswith(url): href = '/' + href[len(url):]
    if re.match(r'^[a-z][a-z0-9+.-]*:|^//', href, re.I): return None    # http:, mailto:, data:, javascript:
    path, _, frag = href.partition('#')
    path = unquote(path.partition('?')[0])
    if not path: return str(page), frag
    joined = os.path.normpath(path.lstrip('/') if path.startswith('/') else os.path.join(str(page.parent), path))
    if path.endswith('/') or not PurePosixPath(joined).suffix: joined = os.path.join(joined, 'index.html')
    return joined.replace(os.sep, '/'), frag


def excerpt(text: str, m: re.Match, width: int = 50) -> str:
    return ' '.join(text[max(0, m.start() - width):m.end() + width].split())


def check_site(site: Path, url: str = '') -> list:
    "Every finding of the built site, one a line: dead internal links and anchors, warnings and machine paths."
    pages = {p.relative_to(site).as_posix(): Page(p.read_text(encoding='utf-8', errors='replace'))
             for p in sorted(site.rglob('*.html')) if 'site_libs' not in p.parts}
    bad = [] if pages else [f'{site}: no pages (did the build fail?)']
    for name, pg in pages.items():
        seen = set()
        for href in pg.links:
            t = internal_target(html.unescape(href), PurePosixPath(name), url)
            if t is None or (href in seen): continue
            seen.add(href)
            path, frag = t
            if path.startswith('..'): bad.append(f'{name}: link outside the site: {href}')
            elif path not in pages and not (site / path).exists(): bad.append(f'{name}: dead link: {href}')
            elif frag and path in pages and frag not in pages[path].ids: bad.append(f'{name}: dead anchor: {href}')
        text = ''.join(pg.text)
        for what in dict.fromkeys(w for w, _ in RENDERED):
            hits = sorted((m for w, pat in RENDERED if w == what for m in pat.finditer(text)
                           if not any(name == pg_ and text.startswith(kept, m.start()) for pg_, kept, _ in KEPT)),
                          key=lambda m: m.start())
            if hits: bad.append(f'{name}: {what} rendered into the page ({len(hits)}x), e.g. "{excerpt(text, hits[0])}"')
    return bad


# ----------------------------------------------------------------------------------------------------- screens

SCREEN, COLUMN, CHARS = 800, 620, 80    # px of a screen (1280x800); the text column's px there, and characters a line
MAX_SCREENS = 10                        # issue 59: a page over 10 screens is split or folded
# Pages still over MAX_SCREENS with all of the above folded, from prose: (estimate allowed, why). Each waits for a split
# of its notebook (after the code-cell reformat); the estimate may not grow past its number meanwhile.
LONG = {   # page: (estimated screens allowed, why it is long), measured in chromium after folding
}
VOID = {'area', 'base', 'br', 'col', 'embed', 'hr', 'img', 'input', 'link', 'meta', 'source', 'track', 'wbr'}
CALLOUT_PX = 75                         # px of a callout's title bar and margins (chromium: 73 to 80)
TEXT_PX = {'h1': (48, 40), 'h2': (36, 60), 'h3': (30, 36), 'h4': (26, 30), 'summary': (24, 12), 'pre': (20, 24)}


def image_px(src: str) -> int:
    "The shown height of an inline PNG or JPEG (a data: URI), at most the column wide; 300 when it cannot tell."
    import base64, struct
    m = re.match(r'data:image/(png|jpeg);base64,(.*)', src, re.S)
    if not m: return 300
    raw = base64.b64decode(m.group(2)[:100_000] + '=' * (-len(m.group(2)[:100_000]) % 4))
    w = h = 0
    if m.group(1) == 'png' and raw[12:16] == b'IHDR': w, h = struct.unpack('>II', raw[16:24])
    else:
        i = 2
        while i + 9 < len(raw):
            if raw[i] != 0xFF: break
            if raw[i + 1] in (0xC0, 0xC1, 0xC2): h, w = struct.unpack('>HH', raw[i + 5:i + 9]); break
            i += 2 + struct.unpack('>H', raw[i + 2:i + 4])[0]
    return round(h * min(1, COLUMN / w)) if w else 300


class Height(HTMLParser):
    """A page's height in px as the visible content of its main column gives it, with no browser: text wrapped at
    CHARS a line, code and outputs by their lines (at most 30, the CSS's), table rows, pictures by their size; what
    lies in a closed <details> (its summary aside) or a collapsed callout (its title bar aside) is not seen.
    A proxy of `measure`."""
    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.px, self.main, self.stack, self.hidden, self.text, self.row = 0, 0, [], 0, [], 0
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == 'main': self.main += 1
        if not self.main: return
        parent = self.stack[-1] if self.stack else None
        hide = bool(self.hidden) or (parent is not None and parent[0] == 'details' and parent[1] and tag != 'summary') or (
            'collapse' in (a.get('class') or '').split() and 'show' not in (a.get('class') or '').split()) or tag in ('script', 'style')
        if tag == 'img' and not hide: self.px += image_px(a.get('src') or '') + 16
        if 'callout-header' in (a.get('class') or '').split() and not hide: self.px += CALLOUT_PX   # a fold's title bar
        if tag in VOID: return
        closed = tag == 'details' and 'open' not in a
        self.stack.append((tag, closed, hide, 'api' in (a.get('class') or '').split()))
        self.hidden += hide
        if tag in ('p', 'li', 'pre', 'summary', 'td', 'th', 'h1', 'h2', 'h3', 'h4', 'h5', 'h6', 'dt', 'dd', 'figcaption'):
            self.text = []

    def handle_endtag(self, tag):
        if tag == 'main' and self.main: self.main -= 1
        if not self.main or tag in VOID or not self.stack: return
        while self.stack and self.stack[-1][0] != tag and tag in [s[0] for s in self.stack]: self._close(self.stack[-1][0])
        if self.stack and self.stack[-1][0] == tag: self._close(tag)

    def _close(self, tag):
        _, _, hide, _ = self.stack.pop()
        self.hidden -= hide
        if hide: return
        text = ''.join(self.text)
        in_api = any(s[0] == 'details' and s[3] for s in self.stack)
        if tag == 'pre':
            lines = text.rstrip('\n').split('\n')
            self.px += min(30, sum(1 + len(l) // 72 for l in lines)) * 20 + 24
        elif tag in ('td', 'th'): self.row = max(self.row, -(-len(text.strip()) // 30) or 1)
        elif tag == 'tr': self.px += self.row * 24 + 16; self.row = 0
        elif tag == 'summary' and in_api: self.px += 50   # one line, clamped, and the rule above it
        elif tag in TEXT_PX or tag in ('p', 'li', 'dt', 'dd', 'figcaption', 'h5', 'h6'):
            if tag != 'summary' and any(s[0] == 'summary' for s in self.stack): return   # the summary's line counts
            line, margin = TEXT_PX.get(tag, (24, 16))
            n = -(-len(' '.join(text.split())) // CHARS)
            if n: self.px += n * line + margin
        if tag in ('p', 'li', 'summary', 'h1', 'h2', 'h3', 'h4', 'h5', 'h6', 'dt', 'dd', 'figcaption'): self.text = []

    def handle_data(self, data):
        if self.main and not self.hidden: self.text.append(data)


def screens(site: Path) -> dict:
    "{page: its estimated height in screens} of a built site: `Height` plus the title block and the footer."
    return {p.name: round((Height(p.read_text(encoding='utf-8', errors='replace')).px + 300) / SCREEN, 1)
            for p in sorted(site.glob('*.html'))}


def check_screens(site: Path) -> list:
    "Pages whose estimated height is over MAX_SCREENS, or over their number in LONG."
    return [f'{page}: about {s} screens, over {LONG.get(page, (MAX_SCREENS,))[0]} (fold or split it: issue 59)'
            for page, s in screens(site).items() if s > LONG.get(page, (MAX_SCREENS,))[0]]

# ----------------------------------------------------------------------------------------------------- measure, shots

CHROMIUM = ['chromium', '--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking',
            '--disable-component-update', '--no-first-run', '--hide-scrollbars']
MEASURE_JS = """<script>addEventListener('load', () => setTimeout(() => {
  const wide = [...document.querySelectorAll('pre')].filter(p => p.offsetParent && p.scrollWidth > p.clientWidth + 1);
  document.body.setAttribute('data-measure', JSON.stringify({height: document.documentElement.scrollHeight,
    blocks: document.querySelectorAll('pre').length, wide: wide.length}));
}, 300));</script></body>"""


def measure(site: Path, width: int = 1280, height: int = 800) -> dict:
    "{page: (height in screens of `height` px, code blocks, code blocks wider than their column)} in headless chromium."
    out = {}
    for p in sorted(site.glob('*.html')):
        probe = p.with_name(f'.measure_{p.name}')
        probe.write_text(p.read_text().replace('</body>', MEASURE_JS, 1))
        try:
            dom = subprocess.run(CHROMIUM + [f'--window-size={width},{height}', '--virtual-time-budget=3000', '--dump-dom',
                                 probe.resolve().as_uri()], capture_output=True, text=True, timeout=120).stdout
        finally: probe.unlink()
        m = re.search(r"data-measure=\"([^\"]*)\"", dom)
        if m:
            d = json.loads(html.unescape(m.group(1)))
            out[p.name] = (round(d['height'] / height, 1), d['blocks'], d['wide'])
    return out


SHOTS = [  # (file, page, anchor at the top or '', what to open): the index, a parameters table, a page with a figure
    ('index.jpg', 'index.html', '', ''),
    ('parameters_table.jpg', 'trainer.html', 'lityolo', 'details.api:has(#lityolo)'),
    ('figure.jpg', 'recorder_results.html', 'step-time-per-epoch-in-the-reference-runs', '.callout-collapse'),
]
SHOT_JS = """<script>addEventListener('load', () => setTimeout(() => {
  document.querySelectorAll('%s').forEach(e => e.tagName == 'DETAILS' ? e.open = true : e.classList.add('show'));
  const e = document.getElementById('%s');
  document.body.setAttribute('data-top', e ? Math.round(e.getBoundingClientRect().top + scrollY) : 0);
}, 300));</script></body>"""


def shot(site: Path, page: str, anchor: str, opened: str, out: Path, size=(1280, 1000), quality: int = 60) -> int:
    """A JPEG of `page` from `anchor` down, `size` big, with the elements `opened` selects open; returns its bytes.
    Chromium cannot scroll before its screenshot, so it takes the page down to there and the top is cut off."""
    from PIL import Image   # the venv's
    p = site / page
    probe = p.with_name(f'.shot_{p.name}')
    probe.write_text(p.read_text().replace('</body>', SHOT_JS % (opened or 'none', anchor), 1))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            dom = subprocess.run(CHROMIUM + [f'--window-size={size[0]},{size[1]}', '--virtual-time-budget=3000',
                                 '--dump-dom', probe.resolve().as_uri()], capture_output=True, text=True, timeout=120).stdout
            top = max(0, int(re.search(r'data-top="(\d+)"', dom).group(1)) - 70) if anchor else 0   # the navbar's 70 px
            png = Path(tmp) / 'shot.png'
            subprocess.run(CHROMIUM + [f'--window-size={size[0]},{top + size[1]}', '--virtual-time-budget=3000',
                                       f'--screenshot={png}', probe.resolve().as_uri()], capture_output=True, timeout=120, check=True)
            Image.open(png).crop((0, top, size[0], top + size[1])).convert('RGB').save(out, quality=quality, optimize=True)
    finally: probe.unlink()
    return out.stat().st_size


def main(argv: list) -> int:
    if len(argv) < 2 or argv[0] not in ('prepare', 'check', 'measure', 'shots'): print(__doc__); return 2
    cmd, folder = argv[0], Path(argv[1])
    if cmd == 'prepare':
        print(prepare(folder))
        return 0
    if cmd == 'measure':
        m = measure(folder)
        guess = screens(folder)
        for page, (high, blocks, wide) in m.items():
            print(f'{page:32} {high:5.1f} screens (estimate {guess.get(page, 0):5.1f})  {blocks:4} code blocks, '
                  f'{wide:3} wider than the column')
        print(f'{len(m)} pages, {sum(v[0] > MAX_SCREENS for v in m.values())} over {MAX_SCREENS} screens; '
              f'{sum(v[2] for v in m.values())} of {sum(v[1] for v in m.values())} code blocks wider than the column')
        return 0
    if cmd == 'shots':
        dest = Path(argv[2]); dest.mkdir(parents=True, exist_ok=True)
        for name, page, anchor, opened in SHOTS: print(dest / name, shot(folder, page, anchor, opened, dest / name), 'bytes')
        return 0
    bad = check_site(folder, site_url()) + check_screens(folder)
    for line in bad: print(line)
    n = len(list(folder.rglob('*.html')))
    print(f'docs: {n} pages crawled, {len(bad)} findings (dead links or anchors, warnings, machine paths, pages over '
          f'{MAX_SCREENS} screens by the estimate; {len(LONG)} long pages wait for a split, LONG)')
    return 1 if bad else 0


if __name__ == '__main__': sys.exit(main(sys.argv[1:]))
