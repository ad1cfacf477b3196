"""Data-parallel training with a growing number of (volatile) workers: benchmarks/studies/growing.py."""

from __future__ import annotations

import pytest
import torch
from studies.growing import (
    GrowingConfig,
    Volatility,
    aggregated_gradient,
    concatenated_gradient,
    train_growing,
)
from studies.schedules import schedule_values

from mopflow.training.models.builtin import ArchSpec, build_model
from mopflow.training.volatile.cost import account_run
from mopflow.training.volatile.price_trace import PriceTrace
from mopflow.training.volatile.prices import SECONDS_PER_HOUR, PriceError, TraceExhaustedError
from mopflow.training.volatile.schedules import WorkerSchedule
from tests.benchmarks.growing_helpers import (
    ARCH,
    TRACE,
    growing_config,
    growing_data,
    volatile_growing_config,
)


def test_workers_follow_the_schedule_and_worker_iterations_add_up() -> None:
    for schedule in (
        WorkerSchedule(kind="exponential", eta=2.0, n_max=4),
        WorkerSchedule(kind="step", n_start=1, increment=2, period=2, n_max=5),
        WorkerSchedule(kind="static", n_max=3),
        WorkerSchedule(kind="exponential", eta=2.0, n_max=4, unit="epoch"),
    ):
        cfg = growing_config(schedule=schedule, iterations_per_epoch=2)
        result = train_growing(cfg, ARCH, growing_data())
        expected = schedule_values(schedule, 6, iterations_per_epoch=2)
        assert tuple(r.provisioned for r in result.records) == expected
        assert tuple(r.active for r in result.records) == expected
        assert [r.worker_iterations for r in result.records] == [sum(expected[: i + 1]) for i in range(6)]
    assert expected == (1, 1, 2, 2, 4, 4)  # the per-epoch schedule holds n for an epoch


def test_averaged_worker_gradients_equal_the_concatenated_batch_gradient() -> None:
    torch.manual_seed(0)
    model = build_model(ArchSpec("cnn", {"width": 4, "depth": 2}, 20, 3))
    x = torch.randn(5 * 7, 20)
    y = torch.randint(0, 3, (5 * 7,))
    micro = [(x[i * 7 : (i + 1) * 7], y[i * 7 : (i + 1) * 7]) for i in range(5)]
    averaged = aggregated_gradient(model, micro)
    whole = concatenated_gradient(model, micro)
    for a, w in zip(averaged, whole, strict=True):
        torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-7)
    # and it is not the gradient of a single worker's batch
    single = aggregated_gradient(model, micro[:1])
    assert any(not torch.allclose(a, s, atol=1e-6) for a, s in zip(averaged, single, strict=True))


def test_per_worker_emulation_trains_like_the_concatenated_one() -> None:
    fast = train_growing(growing_config(emulation="concatenated"), ARCH, growing_data())
    literal = train_growing(growing_config(emulation="per_worker"), ARCH, growing_data())
    for a, b in zip(fast.records, literal.records, strict=True):
        assert a.loss == pytest.approx(b.loss, rel=1e-5)
    for p, q in zip(fast.model.parameters(), literal.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("rule", "expected"),
    [
        ("linear", [0.05, 0.1, 0.2, 0.2, 0.2, 0.2]),
        ("sqrt", [0.05, 0.05 * 2**0.5, 0.1, 0.1, 0.1, 0.1]),
        ("none", [0.05] * 6),
    ],
)
def test_step_size_scales_with_the_workers(rule: str, expected: list[float]) -> None:
    # n_j = 1, 2, 4, 4, 4, 4 (eta 2, n_max 4)
    result = train_growing(growing_config(scaling=rule), ARCH, growing_data())
    assert [r.lr for r in result.records] == pytest.approx(expected)


def test_the_step_size_actually_moves_the_weights_by_lr_times_gradient() -> None:
    cfg = growing_config(schedule=WorkerSchedule(kind="static", n_max=2), iterations=1, scaling="linear")
    x, y = growing_data()
    torch.manual_seed(cfg.seed)
    initial = build_model(ARCH, x.mean(0).tolist(), x.std(0).tolist())
    result = train_growing(cfg, ARCH, (x, y))
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(cfg.seed))[:8]
    grads = concatenated_gradient(initial, [(x[order[:4]], y[order[:4]]), (x[order[4:]], y[order[4:]])])
    for p0, g, p1 in zip(initial.parameters(), grads, result.model.parameters(), strict=True):
        torch.testing.assert_close(p1, p0 - 0.1 * g)  # lr = 0.05 * 2 workers


def test_training_is_seeded_and_deterministic() -> None:
    a = train_growing(growing_config(), ARCH, growing_data())
    b = train_growing(growing_config(), ARCH, growing_data())
    c = train_growing(growing_config(seed=1), ARCH, growing_data())
    assert a.records == b.records
    for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert [r.loss for r in a.records] != [r.loss for r in c.records]


def test_more_workers_learn_a_task_to_its_accuracy() -> None:
    x, y = growing_data(rows=512)
    cfg = growing_config(
        schedule=WorkerSchedule(kind="static", n_max=8), iterations=150, base_lr=0.05, eval_every=50
    )
    result = train_growing(cfg, ARCH, (x, y), eval_data=(x, y))
    assert [r.iteration for r in result.records if r.eval_accuracy is not None] == [50, 100, 150]
    assert result.final_accuracy is not None and result.final_accuracy > 0.85
    assert result.records[-1].loss < result.records[0].loss  # type: ignore[operator]


# ----------------------------------------------------------------------------- volatility


def test_only_active_workers_contribute_and_idle_slots_do_no_update() -> None:
    cfg = volatile_growing_config()
    result = train_growing(cfg, ARCH, growing_data(), volatility=Volatility(TRACE, (4.0, 2.0)))
    assert [(r.slot, r.iteration, r.provisioned, r.active) for r in result.records] == [
        (0, 1, 2, 2),
        (1, 2, 2, 1),
        (2, 3, 2, 0),
        (3, 3, 2, 2),
        (4, 4, 2, 2),
    ]
    idle = result.records[2]
    assert idle.lr == 0.0 and idle.loss is None and idle.worker_iterations == 3
    assert result.records[1].lr == pytest.approx(0.1)  # scaled with the provisioned n_j = 2
    assert result.records[-1].worker_iterations == 7
    # the idle slot changed nothing: the same run without it ends with the same weights
    no_idle = PriceTrace((0.0, 10.0, 20.0), (1.0, 3.0, 1.0), end=200.0)
    same = train_growing(cfg, ARCH, growing_data(), volatility=Volatility(no_idle, (4.0, 2.0)))
    for p, q in zip(result.model.parameters(), same.model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert len(same.records) == 4


def test_the_account_matches_training_and_counts_the_idle_slot() -> None:
    result = train_growing(
        volatile_growing_config(), ARCH, growing_data(), volatility=Volatility(TRACE, (4.0, 2.0))
    )
    account = result.account
    assert account is not None
    assert account.workers_per_unit == (2, 1, 2, 2)
    assert account.idle_seconds == pytest.approx(10.0)
    assert account.wall_seconds == pytest.approx(50.0)
    assert account.billed_worker_seconds == pytest.approx(70.0)
    # price x active worker-seconds, per hour: 2*1*10 + 3*10 + 2*1*10 + 2*1*10
    assert account.cost == pytest.approx((20 + 30 + 20 + 20) / SECONDS_PER_HOUR)
    assert account == account_run(TRACE, (4.0, 2.0), [10.0] * 4, provisioned=[2, 2, 2, 2])


def test_volatility_inputs_are_checked() -> None:
    with pytest.raises(PriceError, match="1 bids for a schedule of up to n_max=2"):
        train_growing(volatile_growing_config(), ARCH, growing_data(), volatility=Volatility(TRACE, (4.0,)))
    misaligned = PriceTrace((0.0, 15.0), (1.0, 2.0), end=200.0)
    with pytest.raises(PriceError, match=r"price change at t=15.0 falls inside an iteration slot"):
        train_growing(
            volatile_growing_config(), ARCH, growing_data(), volatility=Volatility(misaligned, (4.0, 4.0))
        )
    short = PriceTrace((0.0, 10.0), (1.0, 9.0), end=30.0)
    with pytest.raises(TraceExhaustedError, match="after 1 of 4 iterations"):
        train_growing(
            volatile_growing_config(), ARCH, growing_data(), volatility=Volatility(short, (4.0, 4.0))
        )
    with pytest.raises(ValueError, match="batch_size=4 exceeds the 3 training rows"):
        train_growing(volatile_growing_config(), ARCH, growing_data(rows=3))
    with pytest.raises(ValueError, match="eta"):
        GrowingConfig.model_validate({"schedule": {"eta": 0.5}})
