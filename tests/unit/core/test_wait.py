"""core/wait.py: the one waiter (fake clock: no real sleeping)."""
from __future__ import annotations

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.wait import WaitTimeout, wait_for


class FakeClock(object):
    def __init__(self):
        self.now, self.sleeps = 100.0, []

    def clock(self):
        return self.now

    def sleep(self, s):
        self.sleeps.append(s)
        self.now += s


def test_returns_the_first_true_answer():
    fc, answers = FakeClock(), iter([None, [], {"pid": 7}])
    assert wait_for(lambda: next(answers), 5, "a pid", clock=fc.clock, sleep=fc.sleep) == {"pid": 7}
    assert fc.sleeps == [0.05, 0.05]


def test_timeout_names_what_was_awaited_and_never_sleeps_past_the_deadline():
    fc = FakeClock()
    with pytest.raises(WaitTimeout) as err:
        wait_for(lambda: [], 1.0, "pid 42 to be reaped", interval=0.3, clock=fc.clock, sleep=fc.sleep,
                 stage="restore")
    assert "pid 42 to be reaped" in str(err.value) and "1s" in str(err.value)
    assert err.value.stage == "restore" and err.value.last == []
    assert abs(fc.now - 101.0) < 1e-9 and max(fc.sleeps) <= 0.3


def test_return_on_timeout_gives_the_last_answer():
    fc = FakeClock()
    assert wait_for(lambda: 0, 0.2, "x", on_timeout="return", clock=fc.clock, sleep=fc.sleep) == 0


def test_backoff_is_capped():
    fc = FakeClock()
    wait_for(lambda: fc.now > 110, None, "x", interval=0.5, backoff=2, max_interval=2, clock=fc.clock,
             sleep=fc.sleep)
    assert fc.sleeps[:4] == [0.5, 1.0, 2, 2]


def test_zero_timeout_tries_once():
    calls = []
    with pytest.raises(WaitTimeout):
        wait_for(lambda: calls.append(1), 0, "x")
    assert calls == [1]
