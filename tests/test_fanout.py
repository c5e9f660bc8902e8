"""The fan-out that spreads the exact optimum over every core: results in item order,
the same as in one process, and a worker's failure a one-line error."""

import pytest

from memspec.common.errors import MemspecError
from memspec.sim.fanout import fan_out


def test_results_come_back_in_item_order_as_in_one_process():
    def fn(i: int) -> list:
        return [i, i * i / 7, {"name": f"x{i}"}]

    assert fan_out(fn, 11, procs=3) == [fn(i) for i in range(11)]
    assert fan_out(fn, 11, procs=1) == [fn(i) for i in range(11)]
    assert fan_out(fn, 0, procs=2) == []


def test_a_failing_worker_is_one_error_naming_the_cause():
    def fn(i: int) -> int:
        if i == 3:
            raise ValueError("bad trajectory")
        return i

    with pytest.raises(MemspecError, match="ValueError: bad trajectory"):
        fan_out(fn, 6, procs=2)
