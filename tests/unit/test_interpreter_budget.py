"""What the host takes of a kernel's messages (``_control.interpreter``): from one cell's start
to the next, messages up to the budget, one ``cut`` at the first past it, then only the running
cell's end; whatever ids the tenant's stream puts in them."""

from __future__ import annotations

from typing import Any

from corral._control.interpreter import _Budget, _message
from corral._control.lines import Overflow


def out(cell: Any, kind: str = "stdout") -> dict[str, Any]:
    return {"ev": kind, "id": cell, "text": "x"}


def test_messages_within_the_budget_pass_then_one_cut_then_the_end_only() -> None:
    budget = _Budget(100)
    budget.start(1)
    assert budget.admit(out(1), 60) == out(1)
    assert budget.admit(out(1, "result"), 40) == out(1, "result")  # exactly the budget
    assert budget.admit(out(1, "stderr"), 1) == {"ev": "cut", "id": 1, "limit": 100}
    assert budget.admit(out(1), 1) is None
    error = {"ev": "error", "id": 1, "name": "KeyboardInterrupt"}
    assert budget.admit(error, 1) == error  # how the cell ended, once
    assert budget.admit(error, 1) is None
    assert budget.admit({"ev": "end", "id": 2}, 1) is None  # not the running cell's
    assert budget.admit({"ev": "end", "id": 1}, 10) == {"ev": "end", "id": 1}
    budget.start(2)  # the next cell has a budget of its own
    assert budget.admit(out(2), 100) == out(2)


def test_ids_do_not_buy_a_budget_and_nothing_passes_between_cells_past_it() -> None:
    budget = _Budget(100)
    budget.start(1)
    # A stream that changes ids (the tenant writes them) spends the same budget.
    assert [budget.admit(out(cell), 40) is not None for cell in (1, 7, [1])] == [
        True, True, True]  # the third is the cut
    assert budget.admit(out({"a": 1}), 1) is None  # an unhashable id never raises
    budget.stop()
    assert budget.admit({"ev": "end", "id": 1}, 10) is None  # between cells: nobody's
    assert budget.cell is None


def test_lines_that_are_no_message_are_none_and_a_dropped_one_is_the_running_cells() -> None:
    assert _message("", 3) is None
    assert _message("garbage", 3) is None
    assert _message("[1, 2]", 3) is None
    assert _message("[" * 100_000 + "]" * 100_000, 3) is None  # deeper than the stack
    assert _message('{"ev": "end", "id": 4}', 3) == {"ev": "end", "id": 4}
    assert _message(Overflow(10), 3) == {"ev": "overflow", "id": 3, "limit": 10}
