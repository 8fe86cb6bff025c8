"""From-scratch initialisation (`nbs/02_model.ipynb`, `nbs/03_heads.ipynb`, `nbs/03b_yolo26.ipynb`) against
Ultralytics 8.4.190's: after the same `torch.manual_seed`, `yolo` (YOLO11) and `yolo26` hold Ultralytics' tensors bit for bit (`fixtures/ultralytics_init.json`,
written by real Ultralytics with `fixtures/make_ultralytics_init.py`), with its batch-norm settings, and leaves
torch's generator where Ultralytics leaves it; and the rules behind those tensors, checked without the fixture."""
import hashlib, json, math
from pathlib import Path

import pytest, torch, torch.nn as nn
from lucid_nb.heads import DetectHead, yolo
from lucid_nb.loss import dfl_loss
from lucid_nb.weights import lucid_key
from lucid_nb.yolo26 import build_yolo, yolo26_key

FIX = json.loads((Path(__file__).resolve().parent / 'fixtures' / 'ultralytics_init.json').read_text())
BUILDS = {f"{b['yaml'].removesuffix('.yaml')}-nc{b['num_classes']}-seed{b['seed']}": b for b in FIX['builds']}
KEYS = {'yolo11': lucid_key, 'yolo26': yolo26_key}   # Ultralytics' name of a tensor → ours
# Ultralytics' tensors with none of ours: YOLO11's DFL's fixed 1×16 convolution (ours computes softmax · arange without
# a layer); YOLO26 has no DFL (`reg_max` 1)
NOT_OURS = {'yolo11': ['model.23.dfl.conv.weight'], 'yolo26': []}


def tensor_digest(t)->str:
    "As `make_ultralytics_init.py` computes it: sha256 over dtype, shape and bytes, 16 hex digits."
    h = hashlib.sha256(f'{t.dtype} {tuple(t.shape)}'.encode())
    h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def build(b:dict):
    "The build's family, scale, task and classes after its seed; the next four numbers of the generator."
    torch.manual_seed(b['seed'])
    net = build_yolo(b['family'], b['scale'], b['num_classes'], b['task'])
    return net, torch.rand(4).tolist()


@pytest.fixture(scope='module', params=list(BUILDS))
def built(request):
    b = BUILDS[request.param]
    return (b, *build(b))


def test_fixture_is_ultralytics_8_4_190():
    assert FIX['ultralytics'] == '8.4.190' and len(BUILDS) == 11
    assert sorted({b['family'] for b in BUILDS.values()}) == ['yolo11', 'yolo26']


def test_every_tensor_is_ultralytics(built):
    b, net, _ = built
    ours, key = {k: tensor_digest(v) for k, v in net.state_dict().items()}, KEYS[b['family']]
    theirs = {key(k): d for k, d in b['tensors'].items() if key(k) is not None}
    assert [k for k in b['tensors'] if key(k) is None] == NOT_OURS[b['family']]
    assert sorted(ours) == sorted(theirs)
    differ = [k for k in ours if ours[k] != theirs[k]]
    assert not differ, f"{len(differ)} of {len(ours)} tensors differ from Ultralytics', first {differ[:5]}"


def test_the_generator_is_left_where_ultralytics_leaves_it(built):
    b, _, after = built
    assert after == b['after']   # the same number of draws: a later draw (the EMA's copy, the data) is Ultralytics' too


def test_batchnorm_settings_are_ultralytics(built):
    b, net, _ = built
    bns = [m for m in net.modules() if isinstance(m, nn.modules.batchnorm._NormBase)]
    assert len(bns) == b['batchnorms'] and all(type(m) is nn.BatchNorm2d for m in bns)
    assert sorted({(m.eps, m.momentum) for m in bns}) == [tuple(s) for s in b['batchnorm']] == [(1e-3, 0.03)]


# ---- the rules, without the fixture ----

@pytest.fixture(scope='module')
def nano():
    torch.manual_seed(0)
    return yolo('n', 80, 'segment')


def test_batchnorms_start_at_identity(nano):
    for n, m in nano.named_modules():
        if isinstance(m, nn.BatchNorm2d):
            assert (m.weight == 1).all() and (m.bias == 0).all(), n
            assert (m.running_mean == 0).all() and (m.running_var == 1).all() and m.num_batches_tracked == 0, n


def test_convolutions_are_torch_defaults(nano):
    "Uniform in ±1/√fan-in (kaiming_uniform with a=√5), weights and biases: std bound/√3 within 3 % where large."
    for n, m in nano.named_modules():
        if not isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)): continue
        w = m.weight
        fan_in = w.shape[1] * w[0, 0].numel() if isinstance(m, nn.Conv2d) else w.shape[0] * w[0, 0].numel()
        bound = 1 / math.sqrt(fan_in)
        assert w.abs().max() <= bound, n
        if w.numel() >= 4096: assert abs(w.std().item() / (bound / math.sqrt(3)) - 1) < 0.03, (n, w.std().item(), bound)
        if m.bias is not None and not n.startswith(('head.box.', 'head.cls.')): assert m.bias.abs().max() <= bound, n


def test_head_priors(nano):
    h = nano.head
    for s, b, c in zip(h.strides, h.box, h.cls):
        assert (b[-1].bias == 2.0).all()
        assert torch.allclose(c[-1].bias, torch.full((80,), math.log(5 / 80 / (640 / s) ** 2)))


def test_a_constant_on_the_box_logits_changes_nothing():
    "Why the box prior's value (2.0 now, 1.0 in earlier Ultralytics releases) does not matter: the decode and the DFL loss see each side's softmax."
    torch.manual_seed(0)
    det = DetectHead((64, 128, 256)).eval()
    feats = [torch.rand(1, 64, 8, 8), torch.rand(1, 128, 4, 4), torch.rand(1, 256, 2, 2)]
    with torch.no_grad():
        before = det(feats)
        for b in det.box: b[-1].bias.sub_(1.0)
        after = det(feats)
    assert torch.allclose(before['boxes'], after['boxes'], atol=1e-4) and torch.equal(before['scores'], after['scores'])
    logits, target = torch.randn(5, 4, 16, requires_grad=True), torch.rand(5, 4) * 14
    g1, = torch.autograd.grad(dfl_loss(logits, target).sum(), logits)
    g2, = torch.autograd.grad(dfl_loss(logits + 1.0, target).sum(), logits)
    assert torch.allclose(g1, g2, atol=1e-6) and not torch.equal(g1, torch.zeros_like(g1))
