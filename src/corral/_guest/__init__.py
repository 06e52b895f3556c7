"""The microVM guest agent: code that runs inside the sandbox, never on the host.

It runs as root in the guest on the template's own python3, so every module here is standard
library only and imports nothing of Corral outside this package (a unit test,
``test_guest_package.py``, checks both). ``rootimage`` ships the package into the root image
as one zipapp, ``/corral/agent.pyz``, which the guest's init starts as ``python3 -I -S
/corral/agent.pyz``; in the archive the package is named ``_guest``, so its modules import
each other relatively.

Two modules are shared with the host: ``protocol`` (the framing, limits and error shape of the
agent protocol; the host's ``microvm.wire`` re-exports it) and ``fsrules`` (which workspace
paths are refused and in what words, and which OS errors mean what; the host tiers'
``corral._workspace.files`` uses it). The protocol itself is described in
``docs/design/guest-agent.md``.

Modules, by job: ``__main__`` (entry), ``config`` (fixed places and test overrides),
``channel`` (the port and the ordered work lanes), ``agent`` (state and replies), ``dispatch``
(the main loop), ``exec`` and ``commands`` (starting commands, and the ops on a running one),
``workspace`` and ``fs`` (the file operations and the ``fs.*`` ops), ``conns``, ``tunnel`` and
``ports`` (relayed TCP connections), ``lifecycle`` (resume, mount, sync, freeze), ``system``
(Linux calls Python lacks).
"""
