from __future__ import annotations

import pytest

from corral import Sandbox

pytestmark = pytest.mark.needs_root


def test_run_echo(sandbox: Sandbox) -> None:
    result = sandbox.commands.run("echo hello")
    assert result.exit_code == 0
    assert result.stdout == "hello\n"
