"""``graphcomp.train_step``'s whole-step memory rule: the whole step's graph has its
own pool (about the step's peak again), so it is captured only when twice the peak
fits the memory budget."""

from graphcomp.train import whole_step_memory_reason

GiB = 2**30


def test_twice_the_peak_must_fit_the_budget():
    assert whole_step_memory_reason(10 * GiB, 80 * GiB, "auto") is None  # 20 <= 72
    why = whole_step_memory_reason(40 * GiB, 80 * GiB, "auto")  # 80 > 72
    assert why is not None and "40.00 GiB" in why and "72.00 GiB" in why
    assert whole_step_memory_reason(30 * GiB, 80 * GiB, 0.5) is not None  # 60 > 40
    assert whole_step_memory_reason(30 * GiB, 80 * GiB, None) is None  # 60 <= 80
    assert whole_step_memory_reason(30 * GiB, 80 * GiB, 50 * GiB) is not None  # 60 > 50 bytes given
