"""Every `lucid` command ends within seconds of its last line, whatever threads its data path started: prefetch on
and off, loader workers 0 and 2, each cache, augmentation on the CPU or the device, a fit that stops on a data error,
and a script that predicts through the Python API. Each runs in a process of its own (a thread nobody ends keeps a
process alive only at its very end), with a long `LUCID_NB_EXIT_WAIT`: a forgotten thread shows as a process that
outlives its last line by that long and names the thread."""
import os, subprocess, sys, textwrap, threading, time
from pathlib import Path

import pytest

from helpers import LUCID, ROOT, tiny
from test_data import make_coco

TESTS = Path(__file__).resolve().parent
EXIT_SECONDS = 8      # a process's end after its last line: the quick exit takes well under 1 s, a loaded 2-core CI more
FORGOTTEN = 120       # LUCID_NB_EXIT_WAIT here: how long a forgotten thread would hold the exit
LEFT_RUNNING = 'thread(s) still running'


def run_timed(args: list, cwd: Path, timeout: float = 400) -> tuple[int, list[str], float]:
    "Run `args` with stdout and stderr merged: (exit status, lines, seconds from the last line to the process's end)."
    env = {**os.environ, 'LUCID_NB_EXIT_WAIT': str(FORGOTTEN), 'PYTHONUNBUFFERED': '1',
           'PYTHONPATH': os.pathsep.join([str(TESTS), os.environ.get('PYTHONPATH', '')])}
    proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, last = [], [time.monotonic()]
    def read():
        for line in proc.stdout: lines.append(line.rstrip('\n')); last[0] = time.monotonic()
    reader = threading.Thread(target=read, daemon=True); reader.start()
    try: status = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill(); proc.wait()
        pytest.fail(f"{' '.join(map(str, args[:2]))} did not end within {timeout} s; its last lines:\n" + '\n'.join(lines[-10:]))
    ended = time.monotonic(); reader.join(5)
    return status, lines, ended - last[0]


def check_ends(status: int, lines: list[str], gap: float, want: int = 0, says: str = ''):
    out = '\n'.join(lines)
    assert status == want, f"status {status}, not {want}:\n{out[-3000:]}"
    assert LEFT_RUNNING not in out, out[-3000:]
    assert gap < EXIT_SECONDS, f"the process ended {gap:.1f} s after its last line:\n{out[-2000:]}"
    assert says in out, out[-3000:]


# prefetch x workers in full; each cache and each place of augmentation at least once
FITS = [dict(prefetch='false', workers='0', cache='ram', augment_on='cpu'),
        dict(prefetch='false', workers='2', cache='disk', augment_on='device'),
        dict(prefetch='true', workers='0', cache='none', augment_on='device'),
        dict(prefetch='true', workers='2', cache='ram', augment_on='cpu')]


def data_args(o: dict, tmp: Path) -> list:
    args = [a for k, v in o.items() for a in (f'--data.{k}', v)]
    return args + (['--data.cache_dir', str(tmp / 'cache')] if o.get('cache') == 'disk' else [])


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    "A tiny fit without prefetch, the issue's case: its folder and `last.ckpt`."
    tmp = tmp_path_factory.mktemp('exit')
    check_ends(*run_timed([str(LUCID), *tiny(tmp, *data_args(FITS[0], tmp), epochs=1, version='v')], tmp), says='Results saved to')
    return tmp, tmp / 'runs' / 'tiny' / 'v' / 'checkpoints' / 'last.ckpt'


@pytest.mark.slow
@pytest.mark.parametrize('o', FITS[1:], ids=lambda o: '-'.join(f'{k}={v}' for k, v in o.items()))
def test_fit_ends(tmp_path, o):
    check_ends(*run_timed([str(LUCID), *tiny(tmp_path, *data_args(o, tmp_path), epochs=1)], tmp_path), says='Results saved to')


def test_the_fit_without_prefetch_ends(trained):
    "The issue's command: `--data.prefetch false` used to wait for ever after 'Results saved to'."
    assert trained[1].is_file()


@pytest.mark.slow
@pytest.mark.parametrize('sub,o', [('validate', dict(prefetch='false', workers='0')), ('test', dict(prefetch='false', workers='2')),
                                   ('predict', dict(prefetch='false', workers='0')), ('validate', dict(prefetch='true', workers='2'))])
def test_other_subcommands_end(trained, sub, o):
    tmp, ckpt = trained
    check_ends(*run_timed([str(LUCID), *tiny(tmp, *data_args(o, tmp), '--ckpt_path', str(ckpt), sub=sub)], tmp))


def test_export_ends(trained):
    tmp, ckpt = trained
    check_ends(*run_timed([str(LUCID), 'export', '--ckpt_path', str(ckpt), '--format', 'torchscript'], tmp))


@pytest.mark.parametrize('prefetch', ['false', 'true'])
def test_a_fit_stopped_by_a_data_error_ends(tmp_path, prefetch):
    "A validation image spoilt after the first training epoch: one line naming it, status 2, and the process ends."
    imgs, ann = make_coco(tmp_path / 'coco')
    args = tiny(tmp_path, '--data.train_images', str(imgs), '--data.train_annotations', str(ann), '--data.cache', 'none',
                '--data.prefetch', prefetch, '--data.val_count', '3', '--trainer.callbacks', 'helpers.SpoilValidationImage')
    check_ends(*run_timed([str(LUCID), *args], tmp_path), want=2, says='unreadable since setup checked it')


def test_a_python_script_that_predicts_ends(trained):
    "`lucid_nb.load(...).predict` leaves nothing running: the script's interpreter ends by itself (no quick exit here)."
    tmp, ckpt = trained
    images = sorted((ROOT / 'lucid_nb' / 'embedded' / 'coco128' / 'images').glob('*.jpg'))[:3]
    script = textwrap.dedent(f"""
        import lucid_nb
        model = lucid_nb.load({str(ckpt)!r})
        results = model.predict({[str(p) for p in images]!r}, batch_size=2)
        print('predicted', len(results))""")
    status, lines, gap = run_timed([sys.executable, '-c', script], tmp)
    assert status == 0 and 'predicted 3' in lines, '\n'.join(lines[-20:])
    assert gap < 3 * EXIT_SECONDS, f"the script ended {gap:.1f} s after its last line"   # an interpreter's ordinary teardown: seconds
