"""A migration's image changing hands (engine/delivery.py): the source's push ends with the manifest and a
'delivered' journal, and a failed push is a report, never a failed checkpoint; the target waits for the image
while its driver loads, and stops at once when the migration was rolled back meanwhile. A TEST DOUBLE sender,
journal and driver loader stand in for the transfer, the journal file and libcuda."""
from __future__ import annotations

import threading

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import ImageError, TransactionError
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.journal import Fenced
from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine import delivery
from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine.steps import Clock


class Sender(object):
    """TEST DOUBLE of the push (core/transfer's Sender): ``fails`` with the error its finish raises, if any."""

    def __init__(self, fails=None):
        self.fails, self.calls = fails, []

    def finish(self, image_dir):
        self.calls.append(("finish", image_dir))
        if self.fails is not None:
            raise self.fails
        return {"bytes": 4096, "seconds": 0.5}

    def abort(self):
        self.calls.append(("abort",))

    def report(self):
        return {"bytes": 1024}


class Journal(object):
    """TEST DOUBLE of a migration's journal: ``phases``, the phase each read of ``phase`` gives (the last stays)."""

    def __init__(self, phases=("delivering",), migration_id="m-1"):
        self.phases, self.id, self.transitions, self.reads = list(phases), migration_id, [], 0

    @property
    def phase(self):
        self.reads += 1
        return self.phases.pop(0) if len(self.phases) > 1 else self.phases[0]

    def transition(self, phase):
        self.transitions.append(phase)


def _clock():
    clock = Clock()
    clock.start()
    return clock


def test_a_push_that_ends_says_delivered_and_reports_its_sender():
    sender, journal, clock = Sender(), Journal(), _clock()
    report = delivery.deliver(sender, "/img", journal, clock)
    assert report == {"pushed": True, "bytes": 4096, "seconds": 0.5}
    assert sender.calls == [("finish", "/img")] and journal.transitions == ["delivered"]
    assert "push" in clock.stages


def test_a_push_without_a_journal_is_a_plain_push():
    assert delivery.deliver(Sender(), "/img", None, _clock())["pushed"] is True


@pytest.mark.parametrize("error, says", [
    (OSError("connection reset"), "connection reset"),
    (ImageError("the receiver refused the manifest", stage="push"), "the receiver refused the manifest"),
])
def test_a_failed_push_is_aborted_and_reported_never_raised(error, says):
    sender, journal, clock = Sender(fails=error), Journal(), _clock()
    report = delivery.deliver(sender, "/img", journal, clock)
    assert report == {"pushed": False, "bytes": 1024, "error": says}
    assert sender.calls[-1] == ("abort",) and journal.transitions == [], "never said delivered"
    assert "push" in clock.stages, "the push's time is kept even when it failed"


def test_a_fenced_push_says_so():
    """A recovery fenced the migration while the manifest went: the report says it, for the settlement."""
    report = delivery.deliver(Sender(fails=Fenced("fenced by a recovery", stage="push")), "/img", Journal(), _clock())
    assert report["pushed"] is False and report["fenced"] is True and "fenced" in report["error"]


@pytest.fixture
def driver_loads(monkeypatch):
    """The driver's load (cuInit) the target starts while it waits: recorded, not run."""
    loads = []
    monkeypatch.setattr(delivery.cuda, "load", lambda path: loads.append((path, threading.current_thread().name)))
    return loads


@pytest.mark.parametrize("phase", delivery.DELIVERED)
def test_the_target_waits_until_the_image_is_here_while_the_driver_loads(driver_loads, phase):
    journal = Journal(["delivering", "delivering", phase])
    waited = delivery.wait_for_delivery(journal, timeout=5, libcuda_path="/lib/libcuda.so.1", poll=0.001)
    assert waited >= 0 and journal.reads == 3
    assert driver_loads == [("/lib/libcuda.so.1", "gpuckpt-cuinit")], "the driver loaded beside the wait"


@pytest.mark.parametrize("phase", ["cleaned", None])
def test_a_migration_rolled_back_during_the_wait_stops_it_at_once(driver_loads, phase):
    journal = Journal(["delivering", phase])
    with pytest.raises(TransactionError, match="migration m-1 was rolled back while this host waited") as err:
        delivery.wait_for_delivery(journal, timeout=5, poll=0.001)
    assert "nothing was restored" in err.value.msg and err.value.stage == "wait"
    assert ("absent" if phase is None else "cleaned") in err.value.msg


def test_an_image_that_never_comes_is_an_error_after_the_timeout(driver_loads):
    with pytest.raises(ImageError, match="no complete image of migration m-1 arrived within 0.05 s") as err:
        delivery.wait_for_delivery(Journal(["delivering"]), timeout=0.05, poll=0.001)
    assert err.value.stage == "wait" and "transfer" in err.value.hint
