"""The console script (`lucid_nb.cli.main`): its exit (the status, `atexit` handlers and non-daemon threads as a normal exit has
them), and the one line it gives for a broken config file and for out-of-range model options."""
import subprocess, sys, textwrap

import pytest

from helpers import lucid_main, tiny

PROBE = textwrap.dedent("""
    import atexit, sys, threading, time
    atexit.register(lambda: print('atexit ran', flush=True))
    import lucid_nb.command as T
    done, command = threading.Event(), T.main
    def traced(*args):
        try: command(*args)
        finally: done.set()
    T.main = traced                                       # the command, then a signal to the thread below
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
