"""Warmup LR schedulers: legacy reference values (§6), validation, state round trip."""

from types import SimpleNamespace

import numpy as np
import pytest

from ort_trainer.optim import AdamConfig
from ort_trainer.optim.lr_scheduler import (
    ConstantWarmupLRScheduler,
    CosineWarmupLRScheduler,
    LinearWarmupLRScheduler,
    PolyWarmupLRScheduler,
)


def info(step, lr=1.0):
    """Duck-typed TrainStepInfo: the schedulers only read these two attributes."""
    return SimpleNamespace(optimization_step=step, optimizer_config=SimpleNamespace(lr=lr))


# Legacy test values: base lr 1, total_steps 10, warmup 0.5.
REFERENCE = [
    (ConstantWarmupLRScheduler(10, warmup=0.5), [0, 0.2, 0.4, 0.6, 0.8, 1, 1, 1, 1, 1], 1e-12),
    (LinearWarmupLRScheduler(10, warmup=0.5), [0, 0.2, 0.4, 0.6, 0.8, 1, 0.8, 0.6, 0.4, 0.2], 1e-12),
    (
        CosineWarmupLRScheduler(10, cycles=0.5, warmup=0.5),
        [0, 0.2, 0.4, 0.6, 0.8, 1, 0.9045, 0.6545, 0.3455, 0.0955],
        1e-4,
    ),
    (
        PolyWarmupLRScheduler(10, lr_end=1e-7, warmup=0.5),
        [0, 0.2, 0.4, 0.6, 0.8, 1, 0.80000002, 0.60000004, 0.40000006, 0.20000008],
        1e-12,
    ),
]


@pytest.mark.parametrize("scheduler, expected, atol", REFERENCE, ids=lambda x: type(x).__name__)
def test_reference_values(scheduler, expected, atol):
    got = [scheduler._step(info(step))[0] for step in range(10)]
    np.testing.assert_allclose(got, expected, rtol=0, atol=atol)
    assert scheduler.get_last_lr() == [got[-1]]


def test_schedule_scales_with_the_optimizer_lr_and_is_pure():
    sched = LinearWarmupLRScheduler(100, warmup=0.1)
    cfg = AdamConfig(lr=0.5)
    real_info = SimpleNamespace(optimization_step=50, optimizer_config=cfg)
    assert sched.get_lr(real_info) == pytest.approx(0.5 * 50 / 90)
    assert sched.get_lr(info(5, 2.0)) == pytest.approx(1.0) and sched.get_lr(info(5, 2.0)) == sched.get_lr(info(5, 2.0))
    assert sched.get_last_lr() == []  # get_lr does not record; _step does


def test_default_warmup_starts_at_zero_then_decays():
    for cls in (ConstantWarmupLRScheduler, CosineWarmupLRScheduler, LinearWarmupLRScheduler, PolyWarmupLRScheduler):
        sched = cls(1000)  # warmup 0.002 -> 2 warmup steps
        assert [sched.get_lr(info(s)) for s in (0, 1)] == [0.0, 0.5]
        assert sched.get_lr(info(2)) == pytest.approx(1.0)
    assert CosineWarmupLRScheduler(10, warmup=0.0).get_lr(info(10)) == pytest.approx(0.0, abs=1e-12)
    assert LinearWarmupLRScheduler(10, warmup=0.0).get_lr(info(20)) == 0.0  # clamped at 0
    assert PolyWarmupLRScheduler(10, lr_end=0.01, warmup=0.0).get_lr(info(11, 2.0)) == pytest.approx(0.01)


def test_poly_power():
    sched = PolyWarmupLRScheduler(10, lr_end=0.0, power=2.0, warmup=0.0)
    assert sched.get_lr(info(5)) == pytest.approx(0.25)


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: LinearWarmupLRScheduler(0),
            r"LinearWarmupLRScheduler: total_steps must be a strict positive integer, got 0",
        ),
        (lambda: LinearWarmupLRScheduler(10.0), r"total_steps must be a strict positive integer, got 10.0"),
        (lambda: ConstantWarmupLRScheduler(10, warmup=1.0), r"warmup must be a number in \[0.0, 1.0\), got 1.0"),
        (lambda: ConstantWarmupLRScheduler(10, warmup=-0.1), r"warmup must be a number in \[0.0, 1.0\), got -0.1"),
        (lambda: CosineWarmupLRScheduler(10, cycles=0), r"cycles must be a number > 0, got 0"),
        (lambda: PolyWarmupLRScheduler(10, lr_end=-1.0), r"lr_end must be a number in \[0.0, inf\), got -1.0"),
        (lambda: PolyWarmupLRScheduler(10, power=-2), r"power must be a number in \[0.0, inf\), got -2"),
    ],
)
def test_validation(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_poly_lr_must_exceed_lr_end():
    # legacy raised NameError here (its message used an undefined name)
    with pytest.raises(ValueError, match=r"optimizer lr \(1e-08\) must be greater than lr_end \(1e-07\)"):
        PolyWarmupLRScheduler(10)._step(info(3, lr=1e-8))


def test_state_round_trip_and_mismatch():
    sched = CosineWarmupLRScheduler(10, cycles=0.5, warmup=0.5)
    sched._step(info(7))
    state = sched.state_dict()
    assert state == {
        "name": "CosineWarmupLRScheduler",
        "hyper_parameters": {"total_steps": 10, "warmup": 0.5, "cycles": 0.5},
        "last_lr": [pytest.approx(0.6545085)],
    }
    fresh = CosineWarmupLRScheduler(10, cycles=0.5, warmup=0.5)
    fresh.load_state_dict({**state, "name": b"CosineWarmupLRScheduler", "last_lr": np.array(state["last_lr"])})
    assert fresh.get_last_lr() == sched.get_last_lr()
    with pytest.raises(
        ValueError,
        match=r"hyper-parameters differ \(cycles: state has 0.5, this scheduler has 2.0; "
        r"total_steps: state has 10, this scheduler has 20\)",
    ):
        CosineWarmupLRScheduler(20, cycles=2.0, warmup=0.5).load_state_dict(state)
    with pytest.raises(ValueError, match="cannot load a CosineWarmupLRScheduler state into a LinearWarmupLRScheduler"):
        LinearWarmupLRScheduler(10, warmup=0.5).load_state_dict(state)
    with pytest.raises(ValueError, match=r"missing keys \['last_lr'\]"):
        fresh.load_state_dict({"name": "CosineWarmupLRScheduler", "hyper_parameters": {}})
