from __future__ import annotations

from pathlib import Path

from corral._backends._linux.seccomp import compile_filter
from corral._backends._linux.template import BaseTemplate
from corral._backends.namespace.bwrap import BwrapFds, build_options, command_line, encode_args


def test_filter_compiles_to_whole_bpf_instructions() -> None:
    program = compile_filter()
    assert program and len(program) % 8 == 0


def test_bwrap_argv_isolates_everything_but_the_shared_network() -> None:
    template = BaseTemplate(etc=Path("/t/etc"), system=(("symlink", "usr/bin", "/bin"),
                                                        ("bind", "/usr", "/usr")))
    argv = build_options(template=template, workspace=Path("/w"), tmp_bytes=1024,
                         cwd="/workspace", env={"A": "1"}, fds=BwrapFds(3, 4, 5))
    for flag in ("--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
                 "--unshare-cgroup", "--disable-userns", "--die-with-parent", "--new-session"):
        assert flag in argv
    # The sandbox's persistent network namespace is joined from outside, never shared or new.
    assert "--unshare-net" not in argv and "--share-net" not in argv
    usr = argv.index("/usr")
    assert argv[usr - 1:usr + 2] == ["--ro-bind", "/usr", "/usr"]
    assert ["--bind", "/w", "/workspace"] == argv[argv.index("/w") - 1:argv.index("/w") + 2]
    # The environment is set inside, from a cleared one; the command stays on bwrap's argv.
    assert argv[-4:] == ["--clearenv", "--setenv", "A", "1"]
    assert "/etc/shadow" not in argv
    assert encode_args(["--chdir", "/a b"]) == b"--chdir\0/a b\0"
    assert command_line("bwrap", 7, ["echo", "hi"]) == ["bwrap", "--args", "7", "--", "echo", "hi"]
