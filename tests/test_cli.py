"""The console script (`lucid_nb.cli.main`): its exit (the status, `atexit` handlers and non-daemon threads as a normal exit has
them), and the one line it gives for a broken config file and for out-of-range model options."""
import json, os, re, socket, subprocess, sys, textwrap
from pathlib import Path

import pytest

from helpers import lucid_main, tiny

PROBE = textwrap.dedent("""
    import atexit, sys, threading, time
    atexit.register(lambda: print('atexit ran', flush=True))
    import lucid_nb.command as T
    done, command = threading.Event(), T.command_main
    def traced(*args):
        try: command(*args)
        finally: done.set()
    T.command_main = traced                                     # the command, then a signal to the thread below
    def late(): done.wait(); time.sleep(.3); print('thread done', flush=True)
    threading.Thread(target=late).start()                 # not a daemon: a normal exit waits for it
    sys.argv = ['lucid', *sys.argv[1:]]
    from lucid_nb.cli import main
    main()
    print('not reached', flush=True)
""")


def _run(*args, env=None):
    import os
    return subprocess.run([sys.executable, '-c', PROBE, *args], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, **(env or {})))


@pytest.mark.slow
@pytest.mark.parametrize('fast', ['1', '0'])
def test_console_exit_keeps_status_threads_and_atexit(fast):
    ok = _run('fit', '--help', env={'LUCID_NB_FAST_EXIT': fast})
    assert ok.returncode == 0 and '--trainer.max_epochs' in ok.stdout
    assert ok.stdout.splitlines()[-2:] == ['thread done', 'atexit ran'] and 'not reached' not in ok.stdout
    bad = _run('fit', '--data.imgsz', 'big', env={'LUCID_NB_FAST_EXIT': fast})
    assert bad.returncode == 2 and bad.stderr.count('\n') == 1 and 'lucid: error:' in bad.stderr
    assert bad.stdout.splitlines()[-2:] == ['thread done', 'atexit ran']


OPTIONAL = {'transformers': '4.57.0', 'torchvision': '0.26.0', 'scipy': '1.16.0'}   # what torchmetrics imports if installed


def _optional_site(folder):
    "Stand-ins for the optional packages, with distribution metadata: importing one raises, so a test sees who imports it."
    for name, version in OPTIONAL.items():
        (folder / name).mkdir()
        (folder / name / '__init__.py').write_text(f"raise RuntimeError('{name} was imported')\n")
        (folder / f'{name}-{version}.dist-info').mkdir()
        (folder / f'{name}-{version}.dist-info' / 'METADATA').write_text(f'Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n')
    return folder


LEAN_PROBE = textwrap.dedent("""
    import sys
    sys.argv = ['lucid', 'fit', '--help']
    from lucid_nb.cli import run
    status = run()
    print('status', status, sorted(n for n in %r if n in sys.modules))
    try: import torchvision                # after the trainer's import the user's code sees it again
    except RuntimeError as e: print(e)
""" % (tuple(OPTIONAL),))


def test_lucid_imports_lightning_without_the_optional_packages(tmp_path):
    import os
    path = os.pathsep.join([str(_optional_site(tmp_path)), *filter(None, [os.environ.get('PYTHONPATH')])])
    probe = lambda lean: subprocess.run([sys.executable, '-c', LEAN_PROBE], capture_output=True, text=True, timeout=300,
                                        env=dict(os.environ, PYTHONPATH=path, LUCID_NB_LEAN_IMPORTS=lean))
    lean = probe('1')
    assert lean.returncode == 0, lean.stderr[-3000:]
    assert '--trainer.max_epochs' in lean.stdout
    assert lean.stdout.splitlines()[-2:] == ['status 0 []', 'torchvision was imported']
    full = probe('0')                      # the stand-ins are real to torchmetrics: without hiding, it imports them
    assert full.returncode != 0 and 'was imported' in full.stderr


def test_a_broken_config_file_is_named(tmp_path, monkeypatch, capsys):
    "YAML's own message names the text `<unicode string>`; the one line names the file."
    (bad := tmp_path / 'bad.yaml').write_text('trainer:\n  max_epochs: [1\n')
    assert lucid_main(monkeypatch, 'fit', '--config', str(bad)) == 2
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert str(bad) in last_line and '<unicode string>' not in last_line, last_line


@pytest.mark.parametrize('option, value, says', [('lr', '-1', 'must be positive'), ('momentum', '1.5', 'must be in [0, 1)'),
                                                 ('max_det', '0', 'must be at least 1')])
def test_out_of_range_model_options_are_named(tmp_path, monkeypatch, capsys, option, value, says):
    assert lucid_main(monkeypatch, *tiny(tmp_path, f'--model.{option}', value, epochs=1)) == 2
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert last_line.startswith(f'lucid: error: --model.{option}={float(value) if option != "max_det" else int(value)} {says}'), last_line


@pytest.mark.parametrize('given, means', [('1', 1), ('3', 3), ('1.0', 1.0), ('0.25', 0.25)])
def test_batch_limits_are_counts_when_written_as_integers(tmp_path, given, means):
    "Lightning types `limit_*_batches` float first, so `1` became 1.0 (all batches); `1` must mean one batch, on the command line and in a config."
    from lucid_nb.command import cli_main
    (cfg := tmp_path / 'limits.yaml').write_text(f'trainer:\n  limit_val_batches: {given}\n')
    cli = cli_main([*tiny(tmp_path)[1:], '--config', str(cfg), '--trainer.limit_train_batches', given], run=False)
    for limit in (cli.trainer.limit_train_batches, cli.trainer.limit_val_batches):
        assert limit == means and type(limit) is type(means), (given, limit)


# ---- every hint that names an option is a spelling the parser takes (issue 48) ----

SAMPLE = {'CKPT': 'x.ckpt', 'DIR': '/tmp/elsewhere', 'N': '5'}   # the placeholders a hint may give for a value
WORDS = {'and', 'or', 'on', 'to', 'with', 'for', 'if', 'the', 'a', 'in', 'from', 'of', 'is', 'at'}   # of the sentence, not a value
NO_VALUE = {'--ckpt_path': 'x.ckpt', '--trainer.devices': '1', '--model.size': 'n', '--data.val_count': '8', '--data.val_images': 'images', '--data.val_annotations': 'val.json', '--model.weights': 'x.pt', '--model.task': 'detect'}


def hint_options(msg: str) -> list:
    "The command-line words of the options `msg` names: each option, then its value (a sample for a placeholder or none)."
    out = []
    for m in re.finditer(r'(--[a-z_]+(?:\.[a-z_]+)*)(?:[ =]([^\s,;()]+))?', msg):
        opt, v = m.group(1), m.group(2)
        v = v.rstrip(':') if v and v.rstrip(':') not in WORDS else None
        out += [opt, SAMPLE.get(v, v) if v else NO_VALUE[opt]]
    return out


def hints(tmp_path, monkeypatch) -> dict:
    "The message of every hint that tells the user which option to give, made by the code that says it."
    import types, torch
    from pathlib import Path
    from lucid_nb import cache
    from lucid_nb.command import other_run_folder, refuse_earlier_run, refuse_resume_changes
    from lucid_nb.run_folder import acquire_run_lock
    from lucid_nb.saving import AtomicCheckpoint
    from lucid_nb.trainer import ddp_blocker
    from lightning.pytorch.strategies import DDPStrategy
    from lucid_nb.weights import Weights
    from test_data import dm_for, make_coco
    def said(f, *a, **k):
        try: f(*a, **k)
        except Exception as e: return str(e)
        raise AssertionError(f'{f.__name__} said nothing')
    run = tmp_path / 'runs' / 'lucid' / 'version_0'; (run / 'checkpoints').mkdir(parents=True); (run / 'metrics.csv').write_text('')
    torch.save({'epoch': 0}, run / 'checkpoints' / 'last.ckpt'); (run.parent / 'version_1').mkdir()
    (run / 'lucid.lock').write_text(json.dumps(dict(pid=os.getpid(), host=socket.gethostname())))   # a live run holds it
    trainer = types.SimpleNamespace(state=types.SimpleNamespace(fn='fit'), ckpt_path=str(run / 'checkpoints' / 'last.ckpt'),
                                    is_global_zero=False, max_epochs=1)
    w = Weights({}, 'n', 3, 'ultralytics', Path('yolo11n.pt'), task='detect')
    pose = Weights({}, 'n', 3, 'ultralytics', Path('yolo11n-pose.pt'), task='pose')
    monkeypatch.setattr(cache, 'disk_free', lambda folder: 1)
    coco = make_coco(tmp_path / 'coco')
    return {
        'lock': said(acquire_run_lock, run, other_run_folder(run)),
        'lock, no logger': other_run_folder(run, logged=False),
        'an earlier run': said(refuse_earlier_run, run, other_run_folder(run)),
        'a complete run': said(AtomicCheckpoint().on_load_checkpoint, trainer, None, {'epoch': 0}),
        'the cache fits nowhere': cache.fit_cache('disk', 10**12, tmp_path / 'cache')[1],
        'another size': said(w.check_size, 's'),
        'another task': said(w.check_task, 'segment'),
        'a task lucid has not': said(pose.check_lucid_task),
        'a changed optimiser on resume': said(refuse_resume_changes, {'lr': 0.05}, {'lr': 0.01}, {'lr'}),
        'val_count': said(dm_for(coco, val_count=7).setup),
        'one of a pair': said(dm_for, coco, val_images='x'),
        'too few batches': said(few_batches(dm_for(coco, val_batch_size=2)).val_dataloader),
        'not DDP': ddp_blocker(types.SimpleNamespace(world_size=2, strategy=object()), torch.nn.Linear(1, 1), 'fit'),
        'predict on devices': ddp_blocker(types.SimpleNamespace(world_size=2, strategy=DDPStrategy()), torch.nn.Linear(1, 1), 'predict'),
    }


def few_batches(dm):
    "`dm` set up, its validation split of 3 images for 4 processes (a SimpleNamespace trainer): too few batches for them."
    import types, torch
    dm.setup()
    dm.trainer = types.SimpleNamespace(global_rank=3, world_size=4, max_epochs=1, state=types.SimpleNamespace(fn='validate'),
                                       strategy=types.SimpleNamespace(root_device=torch.device('cpu')))
    return dm


def test_every_hint_is_a_spelling_the_parser_takes(tmp_path, monkeypatch, capsys):
    """Each hint that names an option gives it as the parser takes it: `lucid fit` parses the hint's options (a placeholder's
    sample value in their place). The lock's "give another --trainer.logger version" had none: `--trainer.logger.version v2`
    alone is ~900 characters of parser error; the options it gives now put the run in the next free version folder."""
    from lucid_nb.command import cli_main
    said = hints(tmp_path, monkeypatch)
    cli = cli_main(['--trainer.accelerator', 'cpu'], run=False)
    cli.setup_parser(True, {}, {})   # the parser of `lucid fit|validate|...`, as the command has it
    for what, msg in said.items():
        words = hint_options(msg)
        assert words, (what, msg)
        try: cli.parser.parse_args(['fit', *words])
        except SystemExit: pytest.fail(f"{what}: {msg!r}: `lucid fit {' '.join(words)}` is refused: {capsys.readouterr().err}")
    lock = hint_options(said['lock'])
    assert lock[:6] == ['--trainer.logger.save_dir', str(tmp_path / 'runs'), '--trainer.logger.name', 'lucid', '--trainer.logger.version', '2']
    monkeypatch.chdir(tmp_path)
    for base in ([], ['--config', str(Path(__file__).resolve().parent.parent / 'configs' / 'coco128-seg-n-cpu.yaml')]):
        cli = cli_main(['--trainer.accelerator', 'cpu', *base, *lock[:6]], run=False)   # with or without a config that names the logger
        assert Path(cli.trainer.log_dir) == tmp_path / 'runs' / 'lucid' / 'version_2'
    cli = cli_main(['--trainer.accelerator', 'cpu', '--trainer.logger', 'false', *hint_options(said['lock, no logger'])], run=False)
    assert Path(cli.trainer.default_root_dir) == Path(str(tmp_path / 'runs' / 'lucid' / 'version_0') + '-2')


def test_no_sanity_validation_unless_asked(tmp_path, monkeypatch):
    "`lucid fit` validates nothing before its first epoch (Lightning's default: 2 sanity batches, a young model's slowest part on the CPU) unless `--trainer.num_sanity_val_steps N` asks."
    from lucid_nb.command import cli_main
    monkeypatch.chdir(tmp_path)
    assert cli_main(['--trainer.accelerator', 'cpu'], run=False).trainer.num_sanity_val_steps == 0
    assert cli_main(['--trainer.accelerator', 'cpu', '--trainer.num_sanity_val_steps', '2'], run=False).trainer.num_sanity_val_steps == 2
