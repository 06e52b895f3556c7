"""What the host takes of a kernel's messages, per cell (``_control.interpreter``): output and
results up to the cell's budget, one ``cut`` at the first past it, nothing after; whatever the
tenant's stream puts in a message's id."""

from __future__ import annotations

from typing import Any

from corral._control.interpreter import _Budget, _message
from corral._control.lines import Overflow


def out(cell: Any, kind: str = "stdout") -> dict[str, Any]:
    return {"ev": kind, "id": cell, "text": "x"}


def test_output_and_results_within_the_budget_pass_then_one_cut_then_none() -> None:
    budget = _Budget(100)
    assert budget.admit(out(1), 60) == out(1)
    assert budget.admit(out(1, "result"), 40) == out(1, "result")  # exactly the budget
    assert budget.admit(out(1, "stderr"), 1) == {"ev": "cut", "id": 1, "limit": 100}
    assert budget.admit(out(1), 1) is None
    end = {"ev": "end", "id": 1}
    assert budget.admit(end, 10**9) == end  # only output and results are counted
    assert budget.admit(out(2), 100) == out(2)  # the next cell has a budget of its own


def test_late_output_counts_against_its_own_cell_and_odd_ids_share_one() -> None:
    budget = _Budget(100)
    assert budget.admit(out(1), 90) is not None
    assert budget.admit(out(2), 90) is not None
    assert budget.admit(out(1), 20) == {"ev": "cut", "id": 1, "limit": 100}
    assert budget.admit(out([1]), 60) is not None  # an unhashable id never raises
    assert budget.admit(out({"a": 1}), 60) == {"ev": "cut", "id": {"a": 1}, "limit": 100}
    for cell in range(3, 100):  # a bounded memory of cells
        budget.admit(out(cell), 1)
    assert len(budget._spent) <= 8


def test_lines_that_are_no_message_are_none_and_a_dropped_one_is_its_cells() -> None:
    assert _message("", 3) is None
    assert _message("garbage", 3) is None
    assert _message("[1, 2]", 3) is None
    assert _message("[" * 100_000 + "]" * 100_000, 3) is None  # deeper than the stack
    assert _message('{"ev": "end", "id": 4}', 3) == {"ev": "end", "id": 4}
    assert _message(Overflow(10), 3) == {"ev": "overflow", "id": 3, "limit": 10}
