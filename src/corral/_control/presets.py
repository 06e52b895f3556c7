"""Package-index presets: ``pypi``, ``npm`` and ``debian`` as network policy.

A preset names an ecosystem; the operator's settings (``CORRAL_INDEX_*``) say which index
serves it. Asking for a preset does two things: its index hosts join the sandbox's allow rules
(so the tenant ceiling sees them like any other host), and every command gets the client
configuration that points pip, npm or apt at that index.

The configuration travels in each command's environment (``PIP_INDEX_URL``,
``npm_config_registry``, ``APT_CONFIG``) rather than in files the sandbox owns: it is derived
afresh from the record on every command, so nothing the sandbox writes can make it stale, and
both pip and npm rank environment variables above every config file (a ``pip.conf`` or
``.npmrc`` in ``/workspace``, which is ``$HOME``), so the preset wins without overwriting the
user's own files. apt alone cannot take its sources from the environment: for ``debian`` a
config file and a sources list are written under ``/workspace/.config/corral/apt``.

None of this is the boundary: sandbox code can ignore any client setting. The boundary is the
gateway, which lets through only the index hosts. ``require_lock`` is a guardrail for
well-behaved tools (pip refuses to install anything without a hash), not an enforcement
against hostile code, which can fetch any file the index serves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from .._egress.policy import Rule, clip
from .._settings import Settings
from ..errors import UsageError
from .tenants import covers

__all__ = ["APT_DIR", "PRESET_NAMES", "PackageIndexes", "ceiling_network", "check_names"]

PRESET_NAMES = ("debian", "npm", "pypi")
# Only pip can refuse an unlocked install by configuration; see ``check_names``.
LOCKABLE = frozenset({"pypi"})
APT_DIR = "/workspace/.config/corral/apt"
_PUBLIC_PYPI = "https://pypi.org/simple"
_PUBLIC_PYPI_FILES = ("https://files.pythonhosted.org",)
_PUBLIC_DEBIAN = "http://deb.debian.org/debian"
_PUBLIC_DEBIAN_SECURITY = "http://security.debian.org/debian-security"
# apt verifies the archive's signature with the keys the sandbox's /usr ships (Debian's).
_KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"


def check_names(presets: object, require_lock: object) -> tuple[tuple[str, ...], bool]:
    """The preset names and lock flag of a network spec, validated (no settings needed).

    Raises:
        UsageError: not a list of known names, or a lock asked of a preset that cannot
            enforce one.
    """
    if presets is None:
        presets = []
    if isinstance(presets, str) or not isinstance(presets, Iterable):
        raise UsageError("presets takes a list of names, e.g. ['pypi']")
    names: list[str] = []
    for name in presets:
        if name not in PRESET_NAMES:
            raise UsageError(f"unknown network preset {clip(str(name))!r}; valid presets: "
                             f"{', '.join(PRESET_NAMES)}")
        if name not in names:
            names.append(name)
    if not isinstance(require_lock, bool):
        raise UsageError("require_lock must be true or false")
    if require_lock:
        if not names:
            raise UsageError("require_lock needs a preset, e.g. presets=['pypi']")
        unlockable = [n for n in names if n not in LOCKABLE]
        if unlockable:
            # Refused rather than half done: a caller asking for a lock must not believe it
            # holds where it does not.
            raise UsageError(
                f"require_lock is enforced only for the pypi preset (pip --require-hashes); "
                f"{', '.join(unlockable)} cannot refuse an unlocked install by configuration "
                "(for npm, install with `npm ci` from a package-lock.json); drop require_lock "
                "or those presets")
    return tuple(sorted(names)), require_lock


@dataclass(frozen=True, slots=True)
class _Url:
    scheme: str
    host: str
    port: int | None  # None: the scheme's default
    text: str  # the URL as pip/npm/apt get it, without a trailing slash

    @property
    def rule(self) -> str:
        """The allow rule for this URL's host (a bare host covers ports 80 and 443)."""
        return self.host if self.port in (None, 80, 443) else f"{self.host}:{self.port}"


def _parse(text: str, setting: str) -> _Url:
    """An index URL from the operator's settings; refused with the setting's name."""
    raw = text.strip() if isinstance(text, str) else ""
    if "://" not in raw:
        raw = f"https://{raw}"  # a bare host (index_pypi_files) is a TLS download host
    try:
        parts = urlsplit(raw)
        port = parts.port
    except ValueError as exc:
        raise UsageError(f"{setting}={clip(text)!r} is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.username:
        raise UsageError(f"{setting}={clip(text)!r} must be an http(s) URL with a host and no "
                         "credentials")
    host = parts.hostname
    try:
        # The gateway matches names only: an IP literal would be refused on every connection.
        rule = Rule.parse(host)
    except UsageError as exc:
        raise UsageError(f"{setting}={clip(text)!r}: {exc}; give the mirror a name and pin its "
                         "address with CORRAL_EGRESS_HOSTS") from None
    return _Url(parts.scheme, rule.host, port, raw.rstrip("/"))


class PackageIndexes:
    """The operator's index for each preset: the allow rules it needs and its client config."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings

    # -- what each preset reaches ----------------------------------------------------------------

    def _pypi(self) -> tuple[_Url, ...]:
        index = _parse(self._settings.index_pypi, "CORRAL_INDEX_PYPI")
        files = self._settings.index_pypi_files
        if files is None:
            # The public index links its files on another host; a mirror serves its own.
            extra: Iterable[str] = (_PUBLIC_PYPI_FILES if index.text == _PUBLIC_PYPI else ())
        else:
            extra = (f for f in files.split(",") if f.strip())
        return (index, *(_parse(f, "CORRAL_INDEX_PYPI_FILES") for f in extra))

    def _npm(self) -> tuple[_Url, ...]:
        return (_parse(self._settings.index_npm, "CORRAL_INDEX_NPM"),)

    def _debian(self) -> tuple[_Url, ...]:
        main = _parse(self._settings.index_debian, "CORRAL_INDEX_DEBIAN")
        security = self._settings.index_debian_security
        if security is None:
            security = _PUBLIC_DEBIAN_SECURITY if main.text == _PUBLIC_DEBIAN else ""
        if not security.strip():
            return (main,)
        return (main, _parse(security, "CORRAL_INDEX_DEBIAN_SECURITY"))

    def _urls(self, name: str) -> tuple[_Url, ...]:
        sources: Mapping[str, Callable[[], tuple[_Url, ...]]] = {
            "pypi": self._pypi, "npm": self._npm, "debian": self._debian}
        return sources[name]()

    def rules(self, presets: Iterable[str]) -> list[str]:
        """The allow rules the presets expand to, each once, in a stable order."""
        rules: list[str] = []
        for name in presets:
            for url in self._urls(name):
                if url.rule not in rules:
                    rules.append(url.rule)
        return rules

    # -- what each command gets ------------------------------------------------------------------

    def environment(self, presets: Iterable[str], *, require_lock: bool) -> dict[str, str]:
        """Client configuration for a command, as environment variables."""
        env: dict[str, str] = {}
        for name in presets:
            if name == "pypi":
                env.update(self._pip_env(require_lock))
            elif name == "npm":
                # npm takes any npm_config_* variable over every .npmrc.
                env["npm_config_registry"] = self._npm()[0].text + "/"
            elif name == "debian":
                env["APT_CONFIG"] = f"{APT_DIR}/apt.conf"
        return env

    def _pip_env(self, require_lock: bool) -> dict[str, str]:
        urls = self._pypi()
        env = {"PIP_INDEX_URL": urls[0].text + "/"}
        plain = sorted({u.host for u in urls if u.scheme == "http"})
        if plain:
            # pip ignores a plain-HTTP index unless its host is trusted; the operator chose it.
            env["PIP_TRUSTED_HOST"] = " ".join(plain)
        if require_lock:
            # Every requirement must then come with --hash (pip refuses `pip install NAME`).
            env["PIP_REQUIRE_HASHES"] = "1"
        return env

    def files(self, presets: Iterable[str]) -> dict[str, bytes | None]:
        """Client configuration that cannot travel in the environment: apt's sources, and the
        directories apt needs (``None``), which it does not make itself."""
        if "debian" not in presets:
            return {}
        urls = self._debian()
        suite = self._settings.index_debian_suite
        lines = [f"deb [signed-by={_KEYRING}] {urls[0].text} {suite} main",
                 f"deb [signed-by={_KEYRING}] {urls[0].text} {suite}-updates main"]
        if len(urls) > 1:
            lines.append(f"deb [signed-by={_KEYRING}] {urls[1].text} {suite}-security main")
        state = "/workspace/.cache/corral/apt"
        # The root is read-only and the user is not root: apt keeps its lists and downloads
        # in the workspace, takes no lock, and can `apt-get update` / `download` / `source`.
        conf = "\n".join([
            f'Dir::Etc::SourceList "{APT_DIR}/sources.list";',
            f'Dir::Etc::SourceParts "{APT_DIR}/sources.list.d";',
            # Read after this file: the sandbox's /etc has no apt.conf.d.
            f'Dir::Etc::Parts "{APT_DIR}/apt.conf.d";',
            f'Dir::State "{state}/state";',
            f'Dir::Cache "{state}/cache";',
            'Debug::NoLocking "true";',
            "",
        ])
        return {f"{APT_DIR}/apt.conf.d": None, f"{APT_DIR}/sources.list.d": None,
                f"{state}/state/lists/partial": None, f"{state}/cache/archives/partial": None,
                f"{APT_DIR}/sources.list": ("\n".join(lines) + "\n").encode(),
                f"{APT_DIR}/apt.conf": conf.encode()}


def ceiling_network(settings: Settings, hosts: Sequence[str] | None) -> dict[str, Any] | None:
    """The egress policy that opens what a tenant's ceiling allows (``hosts``; no network when
    it names none), with the pypi and npm presets (pip and npm pointed at the operator's
    index) when the ceiling covers every host a preset opens: E2B's "internet access" and the
    steps of a tenant's template builds."""
    if not hosts:
        return None
    patterns = [Rule.parse(h) for h in hosts]
    indexes = PackageIndexes(settings)
    presets = [name for name in ("pypi", "npm")
               if all(any(covers(p, Rule.parse(rule)) for p in patterns)
                      for rule in indexes.rules([name]))]
    network: dict[str, Any] = {"allow": sorted(set(hosts))}
    if presets:
        network["presets"] = presets
    return network
