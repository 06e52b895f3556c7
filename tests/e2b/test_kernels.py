"""The code interpreter's kernels through the official SDKs (issue 37): Python (a figure as a
cell's last expression is the main result with its PNG, as Jupyter's inline backend makes
it), JavaScript, TypeScript and R, and a language without a kernel here refused as the cell's
error, which the JS SDK (it reads no body on a 400) can show. The session's server maps
``code-interpreter-v1`` to ``base``, the host's /usr, where ``scripts/bootstrap --test``
installs the kernels' runtimes."""

from __future__ import annotations

import pytest

from .conftest import ClientRun, Served, run_client

pytestmark = [pytest.mark.e2b, pytest.mark.needs_root]


@pytest.fixture(scope="module")
def py_kernels(served: Served) -> ClientRun:
    return run_client(served, "latest", "kernels.py", timeout=300)


@pytest.fixture(scope="module")
def js_kernels(served: Served) -> ClientRun:
    return run_client(served, "js", "kernels.cjs", timeout=300)


def test_python_sdk_figure_as_the_last_expression(py_kernels: ClientRun) -> None:
    got = py_kernels.value("figure_last")
    assert got["error"] is None and got["text"] == "<Figure size 640x480 with 1 Axes>"
    # One result, the main one, with the PNG: not text on the main result and the PNG apart.
    assert got["results"] == [{"formats": ["png", "text"], "is_main": True,
                               "png_head": "iVBORw0KGgoA",
                               "text": "<Figure size 640x480 with 1 Axes>"}]


def test_python_sdk_javascript_typescript_and_r(py_kernels: ClientRun) -> None:
    assert py_kernels.value("js")["text"] == "42"
    assert py_kernels.value("ts")["text"] == "42"
    r = py_kernels.value("r")
    assert r["error"] is None and r["text"] == "[1] 42"
    plot = py_kernels.value("r_plot")["results"]
    assert [(p["is_main"], p["png_head"]) for p in plot] == [(False, "iVBORw0KGgoA")]


def test_python_sdk_java_is_refused_as_the_cells_error(py_kernels: ClientRun) -> None:
    error = py_kernels.value("java")["error"]
    assert error["name"] == "InterpreterUnavailable"
    assert "no java kernel" in error["value"] and "typescript" in error["value"]
    assert py_kernels.value("kill_sandbox") is True


def test_js_sdk_r_figure_and_refusals(js_kernels: ClientRun) -> None:
    r = js_kernels.value("r")
    assert r["error"] is None and r["text"] == "[1] 42"
    figure = js_kernels.value("figure_last")
    assert figure["results"] == [{"formats": ["png"], "isMain": True,
                                  "pngHead": "iVBORw0KGgoA"}]
    for language in ("java", "deno"):
        error = js_kernels.value(language)["error"]
        assert error["name"] == "InterpreterUnavailable", error
        assert f"no {language} kernel" in error["value"]
    assert js_kernels.value("kill_sandbox") is True
