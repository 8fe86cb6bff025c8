"""The comparator: Ultralytics yolo11n-seg trained from its YAML (no weights) through Ultralytics' public API, offline,
timed epoch by epoch from its callbacks. `reference_run.py` and `scale.py fit` run it as their `ul` arm, one process a
run; it runs on the GPU machine with the wheels in `.whl/` (`ultralytics` among them) and, on a CPU, in smoke runs.

    python benchmarks/ultralytics_run.py --data lucid_nb/embedded/coco128 --batch 4 --json /tmp/ul.json
    python benchmarks/ultralytics_run.py --data <set>/ul/data.yaml --batch 32 --epochs 3 --close-mosaic 0 --json ...
    python benchmarks/ultralytics_run.py ... --compile default   # its fastest setting: torch.compile (inductor) of the model

`--compile` is Ultralytics' own `compile=` training argument (8.4: `True` = `default`, or `reduce-overhead`,
`max-autotune-no-cudagraphs`): the model compiled by inductor, its compile time inside the first epoch and so in the
process's seconds, as it would be for its user (steady state, taken from later epochs, excludes it).

`--data` is a COCO folder (`images/`, `annotations/*.json`: made into Ultralytics' layout by its own
`ultralytics.data.converter.convert_coco`, segments, the 91 COCO ids to its 80 classes, then split as lucid splits
the embedded set: images sorted by file name, the last `--val-count` (32) validate, the rest train), or an
Ultralytics `data.yaml` used as it is (`scale.py make` writes one). Ultralytics keeps its own defaults (AMP, its
optimiser choice, its augmentation); only what would reach the network is switched off: its online checks (the AMP
check's download, which offline passes as well; the font download) and settings sync.

Timing, the device synchronised at each mark: an epoch's training from `on_train_epoch_start` to
`on_train_epoch_end`; its data wait, the host seconds from one batch's end (or the epoch's start) to the next batch's
start; its validation from `on_train_epoch_end` to the first `on_fit_epoch_end` of that epoch (validation and
checkpoints; the final evaluation of `best.pt` calls it again and is not counted). Writes one JSON to `--json`:
versions, setup and `train()` seconds, the process's seconds (from this file's first line), iterations, one row per
epoch (epoch, batches, images, train_seconds, data_wait_seconds, validation_seconds) and peak reserved CUDA MiB.
Callers take images/s at steady state as the training images of epochs after the first over their training seconds.
"""
import time
T0 = time.perf_counter()
import argparse, csv, importlib.util, io, json, os, shutil, sys, tempfile, types
from pathlib import Path


def offline():
    "Ultralytics without the network: its documented environment switches, before it is imported."
    os.environ.setdefault('YOLO_OFFLINE', '1'); os.environ.setdefault('YOLO_AUTOINSTALL', 'false')
    os.environ.setdefault('ULTRALYTICS_SKIP_REQUIREMENTS_CHECKS', '1')
    os.environ.setdefault('YOLO_CONFIG_DIR', tempfile.mkdtemp(prefix='ycfg'))


def polars_stand_in() -> types.ModuleType:
    """A minimal `polars` for machines without it (its wheel is too large to carry): Ultralytics' trainer reads its
    `results.csv` back through `polars.read_csv(...).to_dict(as_series=False)` for the checkpoint's metadata, and its
    metrics may build a `DataFrame` of a dict and write it as CSV; nothing else is used by training and validation."""
    class DataFrame:
        def __init__(self, data=None, **_): self.columns = {k: list(v) for k, v in (data or {}).items()}
        def to_dict(self, as_series=True): return {k: list(v) for k, v in self.columns.items()}
        def write_csv(self, file=None):
            out = io.StringIO(); w = csv.writer(out); w.writerow(self.columns); w.writerows(zip(*self.columns.values()))
            if file is None: return out.getvalue()
            Path(file).write_text(out.getvalue())
    def value(s: str):
        try: return float(s)
        except ValueError: return s
    def read_csv(source, **_):
        text = source.decode() if isinstance(source, bytes) else Path(source).read_text()
        rows = list(csv.reader(io.StringIO(text)))
        names = [h.strip() for h in rows[0]] if rows else []
        return DataFrame({n: [value(r[i].strip()) for r in rows[1:]] for i, n in enumerate(names)})
    mod = types.ModuleType('polars'); mod.DataFrame, mod.read_csv, mod.__version__ = DataFrame, read_csv, '0-stand-in'
    return mod


def coco_to_yolo(folder: Path, work: Path, val_count: int) -> Path:
    "A COCO folder in Ultralytics' layout (its converter), split by sorted file name; the data.yaml written."
    from ultralytics.data.converter import convert_coco
    ann = folder / 'annotations'
    convert_coco(labels_dir=str(ann), save_dir=str(work / 'converted'), use_segments=True, cls91to80=True)
    labels = next(p for p in (work / 'converted' / 'labels').iterdir() if p.is_dir())
    coco = json.loads(next(ann.glob('*.json')).read_text())
    names = [c['name'] for c in sorted(coco['categories'], key=lambda c: c['id'])]
    files = sorted(i['file_name'] for i in coco['images'])
    splits = (('train', files[:-val_count]), ('val', files[-val_count:])) if val_count else (('train', files), ('val', files))
    for split, part in splits:
        (work / 'ds' / 'images' / split).mkdir(parents=True); (work / 'ds' / 'labels' / split).mkdir(parents=True)
        for f in part:
            (work / 'ds' / 'images' / split / f).symlink_to((folder / 'images' / f).resolve())
            label = labels / f'{Path(f).stem}.txt'
            if label.exists(): shutil.copy(label, work / 'ds' / 'labels' / split)
    yaml = work / 'data.yaml'
    yaml.write_text(f"path: {json.dumps(str(work / 'ds'))}\ntrain: images/train\nval: images/val\nnames:\n"
                    + ''.join(f'  {i}: {json.dumps(n)}\n' for i, n in enumerate(names)))
    return yaml


def results_csv(path: Path) -> list:
    "Ultralytics' `results.csv`, one dict an epoch (its header padded with spaces; numbers as floats)."
    rows = list(csv.reader(io.StringIO(path.read_text()))) if path.exists() else []
    return [{h.strip(): float(v) for h, v in zip(rows[0], r)} for r in rows[1:]]


class EpochClock:
    "Ultralytics callbacks that time each epoch's training, its data wait and its validation."
    def __init__(self, sync): self.sync, self.epochs, self.last = sync, [], 0.
    def epoch_start(self, tr):
        self.sync(); self.last = time.perf_counter()
        self.epochs.append(dict(epoch=tr.epoch, t0=self.last, batches=0, data_wait_seconds=0.))   # an epoch redone comes twice
    def batch_start(self, tr): self.epochs[-1]['data_wait_seconds'] += time.perf_counter() - self.last
    def batch_end(self, tr): self.last = time.perf_counter(); self.epochs[-1]['batches'] += 1
    def epoch_end(self, tr):
        self.sync(); e = self.epochs[-1]; e['t1'] = time.perf_counter()
        e['train_seconds'], e['images'] = e['t1'] - e['t0'], len(tr.train_loader.dataset)
    def fit_epoch_end(self, tr):
        self.sync(); self.epochs[-1].setdefault('validation_seconds', time.perf_counter() - self.epochs[-1]['t1'])
    def attach(self, model):
        for name, fn in (('on_train_epoch_start', self.epoch_start), ('on_train_batch_start', self.batch_start),
                         ('on_train_batch_end', self.batch_end), ('on_train_epoch_end', self.epoch_end),
                         ('on_fit_epoch_end', self.fit_epoch_end)): model.add_callback(name, fn)
    def rows(self) -> list: return [{k: v for k, v in e.items() if k not in ('t0', 't1')} for e in self.epochs]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0].replace('\n', ' '))
    p.add_argument('--data', required=True, help='a COCO folder (images/, annotations/*.json) or an Ultralytics data.yaml')
    p.add_argument('--json', required=True, help='the result file to write')
    p.add_argument('--batch', type=int, default=4); p.add_argument('--epochs', type=int, default=10)
    p.add_argument('--imgsz', type=int, default=640); p.add_argument('--workers', type=int, default=8)
    p.add_argument('--val-count', type=int, default=32, help='a COCO folder: the last N images by file name validate (default 32; '
                   '0: every image trains and validates, the it-learns protocol)')
    p.add_argument('--close-mosaic', type=int, default=10, help="epochs at the end without mosaic (Ultralytics' default 10)")
    p.add_argument('--cache', default='none', choices=('none', 'ram', 'disk'), help="Ultralytics' image cache (default none, its own)")
    p.add_argument('--model', default='yolo11n-seg.yaml')
    p.add_argument('--compile', default='off', choices=('off', 'default', 'reduce-overhead', 'max-autotune-no-cudagraphs'),
                   help="Ultralytics' compile= (torch.compile of the model, inductor; default off)")
    p.add_argument('--device', help='default: GPU 0 where CUDA is, else cpu')
    p.add_argument('--seed', type=int, default=0, help="Ultralytics' seed= (default 0)")
    p.add_argument('--no-val', action='store_true', help="Ultralytics' val=False: it validates the last epoch only")
    p.add_argument('--project', help='folder of its run, kept (default: a temporary one, removed); its weights: <project>/r/weights/')
    a = p.parse_args(argv)
    offline()
    if importlib.util.find_spec('polars') is None: sys.modules['polars'] = polars_stand_in()
    import torch, ultralytics
    from ultralytics import YOLO
    from ultralytics.utils import SETTINGS
    import ultralytics.data.utils, ultralytics.engine.trainer, ultralytics.utils.checks
    SETTINGS.update({'sync': False})
    ultralytics.engine.trainer.check_amp = lambda model: True   # its check downloads weights; offline it says True too
    ultralytics.utils.checks.check_font = ultralytics.data.utils.check_font = lambda *_, **__: None   # downloads a font
    work = Path(tempfile.mkdtemp(prefix='ultralytics_run_'))
    data = Path(a.data)
    yaml = coco_to_yolo(data, work, a.val_count) if data.is_dir() else data
    cuda = torch.cuda.is_available() and a.device != 'cpu'
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    clock, model = EpochClock(sync), YOLO(a.model)
    clock.attach(model)
    t_train = time.perf_counter()
    model.train(data=str(yaml), epochs=a.epochs, imgsz=a.imgsz, batch=a.batch, device=a.device or (0 if cuda else 'cpu'),
                seed=a.seed, val=not a.no_val, workers=a.workers, pretrained=False, plots=False, close_mosaic=a.close_mosaic,
                cache=False if a.cache == 'none' else a.cache, project=a.project or str(work / 'runs'), name='r', exist_ok=True,
                **({} if a.compile == 'off' else {'compile': True if a.compile == 'default' else a.compile}))
    sync()
    rows = clock.rows()
    losses = results_csv(Path(model.trainer.save_dir) / 'results.csv')
    res = dict(ultralytics=ultralytics.__version__, torch=torch.__version__, model=a.model, data=str(a.data),
               gpu=torch.cuda.get_device_name(0) if cuda else 'cpu', batch=a.batch, epochs_asked=a.epochs, imgsz=a.imgsz,
               workers=a.workers, seed=a.seed, val=not a.no_val, cache=a.cache, close_mosaic=a.close_mosaic, compile=a.compile, iterations=sum(e['batches'] for e in rows),
               setup_seconds=t_train - T0, train_call_seconds=time.perf_counter() - t_train,
               process_seconds=time.perf_counter() - T0, epochs=rows, results=losses,
               peak_reserved_mib=torch.cuda.max_memory_reserved() / 2**20 if cuda else None)
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f'{a.json}.tmp'); tmp.write_text(json.dumps(res, indent=1)); tmp.replace(a.json)
    shutil.rmtree(work, ignore_errors=True)
    print(f"ultralytics {res['ultralytics']}: {len(rows)} epochs, {res['iterations']} iterations, "
          f"train() {res['train_call_seconds']:.1f} s, process {res['process_seconds']:.1f} s -> {a.json}")


if __name__ == '__main__':
    main()
