"""Tests of `lucid_nb.optim`: parameter groups, MuSGD against a plain per-matrix reference, Newton–Schulz numerics,
tensor hyperparameters through state dicts and the schedule, no host syncs, the warm-up/decay schedule."""
import copy, io, math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lucid_nb.core import digest
from lucid_nb.core import test_bytes_equal as bytes_equal
from lucid_nb.optim import (HYPERPARAMS, NS_COEFFS, MuSGD, WarmupDecayLR, build_optimizer, build_schedule,
                            newton_schulz, orthogonalise, param_groups)


def net(seed=0):
    "Every kind of matrix: repeated 3x3 convs (batched NS), a tall 1x1 conv, a transposed conv, a linear layer."
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.SiLU(),
                         nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.SiLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.SiLU(),
                         nn.Conv2d(8, 48, 1), nn.SiLU(),                       # tall: 48 x 8
                         nn.ConvTranspose2d(48, 8, 2, stride=2), nn.SiLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4), nn.Linear(4, 4))


def set_grads(model, seed, none=()):
    g = torch.Generator().manual_seed(seed)
    for i, p in enumerate(model.parameters()):
        p.grad = None if i in none else torch.randn(p.shape, generator=g)


# ---------------------------------------------------------------- parameter groups

def test_param_groups_nano_model():
    from lucid_nb.heads import yolo_seg
    m = yolo_seg('n')
    gs = param_groups(m, 1e-3)
    assert [g['name'] for g in gs] == ['weight', 'norm', 'bias']
    ids = [id(p) for g in gs for p in g['params']]
    assert len(ids) == len(set(ids)) == len(list(m.parameters()))
    w, nrm, b = gs
    assert w['weight_decay'] == 1e-3 and nrm['weight_decay'] == 0.0 and b['weight_decay'] == 0.0
    assert w['matrix'] and not nrm['matrix'] and not b['matrix']
    assert all(p.ndim >= 2 for p in w['params']) and all(p.ndim == 1 for p in nrm['params'] + b['params'])
    bn_weights = {id(mod.weight) for mod in m.modules() if isinstance(mod, nn.BatchNorm2d)}
    assert {id(p) for p in nrm['params']} == bn_weights


def test_param_groups_skip_frozen_and_shared():
    m = net()
    m[0].weight.requires_grad_(False)
    shared = nn.Sequential(m, m)                     # the same parameters twice
    gs = param_groups(shared)
    ps = [p for g in gs for p in g['params']]
    assert len(ps) == len({id(p) for p in ps}) == len([p for p in m.parameters() if p.requires_grad])


# ---------------------------------------------------------------- a plain reference MuSGD

def ns_reference(G):
    "Unbatched Newton–Schulz on one 2-D matrix, written plainly."
    a, b, c = NS_COEFFS
    X = G / (G.norm() + 1e-7)
    tall = X.shape[0] > X.shape[1]
    if tall: X = X.T
    for _ in range(5):
        A = X @ X.T
        B = torch.addmm(A, A, A, beta=b, alpha=c)     # bA + cA²
        X = torch.addmm(X, B, X, beta=a)              # aX + BX
    return X.T if tall else X


class ReferenceMuSGD:
    "Loop over parameters, one matrix at a time; the same formulas and tensor hyperparameters as MuSGD."
    def __init__(self, groups, nesterov):
        self.groups, self.nesterov, self.state = groups, nesterov, {}

    @torch.no_grad()
    def step(self):
        for g in self.groups:
            lr, mom, wd = g['lr'], g['momentum'], g['weight_decay']
            for p in g['params']:
                s = self.state.setdefault(p, {'b': torch.zeros_like(p), 'm': torch.zeros_like(p)})
                if p.grad is None: continue
                d = p * wd + p.grad
                s['b'] = s['b'] * mom + d
                u = s['b'] * mom + d if self.nesterov else s['b']
                if g['use_muon']:
                    g1 = p.grad * (1 - mom)
                    s['m'] = s['m'] * mom + g1
                    v = s['m'] * mom + g1 if self.nesterov else s['m']
                    r, c = p.shape[0], p[0].numel()
                    o = (ns_reference(v.reshape(r, c)) * max(1.0, r / c) ** 0.5).reshape(p.shape)
                    upd = (u * g['sgd_weight'] + o * g['muon_weight']) * lr
                else:
                    upd = u * lr
                p.sub_(upd)


def hyper_groups(model, **kw):
    "Groups for the reference with the same 0-dim float32 hyperparameters MuSGD makes."
    t = lambda v: torch.tensor(v, dtype=torch.float32)
    return [dict(params=g['params'], use_muon=g['matrix'], lr=t(kw['lr']), momentum=t(kw['momentum']),
                 weight_decay=t(g['weight_decay']), muon_weight=t(kw['muon_weight']), sgd_weight=t(kw['sgd_weight']))
            for g in param_groups(model, kw['weight_decay'])]


def close(a, b, what):
    """Batched vs per-matrix Newton–Schulz agree to about 1e-6 relative, not bitwise, on every backend we measured.

    A batched product and the same products one matrix at a time run different kernels: cuBLAS chooses other
    algorithms for strided-batched gemm than for single gemm (on the H200, 10 of 11 shapes differed in the last
    bits), MKL does so for large or batched problems, and torch's CPU `bmm` uses its own loop kernel when a product
    has fewer than 400 multiply-adds. Bitwise parity is promised between eager and CUDA-graph replay of the *same*
    code (tested below on the GPU), not between batched and unbatched code."""
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=what)


@pytest.mark.parametrize('nesterov', [True, False])
def test_musgd_matches_plain_reference(nesterov):
    kw = dict(lr=0.03, momentum=0.9, weight_decay=0.01, muon_weight=0.2, sgd_weight=1.0)
    m_opt, m_ref = net(), net()
    opt = MuSGD(param_groups(m_opt, kw['weight_decay']), lr=kw['lr'], momentum=kw['momentum'], nesterov=nesterov,
                muon_weight=kw['muon_weight'], sgd_weight=kw['sgd_weight'])
    ref = ReferenceMuSGD(hyper_groups(m_ref, **kw), nesterov)
    for i in range(6):
        none = (3,) if i == 2 else ()                           # a param without grad is skipped by both
        if i == 4:                                              # an lr change between steps, in place
            opt.param_groups[0]['lr'].fill_(0.011); ref.groups[0]['lr'].fill_(0.011)
        set_grads(m_opt, i, none); set_grads(m_ref, i, none)
        opt.step(); ref.step()
        for (n, a), b in zip(m_opt.named_parameters(), m_ref.parameters()):
            if a.ndim >= 2: close(a, b, f'step {i} {n}')            # through Newton–Schulz: batched vs per matrix
            else: bytes_equal(a, b, f'step {i} {n}')                  # elementwise only: exact
    for p_opt, p_ref in zip(m_opt.parameters(), m_ref.parameters()):
        s = opt.state[p_opt]
        if p_opt.ndim >= 2:
            bytes_equal(s['muon_buffer'], ref.state[p_ref]['m'], 'muon buffer')   # depends on grads only: exact
            close(s['momentum_buffer'], ref.state[p_ref]['b'], 'sgd buffer')       # its decay term reads p
        else:
            bytes_equal(s['momentum_buffer'], ref.state[p_ref]['b'], 'sgd buffer')
            assert 'muon_buffer' not in s


def test_batched_orthogonalise_close_to_per_matrix():
    g = torch.Generator().manual_seed(1)
    shapes = [(64, 64, 3, 3)] * 3 + [(32, 16, 3, 3)] * 2 + [(128, 32, 1, 1)] * 2 + [(80, 80, 1, 1), (4, 8), (8, 4)]
    ws = [torch.randn(s, generator=g) for s in shapes]
    for w, o in zip(ws, orthogonalise(ws)):
        r, c = w.shape[0], w[0].numel()
        close(o, (ns_reference(w.reshape(r, c)) * max(1.0, r / c) ** 0.5).reshape(w.shape), str(w.shape))


# ---------------------------------------------------------------- Newton–Schulz numerics (float64)

@pytest.mark.parametrize('shape', [(64, 576), (576, 64), (32, 32), (16, 144), (128, 32)])
@pytest.mark.parametrize('cond', [1.0, 10.0, 100.0])
def test_newton_schulz_float64_orthogonality(shape, cond):
    r, c = shape; k = min(r, c)
    g = torch.Generator().manual_seed(r * c)
    U, _ = torch.linalg.qr(torch.randn(r, k, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(c, k, generator=g, dtype=torch.float64))
    S = torch.logspace(0, -math.log10(cond), k, dtype=torch.float64)
    O = newton_schulz(U @ torch.diag(S) @ V.T)
    assert O.dtype == torch.float64 and O.shape == shape
    sv = torch.linalg.svdvals(O)
    assert sv.min() > 0.65 and sv.max() < 1.25, (sv.min().item(), sv.max().item())
    # the singular vectors are kept: U^T O V is diagonal, with the same order of singular values
    D = U.T @ O @ V
    assert (D - torch.diag(torch.diagonal(D))).abs().max() < 1e-10
    assert (torch.diagonal(D) > 0).all()


def test_orthogonalise_bf16_option_and_scale():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 8, 1, 1, generator=g)                       # tall: scaled by sqrt(48/8)
    o32, o16 = orthogonalise([w])[0], orthogonalise([w], dtype=torch.bfloat16)[0]
    assert o16.dtype == torch.float32 and o16.shape == w.shape
    assert (o32 - o16).abs().max() < 0.05 * o32.abs().max()
    sv = torch.linalg.svdvals(o32.reshape(48, 8).double()) / math.sqrt(6)
    assert sv.min() > 0.65 and sv.max() < 1.25


# ---------------------------------------------------------------- tensor hyperparameters

def test_hyperparameters_are_own_0dim_float32_tensors():
    m = net()
    opt = MuSGD(param_groups(m), lr=0.02, momentum=torch.tensor(0.9, dtype=torch.float64))
    seen = set()
    for g in opt.param_groups:
        for k in HYPERPARAMS:
            t = g[k]
            assert isinstance(t, torch.Tensor) and t.shape == () and t.dtype == torch.float32, (k, t)
            assert t.device == g['params'][0].device and id(t) not in seen
            seen.add(id(t))
    assert opt.param_groups[0]['momentum'].item() == torch.tensor(0.9, dtype=torch.float32).item()
    assert [g['use_muon'] for g in opt.param_groups] == [True, False, False]


def test_musgd_refusals():
    m = net()
    with pytest.raises(ValueError, match="'bn'"):
        MuSGD([dict(params=list(m[1].parameters()), use_muon=True, name='bn')])
    with pytest.raises(ValueError, match='nesterov must be a bool'):
        MuSGD(m.parameters(), nesterov=1)
    # plain parameter list: matrices get Muon only if every parameter is a matrix
    assert MuSGD([m[0].weight]).param_groups[0]['use_muon'] is True
    assert MuSGD(m.parameters()).param_groups[0]['use_muon'] is False


def run_steps(model, opt, seeds):
    for s in seeds: set_grads(model, s); opt.step()


def test_state_dict_round_trip_exact_and_in_place():
    m_a = net(); opt_a = MuSGD(param_groups(m_a, 5e-4), lr=0.01)
    sched_a = build_schedule(opt_a, 5, 4, min_warmup_iters=3)
    for s in range(5): set_grads(m_a, s); opt_a.step(); sched_a.step()
    buf = io.BytesIO(); torch.save(opt_a.state_dict(), buf); buf.seek(0)

    m_b = net(7); opt_b = MuSGD(param_groups(m_b, 5e-4), lr=0.01)
    build_schedule(opt_b, 5, 4, min_warmup_iters=3)
    run_steps(m_b, opt_b, [99])                                     # state exists: its buffers must be reused
    before = {k: g[k] for g in opt_b.param_groups for k in ('lr', 'momentum', 'initial_lr')}
    ptrs = {id(p): [t.data_ptr() for t in s.values()] for p, s in opt_b.state.items()}
    m_b.load_state_dict(m_a.state_dict())
    opt_b.load_state_dict(torch.load(buf, map_location='cpu'))
    assert digest(opt_a.state_dict()) == digest(opt_b.state_dict())
    for g in opt_b.param_groups:
        for k in HYPERPARAMS:
            assert g[k].shape == () and g[k].dtype == torch.float32 and g[k].device == g['params'][0].device
    assert all(any(g[k] is t for g in opt_b.param_groups) for k, t in before.items())
    assert {id(p): [t.data_ptr() for t in s.values()] for p, s in opt_b.state.items()} == ptrs
    run_steps(m_a, opt_a, [10, 11]); run_steps(m_b, opt_b, [10, 11])
    for a, b in zip(m_a.parameters(), m_b.parameters()): bytes_equal(a, b)


def test_load_into_fresh_optimizer_and_float_values():
    m_a = net(); opt_a = MuSGD(param_groups(m_a), lr=0.01)
    run_steps(m_a, opt_a, [0, 1])
    sd = copy.deepcopy(opt_a.state_dict())
    opt_b = MuSGD(param_groups(net()), lr=0.5)                       # no state yet
    opt_b.load_state_dict(sd)
    assert digest(opt_b.state_dict()) == digest(sd)
    sd['param_groups'][0]['lr'] = 0.25                                # a float from elsewhere becomes our tensor
    opt_b.load_state_dict(sd)
    assert opt_b.param_groups[0]['lr'].dtype == torch.float32 and opt_b.param_groups[0]['lr'].item() == 0.25


# ---------------------------------------------------------------- capturable: no host syncs, no baked numbers

class Recorder(TorchDispatchMode):
    def __init__(self): super().__init__(); self.ops, self.floats = set(), set()
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func.overloadpacket.__name__)
        self.floats |= {a for a in [*args, *(kwargs or {}).values()] if isinstance(a, float)}
        return func(*args, **(kwargs or {}))


def test_step_has_no_host_sync_and_no_python_hyperparameters():
    from lucid_nb.loss import assert_no_host_sync
    m = net()
    opt = MuSGD(param_groups(m, 0.0123), lr=0.0456, momentum=0.789, muon_weight=0.321, sgd_weight=0.654)
    set_grads(m, 0)
    with assert_no_host_sync(), Recorder() as rec: opt.step()      # includes the first-step state creation
    assert not rec.floats & {0.0123, 0.0456, 0.789, 0.321, 0.654}
    assert not rec.ops & {'_local_scalar_dense', 'item', 'nonzero', 'is_nonzero', 'equal'}
    scales = {max(1.0, p.shape[0] / p[0].numel()) ** 0.5 for p in m.parameters() if p.ndim >= 2}
    assert rec.floats <= set(NS_COEFFS) | {1e-7, 2.0} | scales, rec.floats


# ---------------------------------------------------------------- build_optimizer

def test_build_optimizer_kinds_and_errors():
    m = net()
    sgd, adamw, musgd = (build_optimizer(m, n, lr=0.02, momentum=0.9) for n in ('sgd', 'ADAMW', 'musgd'))
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]['nesterov'] and sgd.param_groups[0]['lr'] == 0.02
    assert isinstance(adamw, torch.optim.AdamW) and adamw.param_groups[0]['betas'] == (0.9, 0.999)
    assert isinstance(musgd, MuSGD) and musgd.param_groups[0]['muon_weight'].item() == pytest.approx(0.2)
    assert [g['weight_decay'] for g in sgd.param_groups] == [5e-4, 0.0, 0.0]
    with pytest.raises(ValueError, match=r"name='adam' is not one of 'sgd', 'adamw', 'musgd'"):
        build_optimizer(m, 'adam')
    with pytest.raises(ValueError, match='is not one of'):
        build_optimizer(m, None)


# ---------------------------------------------------------------- schedule

def lrs_moms(opt):
    mom = lambda g: g['betas'][0] if 'betas' in g else g['momentum']
    return [float(g['lr']) for g in opt.param_groups], [float(mom(g)) for g in opt.param_groups]


@pytest.mark.parametrize('name', ['sgd', 'adamw', 'musgd'])
def test_schedule_warmup_and_decay(name):
    opt = build_optimizer(net(), name, lr=0.01, momentum=0.9)
    sched = build_schedule(opt, epochs=10, steps_per_epoch=20, warmup_epochs=3)      # 60 < 100: 100 warm-up iters
    assert isinstance(sched, WarmupDecayLR) and sched.warmup_iters == 100
    tensors = [g['lr'] for g in opt.param_groups] if name == 'musgd' else None
    seen = []
    for it in range(200):
        seen.append(lrs_moms(opt)); opt.step(); sched.step()
    (lr0, m0), (lr50, m50), (lr100, m100), (lr199, _) = seen[0], seen[50], seen[100], seen[199]
    assert lr0 == pytest.approx([0.0, 0.0, 0.1]) and m0 == pytest.approx([0.8] * 3)
    f50 = (1 - 2.5 / 10) * 0.99 + 0.01
    assert lr50 == pytest.approx([0.005 * f50, 0.005 * f50, 0.05 + 0.005 * f50]) and m50 == pytest.approx([0.85] * 3)
    f100 = (1 - 5 / 10) * 0.99 + 0.01
    assert lr100 == pytest.approx([0.01 * f100] * 3) and m100 == pytest.approx([0.9] * 3)
    assert lr199 == pytest.approx([0.01 * ((1 - 9.95 / 10) * 0.99 + 0.01)] * 3)
    assert sched.get_last_lr()[0] == pytest.approx(0.01 * ((1 - 10 / 10) * 0.99 + 0.01))
    if tensors is not None:                       # written in place: the same 0-dim tensors throughout
        assert all(g['lr'] is t for g, t in zip(opt.param_groups, tensors))
        assert all(g['momentum'].shape == () and g['momentum'].dtype == torch.float32 for g in opt.param_groups)


def test_schedule_cosine_no_warmup_and_clamp():
    opt = build_optimizer(net(), 'musgd', lr=0.02)
    sched = build_schedule(opt, epochs=4, steps_per_epoch=5, warmup_epochs=0, cosine=True, lrf=0.05)
    assert sched.warmup_iters == 0
    vals = [sched.values(i)[0][0] for i in (0, 10, 20, 30)]
    assert vals == pytest.approx([0.02, 0.02 * (1 + (0.05 - 1) / 2), 0.02 * 0.05, 0.02 * 0.05])
    assert sched.values(0)[1] == pytest.approx([0.937] * 3)


def test_schedule_bad_arguments():
    opt = build_optimizer(net(), 'sgd')
    for kw, msg in [(dict(epochs=0), 'epochs=0'), (dict(steps_per_epoch=2.5), 'steps_per_epoch=2.5'),
                    (dict(warmup_epochs=-1), 'warmup_epochs'), (dict(lrf=0), 'lrf=0'), (dict(lrf=2), 'lrf=2'),
                    (dict(min_warmup_iters=-3), 'min_warmup_iters')]:
        args = dict(epochs=3, steps_per_epoch=4) | kw
        with pytest.raises(ValueError, match=msg): build_schedule(opt, **args)


def test_schedule_and_optimizer_resume_exactly():
    def run(n, resume_at=None):
        m = net(); opt = build_optimizer(m, 'musgd'); sch = build_schedule(opt, 6, 10, min_warmup_iters=25)
        for i in range(n):
            if i == resume_at:
                saved = io.BytesIO(); torch.save((m.state_dict(), opt.state_dict(), sch.state_dict()), saved)
                saved.seek(0); sd = torch.load(saved, weights_only=False)
                m = net(3); opt = build_optimizer(m, 'musgd'); sch = build_schedule(opt, 6, 10, min_warmup_iters=25)
                m.load_state_dict(sd[0]); opt.load_state_dict(sd[1]); sch.load_state_dict(sd[2])
            set_grads(m, i); opt.step(); sch.step()
        return digest(m.state_dict()), digest(opt.state_dict()), digest(sch.state_dict())
    assert run(40) == run(40, resume_at=17)


# ---------------------------------------------------------------- CUDA graph replay (GPU only)

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')
def test_cuda_graph_replay_matches_eager_bitwise():
    dev = torch.device('cuda')
    steps = 7
    grads = [[torch.randn(p.shape, generator=torch.Generator().manual_seed(50 * i + j)).to(dev)
              for j, p in enumerate(net().parameters())] for i in range(steps)]
    m_e, m_g = net().to(dev), net().to(dev)
    opt_e, opt_g = build_optimizer(m_e, 'musgd', lr=0.05), build_optimizer(m_g, 'musgd', lr=0.05)
    sch_e, sch_g = (build_schedule(o, 3, 3, warmup_epochs=1, min_warmup_iters=3) for o in (opt_e, opt_g))
    ps = list(m_g.parameters())
    for p in ps: p.grad = torch.zeros_like(p)
    opt_g.init_state()
    live = ps + [b for s in opt_g.state.values() for b in s.values()]
    saved = [t.detach().clone() for t in live]
    side = torch.cuda.Stream(); side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3): opt_g.step()
    torch.cuda.current_stream().wait_stream(side)
    with torch.no_grad():
        for t, s in zip(live, saved): t.copy_(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph): opt_g.step()
    for i in range(steps):
        with torch.no_grad():
            for p, g in zip(ps, grads[i]): p.grad.copy_(g)
        graph.replay(); sch_g.step()
        for p, g in zip(m_e.parameters(), grads[i]): p.grad = g.clone()
        opt_e.step(); sch_e.step()
        for a, b in zip(m_e.parameters(), m_g.parameters()): bytes_equal(a, b, f'step {i}')
        assert digest(opt_e.state_dict()) == digest(opt_g.state_dict())
