"""At real scale (thousands of training images, batch 32-64), how many training images a second does lucid sustain,
natively and with the whole step replayed from CUDA graphs, against Ultralytics yolo11n-seg, and where does it go?

Stages (each takes `--n N --root DIR`: the data set `<DIR>/n<N>`, made when missing):

    make     N training images made from the 96 embedded training images (`lucid_nb/embedded/coco128`, sorted by file
             name: first 96 train, last 32 val): new names, new bytes (decoded and re-encoded as JPEG, quality 95 down to
             70 by copy, a comment naming the copy), a COCO JSON with new image and annotation ids; the 32 validation
             images as they are; and the same set in Ultralytics' YOLO-seg layout (`ul/data.yaml`, `ul/images/{train,val}`
             linking to those files, `ul/labels/{train,val}/*.txt`: class = the category's place among the categories
             sorted by id, normalised polygons, a multi-part mask joined into one outline by zero-width bridges, crowd
             regions left out). `manifest.json` last: a folder with the same N and recipe is kept as it is.
    fit      alternating processes per round and batch size: `native` (lucid fit, `configs/coco128-seg-n.yaml`, the GPU
             configuration), `step` (`--model.capture_train_step true`), any other arm of `reference_run.py` (`step-cl`:
             channels-last; `step@base`: the library in $LUCID_NB_BASELINE, for before/after in one call; every run of
             one library must end with the same hashes), `ul` (`ultralytics_run.py`: Ultralytics' public API,
             offline; left out, with a line, where `ultralytics` does not import), `ul-compile` (the same with its
             `compile=True`, torch.compile of the model: its fastest setting; `ul-compile-ro` and `ul-compile-max`:
             the modes reduce-overhead and max-autotune-no-cudagraphs; `over_ul_compile` in the summary holds each
             lucid arm's images/s over `ul-compile`'s, per round; `ul26`: Ultralytics' yolo26n-seg, against which
             `over_ul26` holds the YOLO26 arms `native-26`, `step-26`), E epochs. Steady state:
             the training images of epochs 1..E-1 over their training seconds (validation excluded). Per run also each
             epoch's data wait (lucid: `timing.json`; Ultralytics: host seconds between a batch's end and the next one's
             start), whole-process seconds, peak reserved memory; lucid's state hashes (native and step must be equal
             at each batch size). Mosaic: `--close-mosaic 0` (default) keeps it on in every epoch for both trainers, the
             state of most of a long training (with E=3 the configuration's default, 10, turns it off for both).
    loader   `YoloData.train_dataloader()` alone, the GPU configuration's data settings (RAM cache, prefetch, mosaic,
             affine, flip; HSV runs on the device in lucid, so not here), at `--batch` (64) with 8 and 16 workers, each
             run its own process: images/s of the epochs after a warm-up epoch, and the CPU ms an image of the trainer's
             process (receiving batches) and of the workers (building them); `--rounds R`; `--base`: the library in
             $LUCID_NB_BASELINE alternating with this one, each leading in turn (`current_over_baseline` per round);
             with `--fit FIT.json`, over the steady-state images/s of each arm there.
    profile  a short `lucid fit` with `profile_fit.KernelProfile` (a callback): warm-up, a timed window, then
             torch.profiler over K steps with forward / loss / backward / optimizer / ema ranges; kernel time per image
             by part and by kernel family (gemm/conv, batchnorm, elementwise, copy/cast, reduction, other), top kernels.
             `--capture`: the whole step replayed (kernel total and families only). On a CPU: operators' CPU time.
    cache    the cache modes against N (`--points`, default 128 1024 4096 16384: the first N images of the largest set),
             each start a fresh process, smallest N first: for none / ram / disk (`--modes`) a cold start (empty cache
             folder) and a warm one (the same folder again): setup seconds, RSS, peak RSS (VmHWM), PSS (smaps_rollup),
             the cache actually used and the fit check's line, the bytes on disk (prepared images and label index). Then
             the RAM cache at `--pss-n` images (0: not measured) with 0 and `--pss-workers` loader workers after one
             epoch: PSS of the main process and of each worker (a page shared by k processes counts 1/k in each), so
             their sum is the real footprint.
    index    the label index of N images under tracemalloc: read from the JSON (cold), from its cache file (warm) and, with
             `--baseline REV`, by that revision's `read_records`: seconds, bytes per image kept, the parsed JSON's bytes.

    python benchmarks/scale.py make --n 16384
    python benchmarks/scale.py cache --points 128 1024 4096 16384   # ~20 min on 2 CPU cores; the RAM cache's fit check guards the machine
    python benchmarks/scale.py cache --points 16384 --modes disk --pss-n 0   # the disk cache alone, cold and warm (no workers PSS)
    python benchmarks/scale.py index --n 16384 --baseline <rev>
    python benchmarks/scale.py fit --n 4096 --batch 32 64 [--rounds 1] [--epochs 3] [--arms native,step,ul] [-- lucid args]
    python benchmarks/scale.py loader --n 4096 [--batch 64] [--workers 8 16] [--rounds 3 --base] [--fit ...fit....json]
    python benchmarks/scale.py profile --n 4096 [--batch 64] [--capture]
    python benchmarks/scale.py merge PART.json PART.json --out-tag fit_n4096   # one fit result of several calls' parts
    python benchmarks/scale.py --smoke     # everything tiny on this CPU (8 images, 64 px, batch 2), results in a temp folder

On the GPU machine, one device call (carry `.whl`; put the commit run in LUCID_NB_COMMIT: the copied
`.git` may be stale). Estimate on an H200, N=4096, ~230 images/s: install 15 s, make 10 s, loader 30 s, profile 2 x 35 s,
fit 6 runs of 60-75 s (start-up 5 s, RAM cache 3-7 s, 3 epochs of 4,096 images, 3 validations) = ~400 s: ~8.7 min. Each
stage has a time limit and its files are copied to $OUT/results after it; the fit's limit ends the call by 9 minutes
(a run still going then is lost, those before it are in the file):

    export LUCID_NB_COMMIT=<commit> PYTHONUNBUFFERED=1; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null && export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH && mkdir -p $OUT/results && S="python3 benchmarks/scale.py" && c() { cp benchmarks/results/scale_* $OUT/results/ 2>/dev/null; echo "== $1 done at $SECONDS s"; } && $S make --n 4096 && c make && { timeout 75 $S loader --n 4096; c loader; timeout 75 $S profile --n 4096; c profile; timeout 75 $S profile --n 4096 --capture; c capture; timeout $((535 - SECONDS)) $S fit --n 4096 --batch 32 64 --loader "$(ls benchmarks/results/scale_*_loader_n4096_b64.json 2>/dev/null | head -1)"; c fit; }

JSON (`benchmarks/results/scale_<device>_<commit>_<stage>_n<N>[...].json`, with `env`: torch, GPU, date, commit):
`make` returns the manifest (counts, seconds); `fit`: `runs` (arm, batch, round, images_per_s, per-epoch rows with
images, train seconds, data wait, validation seconds; process seconds, peak reserved MiB, lucid hashes) and `summary`
per batch: per arm median (min-max) of images/s, process seconds, data wait, peak; per round each lucid arm's images/s
over Ultralytics'; whether every lucid run at that batch ended with the same hashes. `loader`: per worker count, images/s
per epoch, setup seconds, and the ratio to each fit arm's consumption. `profile`: `profile_fit.analyse`'s keys
(`total_us_per_image`, `by_part_us_per_image`, `by_family_us_per_image`, `top`...), the timed window's images/s.
"""
import argparse, contextlib, io, json, multiprocessing, os, shutil, statistics, subprocess, sys, tempfile, time
from pathlib import Path

from common import write_result   # benchmarks/ is sys.path[0] when this file runs
from reference_run import BASE, LUCID, ROOT, arm_cwd, run_lucid, spread, ul_importable

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / 'results'
SRC = ROOT / 'lucid_nb' / 'embedded' / 'coco128'
CONFIG = ROOT / 'configs' / 'coco128-seg-n.yaml'
RECIPE = 1            # of `make`: a manifest of another recipe is made again
N_TRAIN = 96          # the embedded split: first 96 by file name train, the last 32 validate
SMOKE_LUCID = ['--trainer.accelerator', 'cpu', '--trainer.precision', '32-true', '--data.workers', '0', '--data.imgsz', '64']


def _write_result(script: str, payload: dict, device: str | None = None, tag: str = '') -> Path:
    "`common.write_result` into `RESULTS` (a temporary folder under `--smoke`)."
    return write_result(script, payload, device, tag, out=RESULTS)


# ---------------------------------------------------------------------------------------------------------------- make
def _encode(job):
    "Decode a source image (kept per worker process), write it as a JPEG at `quality` with a comment naming the copy."
    from PIL import Image, ImageOps
    k, src, dst, quality = job
    im = _encode.cache.get(src)
    if im is None:
        im = ImageOps.exif_transpose(Image.open(src)); im = im if im.mode in ('RGB', 'L') else im.convert('RGB')
        _encode.cache[src] = im
    im.save(dst, 'JPEG', quality=quality, comment=f'lucid_nb scale copy {k}'.encode())
    return k, im.width, im.height
_encode.cache = {}


def _outline(polys):
    "One outline of a multi-part polygon: each next part entered at its point nearest the outline's end, and left there."
    import numpy as np
    out = polys[0]
    for p in polys[1:]:
        j = int(((p - out[-1]) ** 2).sum(1).argmin())
        out = np.concatenate([out, np.roll(p, -j, 0), p[j:j + 1], out[-1:]])
    return out


def _yolo_label(anns, w, h, cls) -> str:
    "YOLO-seg lines of one image's COCO annotations (polygons only; crowd regions left out, as in training)."
    import numpy as np
    lines = []
    for a in anns:
        seg = a.get('segmentation')
        if a.get('iscrowd') or not isinstance(seg, list): continue
        polys = [np.asarray(p, float).reshape(-1, 2) for p in seg if len(p) >= 6]
        if not polys: continue
        xy = (_outline(polys) / (w, h)).clip(0, 1).reshape(-1)
        lines.append(f"{cls[a['category_id']]} " + ' '.join(f'{v:.6f}' for v in xy))
    return ''.join(l + '\n' for l in lines)


def make(n: int, root: Path, workers: int | None = None) -> dict:
    "The data set of `n` training images in `root/n<n>` (see the module's docstring); its manifest."
    out, t0 = root / f'n{n}', time.perf_counter()
    man = out / 'manifest.json'
    if man.exists():
        m = json.loads(man.read_text())
        if (m.get('n'), m.get('recipe')) == (n, RECIPE): print(f'make: {out} has {n} images already'); return m
    if out.exists(): shutil.rmtree(out)
    d = json.loads((SRC / 'annotations' / 'instances_train2017.json').read_text())
    images = sorted(d['images'], key=lambda i: i['file_name'])
    train, val = images[:N_TRAIN], images[N_TRAIN:]
    anns = {}
    for a in d['annotations']: anns.setdefault(a['image_id'], []).append(a)
    cats = sorted(d['categories'], key=lambda c: c['id'])
    cls = {c['id']: i for i, c in enumerate(cats)}
    for p in ('train', 'val', 'ul/images/train', 'ul/images/val', 'ul/labels/train', 'ul/labels/val'): (out / p).mkdir(parents=True)
    names = [f'{k:06d}.jpg' for k in range(n)]
    jobs = [(k, str(SRC / 'images' / train[k % N_TRAIN]['file_name']), str(out / 'train' / names[k]), 95 - (k // N_TRAIN) % 26)
            for k in range(n)]
    with multiprocessing.get_context('fork').Pool(workers or os.cpu_count()) as pool:
        sizes = {k: (w, h) for k, w, h in pool.imap_unordered(_encode, jobs, chunksize=32)}
    coco_images, coco_anns, aid = [], [], 1
    labels = {i['id']: _yolo_label(anns.get(i['id'], []), i['width'], i['height'], cls) for i in images}
    for k, name in enumerate(names):
        src = train[k % N_TRAIN]; w, h = sizes[k]
        if (w, h) != (src['width'], src['height']): raise SystemExit(f"make: {src['file_name']} decodes as {w}x{h}, its entry says "
                                                                     f"{src['width']}x{src['height']}")
        coco_images.append(dict(id=k + 1, file_name=name, width=w, height=h))
        for a in anns.get(src['id'], []): coco_anns.append(dict(a, id=aid, image_id=k + 1)); aid += 1
        os.symlink(f'../../../train/{name}', out / 'ul/images/train' / name)
        if labels[src['id']]: (out / 'ul/labels/train' / f'{name[:-4]}.txt').write_text(labels[src['id']])
    for i in val:
        shutil.copyfile(SRC / 'images' / i['file_name'], out / 'val' / i['file_name'])
        os.symlink(f"../../../val/{i['file_name']}", out / 'ul/images/val' / i['file_name'])
        if labels[i['id']]: (out / 'ul/labels/val' / f"{Path(i['file_name']).stem}.txt").write_text(labels[i['id']])
    head = {k: d[k] for k in ('info', 'licenses') if k in d}
    (out / 'train.json').write_text(json.dumps(dict(head, images=coco_images, annotations=coco_anns, categories=d['categories'])))
    val_ids = {i['id'] for i in val}
    (out / 'val.json').write_text(json.dumps(dict(head, images=val, categories=d['categories'],
                                                  annotations=[a for a in d['annotations'] if a['image_id'] in val_ids])))
    (out / 'ul/data.yaml').write_text(f"path: {json.dumps(str(out / 'ul'))}\ntrain: images/train\nval: images/val\nnames:\n"
                                      + ''.join(f'  {i}: {json.dumps(c["name"])}\n' for i, c in enumerate(cats)))
    m = dict(n=n, recipe=RECIPE, folder=str(out), train_images=n, train_instances=len(coco_anns), val_images=len(val),
             ul_label_lines=sum(labels[train[k % N_TRAIN]['id']].count('\n') for k in range(n)),
             seconds=round(time.perf_counter() - t0, 2), processes=workers or os.cpu_count())
    man.write_text(json.dumps(m, indent=1))
    _write_result('scale', dict(what='the data set at scale (made by `make`)', stage='make', **m), tag=f'make_n{n}')
    print(f"make: {n} training images, {len(coco_anns)} instances, into {out} in {m['seconds']:.1f} s")
    return m


def lucid_data_args(ds: Path) -> list:
    return ['--data.train_images', str(ds / 'train'), '--data.train_annotations', str(ds / 'train.json'),
            '--data.val_images', str(ds / 'val'), '--data.val_annotations', str(ds / 'val.json')]


def config_data(smoke: bool) -> dict:
    "The GPU configuration's `data` settings (the smoke run's CPU overrides applied)."
    import yaml
    cfg = yaml.safe_load(CONFIG.read_text())['data']
    return {**cfg, 'workers': 0, 'imgsz': 64} if smoke else cfg


# ----------------------------------------------------------------------------------------------------------------- fit
def steady(epochs: list) -> dict:
    "Images/s of the epochs after the first (all of them with one epoch), from rows with `images` and `train_seconds`."
    later = epochs[1:] or epochs
    images, seconds = sum(e['images'] for e in later), sum(e['train_seconds'] for e in later)
    return dict(images_per_s=images / seconds if seconds else None, steady_images=images, steady_train_seconds=seconds,
                steady_data_wait_seconds=sum(e['data_wait_seconds'] or 0 for e in later))


def fit_lucid(arm: str, batch: int, ds: Path, a, work: Path) -> dict:
    extra = [*lucid_data_args(ds), '--trainer.max_epochs', str(a.epochs), '--data.close_mosaic', str(a.close_mosaic),
             *(SMOKE_LUCID if a.smoke else []), *a.extra]
    try: r = run_lucid(arm, batch, work, extra)
    except SystemExit as e: return dict(error=str(e)[-3000:])
    epochs = [dict(epoch=e['epoch'], steps=e['steps'], images=e['steps'] * batch, train_seconds=e['train_seconds'],
                   data_wait_seconds=e.get('data_wait_seconds'), validation_seconds=e['seconds'] - e['train_seconds'])
              for e in r['timing']['epochs']]
    keep = ('command', 'process_seconds', 'fit_seconds', 'startup_seconds', 'data_setup_seconds', 'first_step_seconds',
            'recording_seconds', 'fit_end_seconds', 'peak_reserved_mib', 'hashes', 'fallback_lines')
    return dict(**{k: r[k] for k in keep}, **steady(epochs), epochs=epochs)


UL_COMPILE = {'ul': 'off', 'ul-compile': 'default', 'ul-compile-ro': 'reduce-overhead', 'ul-compile-max': 'max-autotune-no-cudagraphs',
              'ul26': 'off'}
UL_MODEL = {'ul26': 'yolo26n-seg.yaml'}   # Ultralytics' model of an arm (default yolo11n-seg.yaml)

def fit_ul(batch: int, ds: Path, a, work: Path, arm: str = 'ul') -> dict:
    "One `ultralytics_run.py` process on the set's YOLO-seg copy (`ul-compile*`: with its `compile=` mode): its epochs, steady state and process seconds."
    cfg, out = config_data(a.smoke), work / f'{arm}_b{batch}.json'
    args = [sys.executable, str(BENCH / 'ultralytics_run.py'), '--data', str(ds / 'ul' / 'data.yaml'), '--batch', str(batch),
            '--epochs', str(a.epochs), '--imgsz', str(cfg['imgsz']), '--workers', str(cfg['workers']),
            '--close-mosaic', str(a.close_mosaic), '--cache', a.ul_cache, '--compile', UL_COMPILE[arm],
            '--model', UL_MODEL.get(arm, 'yolo11n-seg.yaml'),
            '--project', str(work / arm), '--json', str(out)]
    t0 = time.perf_counter()
    r = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if r.returncode or not out.exists(): return dict(error=(r.stdout + r.stderr)[-3000:])
    res = json.loads(out.read_text())
    keep = ('ultralytics', 'torch', 'cache', 'close_mosaic', 'workers', 'imgsz', 'setup_seconds', 'train_call_seconds',
            'epochs', 'peak_reserved_mib', 'compile')
    return dict(command=' '.join(args[1:]), process_seconds=wall, ul_process_seconds=res['process_seconds'],
                **steady(res['epochs']), **{k: res[k] for k in keep})


def summarize(runs: list, arms: list, batches: list) -> dict:
    "Per batch: each arm's median (min-max), each lucid arm's images/s over Ultralytics' per round, hash equality."
    keys = ('images_per_s', 'process_seconds', 'steady_data_wait_seconds', 'peak_reserved_mib', 'startup_seconds')
    s = {}
    for b in batches:
        ok = [r for r in runs if r['batch'] == b and 'error' not in r]
        by = {arm: [r for r in ok if r['arm'] == arm] for arm in arms}
        sb = {arm: {k: spread([r.get(k) for r in rs]) for k in keys} for arm, rs in by.items()}
        ul = {r['round']: r['images_per_s'] for r in by.get('ul', [])}
        sb['over_ul'] = {arm: [r['images_per_s'] / ul[r['round']] if ul.get(r['round']) else None for r in rs]
                         for arm, rs in by.items() if arm != 'ul' and not arm.endswith('26')} if ul else None
        ul26 = {r['round']: r['images_per_s'] for r in by.get('ul26', [])}   # YOLO26 against YOLO26
        sb['over_ul26'] = {arm: [r['images_per_s'] / ul26[r['round']] if ul26.get(r['round']) else None for r in rs]
                           for arm, rs in by.items() if arm.endswith('-26')} if ul26 else None
        ulc = {r['round']: r['images_per_s'] for r in by.get('ul-compile', [])}   # Ultralytics' fastest setting
        sb['over_ul_compile'] = {arm: [r['images_per_s'] / ulc[r['round']] if ulc.get(r['round']) else None for r in rs]
                                 for arm, rs in by.items() if arm not in UL_COMPILE} if ulc else None
        lucid = [r for r in ok if 'hashes' in r]   # the runs of one library (`@base`: the other), memory order (`-cl`) and task end byte-identical
        kind = lambda arm: ('baseline' if arm.endswith('@base') else 'current') + ''.join(k for k in ('-cl', '-detect', '-26') if k in arm)
        libs = {k: [r for r in lucid if kind(r['arm']) == k] for k in sorted({kind(r['arm']) for r in lucid})}
        sb['lucid_hashes_equal'] = {lib: len({json.dumps(r['hashes'], sort_keys=True) for r in rs}) == 1 for lib, rs in libs.items() if rs} or None
        sb['lucid_hashes'] = {lib: sorted({r['hashes'].get('all', '')[:12] for r in rs}) for lib, rs in libs.items() if rs}
        sb['failed_runs'] = [(r['arm'], r['round']) for r in runs if r['batch'] == b and 'error' in r]
        s[f'b{b}'] = sb
    return s


def fit(a, ds: Path) -> Path:
    arms = a.arms.split(',')
    if any(arm in UL_COMPILE for arm in arms) and not ul_importable():
        arms = [arm for arm in arms if arm not in UL_COMPILE]; print('fit: ultralytics does not import here: its arms are left out')
    if not arms: raise SystemExit('fit: no arm to run')
    loader_res = json.loads(Path(a.loader).read_text()) if a.loader else None
    runs, path = [], None
    for rnd in range(a.first_round, a.first_round + a.rounds):
        for b in a.batch:
            for arm in arms:
                work = Path(a.root) / 'runs' / f'n{a.n}' / f'b{b}' / f'round{rnd}'
                r = fit_ul(b, ds, a, work, arm) if arm in UL_COMPILE else fit_lucid(arm, b, ds, a, work)
                r = dict(arm=arm, batch=b, round=rnd, **r); runs.append(r)
                if 'error' in r: print(f'round {rnd} b{b} {arm:>6}: FAILED\n{r["error"][-1500:]}', flush=True)
                else: print(f"round {rnd} b{b} {arm:>6}: {r['images_per_s']:7.1f} images/s steady, process {r['process_seconds']:.1f} s, "
                            f"data wait {r['steady_data_wait_seconds']:.2f} s, peak {r['peak_reserved_mib'] or 0:.0f} MiB"
                            + (f", hashes {r['hashes']['all'][:12]}" if 'hashes' in r else ''), flush=True)
                summary = summarize(runs, arms, a.batch)   # after every run: a call cut short keeps what ran
                path = _write_result('scale', dict(
                    what='steady-state training images/s at scale: lucid native / whole step replayed / Ultralytics, '
                         'alternating processes', stage='fit', n=a.n, batches=a.batch, epochs=a.epochs, arms=arms,
                    rounds=a.rounds, first_round=a.first_round, close_mosaic=a.close_mosaic, ul_cache=a.ul_cache,
                    extra_args=a.extra, command=' '.join([sys.executable, *sys.argv]), summary=summary, runs=runs,
                    loader=loader_res and loader_over_fit(loader_res['rows'], summary, loader_res['batch_size'], a.loader)),
                    tag=f'fit_n{a.n}{a.tag}')
    for b in a.batch:
        sb = summary[f'b{b}']
        cells = '  '.join(f"{arm} {sb[arm]['images_per_s']['median']:.1f} ({sb[arm]['images_per_s']['min']:.1f}-"
                          f"{sb[arm]['images_per_s']['max']:.1f})" for arm in arms if sb[arm]['images_per_s'])
        over = '  '.join(f"{arm}/{ref} {statistics.median(x for x in v if x):.2f}x"
                         for ref, key in (('ul', 'over_ul'), ('ul-compile', 'over_ul_compile'), ('ul26', 'over_ul26'))
                         for arm, v in (sb.get(key) or {}).items() if any(v))
        print(f"batch {b}: images/s {cells}  {over}  lucid hashes equal: {sb['lucid_hashes_equal']}")
    if loader_res: print_loader_over_fit(loader_over_fit(loader_res['rows'], summary, loader_res['batch_size'], a.loader))
    print(f'-> {path}'); return path


# -------------------------------------------------------------------------------------------------------------- loader
def _children_cpu_seconds() -> float:
    "User + system CPU seconds of this process's live child processes (the loader's workers)."
    tick, total = os.sysconf('SC_CLK_TCK'), 0.
    for c in _children(os.getpid()):
        with contextlib.suppress(OSError):   # a worker that ended meanwhile
            f = Path(f'/proc/{c}/stat').read_text().rsplit(')', 1)[1].split()
            total += (int(f[11]) + int(f[12])) / tick
    return total


def loader_point(a, ds: Path, workers: int) -> dict:
    "One loader, `workers` workers: images/s per epoch and, for the epochs after the first, the CPU time per image of the trainer's process and of the workers."
    from lucid_nb.data import YoloData
    dm = YoloData(**{**config_data(a.smoke), 'batch_size': a.batch, 'workers': workers, 'close_mosaic': a.close_mosaic, 'max_epochs': a.loader_epochs},
                  train_images=str(ds / 'train'), train_annotations=str(ds / 'train.json'),
                  val_images=str(ds / 'val'), val_annotations=str(ds / 'val.json'))
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()): dm.setup('fit')
    setup, ld, epochs = time.perf_counter() - t0, dm.train_dataloader(), []
    for e in range(a.loader_epochs):
        ld.set_epoch(e); n, t, main, kids = 0, time.perf_counter(), time.process_time(), _children_cpu_seconds()
        for b in ld: n += len(b['img'])
        epochs.append(dict(images=n, seconds=time.perf_counter() - t, main_cpu_seconds=time.process_time() - main,
                           workers_cpu_seconds=_children_cpu_seconds() - kids))
    dm.teardown()
    later = epochs[1:] or epochs
    per_image = lambda k: 1e3 * sum(e[k] for e in later) / sum(e['images'] for e in later)
    return dict(workers=workers, images_per_s=statistics.median(e['images'] / e['seconds'] for e in later),
                images_per_s_each_epoch=[e['images'] / e['seconds'] for e in epochs], images_per_epoch=epochs[-1]['images'],
                main_cpu_ms_per_image=per_image('main_cpu_seconds'), workers_cpu_ms_per_image=per_image('workers_cpu_seconds'),
                setup_seconds=setup)


def loader(a, ds: Path) -> Path:
    "Each worker count, `--rounds` times; with `--base`, the library in $LUCID_NB_BASELINE alternating with this one (each leading in turn), each run its own process."
    libs = ['current', 'baseline'] if a.base else ['current']
    rows = []
    for r in range(a.rounds):
        for w in a.workers:
            for lib in libs if r % 2 == 0 else libs[::-1]:
                argv = [sys.executable, str(BENCH / 'scale.py'), '_loader_point', '--n', str(a.n), '--root', a.root, '--batch', str(a.batch),
                        '--workers', str(w), '--loader-epochs', str(a.loader_epochs), '--close-mosaic', str(a.close_mosaic)] + (['--smoke'] if a.smoke else [])
                cwd = arm_cwd('loader' + BASE) if lib == 'baseline' else ROOT
                p = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, env={**os.environ, 'PYTHONPATH': str(cwd)})
                if p.returncode != 0: raise SystemExit(f'loader ({lib}, {w} workers) failed:\n{p.stderr[-3000:]}')
                row = dict(json.loads(p.stdout.strip().splitlines()[-1]), library=lib, round=r); rows.append(row)
                print(f"loader {lib:8} round {r}: {w:>2} workers, batch {a.batch}: {row['images_per_s']:7.1f} images/s after warm-up; "
                      f"CPU ms an image: trainer's process {row['main_cpu_ms_per_image']:.2f}, workers {row['workers_cpu_ms_per_image']:.2f} "
                      f"(setup {row['setup_seconds']:.1f} s)", flush=True)
    summary = {f'{lib}_w{w}': {k: spread([x[k] for x in rows if x['library'] == lib and x['workers'] == w])
                               for k in ('images_per_s', 'main_cpu_ms_per_image', 'workers_cpu_ms_per_image')} for lib in libs for w in a.workers}
    if a.base:
        pair = lambda w, k: [c[k] / b[k] for r in range(a.rounds) for c in rows for b in rows if c['round'] == b['round'] == r
                             and c['workers'] == b['workers'] == w and c['library'] == 'current' and b['library'] == 'baseline']
        summary['current_over_baseline'] = {f'w{w}': {k: spread(pair(w, k)) for k in ('images_per_s', 'main_cpu_ms_per_image', 'workers_cpu_ms_per_image')}
                                            for w in a.workers}
    res = dict(what='training loader alone (YoloData.train_dataloader, GPU configuration data settings)', stage='loader',
               n=a.n, batch_size=a.batch, epochs=a.loader_epochs, rounds=a.rounds, close_mosaic=a.close_mosaic, data=config_data(a.smoke),
               baseline='$LUCID_NB_BASELINE' if a.base else None,   # its folder is this machine's
               cpu_count=os.cpu_count(), load_average=list(os.getloadavg()), rows=rows, summary=summary,
               command=' '.join([Path(sys.executable).name, *sys.argv]))
    if a.fit: res['fit'] = print_loader_over_fit(loader_over_fit([x for x in rows if x['library'] == 'current'],
                                                                 json.loads(Path(a.fit).read_text())['summary'], a.batch, a.fit))
    path = _write_result('scale', res, tag=f'loader_n{a.n}_b{a.batch}{a.tag}'); print(f'-> {path}'); return path


def loader_over_fit(rows: list, fit_summary: dict, batch: int, name: str) -> dict:
    "Each worker count's loader images/s over each fit arm's steady-state images/s at `batch` (its median)."
    arms = fit_summary.get(f'b{batch}') or {}
    need = {arm: v['images_per_s']['median'] for arm, v in arms.items() if isinstance(v, dict) and v.get('images_per_s')}
    return dict(file=str(name), batch_size=batch, fit_images_per_s=need, loader_images_per_s={r['workers']: r['images_per_s'] for r in rows},
                loader_over_fit={r['workers']: {arm: r['images_per_s'] / x for arm, x in need.items()} for r in rows})


def print_loader_over_fit(c: dict) -> dict:
    if not c['fit_images_per_s']: print(f"no steady-state images/s at batch {c['batch_size']} to compare the loader with")
    for w, q in c['loader_over_fit'].items():
        print(f"loader, {w} workers, over the fit's steady state at batch {c['batch_size']}: " + '  '.join(f'{arm} {x:.2f}x' for arm, x in q.items()))
    return c


# --------------------------------------------------------------------------------------------------------------- cache
def subset_json(ds: Path, n: int) -> Path:
    "A COCO JSON of the first `n` training images of `ds` (the same files and annotations): every N point of one made set."
    out = ds / 'subsets' / f'train{n}.json'
    if out.exists(): return out
    d = json.loads((ds / 'train.json').read_text())
    images = d['images'][:n]; ids = {i['id'] for i in images}
    out.parent.mkdir(exist_ok=True); tmp = out.with_suffix('.tmp')
    tmp.write_text(json.dumps(dict(d, images=images, annotations=[a for a in d['annotations'] if a['image_id'] in ids]))); tmp.replace(out)
    return out


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f'/proc/{pid}/status').read_text().splitlines():
        if line.startswith(key + ':'): return int(line.split()[1])
    return 0


def _pss_kib(pid: int) -> int:
    "Proportional set size: each page's bytes divided among the processes that share it (/proc/<pid>/smaps_rollup)."
    for line in Path(f'/proc/{pid}/smaps_rollup').read_text().splitlines():
        if line.startswith('Pss:'): return int(line.split()[1])
    return 0


def _children(pid: int) -> list:
    "The child processes of `pid`'s threads (a thread that ends meanwhile has none)."
    out = []
    for t in Path(f'/proc/{pid}/task').iterdir():
        with contextlib.suppress(OSError): out += [int(c) for c in (t / 'children').read_text().split()]
    return out


def cache_point(a):
    "One start in this process: `YoloData.setup` at one N and cache mode (and with workers, one epoch); a JSON row to `--out`."
    import logging
    from lucid_nb.data import YoloData
    ds, lines, me = Path(a.ds), [], os.getpid()
    h = logging.Handler(); h.emit = lambda r: lines.append(r.getMessage()); logging.getLogger('lucid_nb.data').addHandler(h)
    rss0 = _status_kib(me, 'VmRSS')
    dm = YoloData(train_images=str(ds / 'train'), train_annotations=a.json, val_images=str(ds / 'val'), val_annotations=str(ds / 'val.json'), imgsz=a.imgsz, batch_size=16, cache=a.cache,
                  cache_dir=a.cache_dir, workers=a.workers, prefetch=False, mosaic=0.)
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()): dm.setup('fit')
    row = dict(n=len(dm._train), cache=a.cache, used=dm.cache_mode, fit_line=next((l for l in lines if 'would take' in l), None),
               setup_seconds=round(time.perf_counter() - t0, 2), rss_before_mib=rss0 / 1024, rss_mib=_status_kib(me, 'VmRSS') / 1024,
               peak_rss_mib=_status_kib(me, 'VmHWM') / 1024, pss_mib=_pss_kib(me) / 1024, notes=dict(dm.report.notes))
    if a.epoch:   # one epoch (every image used), then the footprint of this process and its workers (still alive)
        ld, t0, k = dm.train_dataloader(), time.perf_counter(), 0
        for b in ld: k += len(b['img'])
        kids = _children(me)
        row.update(workers=a.workers, epoch_images=k, epoch_seconds=round(time.perf_counter() - t0, 2), pss_main_mib=_pss_kib(me) / 1024,
                   pss_workers_mib=[_pss_kib(c) / 1024 for c in kids], rss_workers_mib=[_status_kib(c, 'VmRSS') / 1024 for c in kids],
                   rss_main_mib=_status_kib(me, 'VmRSS') / 1024)
        row['pss_total_mib'] = row['pss_main_mib'] + sum(row['pss_workers_mib'])
        dm.teardown()
    Path(a.out).write_text(json.dumps(row))


def _dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob('*') if f.is_file()) if p.exists() else 0


def cache_scaling(a, ds: Path) -> Path:
    """RSS/PSS, setup seconds cold and warm and disk bytes against N for each cache mode, one fresh process a start; the
    largest N last (where the fit check may send the RAM cache to the disk: what it decided is recorded)."""
    rows, runs, t_start = [], Path(a.root) / 'cache_runs', time.perf_counter()
    shutil.rmtree(runs, ignore_errors=True)
    def point(n, cache, cache_dir, workers=0, epoch=False):
        out = runs / f'row_{n}_{cache}_{workers}_{time.monotonic_ns()}.json'
        args = [sys.executable, str(Path(__file__).resolve()), '_cache_point', '--ds', str(ds), '--json', str(subset_json(ds, n)),
                '--cache', cache, '--cache-dir', str(cache_dir), '--imgsz', str(a.imgsz), '--workers', str(workers), '--out', str(out), *(['--epoch'] if epoch else [])]
        t0 = time.perf_counter()
        r = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
        if r.returncode: raise SystemExit(f'cache point {n} {cache}: failed:\n{r.stderr[-3000:]}')
        return dict(json.loads(out.read_text()), process_seconds=round(time.perf_counter() - t0, 2))
    runs.mkdir(parents=True)
    if a.pss_into:   # the N points of an earlier result, the workers measurement again
        old = json.loads(Path(a.pss_into).read_text())
        rows, a.points = old['rows'], old['points']
        rows_from = dict(file=Path(a.pss_into).name, commit=old['env'].get('commit'), command=old.get('command'), seconds=old.get('seconds'))
    for n in sorted(a.points) if not a.pss_into else []:
        for cache in a.modes:
            cd = runs / f'{cache}_{n}'
            cold = point(n, cache, cd); disk_bytes = _dir_bytes(cd); warm = point(n, cache, cd)
            row = dict(n=n, cache=cache, used=cold['used'], fit_line=cold['fit_line'], cold=cold, warm=warm, disk_bytes=disk_bytes,
                       warm_over_cold=round(warm['setup_seconds'] / cold['setup_seconds'], 3))
            rows.append(row); shutil.rmtree(cd, ignore_errors=True)
            print(f"cache n={n:>6} {cache:>4} (used {cold['used']}): setup cold {cold['setup_seconds']:6.1f} s, warm {warm['setup_seconds']:6.1f} s "
                  f"({row['warm_over_cold']:.0%}); peak RSS {cold['peak_rss_mib']:7.0f} MiB, PSS {cold['pss_mib']:7.0f} MiB; "
                  f"disk {disk_bytes / 2**20:7.0f} MiB; {time.perf_counter() - t_start:.0f} s so far", flush=True)
            if cold['fit_line']: print('   ', cold['fit_line'], flush=True)
    shared = []
    for w in (0, a.pss_workers) if a.pss_n else ():   # the RAM cache with loader workers: PSS over the main process and its workers after an epoch
        r = point(a.pss_n, 'ram', runs / 'pss', w, epoch=True); shared.append(r)
        print(f"workers {w}: n={a.pss_n} RAM cache, after one epoch: PSS total {r.get('pss_total_mib', r['pss_mib']):.0f} MiB "
              f"(main {r.get('pss_main_mib', r['pss_mib']):.0f}, workers {[round(x) for x in r.get('pss_workers_mib', [])]}); "
              f"RSS of each worker {[round(x) for x in r.get('rss_workers_mib', [])]} MiB", flush=True)
    shutil.rmtree(runs, ignore_errors=True)
    res = dict(what='cache modes against N: setup seconds cold and warm, RSS/PSS, disk bytes; RAM cache PSS with loader workers',
               stage='cache', imgsz=a.imgsz, points=sorted(a.points), modes=a.modes, rows=rows, workers_pss=shared,
               seconds=round(time.perf_counter() - t_start, 1), cpu_count=os.cpu_count(), load_average=list(os.getloadavg()),
               command=' '.join([sys.executable, *sys.argv]), **({'rows_from': rows_from} if a.pss_into else {}))
    path = _write_result('scale', res, tag=f'cache_n{max(a.points)}{a.tag}'); print(f'-> {path}'); return path


def index_point(a):
    "One read of the label index in this process, under tracemalloc: the JSON's, the cached index's, or a revision's `read_records`."
    import gc, tracemalloc
    from lucid_nb.cache import label_index
    from lucid_nb.data import DataReport
    images = Path(a.ds) / 'train'
    gc.collect(); tracemalloc.start(); t0 = time.perf_counter()
    if a.baseline:   # a revision's records (its polygons as it keeps them), from the JSON
        from common import load_baseline
        coco = load_baseline(a.baseline, module='coco')
        d = coco.load_coco_json(a.json); recs = coco.read_records(d, images, coco.coco_categories(d)[0], coco.DataReport())
    else:
        idx, d = label_index(a.json, images, DataReport(), cache=True, cache_dir=a.cache_dir); recs = idx.records
    seconds = time.perf_counter() - t0
    with_json = tracemalloc.get_traced_memory()[0]; del d; gc.collect()
    records, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    Path(a.out).write_text(json.dumps(dict(n=len(recs), instances=sum(len(r.instances) for r in recs), seconds=round(seconds, 2),
                                           traced_with_json_mib=with_json / 2**20, traced_records_mib=records / 2**20, traced_peak_mib=peak / 2**20,
                                           records_bytes_per_image=round(records / len(recs)))))


def index_memory(a, ds: Path) -> Path:
    "The label index of N images: seconds and memory per image read from the JSON (cold), from its cache file (warm), and by `--baseline`."
    work = Path(a.root) / 'index_runs'; shutil.rmtree(work, ignore_errors=True); work.mkdir(parents=True)
    js = subset_json(ds, a.n) if a.n < json.loads((ds / 'manifest.json').read_text())['n'] else ds / 'train.json'
    def point(baseline=''):
        out = work / f'{time.monotonic_ns()}.json'
        r = subprocess.run([sys.executable, str(Path(__file__).resolve()), '_index_point', '--ds', str(ds), '--json', str(js),
                            '--cache-dir', str(work), '--out', str(out), '--baseline', baseline], capture_output=True, text=True, cwd=ROOT)
        if r.returncode: raise SystemExit(f'index point failed:\n{r.stderr[-3000:]}')
        return json.loads(out.read_text())
    rows = dict(cold=point(), warm=point(), **({f'baseline_{a.baseline}': point(a.baseline)} if a.baseline else {}))
    index_bytes = sum(f.stat().st_size for f in work.glob('*.labels.npz'))
    for k, r in rows.items():
        print(f"index {k:>16}: {r['n']} images, {r['seconds']:.2f} s, records {r['traced_records_mib']:.1f} MiB "
              f"({r['records_bytes_per_image']} B/image), with the parsed JSON {r['traced_with_json_mib']:.1f} MiB", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    res = dict(what='label index of N images: read from the JSON (cold), from its cache file (warm), by a revision; tracemalloc bytes',
               stage='index', n=a.n, json_bytes=js.stat().st_size, index_file_bytes=index_bytes, rows=rows, command=' '.join([sys.executable, *sys.argv]))
    path = _write_result('scale', res, tag=f'index_n{a.n}{a.tag}'); print(f'-> {path}'); return path


# ------------------------------------------------------------------------------------------------------------- profile
def profile(a, ds: Path) -> Path:
    with tempfile.TemporaryDirectory(prefix='scale_profile_') as tmp:
        out = Path(tmp) / 'profile.json'
        cb = dict(class_path='profile_fit.KernelProfile',
                  init_args=dict(out=str(out), warmup=a.warmup, timed=a.timed, steps=a.steps, parts=not a.capture))
        args = [sys.executable, '-c', LUCID, 'fit', '--config', str(CONFIG), *lucid_data_args(ds), '--data.batch_size', str(a.batch),
                '--data.close_mosaic', str(a.close_mosaic), '--trainer.max_epochs', '1000',
                '--trainer.max_steps', str(a.warmup + a.timed + a.steps + 1), '--trainer.limit_val_batches', '0',
                '--trainer.enable_checkpointing', 'false', '--trainer.enable_progress_bar', 'false', '--trainer.logger', 'false',
                '--trainer.default_root_dir', tmp, '--trainer.callbacks', json.dumps(cb),
                *(['--model.capture_train_step', 'true'] if a.capture else []), *(SMOKE_LUCID if a.smoke else []), *a.extra]
        env = {**os.environ, 'PYTHONPATH': os.pathsep.join([str(BENCH), *filter(None, [os.environ.get('PYTHONPATH')])])}
        t0 = time.perf_counter()
        r = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env)
        if r.returncode or not out.exists(): raise SystemExit(f'profile: lucid fit failed:\n{r.stderr[-4000:]}')
        res = json.loads(out.read_text())
    res.update(what=f"training step kernel time per image, {'the whole step replayed' if a.capture else 'native'}", stage='profile',
               n=a.n, capture=a.capture, process_seconds=time.perf_counter() - t0, lucid_args=args[3:],
               fallback_lines=[l for l in r.stderr.splitlines() if 'capture_' in l])
    print(f"profile b{a.batch}{' capture' if a.capture else ''}: {res['total_us_per_image']:.1f} us/image ({res['clock']}), "
          f"timed {res['timed_images_per_s']:.1f} images/s; parts {res['by_part_us_per_image']}; families {res['by_family_us_per_image']}")
    path = _write_result('scale', res, tag=f"profile_n{a.n}_b{a.batch}{'_capture' if a.capture else ''}{a.tag}")
    print(f'-> {path}'); return path


# ---------------------------------------------------------------------------------------------------------------- main
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0].replace('\n', ' '))
    p.add_argument('--smoke', action='store_true', help='every stage tiny on the CPU (8 images, 64 px, batch 2), results in a temp folder')
    sub = p.add_subparsers(dest='stage')
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument('--n', type=int, default=4096, help='training images (default 4096)')
    common.add_argument('--root', default='/tmp/lucid_scale', help='folder of the data sets (n<N>/) and runs')
    common.add_argument('--close-mosaic', type=int, default=0, help='epochs at the end without mosaic, both trainers (default 0: mosaic always)')
    common.add_argument('--tag', default='', help='appended to the result file name (e.g. _r1 for a later round)')
    common.add_argument('--smoke', action='store_true', help=argparse.SUPPRESS)
    common.add_argument('extra', nargs='*', help='extra `lucid fit` arguments, after --')
    sub.add_parser('make', parents=[common]).add_argument('--processes', type=int, help='encoding processes (default: CPU count)')
    f = sub.add_parser('fit', parents=[common])
    f.add_argument('--batch', type=int, nargs='+', default=[32, 64]); f.add_argument('--epochs', type=int, default=3)
    f.add_argument('--rounds', type=int, default=1); f.add_argument('--first-round', type=int, default=0)
    f.add_argument('--arms', default='native,step,ul')
    f.add_argument('--loader', help="a `loader` result: its images/s over each arm's steady state at the loader's batch")
    f.add_argument('--ul-cache', default='none', choices=('none', 'ram', 'disk'), help="Ultralytics' image cache (default: its own, none)")
    l = sub.add_parser('loader', parents=[common])
    l.add_argument('--batch', type=int, default=64); l.add_argument('--workers', type=int, nargs='+', default=[8, 16])
    l.add_argument('--loader-epochs', type=int, default=2, help='epochs, the first a warm-up (default 2)')
    l.add_argument('--fit', help="a `fit` result: the loader's images/s over each arm's steady state at this batch")
    l.add_argument('--rounds', type=int, default=1, help='each worker count this many times (default 1)')
    l.add_argument('--base', action='store_true', help='also the library in $LUCID_NB_BASELINE, alternating with this one')
    lp = sub.add_parser('_loader_point', parents=[common])   # one loader, in its own process (loader)
    lp.add_argument('--batch', type=int, required=True); lp.add_argument('--workers', type=int, required=True)
    lp.add_argument('--loader-epochs', type=int, required=True)
    m = sub.add_parser('merge', help="join `fit` results of several calls into one (each part's file and env kept)")
    m.add_argument('parts', nargs='+'); m.add_argument('--out-tag', required=True, help='the joined file: scale_<device>_<commit>_<tag>.json')
    q = sub.add_parser('profile', parents=[common])
    q.add_argument('--batch', type=int, default=64); q.add_argument('--capture', action='store_true')
    q.add_argument('--warmup', type=int, default=8); q.add_argument('--timed', type=int, default=10)
    q.add_argument('--steps', type=int, default=5, help='profiled steps (K)')
    c = sub.add_parser('cache', parents=[common])
    c.add_argument('--points', type=int, nargs='+', default=[128, 1024, 4096, 16384], help='N values (the largest is made; the others are its first N)')
    c.add_argument('--imgsz', type=int, default=640); c.add_argument('--pss-n', type=int, default=1024, help='N of the workers measurement')
    c.add_argument('--pss-workers', type=int, default=4)
    c.add_argument('--modes', nargs='+', default=['none', 'ram', 'disk'], choices=['none', 'ram', 'disk'], help='cache modes to start (default: all three)')
    c.add_argument('--pss-into', help='an earlier `cache` result: keep its N points, measure the workers again')
    ix = sub.add_parser('index', parents=[common]); ix.add_argument('--baseline', default='', help='a revision whose read_records to measure too')
    ip = sub.add_parser('_index_point')   # one read, in its own process (index_memory)
    for k in ('--ds', '--json', '--cache-dir', '--out', '--baseline'): ip.add_argument(k, required=True)
    cp = sub.add_parser('_cache_point')   # one start, in its own process (cache_scaling)
    for k in ('--ds', '--json', '--cache', '--cache-dir', '--out'): cp.add_argument(k, required=True)
    for k in ('--imgsz', '--workers'): cp.add_argument(k, type=int, required=True)
    cp.add_argument('--epoch', action='store_true', help='after setup, one training epoch, then the PSS of this process and its workers')
    return p


def smoke(p: argparse.ArgumentParser):
    "Every stage tiny on this CPU into a temporary folder; the ul arm only where ultralytics imports."
    global RESULTS
    tmp = Path(tempfile.mkdtemp(prefix='scale_smoke_')); RESULTS = tmp / 'results'
    os.environ.setdefault('OMP_NUM_THREADS', '1')   # a shared small CPU: one thread per process avoids stalls
    root = ['--n', '8', '--root', str(tmp), '--smoke']
    t0 = time.perf_counter()
    for argv in (['make', *root], ['make', *root],       # the second finds the manifest
                 ['loader', *root, '--batch', '2', '--workers', '0', '2'],
                 ['fit', *root, '--batch', '2', '--epochs', '2', '--loader', 'LAST'],
                 ['loader', *root, '--batch', '2', '--workers', '2', '--fit', 'LAST'],
                 ['profile', *root, '--batch', '2', '--warmup', '1', '--timed', '1', '--steps', '2'],
                 ['profile', *root, '--batch', '2', '--warmup', '1', '--timed', '1', '--steps', '2', '--capture']):
        a = p.parse_args([x if x != 'LAST' else str(last) for x in argv])
        print(f"== smoke: scale.py {' '.join(argv)}", flush=True)
        last = run(a)
    print(f'smoke: every stage ran in {time.perf_counter() - t0:.0f} s; results in {RESULTS}')


def run(a):
    if a.stage == '_cache_point': return cache_point(a)
    if a.stage == '_index_point': return index_point(a)
    if a.stage == '_loader_point': return print(json.dumps(loader_point(a, Path(a.root) / f'n{a.n}', a.workers), default=float))
    if a.stage == 'cache': a.n = max(json.loads(Path(a.pss_into).read_text())['points'] if a.pss_into else a.points)
    m = make(a.n, Path(a.root), getattr(a, 'processes', None))
    ds = Path(m['folder'])
    return {'make': lambda: m, 'fit': lambda: fit(a, ds), 'loader': lambda: loader(a, ds), 'profile': lambda: profile(a, ds),
            'cache': lambda: cache_scaling(a, ds), 'index': lambda: index_memory(a, ds)}[a.stage]()


def merge_fits(paths: list, out_tag: str) -> Path:
    "One `fit` result of several calls' parts (the same N and epochs): runs joined, arms and batches united, summary redone."
    parts = [json.loads(Path(p).read_text()) for p in paths]
    if len({(q['n'], q['epochs'], q['close_mosaic']) for q in parts}) != 1: raise SystemExit('scale merge: the parts differ in N, epochs or mosaic')
    runs = [dict(r, part=Path(p).name) for p, q in zip(paths, parts) for r in q['runs']]
    arms = list(dict.fromkeys(arm for q in parts for arm in q['arms']))
    batches = sorted({b for q in parts for b in q['batches']})
    first, device = parts[0], Path(paths[0]).name.split('_')[1]   # scale_<device>_<commit>_...: the device the parts ran on
    return _write_result('scale', dict(first, arms=arms, batches=batches, runs=runs, summary=summarize(runs, arms, batches),
                                       parts=[dict(file=Path(p).name, env=q['env'], command=q['command']) for p, q in zip(paths, parts)],
                                       command=' '.join([Path(sys.executable).name, *sys.argv])), device=device, tag=out_tag)


def main(argv=None):
    p = parser()
    a = p.parse_args(argv)
    if a.smoke and a.stage is None: return smoke(p)
    if a.stage == 'merge': print('->', merge_fits(a.parts, a.out_tag)); return
    if a.stage is None: p.error('give a stage (make, fit, loader, profile) or --smoke')
    run(a)


if __name__ == '__main__':
    main()
