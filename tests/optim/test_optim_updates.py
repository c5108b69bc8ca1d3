"""FlatLayout and FlatOptimizer: update math vs torch / an independent per-parameter numpy reference,
counters, state_dict copies, resume equivalence and state validation."""

import math
import re
import sys

import numpy as np
import pytest
import torch

from ort_trainer.optim import AdamConfig, DecayMode, FlatLayout, FlatOptimizer, LambConfig, ParamSlot, SGDConfig

SHAPES = [("fc1.weight", (4, 3)), ("fc1.bias", (4,)), ("fc2.weight", (2, 4))]
NAMES = [n for n, _ in SHAPES]


def make(config, shapes=SHAPES, seed=0):
    layout = FlatLayout(shapes)
    params = torch.randn(layout.numel, generator=torch.Generator().manual_seed(seed))
    grads = torch.zeros(layout.numel)
    return layout, params, grads, FlatOptimizer(config, layout, params, grads)


def grad_steps(numel, steps, seed=1):
    """Random gradients whose global norm varies a lot, so clipping is on for some steps only."""
    gen = torch.Generator().manual_seed(seed)
    scales = [10.0 ** (2 * torch.rand(1, generator=gen).item() - 1) for _ in range(steps)]
    return [torch.randn(numel, generator=gen) * s for s in scales]


# ------------------------------------------------------------------ numpy reference of §5.3
def ref_unscale(grads, loss_scale, max_norm, clip):
    norm = math.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads.values()))
    s = norm / max_norm if clip and norm > loss_scale * max_norm else loss_scale
    return {k: g / s for k, g in grads.items()}, s != loss_scale


def corr(beta, t, on):
    return 1.0 - beta**t if on and t > 0 else 1.0


def ref_adam(w, g, st, hp, lr):
    a, b, lam, eps, bc = hp["alpha"], hp["beta"], hp["lambda"], hp["epsilon"], hp["do_bias_correction"]
    t = st["t"]
    st["m"] = a * st["m"] + (1 - a) * g
    st["v"] = b * st["v"] + (1 - b) * g * g
    c1, c2 = corr(a, t, bc), corr(b, t, bc)
    if hp["weight_decay_mode"] == DecayMode.BEFORE_WEIGHT_UPDATE:
        w = w - lr * ((st["m"] / c1) / (np.sqrt(st["v"] / c2) + eps) + lam * w)
    else:
        w = w - lr * math.sqrt(c2) / c1 * st["m"] / (np.sqrt(st["v"]) + eps)
        w = w - lr * lam * w
    st["t"] = t + 1
    return w


def ref_lamb(w, g, st, hp, lr, step):
    a, b, lam, eps, bc = hp["alpha"], hp["beta"], hp["lambda"], hp["epsilon"], hp["do_bias_correction"]
    with np.errstate(all="ignore"):
        m1, v1 = a * st["m"] + (1 - a) * g, b * st["v"] + (1 - b) * g * g
        d = (m1 / corr(a, step, bc)) / (np.sqrt(v1 / corr(b, step, bc)) + eps) + lam * w
        ok = np.isfinite(d)
        d = np.where(ok, d, 0.0)
        st["m"], st["v"] = np.where(ok, m1, st["m"]), np.where(ok, v1, st["v"])
        wn, dn = float((w**2).sum()), float((d**2).sum())
        r = lr * max(hp["ratio_min"], min(hp["ratio_max"], math.sqrt(wn / dn))) if wn != 0 and dn != 0 else lr
        w1 = w - r * d
    return np.where(np.isfinite(w1), w1, w)


def run_reference(config, layout, params0, grads_seq, lrs, loss_scale=1.0, clip=True, t0=None):
    """Per-parameter numpy (float64) replay of the legacy backend math."""
    w = {s.name: params0[s.offset : s.end].double().numpy().reshape(s.shape) for s in layout.slots}
    st = {n: {"m": np.zeros_like(x), "v": np.zeros_like(x), "t": (t0 or {}).get(n, 1)} for n, x in w.items()}
    clipped = 0
    for step, (flat, lr) in enumerate(zip(grads_seq, lrs, strict=True), start=1):
        raw = {s.name: flat[s.offset : s.end].double().numpy().reshape(s.shape) for s in layout.slots}
        for name in w:
            hp = config.hyper_parameters(name)
            if config.name == "SGDOptimizer":
                w[name] = w[name] - lr * raw[name] / loss_scale
                continue
            g, was_clipped = ref_unscale(raw, loss_scale, hp["max_norm_clip"], clip)
            clipped += was_clipped
            if config.name == "AdamOptimizer":
                w[name] = ref_adam(w[name], g[name], st[name], hp, lr)
            else:
                w[name] = ref_lamb(w[name], g[name], st[name], hp, lr, step)
    return w, clipped


def run_flat(opt, params, grads, grads_seq, lrs, **kw):
    for g, lr in zip(grads_seq, lrs, strict=True):
        grads.copy_(g)
        opt.step(lr, **kw)


def assert_matches(layout, params, ref, rtol, atol):
    for s in layout.slots:
        got = params[s.offset : s.end].double().numpy().reshape(s.shape)
        np.testing.assert_allclose(got, ref[s.name], rtol=rtol, atol=atol, err_msg=s.name)


LRS = [0.01 * (1 + (i % 3)) for i in range(20)]


# ------------------------------------------------------------------------------ FlatLayout
def test_layout_packs_in_order_and_views_share_storage():
    layout = FlatLayout([("a", (2, 3)), ("b", torch.Size([4])), ("c", ()), ("z", (0, 5))])
    assert layout.numel == 11 and len(layout) == 4 and layout.names == ("a", "b", "c", "z")
    assert layout["b"] == ParamSlot("b", (4,), 6, 4) and "c" in layout and "x" not in layout
    buf = torch.arange(11.0)
    views = layout.views(buf)
    assert views["a"].shape == (2, 3) and views["c"].shape == () and views["c"].item() == 10.0
    views["b"].fill_(-1.0)
    assert buf[6:10].eq(-1).all()
    assert layout.runs(["c", "a", "b"]) == [(0, 11)]
    assert layout.runs(["a", "c"]) == [(0, 6), (10, 11)]
    assert layout.runs(["z"]) == []


def test_layout_errors():
    with pytest.raises(ValueError, match=r"duplicate tensor names \['a', 'b'\]"):
        FlatLayout([("a", (1,)), ("b", (1,)), ("a", (2,)), ("b", (3,))])
    with pytest.raises(ValueError, match=r"shape of 'w' has a negative dimension: \(2, -1\)"):
        FlatLayout([("w", (2, -1))])
    with pytest.raises(TypeError, match="shape of 'w' must contain ints"):
        FlatLayout([("w", (2.0,))])
    layout = FlatLayout([("a", (2, 3))])
    with pytest.raises(ValueError, match=r"1-D contiguous tensor of 6 elements, got shape \(7,\)"):
        layout.views(torch.zeros(7))
    with pytest.raises(ValueError, match="contiguous=False"):
        layout.views(torch.zeros(12)[::2])
    with pytest.raises(KeyError, match=r"no tensors named \['nope'\]"):
        layout.runs(["a", "nope"])


# ------------------------------------------------------------------------------------ Adam
@pytest.mark.parametrize("clip, loss_scale", [(False, 1.0), (True, 1.0), (True, 8.0)])
def test_adam_mode0_matches_torch_adamw(clip, loss_scale):
    cfg = AdamConfig(lr=0.01, alpha=0.85, beta=0.99, lambda_coef=0.05, epsilon=1e-6, max_norm_clip=2.0)
    layout, params, grads, opt = make(cfg)
    ref = [torch.nn.Parameter(params[s.offset : s.end].clone().view(s.shape)) for s in layout.slots]
    torch_opt = torch.optim.AdamW(ref, lr=0.01, betas=(0.85, 0.99), eps=1e-6, weight_decay=0.05)
    clipped = 0
    for raw in grad_steps(layout.numel, 20):
        grads.copy_(raw * loss_scale)
        opt.step(0.01, loss_scale=loss_scale, clip=clip)
        norm = float(torch.linalg.vector_norm(raw * loss_scale))
        s = norm / 2.0 if clip and norm > loss_scale * 2.0 else loss_scale  # legacy formula, not clip_grad_norm_
        clipped += s != loss_scale
        for p, slot in zip(ref, layout.slots, strict=True):
            p.grad = (raw * loss_scale)[slot.offset : slot.end].view(slot.shape) / s
        torch_opt.step()
    assert clipped > 3 if clip else clipped == 0  # both branches of the clip formula ran
    for p, slot in zip(ref, layout.slots, strict=True):
        torch.testing.assert_close(params[slot.offset : slot.end].view(slot.shape), p.detach(), rtol=1e-6, atol=1e-7)


def test_adam_with_pytorchs_keywords_is_torch_adamw_with_them():
    """AdamConfig(betas=, eps=, weight_decay=) (PyTorch's names) updates as torch.optim.AdamW given the same."""
    kwargs = {"betas": (0.85, 0.99), "eps": 1e-6, "weight_decay": 0.05}
    layout, params, grads, opt = make(AdamConfig(lr=0.01, **kwargs))
    ref = [torch.nn.Parameter(params[s.offset : s.end].clone().view(s.shape)) for s in layout.slots]
    torch_opt = torch.optim.AdamW(ref, lr=0.01, **kwargs)
    for raw in grad_steps(layout.numel, 20):
        grads.copy_(raw)
        opt.step(0.01, clip=False)
        for p, slot in zip(ref, layout.slots, strict=True):
            p.grad = raw[slot.offset : slot.end].view(slot.shape).clone()
        torch_opt.step()
    for p, slot in zip(ref, layout.slots, strict=True):
        torch.testing.assert_close(params[slot.offset : slot.end].view(slot.shape), p.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("loss_scale", [1.0, 8.0])
def test_clipping_on_a_device_never_reads_the_norm_back_and_updates_the_same(monkeypatch, loss_scale):
    """On a GPU the clip divisor stays a device tensor (no wait per update); the weights equal the host rule's."""
    cfg = AdamConfig(lr=0.01, lambda_coef=0.05, max_norm_clip=2.0)
    layout, params, grads, opt = make(cfg)
    _, host_params, host_grads, host_opt = make(cfg)
    seq = grad_steps(layout.numel, 20)
    monkeypatch.setattr(sys.modules[type(opt).__module__], "_norm_stays_on_device", lambda grads: True)
    monkeypatch.setattr(torch.Tensor, "__float__", lambda t: pytest.fail("the norm was read back to the host"))
    for raw in seq:
        grads.copy_(raw * loss_scale)
        opt.step(0.01, loss_scale=loss_scale, clip=True)
    monkeypatch.undo()
    clipped = 0
    for raw in seq:
        host_grads.copy_(raw * loss_scale)
        clipped += float(torch.linalg.vector_norm(raw)) > 2.0
        host_opt.step(0.01, loss_scale=loss_scale, clip=True)
    assert 3 < clipped < len(seq)  # both branches of the rule ran
    torch.testing.assert_close(params, host_params, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "mode, bias",
    [
        (DecayMode.AFTER_WEIGHT_UPDATE, True),
        (DecayMode.AFTER_WEIGHT_UPDATE, False),
        (DecayMode.BEFORE_WEIGHT_UPDATE, False),
    ],
)
def test_adam_modes_match_reference(mode, bias):
    cfg = AdamConfig(lr=0.01, lambda_coef=0.1, max_norm_clip=3.0, do_bias_correction=bias, weight_decay_mode=mode)
    layout, params, grads, opt = make(cfg)
    seq = grad_steps(layout.numel, 20)
    ref, clipped = run_reference(cfg, layout, params.clone(), [g * 4 for g in seq], LRS, loss_scale=4.0)
    run_flat(opt, params, grads, [g * 4 for g in seq], LRS, loss_scale=4.0)
    assert clipped > 0
    assert_matches(layout, params, ref, rtol=2e-6, atol=2e-7)


def test_adam_param_groups_apply_their_hyper_parameters():
    cfg = AdamConfig(
        [
            {"params": ["fc2.weight"], "alpha": 0.5, "lambda_coef": 0.3},
            {"params": ["fc1.weight"], "weight_decay_mode": DecayMode.AFTER_WEIGHT_UPDATE, "beta": 0.9},
        ],
        lr=0.02,
        lambda_coef=0.01,
    )  # fc1.bias is in no group: defaults
    layout, params, grads, opt = make(cfg)
    seq = grad_steps(layout.numel, 10)
    ref, _ = run_reference(cfg, layout, params.clone(), seq, LRS[:10], clip=False)
    run_flat(opt, params, grads, seq, LRS[:10], clip=False)
    assert_matches(layout, params, ref, rtol=2e-6, atol=2e-7)
    # the groups mattered: the same run with defaults only ends elsewhere
    plain, _ = run_reference(AdamConfig(lr=0.02, lambda_coef=0.01), layout, make(cfg)[1], seq, LRS[:10], clip=False)
    assert not np.allclose(plain["fc2.weight"], ref["fc2.weight"], atol=1e-4)
    np.testing.assert_allclose(plain["fc1.bias"], ref["fc1.bias"], rtol=1e-12)


@pytest.mark.parametrize("mode", list(DecayMode))
def test_groups_split_across_the_layout(mode):
    """A group whose parameters are not adjacent in the layout is updated run by run."""
    cfg = AdamConfig(
        [{"params": ["fc2.weight", "fc1.weight"], "alpha": 0.5, "lambda_coef": 0.3, "weight_decay_mode": mode}],
        lr=0.02,
        max_norm_clip=4.0,
    )
    layout, params, grads, opt = make(cfg)
    assert layout.runs(cfg.params[0]["params"]) == [(0, 12), (16, 24)]
    seq = grad_steps(layout.numel, 10)
    ref, _ = run_reference(cfg, layout, params.clone(), seq, LRS[:10])
    run_flat(opt, params, grads, seq, LRS[:10])
    assert_matches(layout, params, ref, rtol=2e-6, atol=2e-7)


def test_fused_adam_chunking_changes_nothing(monkeypatch):
    # Pieces are multiples of the SIMD width (8 or 16 floats), as the real 2**20 chunk is, so the
    # fused kernel computes every element exactly as on the whole run.
    shapes = [("w", (5, 8)), ("b", (7,))]
    seq = grad_steps(47, 5)
    results = []
    for chunk in (1 << 20, 16):  # one run of 47 elements; then pieces of 16, 16, 15
        monkeypatch.setattr("ort_trainer.optim._updates.FUSED_CHUNK", chunk)
        layout, params, grads, opt = make(AdamConfig(lambda_coef=0.1), shapes)
        run_flat(opt, params, grads, seq, LRS[:5])
        results.append(params)
    assert torch.equal(results[0], results[1])


def test_params_updated_in_place_and_grads_untouched():
    layout, params, grads, opt = make(AdamConfig(weight_decay_mode=DecayMode.AFTER_WEIGHT_UPDATE))
    ptr, views, before = params.data_ptr(), layout.views(params), params.clone()
    grads.copy_(grad_steps(layout.numel, 1)[0] * 2)
    saved = grads.clone()
    opt.step(0.1, loss_scale=2.0)
    assert params.data_ptr() == ptr and not torch.equal(params, before)
    assert torch.equal(views["fc1.bias"], params[12:16]) and torch.equal(grads, saved)


# ------------------------------------------------------------------------------------ Lamb
@pytest.mark.parametrize("bias", [False, True])
def test_lamb_matches_reference(bias):
    cfg = LambConfig(
        [
            {"params": ["small"], "ratio_min": 0.5},
            {"params": ["big"], "ratio_max": 2.0, "lambda_coef": 0.2},
            {"params": ["frozen_grad"], "lambda_coef": 0.0},
        ],
        lr=0.01,
        lambda_coef=0.01,
        max_norm_clip=5.0,
        do_bias_correction=bias,
    )
    shapes = [("small", (3, 4)), ("big", (5,)), ("zero", (2, 2)), ("frozen_grad", (3,))]
    layout, params, grads, opt = make(cfg, shapes)
    params[:12] *= 0.01  # trust ratio ~0.01: clamped up to ratio_min
    params[12:17] *= 100.0  # trust ratio ~100: clamped down to ratio_max
    params[17:21] = 0.0  # ||w|| == 0 on step 1: r = lr
    seq = grad_steps(layout.numel, 12)
    for g in seq:
        g[21:] = 0.0  # zero moments and lambda 0: ||d|| == 0, r = lr
    ref, clipped = run_reference(cfg, layout, params.clone(), seq, LRS[:12])
    run_flat(opt, params, grads, seq, LRS[:12])
    assert clipped > 0
    assert_matches(layout, params, ref, rtol=2e-6, atol=2e-7)
    unclamped, _ = run_reference(
        LambConfig(lr=0.01, lambda_coef=0.01, max_norm_clip=5.0, do_bias_correction=bias),
        layout,
        make(cfg, shapes)[1],
        seq,
        LRS[:12],
    )
    assert not np.allclose(unclamped["small"], ref["small"], rtol=1e-3)


def test_lamb_non_finite_direction_keeps_moments_and_weight():
    cfg = LambConfig(lr=0.1)
    layout, params, grads, opt = make(cfg)
    seq = grad_steps(layout.numel, 3)
    seq[1][5] = float("inf")
    seq[2][13] = float("nan")
    ref, _ = run_reference(cfg, layout, params.clone(), seq, [0.1] * 3, clip=False)
    run_flat(opt, params, grads, seq, [0.1] * 3, clip=False)
    assert_matches(layout, params, ref, rtol=2e-6, atol=2e-7)
    state = opt.state_dict()
    assert torch.isfinite(params).all() and torch.isfinite(state["fc1.weight"]["Moment_1"]).all()


# ------------------------------------------------------------------------------------- SGD
def test_sgd_matches_torch_sgd():
    layout, params, grads, opt = make(SGDConfig(lr=0.1))
    ref = [torch.nn.Parameter(params[s.offset : s.end].clone().view(s.shape)) for s in layout.slots]
    torch_opt = torch.optim.SGD(ref, lr=0.1)
    for raw in grad_steps(layout.numel, 5):
        grads.copy_(raw)
        opt.step(0.1)
        for p, s in zip(ref, layout.slots, strict=True):
            p.grad = raw[s.offset : s.end].view(s.shape).clone()
        torch_opt.step()
    for p, s in zip(ref, layout.slots, strict=True):
        assert torch.equal(params[s.offset : s.end].view(s.shape), p.detach())
    ref_w, _ = run_reference(SGDConfig(), layout, params.clone(), [torch.ones(layout.numel) * 4], [0.5], loss_scale=4.0)
    grads.fill_(4.0)
    opt.step(0.5, loss_scale=4.0)  # SGD only divides by the loss scale
    assert_matches(layout, params, ref_w, rtol=1e-6, atol=1e-7)
    assert opt.state_dict() == {}


# ------------------------------------------------------------------------- counters + state
def test_counters_start_at_one_and_grow_per_step():
    _, _, grads, adam = make(AdamConfig())
    _, _, _, lamb = make(LambConfig())
    assert adam.state_dict()["fc1.bias"]["Update_Count"].tolist() == [1]
    assert lamb.state_dict()["shared_optimizer_state"]["Step"].tolist() == [1]
    for _ in range(3):
        adam.step(0.1)
        lamb.step(0.1)
    counts = adam.state_dict()
    assert all(counts[n]["Update_Count"].dtype == torch.int64 for n in NAMES)
    assert [counts[n]["Update_Count"].tolist() for n in NAMES] == [[4]] * 3
    assert lamb.state_dict()["shared_optimizer_state"]["Step"].tolist() == [4]


def test_state_dict_returns_copies():
    layout, params, grads, opt = make(AdamConfig())
    grads.copy_(grad_steps(layout.numel, 1)[0])
    opt.step(0.1)
    state = opt.state_dict()
    for entry in state.values():
        for t in entry.values():
            t.add_(100)
    again = opt.state_dict()
    assert again["fc1.weight"]["Update_Count"].tolist() == [2]
    assert again["fc1.weight"]["Moment_1"].abs().max() < 50
    assert again["fc2.weight"]["Moment_1"].shape == (2, 4)


CONFIGS = [
    AdamConfig(),
    AdamConfig([{"params": ["fc1.bias"], "weight_decay_mode": DecayMode.AFTER_WEIGHT_UPDATE}], lambda_coef=0.1),
    LambConfig(lambda_coef=0.1, do_bias_correction=True),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["adam", "adam-groups", "lamb"])
@pytest.mark.parametrize("as_numpy", [False, True])
def test_resume_is_bit_identical(cfg, as_numpy):
    seq = grad_steps(24, 10)
    layout, params, grads, full = make(cfg)
    run_flat(full, params, grads, seq, LRS[:10], loss_scale=2.0)
    layout, params2, grads2, first = make(cfg)
    run_flat(first, params2, grads2, seq[:6], LRS[:6], loss_scale=2.0)
    state = first.state_dict()
    if as_numpy:  # what an HDF5 round trip gives back
        state = {k: {kk: vv.numpy() for kk, vv in v.items()} for k, v in state.items()}
    resumed_params = params2.clone()
    resumed = FlatOptimizer(cfg, layout, resumed_params, grads2)
    resumed.load_state_dict(state)
    run_flat(resumed, resumed_params, grads2, seq[6:], LRS[6:10], loss_scale=2.0)
    assert torch.equal(resumed_params, params)


def test_update_counts_that_differ_within_a_group():
    cfg = AdamConfig(lr=0.05)
    layout, params, grads, opt = make(cfg)
    state = opt.state_dict()
    counts = {"fc1.weight": 7, "fc1.bias": 1, "fc2.weight": 3}
    for name, t in counts.items():
        state[name]["Update_Count"] = t
    opt.load_state_dict(state)
    seq = grad_steps(layout.numel, 4)
    ref, _ = run_reference(cfg, layout, params.clone(), seq, [0.05] * 4, clip=False, t0=counts)
    run_flat(opt, params, grads, seq, [0.05] * 4, clip=False)
    assert_matches(layout, params, ref, rtol=2e-6, atol=2e-7)
    assert {n: opt.state_dict()[n]["Update_Count"].item() for n in counts} == {n: t + 4 for n, t in counts.items()}


def test_validation_lists_every_problem_and_failed_load_changes_nothing():
    layout, params, grads, opt = make(AdamConfig())
    grads.copy_(grad_steps(layout.numel, 1)[0])
    opt.step(0.1)
    before = opt.state_dict()
    bad = opt.state_dict()
    del bad["fc2.weight"]
    del bad["fc1.bias"]["Update_Count"]
    bad["extra"] = {}
    bad["fc1.weight"]["Moment_1"] = torch.zeros(3, 4)
    bad["fc1.weight"]["Moment_2"] = torch.zeros(4, 3, dtype=torch.int32)
    bad["fc1.weight"]["Update_Count"] = torch.tensor([2.0])
    bad["fc1.bias"]["Moment_1"] = np.zeros(4, np.float32)  # fine: numpy is accepted
    bad["fc1.bias"]["junk"] = 1
    expected = "\n  ".join(
        [
            "AdamOptimizer state is invalid (7 problem(s)):",
            "missing key state_dict[optimizer][fc1.bias][Update_Count]",
            "missing key state_dict[optimizer][fc2.weight]",
            "unexpected key state_dict[optimizer][extra]",
            "unexpected key state_dict[optimizer][fc1.bias][junk]",
            "state_dict[optimizer][fc1.weight][Moment_1]: shape mismatch: expected (4, 3), got (3, 4)",
            "state_dict[optimizer][fc1.weight][Moment_2]: wrong dtype: expected a floating-point dtype, got int32",
            "state_dict[optimizer][fc1.weight][Update_Count]: "
            "wrong dtype: expected an integer dtype (int64), got float32",
        ]
    )
    with pytest.raises(ValueError, match=re.escape(expected) + r"\nThe state must come from .* strict=False"):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    for name in NAMES:
        for key in ("Moment_1", "Moment_2", "Update_Count"):
            assert torch.equal(after[name][key], before[name][key])
    with pytest.raises(ValueError, match=r"ckpt\[fc1.bias\]\[Update_Count\]: must be >= 1 .*got 0"):
        opt.validate_state_dict({**before, "fc1.bias": {**before["fc1.bias"], "Update_Count": 0}}, where="ckpt")
    lamb = make(LambConfig())[3]
    with pytest.raises(
        ValueError,
        match=r"\[optimizer\]\[shared_optimizer_state\]\[Step\]: shape mismatch: expected \(1,\), got \(2,\)",
    ):
        lamb.validate_state_dict({"shared_optimizer_state": {"Step": np.ones(2, np.int64)}}, strict=False)
    with pytest.raises(ValueError, match=r"unexpected key state_dict\[optimizer\]\[fc1.weight\]"):
        make(SGDConfig())[3].load_state_dict({"fc1.weight": {}})


def test_non_strict_load_keeps_missing_entries():
    layout, params, grads, opt = make(AdamConfig())
    grads.copy_(grad_steps(layout.numel, 1)[0])
    opt.step(0.1)
    before = opt.state_dict()
    opt.load_state_dict({"fc1.bias": {"Moment_1": torch.full((4,), 7.0)}, "other": {}}, strict=False)
    after = opt.state_dict()
    assert after["fc1.bias"]["Moment_1"].eq(7).all()
    assert torch.equal(after["fc1.bias"]["Moment_2"], before["fc1.bias"]["Moment_2"])
    assert torch.equal(after["fc1.weight"]["Moment_1"], before["fc1.weight"]["Moment_1"])
    assert after["fc1.bias"]["Update_Count"].tolist() == [2]


def test_step_and_constructor_argument_errors():
    layout, params, grads, opt = make(AdamConfig())
    with pytest.raises(ValueError, match="lr must be >= 0, got -0.1"):
        opt.step(-0.1)
    with pytest.raises(ValueError, match="loss_scale must be > 0, got 0"):
        opt.step(0.1, loss_scale=0)
    with pytest.raises(ValueError, match=r"grads must be a 1-D contiguous tensor of 24 elements, got shape \(23,\)"):
        FlatOptimizer(AdamConfig(), layout, params, torch.zeros(23))
    with pytest.raises(ValueError, match="one dtype and device"):
        FlatOptimizer(AdamConfig(), layout, params, torch.zeros(24, dtype=torch.float64))
