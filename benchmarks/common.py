"""What every benchmark script shares: the reference protocol, the environment of a measurement, ONE result writer.

A script in `benchmarks/` imports it as `from common import ...` (its own folder is first on `sys.path`). The library is imported only inside the functions
(a script's `--help` costs no torch import).

Result files are `benchmarks/results/<script>_<device>_<commit>[_<tag>].json`: `<script>` is the script's name, with
the batch size where it matters (`reference_run_b4`), `<device>` `lucid_nb.core.device_tag()` (`nvidia-h200`, `cpu`),
`<commit>` the measured library's (`$LUCID_NB_COMMIT` first: a copied tree's `.git` may be stale on the GPU machine).
"""
import importlib, io, json, os, shlex, statistics, subprocess, sys, tarfile, tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / 'benchmarks' / 'results'

# The reference run: `configs/coco128-seg-n.yaml` — the embedded coco128 split by file name, 96 train / 32 val images
# (`val_count` 32, `lucid_nb/embedded/README.md`), nano, 640 px, 10 epochs, bf16-mixed, RAM cache, batch 4 (and 16).
REFERENCE_CONFIG = ROOT / 'configs' / 'coco128-seg-n.yaml'
CPU_CONFIG = ROOT / 'configs' / 'coco128-seg-n-cpu.yaml'
REFERENCE = dict(config='configs/coco128-seg-n.yaml', train_images=96, val_images=32, imgsz=640, epochs=10,
                 batch_sizes=(4, 16), model='nano')
# a child process that runs the `lucid` command exactly as installed (`python -c LUCID fit ...`)
LUCID = 'import sys; from lucid_nb.cli import main; sys.argv[0] = "lucid"; main()'


def device_of(cuda: bool | None = None) -> str:
    "The device as a file-name part: `lucid_nb.core.device_tag()` (`nvidia-h200`), or `cpu` when `cuda` is False."
    if cuda is False: return 'cpu'
    from lucid_nb.core import device_tag
    return device_tag()


def env() -> dict:
    "`lucid_nb.core.env_info()` (device, torch, CUDA, cuDNN, python, allocator, commit, date) and this process's command."
    from lucid_nb.core import env_info
    return dict(env_info(), command=shlex.join([Path(sys.executable).name, *sys.argv]),
                cpu_count=os.cpu_count(), load_average=list(os.getloadavg()))


def result_path(script: str, device: str, commit: str, tag: str = '', out=None) -> Path:
    "`<out>/<script>_<device>_<commit>[_<tag>].json` (`out` default `benchmarks/results`)."
    return Path(out or RESULTS) / f"{script}_{device}_{commit}{'_' + tag.lstrip('_') if tag else ''}.json"


def portable(x):
    "`x` (strings, dicts, lists) with the interpreter, this checkout and the home folder as names, not this machine's paths."
    if isinstance(x, str):
        for path, name in ((sys.executable, Path(sys.executable).name), (f'{ROOT}/', ''), (str(ROOT), '.'), (str(Path.home()), '~')):
            x = x.replace(path, name)
        return x
    if isinstance(x, dict): return {k: portable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)): return [portable(v) for v in x]
    return x


def write_result(script: str, payload: dict, device: str | None = None, tag: str = '', *, out=None,
                 commit: str | None = None) -> Path:
    """Write `payload` (a dict, plus `env` unless it has one; `portable`: no path of this machine) atomically (temp file,
    fsync, rename) to `result_path(script, device, commit, tag, out)`; `device` defaults to `device_of()`, `commit` to
    the env's. Return the path."""
    from lucid_nb.core import atomic_write
    res = portable(dict(payload))
    res.setdefault('env', env())
    dev = device or device_of()
    path = result_path(script, dev, commit or res['env'].get('commit') or 'unknown', tag, out)
    atomic_write(path, (json.dumps(res, indent=1, default=str) + '\n').encode())
    return path


def read_result(path) -> dict: return json.loads(Path(path).read_text())


def mark_loss_and_ema(module, begin, end, required: str | None = None) -> list[str]:
    """Mark the training step's loss and EMA parts: `begin('loss')` as `module.loss_fn` (an `nn.Module`) starts, and
    `begin('ema')` ... `end()` around `module.ema.update`. The parts found are returned; with `required` (the
    caller's name), a missing one stops the script in one line."""
    import torch
    hooked = []
    loss = getattr(module, 'loss_fn', None)
    if isinstance(loss, torch.nn.Module):
        loss.register_forward_pre_hook(lambda *_: begin('loss')); hooked.append('loss')
    elif required: raise SystemExit(f'{required}: the module has no `loss_fn` module to mark the loss at')
    ema = getattr(module, 'ema', None)
    if callable(getattr(ema, 'update', None)):
        update = ema.update
        def marked_update(*args, **kwargs):
            begin('ema')
            try: return update(*args, **kwargs)
            finally: end()
        ema.update = marked_update; hooked.append('ema')
    elif required: raise SystemExit(f'{required}: the module has no `ema.update` to mark the EMA at')
    return hooked


def spread(xs, digits: int | None = None) -> dict | None:
    "Median, min, max and count of the values that are not None (rounded to `digits`), None if there are none."
    xs = [x for x in xs if x is not None]
    if not xs: return None
    r = (lambda x: round(x, digits)) if digits is not None else (lambda x: x)
    return dict(median=r(statistics.median(xs)), min=r(min(xs)), max=r(max(xs)), n=len(xs))


def ratios(xs, ys, digits: int | None = 3) -> dict | None:
    "The spread of the round-by-round ratios `x / y` (alternating arms: each round's ratio, then their median)."
    return spread([x / y for x, y in zip(xs, ys) if x is not None and y], digits)


def load_baseline(rev: str, package: str | None = None, module: str = 'metrics'):
    """`lucid_nb.<module>` of git revision `rev` (or of a folder holding a `lucid_nb/` exported from one, for a machine
    whose clone lacks it: `git archive REV lucid_nb | tar -x -C DIR`), imported as `<package>.<module>` (one package
    name per revision; default `lucid_nb_<rev>`), beside this checkout's `lucid_nb`."""
    package = package or 'lucid_nb_' + ''.join(c if c.isalnum() else '_' for c in Path(rev).name)
    if (Path(rev) / 'lucid_nb').is_dir(): r = subprocess.run(['tar', '-c', '-C', rev, 'lucid_nb'], capture_output=True)
    else: r = subprocess.run(['git', 'archive', rev, 'lucid_nb'], cwd=ROOT, capture_output=True)
    if r.returncode: raise SystemExit(f"baseline {rev}: its lucid_nb/ could not be read: {r.stderr.decode().strip()}")
    d = Path(tempfile.mkdtemp(prefix='lucid_nb_baseline_'))
    with tarfile.open(fileobj=io.BytesIO(r.stdout)) as t:
        for m in t.getmembers():
            if m.name.endswith('.py'): m.name = m.name.replace('lucid_nb/', f'{package}/', 1); t.extract(m, d)
    sys.path.insert(0, str(d))
    return importlib.import_module(f'{package}.{module}')
