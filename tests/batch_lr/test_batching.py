import pytest

from accel_common.batch_lr.batching import BatchPlanError, SmallBatchWarning, plan_batch


@pytest.mark.parametrize(
    ("world", "kwargs", "expected"),
    [
        (8, {"global_batch_size": 64}, (64, 8, 1)),
        (1, {"global_batch_size": 8}, (8, 8, 1)),
        (4, {"global_batch_size": 64, "grad_accum_steps": 2}, (64, 8, 2)),
        (4, {"per_device_batch_size": 16}, (64, 16, 1)),
        (4, {"per_device_batch_size": 32, "grad_accum_steps": 4}, (512, 32, 4)),
        # a memory cap turns the rest into accumulation and keeps the global batch
        (2, {"global_batch_size": 128, "max_per_device_batch_size": 16}, (128, 16, 4)),
        (2, {"global_batch_size": 96, "max_per_device_batch_size": 20}, (96, 16, 3)),
        (4, {"per_device_batch_size": 32, "max_per_device_batch_size": 16}, (128, 16, 2)),
    ],
)
def test_plan_is_exact(world, kwargs, expected):
    plan = plan_batch(world, **kwargs)
    assert (plan.global_batch_size, plan.per_device_batch_size, plan.grad_accum_steps) == expected
    assert plan.num_processes == world
    product = plan.per_device_batch_size * plan.num_processes * plan.grad_accum_steps
    assert product == plan.global_batch_size


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("samples", "cap", "micro"),
    [(1_000_000_007, 2, 1), (2 * 1_000_000_007, 1_000_000_007, 1_000_000_007), (10**12, 3, 2)],
)
def test_a_memory_cap_splits_a_large_batch_at_once(samples, cap, micro):
    """Fault-injection pass: --bs 1000000007 (a prime) --max-per-device-bs 2 searched for a
    divisor one by one up to 10**9, and hung even under --dry-run."""
    plan = plan_batch(1, global_batch_size=samples, max_per_device_batch_size=cap, warn_small=False)
    assert (plan.per_device_batch_size, plan.grad_accum_steps) == (micro, samples // micro)


@pytest.mark.parametrize(
    ("world", "bs", "accum", "suggestions"),
    [(16, 8, 1, ["16"]), (8, 100, 1, ["96", "104"]), (2, 10, 4, ["8", "16"])],
)
def test_unsplittable_global_batch_names_valid_values(world, bs, accum, suggestions):
    with pytest.raises(BatchPlanError) as err:
        plan_batch(world, global_batch_size=bs, grad_accum_steps=accum)
    message = str(err.value)
    assert f"--bs {bs} cannot be split" in message
    for value in suggestions:
        assert value in message


def test_more_accumulation_steps_than_samples_names_grad_accum():
    """The advice was a multiple of the steps ('e.g. --bs 1000000000000') for a mistyped one."""
    with pytest.raises(BatchPlanError, match=r"^--grad-accum 1000000000000: .* give at most 32$"):
        plan_batch(2, global_batch_size=64, grad_accum_steps=10**12)


def test_exactly_one_convention():
    with pytest.raises(BatchPlanError, match="both were given"):
        plan_batch(2, global_batch_size=8, per_device_batch_size=4)
    with pytest.raises(BatchPlanError, match="neither was given"):
        plan_batch(2)


@pytest.mark.parametrize("bad", [{"global_batch_size": 0}, {"per_device_batch_size": -1}])
def test_non_positive_batch_refused(bad):
    with pytest.raises(BatchPlanError, match="must be a positive integer"):
        plan_batch(2, **bad)


def test_small_per_device_batch_warns_why():
    with pytest.warns(SmallBatchWarning, match="noisy gradients"):
        plan_batch(8, global_batch_size=8)


def test_no_warning_at_four_per_device(recwarn):
    plan_batch(2, global_batch_size=8)
    assert not [w for w in recwarn if issubclass(w.category, SmallBatchWarning)]
