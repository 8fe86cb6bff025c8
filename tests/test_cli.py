"""The console script's exit (`lucid_nb.cli.main`): the status, `atexit` handlers and non-daemon threads as a normal exit has them."""
import subprocess, sys, textwrap

import pytest

PROBE = textwrap.dedent("""
    import atexit, sys, threading, time
    atexit.register(lambda: print('atexit ran', flush=True))
    import lucid_nb.trainer as T
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
