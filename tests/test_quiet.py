"""What a first run prints (issue 41): at most three lines before the first epoch line, one line for a capture option
that cannot act, the model in one line whose numbers are checked against an independent count, and `--verbose true`
bringing Lightning's own lines back. stdout and stderr are read together, in the order a terminal shows them."""
import os, re, subprocess

import pytest
import torch
from torch import nn

from lucid_nb.heads import yolo_seg
from lucid_nb.model import Attention

from helpers import LUCID

QUICK = ('--trainer.accelerator', 'cpu', '--trainer.max_epochs', '1', '--trainer.limit_train_batches', '2',
         '--data.imgsz', '64', '--data.batch_size', '2', '--data.val_count', '2')   # no bar: stdout is not a terminal
CPU_LINE = 'capture_train_step: the whole training step runs natively: the run trains on cpu; the recorder needs a CUDA GPU'


def _lucid(cwd, *args) -> list:
    """The lines a `lucid` command prints, stdout and stderr interleaved as they were written. Without `PL_GLOBAL_SEED`,
    which Lightning's `seed_everything` leaves in this process's environment after an in-process fit: a child that
    inherits it has a seed, and Lightning's "No seed found" line would not be there to count."""
    r = subprocess.run([str(LUCID), *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600,
                       env={**{k: v for k, v in os.environ.items() if k != 'PL_GLOBAL_SEED'}, 'PYTHONUNBUFFERED': '1', 'OMP_NUM_THREADS': '1'})
    assert r.returncode == 0, r.stdout[-3000:]
    return r.stdout.splitlines()


def _before_first_epoch(lines: list) -> list:
    first = next(i for i, l in enumerate(lines) if l.startswith('epoch 1/'))
    return lines[:first]


def independent_flops(net: nn.Module, size: int) -> int:
    "FLOPs (2 per multiply-accumulate) of one (1,3,size,size) forward, counted by forward hooks from the layers' shapes."
    total = []
    def conv(m, args, out):
        k = m.kernel_size[0] * m.kernel_size[1]
        if isinstance(m, nn.ConvTranspose2d): total.append(2 * args[0].numel() * m.out_channels // m.groups * k)
        else: total.append(2 * out.numel() * m.in_channels // m.groups * k)
    def attention(m, args, out):   # q^T k and v attn^T: two (N×N) products per head
        B, C, H, W = args[0].shape
        total.append(2 * B * m.num_heads * (H * W) ** 2 * (m.key_dim + m.head_dim))
    for m in net.modules():
        if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)): m.register_forward_hook(conv)
        elif isinstance(m, Attention): m.register_forward_hook(attention)
        else: assert not isinstance(m, (nn.Linear, nn.MultiheadAttention)), f"not counted here: {type(m).__name__}"
    with torch.no_grad(): net.eval()(torch.zeros(1, 3, size, size))
    return sum(total)


@pytest.fixture(scope='module')
def quick(tmp_path_factory):
    d = tmp_path_factory.mktemp('quick')
    return d, _lucid(d, 'fit', *QUICK)


def test_quick_fit_prints_three_lines_before_its_first_epoch(quick):
    "Lightning's seed, accelerator and stepping-batches lines, its module table and its `log_every_n_steps` warning were 18 lines."
    d, lines = quick
    head = _before_first_epoch(lines)
    assert len(head) <= 3, '\n'.join(head)
    assert head[0].startswith('lucid_nb data: train 126 images') and 'input problems: none' in head[0]
    (model,) = [l for l in head if l.startswith('model: ')]
    assert model.endswith('; run folder runs/lucid/version_0') and (d / 'runs' / 'lucid' / 'version_0' / 'checkpoints').is_dir()
    assert not [l for l in lines if l.startswith('`Trainer.fit` stopped')], 'Lightning says the fit reached max_epochs: the run did as asked'
    assert not [l for l in lines if 'capture' in l]
    assert not [l for l in lines if 'it/s' in l or '\r' in l], 'a progress bar drawn into a pipe'
    assert len([l for l in lines if l.startswith('epoch 1/1 ')]) == 1   # printed through no bar, so not lost
    young = lines.index(next(l for l in lines if l.startswith('Results saved to '))) - 1   # 1 epoch from scratch: zeros, said to be expected
    assert lines[young].startswith('From scratch, 1 epoch is far too few to detect anything') and 'README.md' in lines[young], lines[young]


def test_model_line_numbers_are_counted_independently(quick):
    _, lines = quick
    (model,) = [l for l in lines if l.startswith('model: ')]
    params, gflops, px, mb = re.match(r'model: ([\d,]+) parameters, ([\d.]+) GFLOPs at (\d+) px, ([\d.]+) MB;', model).groups()
    net = yolo_seg('n', 80)   # the embedded coco128 has 80 classes
    n = sum(p.numel() for p in net.parameters())
    assert (int(params.replace(',', '')), int(px), float(mb)) == (n, 64, round(4 * n / 1e6, 1))   # float32: 4 bytes each
    assert gflops == f"{independent_flops(net, 64) / 1e9:.3g}"


def test_capture_option_on_cpu_is_one_line(tmp_path):
    "It was 8 lines: a fallback reason and an end-of-fit summary for each of the four regions the option turns on."
    lines = _lucid(tmp_path, 'fit', *QUICK, '--model.capture_train_step', 'true')
    head = _before_first_epoch(lines)
    assert len(head) <= 3 and head[-1] == CPU_LINE, '\n'.join(head)
    assert [l for l in lines if 'capture' in l] == [CPU_LINE]   # nothing recorded: no summary at the end


def test_verbose_brings_lightning_lines_back(tmp_path):
    lines = _lucid(tmp_path, 'fit', *QUICK, '--model.capture_train_step', 'true', '--verbose', 'true')
    text = '\n'.join(_before_first_epoch(lines))
    for said in ('No seed found', 'Seed set to 0', 'GPU available: False', 'TPU available:', 'Loading `train_dataloader`',
                 'smaller than the logging interval', 'Total params', 'model: 2,876,832 parameters'):
        assert said in text, said
    regions = ('capture_segment_heads: the head', 'capture_optimizer_step: the update', 'capture_train_step: the step',
               'capture_train_step: the EMA update')
    assert [l.split(' runs natively')[0] for l in lines if 'runs natively' in l] == list(regions)
    assert len([l for l in lines if re.match(r'capture_\w+: 0 ', l)]) == 4   # each region's summary, zeros included


def test_validate_keeps_its_results_table(quick):
    """`lucid validate --verbose` was Lightning's switch for its metric box; now it is `lucid`'s: `lucid`'s per-class
    table always prints, Lightning's box after it only with `--verbose true`."""
    d, _ = quick
    args = ('validate', '--trainer.accelerator', 'cpu', '--ckpt_path', 'runs/lucid/version_0/checkpoints/last.ckpt')
    lines = _lucid(d, *args)
    assert any(l.split()[:2] == ['Class', 'Images'] for l in lines) and not any('Validate metric' in l for l in lines)
    assert not any('GPU available' in l or 'Seed set' in l for l in lines)
    assert any('Validate metric' in l for l in _lucid(d, *args, '--verbose', 'true'))
