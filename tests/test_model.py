"Model and head checks the notebooks (02_model, 03_heads) do not make: copies, pickling, bad configs, larger scales."
import copy, io, pickle, types

import pytest, torch, torch.nn as nn
from lucid_nb.core import digest
from lucid_nb.heads import DetectHead, SegHead
from lucid_nb.model import SCALES, Scale, YoloModel, get_scale, model_summary, summary_layers
from lucid_nb.heads import yolo_detect, yolo_seg


@pytest.fixture(scope='module')
def nano():
    torch.manual_seed(0)
    return yolo_seg('n').eval()


@pytest.fixture(scope='module')
def x():
    return torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))


def test_deepcopy_is_independent_and_identical(nano, x):
    twin = copy.deepcopy(nano)
    assert digest(twin(x)) == digest(nano(x))
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(twin.parameters(), nano.parameters()))
    with torch.no_grad(): next(twin.parameters()).add_(1)
    assert digest(twin.state_dict()) != digest(nano.state_dict())


def test_pickle_and_torch_save_roundtrip(nano, x):
    back = pickle.loads(pickle.dumps(nano))
    assert digest(back(x)) == digest(nano(x))
    buf = io.BytesIO(); torch.save(nano, buf); buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert isinstance(loaded, YoloModel) and loaded.config == nano.config
    assert digest(loaded.state_dict()) == digest(nano.state_dict())


def test_no_hooks_and_no_function_attributes(nano):
    for name, m in nano.named_modules():
        assert not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks), name
        for k, v in vars(m).items():
            assert not isinstance(v, (types.FunctionType, types.MethodType, types.LambdaType)), f"{name}.{k}"


def test_batchnorm_settings(nano):
    bns = [m for m in nano.modules() if isinstance(m, nn.BatchNorm2d)]
    assert bns and all(m.eps == 1e-3 and m.momentum == 0.03 for m in bns)


@pytest.mark.parametrize('bad', ['x', 'N', '', 'nano'])
def test_unknown_scale_is_refused(bad):
    with pytest.raises(ValueError, match=r"scale=.*allowed values: n, s, m"): yolo_seg(bad)


@pytest.mark.parametrize('bad', [0, -3, 2.5, '80'])
def test_bad_num_classes_is_refused(bad):
    with pytest.raises(ValueError, match='num_classes'): yolo_seg('n', num_classes=bad)


def test_scale_objects_pass_through():
    sc = Scale(0.33, 0.25, 1024)
    assert get_scale(sc) is sc and list(SCALES) == ['n', 's', 'm']


@pytest.mark.parametrize('scale,ref_m', [('n', 2.9), ('s', 10.1), ('m', 22.4)])
def test_parameter_counts_match_yolo11_seg(scale, ref_m):
    # Ultralytics docs, 640 px: YOLO11n-seg 2.9 M, YOLO11s-seg 10.1 M, YOLO11m-seg 22.4 M parameters.
    # Ours: 2,876,832 / 10,113,232 / 22,420,880 (Ultralytics counts 16 more: its fixed DFL conv weights).
    n = sum(p.numel() for p in yolo_seg(scale).parameters())
    assert abs(n / 1e6 - ref_m) / ref_m < 0.02, (scale, n)


@pytest.mark.parametrize('scale,ultralytics', [('n', 2_624_080), ('s', 9_458_752), ('m', 20_114_688)])
def test_parameter_counts_equal_yolo11_detect(scale, ultralytics):
    # sum(p.numel() for p in YOLO(f'yolo11{scale}.yaml').model.parameters()), Ultralytics 8.4.190: ours less the 16 fixed
    # weights of its DFL convolution; the backbone and neck are the segmentation model's, tensor for tensor
    det, seg = yolo_detect(scale), yolo_seg(scale)
    assert sum(p.numel() for p in det.parameters()) == ultralytics - 16
    assert {k: v.shape for k, v in det.state_dict().items() if not k.startswith('head.')} == \
           {k: v.shape for k, v in seg.state_dict().items() if not k.startswith('head.')}


def test_few_classes():
    m = yolo_seg('n', num_classes=3).eval()
    out = m(torch.rand(1, 3, 64, 64))
    assert out['scores'].shape == (1, 84, 3)
    assert torch.allclose(m.head.cls[2][-1].bias, torch.full((3,), torch.log(torch.tensor(5 / 3 / 20**2)).item()))


def test_head_refuses_mismatched_levels():
    with pytest.raises(ValueError, match='one entry per level'): DetectHead((64, 128), strides=(8, 16, 32))
    head = SegHead((16, 32, 64), proto_channels=16)
    with pytest.raises(ValueError, match='expected 3 feature maps, got 2'):
        head([torch.rand(1, 16, 8, 8), torch.rand(1, 32, 4, 4)])


def test_summary_markdown_and_generic_modules(nano):
    s = model_summary(nano, 64)
    md = s._repr_markdown_()
    assert md.startswith(f"**{s.params:,} parameters") and '| head.proto |' in md
    assert nano.training is False and next(nano.parameters()).device.type == 'cpu'  # untouched
    seq = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    assert [n for n, _ in summary_layers(seq)] == ['0', '1']
    s2 = model_summary(seq, 8)
    assert s2.params == 3 * 4 * 9 + 4 and s2.flops == 2 * 3 * 9 * 4 * 36
