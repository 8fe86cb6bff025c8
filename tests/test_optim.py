"""Checks of `lucid_nb.optim` beyond `nbs/05_optim.ipynb` (which checks the groups, Newton–Schulz, the tensor
hyperparameters, refusals, host syncs, state-dict round trips, `build_optimizer`, the schedule, resuming and, on a GPU,
graph replay): frozen and shared parameters, MuSGD against a plain per-matrix reference over several steps, the
bfloat16 default, float values loaded into tensor hyperparameters, the cosine schedule and its bad arguments; and
the optimisers, the trainer's clipping and the schedule against what Ultralytics 8.4.190 recorded
(`fixtures/make_ultralytics_optim.py`)."""
import copy, math

import pytest
import torch
from torch import nn

from lucid_nb.core import digest
from lucid_nb.core import test_bytes_equal as bytes_equal
from lucid_nb.optim import NS_COEFFS, MuSGD, build_optimizer, build_schedule, orthogonalise, param_groups


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
    "Loop over parameters, one matrix at a time, in fp32; the same formulas, order and tensor hyperparameters as MuSGD (Ultralytics')."
    def __init__(self, groups, nesterov):
        self.groups, self.nesterov, self.state = groups, nesterov, {}

    @torch.no_grad()
    def step(self):
        for g in self.groups:
            mom, wd = g['momentum'], g['weight_decay']
            for p in g['params']:
                s = self.state.setdefault(p, {'b': torch.zeros_like(p), 'm': torch.zeros_like(p)})
                if p.grad is None: continue
                lr = g['lr']
                if g['use_muon']:                                          # first the Muon step
                    s['m'] = torch.addcmul(s['m'] * mom, p.grad, 1 - mom)
                    v = torch.addcmul(s['m'] * mom, p.grad, 1 - mom) if self.nesterov else s['m']
                    o = ns_reference(v.reshape(p.shape[0], -1)).reshape(p.shape) * max(1, p.shape[-2] / p.shape[-1]) ** 0.5
                    p.addcmul_(o, -(lr * g['muon_weight']))
                    lr = lr * g['sgd_weight']
                d = torch.addcmul(p.grad, p, wd)                           # then SGD, decaying the new p
                s['b'] = s['b'] * mom + d
                u = torch.addcmul(d, s['b'], mom) if self.nesterov else s['b']
                p.addcmul_(u, -lr)


def hyper_groups(model, **kw):
    "Groups for the reference with the same 0-dim float64 hyperparameters MuSGD makes."
    t = lambda v: torch.tensor(v, dtype=torch.float64)
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
                muon_weight=kw['muon_weight'], sgd_weight=kw['sgd_weight'], ns_dtype=torch.float32)
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
            close(s['momentum_buffer'], ref.state[p_ref]['b'], 'sgd buffer')       # its decay term reads p, after the Muon step
        else:
            bytes_equal(s['momentum_buffer'], ref.state[p_ref]['b'], 'sgd buffer')
            assert 'muon_buffer' not in s


# ---------------------------------------------------------------- orthogonalise in bfloat16


def test_orthogonalise_bf16_default_and_scale():
    g = torch.Generator().manual_seed(0)
    w, lin = torch.randn(48, 8, 1, 1, generator=g), torch.randn(48, 8, generator=g)   # a tall 1x1 conv, a tall matrix
    o16, o32 = orthogonalise([w])[0], orthogonalise([w], dtype=torch.float32)[0]
    assert o16.dtype == torch.float32 and o16.shape == w.shape
    assert (o32 - o16).abs().max() < 0.05 * o32.abs().max()
    sv = torch.linalg.svdvals(o32.reshape(48, 8).double())           # a 4-D weight: scale size(-2)/size(-1) = 1, as Ultralytics
    assert sv.min() > 0.65 and sv.max() < 1.25
    sv = torch.linalg.svdvals(orthogonalise([lin], dtype=torch.float32)[0].double()) / math.sqrt(6)   # a matrix: sqrt(48/8)
    assert sv.min() > 0.65 and sv.max() < 1.25


# ---------------------------------------------------------------- loading a state dict


def run_steps(model, opt, seeds):
    for s in seeds: set_grads(model, s); opt.step()


def test_load_into_fresh_optimizer_and_float_values():
    m_a = net(); opt_a = MuSGD(param_groups(m_a), lr=0.01)
    run_steps(m_a, opt_a, [0, 1])
    sd = copy.deepcopy(opt_a.state_dict())
    opt_b = MuSGD(param_groups(net()), lr=0.5)                       # no state yet
    opt_b.load_state_dict(sd)
    assert digest(opt_b.state_dict()) == digest(sd)
    sd['param_groups'][0]['lr'] = 0.25                                # a float from elsewhere becomes our tensor
    opt_b.load_state_dict(sd)
    assert opt_b.param_groups[0]['lr'].dtype == torch.float64 and opt_b.param_groups[0]['lr'].item() == 0.25


# ---------------------------------------------------------------- schedule


def test_schedule_cosine_no_warmup_and_clamp():
    opt = build_optimizer(net(), 'musgd', lr=0.02)
    sched = build_schedule(opt, epochs=4, steps_per_epoch=5, warmup_epochs=0, cosine=True, lrf=0.05)
    assert sched.warmup_iters == 0
    vals = [sched.values(i)[0][0] for i in (0, 4, 10, 19)]            # whole epochs: 0, 0, 2, 3 (of 4)
    assert vals == pytest.approx([0.02, 0.02, 0.02 * (1 + (0.05 - 1) / 2), 0.02 * (1 + (0.05 - 1) * (1 - math.cos(0.75 * math.pi)) / 2)])
    assert sched.values(0)[1] == [None] * len(opt.param_groups)      # no warm-up: the momentum is left as it is


def test_schedule_bad_arguments():
    opt = build_optimizer(net(), 'sgd')
    for kw, msg in [(dict(epochs=0), 'epochs=0'), (dict(steps_per_epoch=2.5), 'steps_per_epoch=2.5'),
                    (dict(warmup_epochs=-1), 'warmup_epochs'), (dict(lrf=0), 'lrf=0'), (dict(lrf=2), 'lrf=2'),
                    (dict(min_warmup_iters=-3), 'min_warmup_iters')]:
        args = dict(epochs=3, steps_per_epoch=4) | kw
        with pytest.raises(ValueError, match=msg): build_schedule(opt, **args)


# ---------------------------------------------------------------- Ultralytics 8.4.190 (fixtures/make_ultralytics_optim.py)

import importlib.util, json
from pathlib import Path

FIX = Path(__file__).parent / 'fixtures'
_spec = importlib.util.spec_from_file_location('make_ultralytics_optim', FIX / 'make_ultralytics_optim.py')
MUO = importlib.util.module_from_spec(_spec); _spec.loader.exec_module(MUO)   # its gradients, pattern and clip norm
UO = json.loads((FIX / 'ultralytics_optim.json').read_text())
# Each parameter's change after one and two steps, relative to its norm. Measured on the CPU that made the fixture:
# 0 for all three (the same bytes); MuSGD's bfloat16 Newton–Schulz may round otherwise on another CPU's kernels.
STEP_RTOL = {'SGD': 1e-5, 'AdamW': 1e-5, 'MuSGD': 1e-3}


def lit_model():
    from lucid_nb.trainer import LitYolo
    return LitYolo(weights=str(FIX / UO['weights']))


def value(v): return v.item() if isinstance(v, torch.Tensor) else v


def group_by_param(opt): return {id(p): g for g in opt.param_groups for p in g['params']}


def test_ultralytics_optim_fixture_is_small_and_complete():
    assert (FIX / 'ultralytics_optim.json').stat().st_size < 2**20 and UO['versions']['ultralytics'] == '8.4.190'
    assert set(UO['steps']) == {'SGD', 'AdamW', 'MuSGD'} and len(UO['schedules']) == 5
    for s in UO['schedules'].values(): assert len(s['iterations']) == 4 * s['batches_per_epoch'] == 24


@pytest.mark.parametrize('name', ['SGD', 'AdamW', 'MuSGD'])
def test_step_equals_ultralytics(name):
    "The groups (lr, decay, momentum, Muon) of `build_optimizer` and two steps of lucid's update, clipping included, as Ultralytics'."
    from lucid_nb.weights import lucid_key
    case, lit = UO['steps'][name], lit_model()
    lit.hparams.clip_grad_norm = case['clip']
    P = dict(lit.model.named_parameters())
    opt = build_optimizer(lit.model, name.lower(), lr=case['lr'], momentum=case['momentum'], weight_decay=case['weight_decay'])
    of = group_by_param(opt)
    for g in case['groups']:
        mine = {id(of[id(P[lucid_key(n)])]) for n in g['params']}
        assert len(mine) == 1, (name, g['param_group'], 'spread over several groups')
        m = of[id(P[lucid_key(g['params'][0])])]
        got = (value(m['lr']), value(m['weight_decay']), value(m['betas'][0] if 'betas' in m else m['momentum']), bool(m.get('use_muon')))
        assert got == (g['lr'], g['weight_decay'], g['momentum'], g['use_muon']), (name, g['param_group'], got)
    assert sum(len(g['params']) for g in opt.param_groups) == sum(len(g['params']) for g in case['groups'])
    names = list(case['changes']); before = {n: P[lucid_key(n)].detach().clone() for n in names}
    got = {n: [] for n in names}
    for step in (1, 2):
        gs = MUO.grads([(n, P[lucid_key(n)].shape) for n in names], step)
        assert MUO.grads_digest(gs) == case['grads_digests'][step - 1]
        for n in names: P[lucid_key(n)].grad = gs[n].clone()
        lit.configure_gradient_clipping(opt)                 # what Lightning calls before the update
        opt.step(); opt.zero_grad()
        for n in names: got[n] += MUO.change(P[lucid_key(n)].detach(), before[n])
    for n in names:
        want = case['changes'][n]
        for k in (0, 1, 2, 3): assert abs(got[n][k] - want[k]) <= STEP_RTOL[name] * want[k // 2 * 2], (name, n, k, got[n][k], want[k])


@pytest.mark.parametrize('case', list(UO['schedules']))
def test_schedule_equals_ultralytics(case):
    "Every group's lr and momentum at every iteration of 4 epochs, warm-up and decay, the same floats as Ultralytics' trainer wrote."
    from lucid_nb.optim import auto_optimizer, NBS
    from lucid_nb.weights import lucid_key
    s, lit = UO['schedules'][case], lit_model()
    a, P = s['args'], dict(lit.model.named_parameters())
    name, lr, momentum, bias_lr = a['optimizer'].lower(), a.get('lr0', 0.01), 0.937, 0.1   # Ultralytics' defaults
    if name == 'auto': (name, lr, momentum), bias_lr = auto_optimizer(math.ceil(96 / max(a['batch'], NBS)) * a['epochs'], 80), 0.0
    opt = build_optimizer(lit.model, name, lr=lr, momentum=momentum, weight_decay=5e-4)
    sched = build_schedule(opt, epochs=a['epochs'], steps_per_epoch=s['batches_per_epoch'], warmup_epochs=a['warmup_epochs'],
                           warmup_bias_lr=bias_lr, cosine=a.get('cos_lr', False), momentum=0.937)
    of = group_by_param(opt)
    mine = [of[id(P[lucid_key(next(n for n in g['params'] if lucid_key(n) in P))])] for g in s['groups']]
    for i, row in enumerate(s['iterations']):
        for g, want_lr, want_m in zip(mine, row['lr'], row['momentum']):
            m = value(g['betas'][0] if 'betas' in g else g['momentum'])
            assert (value(g['lr']), m) == (want_lr, want_m), (case, i, g.get('name'), value(g['lr']), want_lr, m, want_m)
        opt.step(); sched.step()
