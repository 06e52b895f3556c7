"""The one environment every host helper Corral starts gets (setpriv, setsid, bwrap, runsc,
mount, mkfs.ext4, unshare, mmdebstrap, ...).

Why fixed rather than inherited or passed through: a helper started as root reads its
environment before it drops anything. The dynamic loader honours ``LD_PRELOAD``/``LD_AUDIT``
(and glibc ``GCONV_PATH``, ``LOCPATH``, ...) for a root process that is not set-uid, so one
caller-chosen variable on a helper's environment is code running as host root. A caller's
environment therefore only ever travels as *data* (bwrap ``--setenv`` in an args file, the OCI
spec for runsc) and is applied inside the sandbox; the service's own environment (whatever the
operator's shell or unit file holds) is not passed on either, so what a helper sees does not
depend on how Corral was started.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from types import MappingProxyType

__all__ = ["PRIVILEGED_ENV", "privileged_env"]

# LC_ALL=C: helpers' messages (which Corral shows in errors) in one language and encoding.
PRIVILEGED_ENV: Mapping[str, str] = MappingProxyType({
    "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
    "LC_ALL": "C",
})


def privileged_env(*, inherit: Iterable[str] = ()) -> dict[str, str]:
    """A fresh copy of ``PRIVILEGED_ENV`` for one helper.

    ``inherit`` names variables to copy from *Corral's own* environment (the operator's, such
    as a proxy for the template builder's downloads); never pass a caller's names here.
    """
    env = dict(PRIVILEGED_ENV)
    for name in inherit:
        value = os.environ.get(name)
        if value is not None:
            env[name] = value
    return env
