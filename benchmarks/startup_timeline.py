"""Where the time before the first training step goes: wall-clock marks from process start (a diagnostic).

Usage (repository root): T0=$(date +%s.%N) python benchmarks/startup_timeline.py [lucid fit options...]
Imports torch, torchmetrics, Lightning and `lucid_nb.trainer` one after the other, then runs a 1-epoch
`lucid fit --config configs/coco128-seg-n.yaml` with the first calls of the CLI's parse/instantiate, `Trainer`,
the data module and the module's hooks wrapped to print `[seconds since T0] name >` / `<` (after a device
synchronisation). Run it twice: the first process of a machine whose environment turns bytecode caching off
compiles every import.
"""
import functools, os, sys, time
T0 = float(os.environ['T0'])
def mark(what): print(f'[{time.time()-T0:6.2f}] {what}', flush=True)
mark('python main')
from lucid_nb.cli import enable_bytecode_cache, lean_imports; enable_bytecode_cache()
with lean_imports():   # as the `lucid` command imports them
    import torch; mark('torch')
    import torchmetrics; mark('torchmetrics')
    import lightning.pytorch; mark('lightning')
    import lucid_nb.command as T; mark('lucid_nb.command')
def wrap(cls, name, limit=3):
    orig = getattr(cls, name); n = [0]
    def w(*a, **k):
        n[0] += 1
        if n[0] <= limit: mark(f'{cls.__name__}.{name} >')
        r = orig(*a, **k)
        if n[0] <= limit:
            if torch.cuda.is_initialized(): torch.cuda.synchronize()
            mark(f'{cls.__name__}.{name} <')
        return r
    setattr(cls, name, functools.wraps(orig)(w))
for name in ['setup', 'configure_optimizers', 'on_fit_start', 'on_train_start', 'on_train_epoch_start', 'training_step', 'on_train_batch_end', 'on_validation_start', 'on_fit_end']:
    wrap(T.LitYolo, name)
for name in ['setup', 'train_dataloader', 'val_dataloader']: wrap(T.YoloData, name)
for name in ['parse_arguments', 'instantiate_classes']: wrap(T.LucidCLI, name)
import lightning.pytorch as pl
wrap(pl.Trainer, '__init__'); wrap(pl.Trainer, 'fit')
sys.argv = ['lucid', 'fit', '--config', 'configs/coco128-seg-n.yaml', '--trainer.max_epochs', '1'] + sys.argv[1:]
try: T.main()
except SystemExit: pass
mark('end')
