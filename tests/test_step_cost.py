"""`benchmarks/step_cost.py`: its op counter (`lucid_nb.testing.OpCost`) checked by hand on single ops, and a `--smoke`
step whose parts add up."""
import json, subprocess, sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lucid_nb.heads import yolo_seg
from lucid_nb.testing import OpCost, family

ROOT = Path(__file__).resolve().parent.parent
PARTS = ('forward', 'loss', 'backward', 'optimizer', 'ema')   # the step's parts, as the script counts them

VIEWS = {'view', 'reshape', 'expand', 'permute', 'as_strided', 't', 'transpose', 'select', 'slice', 'unsqueeze', 'squeeze',
         'detach', 'alias', '_unsafe_view', 'split', 'unbind', 'chunk', 'narrow', 'split_with_sizes'}


def conv_flops(conv: nn.Conv2d | nn.ConvTranspose2d, x: torch.Tensor, out: torch.Tensor) -> int:
    """2 x the multiply-adds: per output element, input channels of a group x kernel pixels; transposed (each input
    element spread over a kernel), per input element, output channels of a group x kernel pixels."""
    k = conv.kernel_size[0] * conv.kernel_size[1]
    if isinstance(conv, nn.ConvTranspose2d): return 2 * x.numel() * conv.out_channels // conv.groups * k
    return 2 * out.numel() * conv.in_channels // conv.groups * k


def test_one_convolution_by_hand():
    conv, x = nn.Conv2d(3, 16, 3, stride=2, padding=1), torch.randn(2, 3, 64, 64)
    with OpCost() as c, torch.autocast('cpu', torch.bfloat16):
        c.part = 'forward'
        y = conv(x)
        y.view(-1); y.permute(0, 2, 3, 1); y.detach()   # views: no call, no bytes
    ops = {n: v for (p, n), v in c.ops.items()}
    assert set(ops) == {'_to_copy f32>bf16', 'convolution'}, ops
    calls, read, written, flops = ops['convolution']
    assert (calls, flops) == (1, 2 * 2 * 16 * 32 * 32 * 3 * 3 * 3) == (1, conv_flops(conv, x, y))
    assert read == 2 * (x.numel() + conv.weight.numel() + conv.bias.numel())   # bf16 input, weight and bias
    assert written == 2 * y.numel() and y.dtype == torch.bfloat16
    calls, read, written, _ = ops['_to_copy f32>bf16']   # autocast's casts of the input, the weight and the bias
    assert (calls, read, written) == (3, 4 * (x.numel() + 16 * 27 + 16), 2 * (x.numel() + 16 * 27 + 16))


def test_in_place_copy_and_broadcast_bytes():
    a, b, col = torch.ones(1000), torch.ones(1000), torch.ones(1)
    with OpCost() as c:
        a.add_(b)                   # reads a and b, writes a
        a.copy_(b)                  # reads b, writes a
        a.mul_(col.expand(1000))    # the broadcast operand touches 4 bytes
        torch.cat([a[:500], a[500:]])   # two views of one storage: read once, 4,000 bytes
    ops = {n: v[:3] for (p, n), v in c.ops.items()}
    assert ops == {'add_': [1, 8000, 4000], 'copy_': [1, 4000, 4000], 'mul_': [1, 4004, 4000], 'cat': [1, 4000, 4000]}, ops


def test_families():
    for name, fam in (('convolution_backward', 'conv/matmul'), ('aten::cudnn_convolution', 'conv/matmul'), ('addmm', 'conv/matmul'),
                      ('native_batch_norm_backward', 'batch norm'), ('_to_copy f32>bf16', 'casts/copies'), ('aten::copy_', 'casts/copies'),
                      ('mul', 'elementwise'), ('silu_backward', 'elementwise'), ('_foreach_add_', 'elementwise'),
                      ('sum', 'reductions'), ('_softmax_backward_data', 'reductions'), ('max_pool2d_with_indices', 'reductions'),
                      ('gather', 'indexing/gather'), ('index_put_', 'indexing/gather'), ('upsample_nearest2d', 'other')):
        assert family(name) == fam, (name, family(name), fam)


@pytest.mark.slow
def test_smoke_step_adds_up(tmp_path):
    done = subprocess.run([sys.executable, 'benchmarks/step_cost.py', '--smoke', '--out', str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    r = json.loads(next(tmp_path.glob('step_cost_*.json')).read_text())
    B, parts, ops = r['batch_size'], PARTS, r['ops']
    assert (B, r['imgsz'], r['mosaic']['probability']) == (2, 64, 1.0) and r['mosaic']['until_epoch'] > r['mosaic']['epoch']
    for p in parts: assert r['by_part'][p]['calls'] > 0 and r['by_part'][p]['bytes_mb'] > 0, p
    step = [o for o in ops if o['part'] in parts]
    assert r['op_count'] == sum(o['calls'] for o in step) == sum(r['by_part'][p]['calls'] for p in parts) \
        == sum(v['calls'] for v in r['by_family'].values())
    total_bytes = sum(o['read_bytes'] + o['written_bytes'] for o in step)
    assert r['total']['bytes_mb'] == round(total_bytes / B / 1e6, 3)
    assert abs(sum(r['by_part'][p]['bytes_mb'] for p in parts) - r['total']['bytes_mb']) < 0.001 * len(parts)
    assert not VIEWS & {o['op'] for o in ops}
    # the forward's convolution FLOPs against the network's convolution shapes, counted by hand at this batch and size
    net, hand = yolo_seg('n', 80), []
    for m in net.modules():
        if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)): m.register_forward_hook(lambda m, i, o: hand.append(conv_flops(m, i[0], o)))
    with torch.no_grad(): net.train()(torch.zeros(B, 3, 64, 64))
    counted = sum(o['flops'] for o in ops if o['part'] == 'forward' and o['op'] == 'convolution')
    assert counted == sum(hand) > 0
    assert sum(o['calls'] for o in ops if o['part'] == 'forward' and o['op'] == 'convolution') == len(hand)
    # the gradients made in the backward are alive when the optimiser starts: at least the weights' float32 bytes
    weights = sum(p.numel() * 4 for p in net.parameters())
    assert r['peak_bytes_alive']['live_at_part_end_mb']['backward'] >= round(weights / 1e6, 1) > 0
