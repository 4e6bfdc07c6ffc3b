"""The one slot table (runtime/slot_table.py), as pure code: who holds each slot, the
queue, and what a release hands on."""

import pytest

from motet.runtime.errors import BadRequest, QueueFull, SlotBusy
from motet.runtime.slot_table import SlotTable


def test_take_follows_the_rule_and_release_records_the_history():
    table = SlotTable(2)
    a = table.take("a", (1, 2, 3))
    assert table.holder(a) == "a" and table.pick((9,)) == 1 - a
    assert table.release(a, "a", (1, 2, 3, 4)) == []
    assert table.histories[a] == (1, 2, 3, 4) and not table.held(a)
    assert table.take("b", (1, 2, 3, 7)) == a  # the longest shared prefix
    assert table.reusable(a, (1, 2, 3, 7)) == 3


def test_the_queue_is_first_come_first_served_and_bounded():
    table = SlotTable(1, queue_limit=2)
    slot = table.take("a", (1,))
    assert table.take("b", (2,)) is None and table.take("c", (3,)) is None
    with pytest.raises(QueueFull):
        table.take("d", (4,))
    assert table.withdraw("b") and not table.withdraw("b")
    assert table.release(slot, "a") == [("c", slot)]
    assert table.holder(slot) == "c" and not table.queue


def test_a_release_by_someone_else_changes_nothing():
    table = SlotTable(1)
    table.take("a", (1,))
    table.take("b", (2,))
    assert table.release(0, "stranger", (5, 5)) == []
    assert table.holder(0) == "a" and table.histories[0] == () and len(table.queue) == 1


def test_holds_are_exclusive_unless_shared():
    table = SlotTable(2)
    table.hold(0, "a")
    with pytest.raises(SlotBusy):
        table.hold(0, "b")
    table.hold(0, "c", share=True)
    table.take("w", (1,))  # slot 1
    table.take("q", (1,))  # queued: nothing is free
    assert table.release(0, "a") == []  # "c" still holds it
    assert table.release(0, "c") == [("q", 0)]


def test_untouched_releases_keep_the_order_and_forget_puts_a_slot_first():
    table = SlotTable(3)
    for slot in range(3):
        table.hold(slot, slot)
    table.release(0, 0, (1,))
    table.release(1, 1, (2,))
    table.release(2, 2, (3,), touch=False)  # never counted as used
    assert table.pick((9,)) == 2
    table.hold(2, "x")
    table.forget(0)
    table.release(2, "x")
    assert table.pick((9,)) == 0 and table.histories[0] == ()


def test_text_histories_stay_text_and_slots_are_checked():
    table = SlotTable(1)
    table.hold(0, "a")
    table.release(0, "a", "Hello there")
    assert table.histories[0] == "Hello there" and table.reusable(0, "Hello you") == 6
    with pytest.raises(BadRequest):
        table.check(1)
