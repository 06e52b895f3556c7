from __future__ import annotations

import pytest

from corral import PathRefused
from corral._workspace.files import to_relative


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("/workspace", "."),
        ("/workspace/", "."),
        ("a.txt", "a.txt"),
        ("./a.txt", "a.txt"),
        ("/workspace/a/b", "a/b"),
        ("a/./b//c", "a/b/c"),
        ("a/../b", "b"),
        ("/workspace/a/../b", "b"),
    ],
)
def test_paths_inside_the_workspace_are_accepted(given: str, expected: str) -> None:
    assert to_relative(given) == expected


@pytest.mark.parametrize(
    "given",
    ["..", "../x", "a/../../x", "/workspace/../etc/passwd", "/etc/passwd", "/", "/workspacex/a",
     "/tmp/x", "", "a\x00b", "x" * 5000],
)
def test_paths_leaving_the_workspace_are_refused(given: str) -> None:
    with pytest.raises(PathRefused):
        to_relative(given)


@pytest.mark.parametrize("given", [None, 3, b"/workspace/a", ["a"]])
def test_non_string_paths_are_refused(given: object) -> None:
    with pytest.raises(PathRefused):
        to_relative(given)  # type: ignore[arg-type]
