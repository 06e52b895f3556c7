"""Template specs: validation with precise errors, and a hash that only follows the content."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from corral._templates import BUILTIN_SPECS, TemplateSpec, load_spec_file, parse_spec
from corral._templates.builder import mmdebstrap_argv
from corral._templates.spec import BUILDER_VERSION
from corral.errors import UsageError


def spec(**fields: object) -> TemplateSpec:
    return parse_spec({"name": "tools", "packages": ["jq"], **fields})


def test_a_full_spec_parses() -> None:
    parsed = parse_spec({
        "name": "tools", "description": "jq and a config",
        "packages": ["jq", "python3"],
        "files": [{"path": "/etc/tools/config.ini", "content": "[x]\n", "mode": "0600"},
                  {"path": "/usr/local/bin/hi", "content": "#!/bin/sh\necho hi\n",
                   "mode": 0o755}],
        "setup": ["python3 -m compileall -q /usr/lib/python3"],
    })
    assert parsed.name == "tools" and parsed.packages == ("jq", "python3")
    assert [(f.path, f.mode) for f in parsed.files] == [("/etc/tools/config.ini", 0o600),
                                                        ("/usr/local/bin/hi", 0o755)]
    assert parsed.setup == ("python3 -m compileall -q /usr/lib/python3",)


def test_builtin_specs_are_valid_and_named_for_their_key() -> None:
    assert set(BUILTIN_SPECS) == {"python", "node", "go", "code-interpreter", "microvm-base"}
    for name, builtin in BUILTIN_SPECS.items():
        assert builtin.name == name
        assert parse_spec(builtin.to_dict()).hash == builtin.hash
    assert {"python3", "python3-pip", "python3-venv", "git", "curl", "build-essential",
            "ca-certificates"} == set(BUILTIN_SPECS["python"].packages)
    assert {"nodejs", "npm", "ca-certificates"} == set(BUILTIN_SPECS["node"].packages)
    assert {"python3", "python3-ipython", "python3-numpy", "python3-pandas",
            "python3-matplotlib"} <= set(BUILTIN_SPECS["code-interpreter"].packages)


# -- the hash --------------------------------------------------------------------------------


def test_hash_ignores_package_order_repeats_whitespace_name_and_description() -> None:
    one = parse_spec({"name": "a", "packages": ["jq", "curl"]})
    two = parse_spec({"name": "b", "description": "same content",
                      "packages": [" curl", "jq", "jq "]})
    assert one.hash == two.hash
    assert len(one.hash) == 16 and int(one.hash, 16) >= 0


def test_hash_ignores_file_order_but_follows_content_mode_and_setup_order() -> None:
    f1 = {"path": "/etc/a", "content": "1"}
    f2 = {"path": "/etc/b", "content": "2"}
    base = spec(files=[f1, f2], setup=["echo 1", "echo 2"])
    assert spec(files=[f2, f1], setup=["echo 1", "echo 2"]).hash == base.hash
    assert spec(files=[f1, f2], setup=["echo 2", "echo 1"]).hash != base.hash
    assert spec(files=[f1, {**f2, "content": "3"}], setup=["echo 1", "echo 2"]).hash != base.hash
    assert spec(files=[f1, {**f2, "mode": "0600"}], setup=["echo 1", "echo 2"]).hash != base.hash
    assert spec().hash != spec(packages=["jq", "curl"]).hash


def test_hash_covers_the_builder_version_and_the_debian_source() -> None:
    normalised = spec().normalised()
    assert normalised["builder"] == BUILDER_VERSION
    assert normalised["suite"] == "bookworm"
    assert normalised["mirror"] == "http://deb.debian.org/debian"


# -- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("data", "message"), [
    ([], "must be a table"),
    ({"packages": ["jq"]}, "no 'name'"),
    ({"name": "t"}, "no 'packages'"),
    ({"name": "t", "pakages": ["jq"]}, "unknown key 'pakages'; did you mean 'packages'?"),
    ({"name": "t", "packages": "jq"}, "packages must be a list of strings"),
    ({"name": "t", "packages": ["jq", 3]}, "packages must be a list of strings"),
    ({"name": "t", "packages": ["Jq"]}, "'Jq' is not a Debian package name"),
    ({"name": "t", "packages": ["jq=1.6"]}, "versions and architectures are not supported"),
    ({"name": "t", "packages": ["-jq"]}, "not a Debian package name"),
    ({"name": "t", "packages": ["jq;rm"]}, "not a Debian package name"),
    ({"name": "t", "packages": [], "setup": ["  "]}, "setup[0] is empty"),
    ({"name": "t", "packages": [], "setup": "echo"}, "setup must be a list of strings"),
    ({"name": "t", "packages": [], "description": 1}, "description must be a string"),
    ({"name": "t", "packages": [], "files": {"/etc/a": "x"}}, "files must be a list"),
])
def test_bad_specs_name_what_is_wrong(data: object, message: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_spec(data, where="spec.toml")
    assert message in info.value.message
    assert info.value.message.startswith("spec.toml")


@pytest.mark.parametrize(("name", "message"), [
    ("base", "reserved"),
    ("Python", "invalid"),
    ("py.thon", "invalid"),
    ("1python", "invalid"),
    ("", "invalid"),
    ("a" * 41, "invalid"),
    ("../etc", "invalid"),
    (3, "must be a string"),
])
def test_bad_names_are_refused(name: object, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        parse_spec({"name": name, "packages": []})


@pytest.mark.parametrize(("entry", "message"), [
    ("x", "must be a table"),
    ({"path": "/etc/a"}, "'content' must be a string"),
    ({"content": "x"}, "'path' must be a non-empty string"),
    ({"path": "etc/a", "content": ""}, "must be absolute and normalised"),
    ({"path": "/etc/../root/a", "content": ""}, "must be absolute and normalised"),
    ({"path": "/etc//a", "content": ""}, "must be absolute and normalised"),
    ({"path": "/etc/a/", "content": ""}, "must be absolute and normalised"),
    ({"path": "/srv/a", "content": ""}, "outside the parts of the root a sandbox sees"),
    ({"path": "/workspace/a", "content": ""}, "outside the parts of the root a sandbox sees"),
    ({"path": "/etc/passwd", "content": ""}, "written by Corral"),
    ({"path": "/etc/resolv.conf", "content": ""}, "written by Corral"),
    ({"path": "/etc/a", "content": "", "mode": "rwx"}, "must be an octal string"),
    ({"path": "/etc/a", "content": "", "mode": "4755"}, "must be an octal string"),
    ({"path": "/etc/a", "content": "", "mode": 0o4755}, "no setuid"),
    ({"path": "/etc/a", "content": "", "owner": "root"}, "unknown key 'owner'"),
    ({"path": "/etc/a", "content": "x" * (1024 * 1024 + 1)}, "over 1048576 bytes"),
])
def test_bad_files_are_refused(entry: object, message: str) -> None:
    with pytest.raises(UsageError, match="files\\[0\\]") as info:
        spec(files=[entry])
    assert message in info.value.message


def test_a_file_listed_twice_is_refused() -> None:
    with pytest.raises(UsageError, match="/etc/a is listed twice"):
        spec(files=[{"path": "/etc/a", "content": "1"}, {"path": "/etc/a", "content": "2"}])


# -- files ---------------------------------------------------------------------------------------


def test_spec_files_in_toml_and_json_agree(tmp_path: Path) -> None:
    toml = tmp_path / "tools.toml"
    toml.write_text('name = "tools"\npackages = ["jq"]\nsetup = ["jq --version"]\n'
                    '[[files]]\npath = "/etc/tools.ini"\ncontent = "x = 1\\n"\n')
    as_json = tmp_path / "tools.json"
    as_json.write_text(json.dumps({"name": "tools", "packages": ["jq"],
                                   "setup": ["jq --version"],
                                   "files": [{"path": "/etc/tools.ini", "content": "x = 1\n"}]}))
    assert load_spec_file(toml) == load_spec_file(as_json)
    assert load_spec_file(toml, name="other").name == "other"


def test_spec_file_errors_name_the_file(tmp_path: Path) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text("name = \n")
    with pytest.raises(UsageError, match="broken.toml: not valid TOML"):
        load_spec_file(broken)
    yaml = tmp_path / "spec.yaml"
    yaml.write_text("name: x\n")
    with pytest.raises(UsageError, match="must end in .toml or .json"):
        load_spec_file(yaml)
    with pytest.raises(UsageError, match="cannot read template spec"):
        load_spec_file(tmp_path / "missing.toml")
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x", "packages": ["jq"], "extra": 1}')
    with pytest.raises(UsageError, match=r"bad.json: unknown key 'extra'"):
        load_spec_file(bad)


# -- the mmdebstrap command line -------------------------------------------------------------


def test_mmdebstrap_argv_is_small_and_quotes_setup_commands() -> None:
    s = spec(packages=["jq", "curl"], setup=["echo 'it''s' > /opt/x; touch /opt/$HOME"])
    argv = mmdebstrap_argv(s, Path("/t/root"), Path("/t/files dir"))
    assert argv[0] == "mmdebstrap" and argv[-3:] == ["bookworm", "/t/root",
                                                     "http://deb.debian.org/debian"]
    assert "--variant=apt" in argv and "--mode=unshare" in argv
    assert '--aptopt=Apt::Install-Recommends "false"' in argv
    assert "--include=curl,jq" in argv
    assert "--customize-hook=sync-in '/t/files dir' /" in argv
    (hook,) = [a for a in argv if "chroot" in a]
    # The command reaches the chroot's shell as one argument, unexpanded by the hook's shell.
    words = shlex.split(hook.removeprefix("--customize-hook="))
    assert words[:2] == ["chroot", "$1"] and words[-3:] == ["/bin/sh", "-ec", s.setup[0]]
    assert "env" in words[2] and "-i" in words  # a clean environment, not the builder's
    assert argv.index("--customize-hook=sync-in '/t/files dir' /") < argv.index(hook)


def test_a_failed_build_names_dpkg_s_cause_not_only_apt_s_summary() -> None:
    from corral._templates.builder import _run
    from corral.errors import BackendError

    script = ("echo 'dpkg: error processing archive /var/cache/apt/archives/golang.deb "
              "(--unpack):'; echo ' cannot copy extracted data for ./usr/lib/go/x to "
              "/usr/lib/go/x.dpkg-new: failed to write (No space left on device)'; "
              "echo 'E: Sub-process env returned an error code (1)'; exit 25")
    with pytest.raises(BackendError) as refused:
        _run(["sh", "-c", script], BUILTIN_SPECS["go"], lambda line: None)
    message = str(refused.value)
    assert "exited with 25" in message and "No space left on device" in message
    assert "dpkg: error processing archive" in message
