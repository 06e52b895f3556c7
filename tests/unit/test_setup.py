"""``corral setup``: the one table of the host's Debian packages, checked (not installed) with
--dry-run on this host, and its refusals."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from corral._cli.main import cli
from corral._host.packages import groups_for

pytestmark = pytest.mark.skipif(shutil.which("dpkg-query") is None, reason="not Debian")


def test_dry_run_reports_every_group_and_installs_nothing() -> None:
    result = CliRunner().invoke(cli, ["setup", "--dry-run", "--tests", "--json"])
    report = json.loads(result.output)
    assert report["dry_run"] is True
    assert [group.name for group in groups_for(tests=True)] == [
        step["group"] for step in report["packages"]]
    assert all(not step["installed"] for step in report["packages"])
    # CI's bootstrap ran `corral setup --tests`: nothing is missing on its hosts.
    assert result.exit_code == 0, report


def test_the_test_packages_are_only_asked_for() -> None:
    names = [group.name for group in groups_for(tests=False)]
    assert "tests" not in names and "host" in names


@pytest.mark.parametrize("listen", ["8080", "host:", ":8080", "h:0", "h:99999"])
def test_a_bad_listen_address_is_refused_with_an_example(listen: str) -> None:
    result = CliRunner().invoke(cli, ["setup", "--service", "--listen", listen])
    assert result.exit_code == 2
    assert "like 127.0.0.1:8080" in result.output
