"""Wires the egress gateway into the control plane: policies from the store, secrets from the
secret store, decisions into the audit trail, a listener per command."""

from __future__ import annotations

import contextlib
import logging
import secrets as random
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from .._audit.auditor import Auditor
from .._egress.addresses import parse_cidrs
from .._egress.policy import NetworkPolicy, Rule
from .._settings import Settings
from ..backends import EgressEndpoint, IsolationBackend, SandboxSpec, WorkspaceFS
from ..errors import BackendError, CorralError, UsageError
from .presets import PackageIndexes, check_names
from .secrets import SecretStore
from .store import Store

if TYPE_CHECKING:
    # Imported where used: the CA needs cryptography and the gateway asyncio, ssl and h11,
    # ~50 ms of a CLI call that runs no command (`corral ls`, `corral info`).
    from .._egress.ca import CertificateAuthority
    from .._egress.gateway import Decision, EgressContext, Gateway, ListenerHandle

__all__ = ["EgressBroker", "NetworkSpec", "network_spec", "policy_from"]

NetworkSpec = str | Mapping[str, Iterable[str] | bool] | None

logger = logging.getLogger(__name__)
_KEYS = ("allow", "deny", "presets", "require_lock")

# Where the sandbox finds the gateway's CA (the template's bundle includes it too).
_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


def policy_from(network: NetworkSpec, indexes: PackageIndexes | None = None) -> NetworkPolicy:
    """``None``/``"none"``, or ``{"allow": [...], "deny": [...], "presets": [...],
    "require_lock": bool}`` (every key optional).

    ``indexes`` expands the presets into allow rules for the operator's index hosts, so the
    ceiling check sees them. Without it the presets are carried but not expanded: that is the
    form of a stored policy (``network_spec``), whose allow rules already hold the expansion.

    Raises:
        UsageError: anything else, an unknown preset, or a malformed rule.
    """
    if network is None or network == "none":
        return NetworkPolicy.none()
    if isinstance(network, Mapping):
        unknown = set(network) - set(_KEYS)
        if unknown:
            raise UsageError(f"unknown network keys {sorted(unknown)}; use "
                             f"{', '.join(repr(k) for k in _KEYS)}")
        presets, require_lock = check_names(network.get("presets"),
                                            network.get("require_lock", False))
        allow = network.get("allow")
        if isinstance(allow, str) or isinstance(allow, bool):
            raise UsageError("allow and deny take a list of rules, not a single string")
        rules = list(allow or ())
        if indexes is not None:
            rules += indexes.rules(presets)
        deny = network.get("deny")
        if isinstance(deny, bool):
            raise UsageError("allow and deny take a list of rules, not a single string")
        return NetworkPolicy.build(rules, deny, presets=presets, require_lock=require_lock)
    raise UsageError(f"network must be 'none' or {{'allow': [...], 'deny': [...], "
                     f"'presets': [...]}}, not {network!r}")


class EgressBroker:
    def __init__(self, settings: Settings, store: Store, secret_store: SecretStore,
                 auditor: Auditor) -> None:
        self._settings = settings
        self._store = store
        self._secrets = secret_store
        self._auditor = auditor
        self._cidrs = parse_cidrs(c for c in settings.egress_allow_cidrs.split(",") if c.strip())
        # Made now, before any template is built, so every sandbox's trust bundle has it; a
        # CA already on disk is loaded when first used (the gateway's start).
        self._ca_dir = settings.home / "egress"
        self._ca: CertificateAuthority | None = None
        if not ((self._ca_dir / "ca.pem").exists() and (self._ca_dir / "ca.key").exists()):
            self._ca = self._load_ca()
        self.indexes = PackageIndexes(settings)
        self._gateway: Gateway | None = None
        self._lock = threading.Lock()
        # Each sandbox without network's refusing listener: (handle, proxy URL); ``_refuser``.
        self._refusers: dict[str, tuple[ListenerHandle, str]] = {}
        self._running: dict[str, list[str]] = {}  # each such sandbox's commands now running

    def _load_ca(self) -> CertificateAuthority:
        from .._egress.ca import CertificateAuthority

        return CertificateAuthority(self._ca_dir)

    @property
    def ca(self) -> CertificateAuthority:
        """The deployment's egress CA (made or loaded on first use)."""
        with self._lock:
            if self._ca is None:
                self._ca = self._load_ca()
            return self._ca

    def policy(self, network: NetworkSpec) -> NetworkPolicy:
        """``policy_from`` with this operator's package indexes for the presets."""
        return policy_from(network, self.indexes)

    def placeholders_for(self, names: Iterable[str]) -> dict[str, str]:
        """A fresh random placeholder per secret name; unknown names are refused."""
        known = {s.name for s in self._secrets.list()}
        result = {}
        for name in names:
            if name not in known:
                raise UsageError(f"no secret named {name!r}; register it with "
                                 f"`corral secrets add {name} --host HOST`")
            result[name] = f"CORRAL_PLACEHOLDER_{name}_{random.token_hex(16)}"
        return result

    def _context(self, sandbox_id: str) -> EgressContext:
        from .._egress.gateway import BoundSecret, EgressContext

        info = self._store.get(sandbox_id)
        if info is None or info.state != "running":
            return EgressContext(policy=NetworkPolicy.none())
        bound = []
        for secret in self._secrets.list():
            placeholder = info.secrets.get(secret.name)
            if placeholder is None:
                continue
            value = self._secrets.value(secret.name)
            if value is None:
                continue
            rules = tuple(Rule.parse(h) for h in secret.hosts)
            bound.append(BoundSecret(secret.name, placeholder, value, rules))
        return EgressContext(policy=NetworkPolicy.from_json(info.network), secrets=tuple(bound))

    def _report(self, decision: Decision) -> None:
        # On the gateway's loop: a write, never a wait. A refusal is repeated at will by the
        # sandbox, so refusals are aggregated per command and rule: neither is the sandbox's
        # to choose (a command id is the control plane's, a rule is the gateway's own reason
        # or the policy's), never the host asked for. Each command's first refusals of a rule
        # stay in full, as the drill and replay read them. What was allowed is always
        # written in full.
        if decision.verdict == "allowed":
            self._auditor.event(decision.sandbox_id, "egress.decision", decision.to_dict(),
                                command=decision.command_id)
        else:
            self._auditor.repeated(decision.sandbox_id, "egress.decision",
                                   {"rule": decision.rule, "command": decision.command_id},
                                   decision.to_dict(), command=decision.command_id)
        self._auditor.count("corral_egress_decisions", verdict=decision.verdict)

    def gateway(self) -> Gateway:
        from .._egress.gateway import Gateway

        with self._lock:
            if self._gateway is None:
                upstream_ca = self._settings.egress_upstream_ca
                self._gateway = Gateway(
                    # The CA when a connection is first intercepted (``ca`` takes the lock).
                    lookup=self._context, report=self._report, ca=lambda: self.ca,
                    operator_cidrs=self._cidrs, pinned_hosts=self._settings.egress_hosts,
                    upstream_ca_file=str(upstream_ca) if upstream_ca else None)
            return self._gateway

    @contextlib.contextmanager
    def for_command(self, backend: IsolationBackend, spec: SandboxSpec, *,
                    network: Mapping[str, Any], placeholders: Mapping[str, str],
                    command_id: str) -> Iterator[dict[str, str]]:
        """The environment a command gets for egress; a listener lives while it runs."""
        env = dict(placeholders)
        policy = NetworkPolicy.from_json(dict(network))
        if policy.mode == "none":
            # Still a listener: it refuses every request, saying it was the policy and which
            # setting allows the host, and the refusal is audited; without it a model reads
            # "Could not resolve host" and takes the sandbox for broken. Best effort: where it
            # cannot be had (the in-memory test backend has no network, a stuck gateway) the
            # command runs without proxy variables, and nothing answers, as before.
            try:
                proxy = self._refuser(backend, spec)
            except (CorralError, OSError) as exc:
                logger.debug("sandbox %s: no refusing listener for a command: %s", spec.id, exc)
                yield env
                return
            with self._lock:
                self._running.setdefault(spec.id, []).append(command_id)
            try:
                yield {**env, **_proxy_environment(proxy)}
            finally:
                with self._lock:
                    running = self._running.get(spec.id, [])
                    running.remove(command_id)
                    if not running:
                        self._running.pop(spec.id, None)
            return
        endpoint = backend.egress_endpoint(spec)
        handle = self._serve(backend, endpoint, spec, command_id)
        try:
            env.update(_proxy_environment(endpoint.proxy_url))
            for name in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT"):
                env[name] = _CA_BUNDLE
            env["NODE_EXTRA_CA_CERTS"] = "/etc/corral/egress-ca.pem"
            if policy.presets:
                env.update(self._client_config(backend, spec, policy))
            yield env
        finally:
            handle.close()

    def _serve(self, backend: IsolationBackend, endpoint: EgressEndpoint, spec: SandboxSpec,
               command_id: str | Callable[[], str]) -> ListenerHandle:
        """The gateway serving ``endpoint`` for one command (the listener closed on failure)."""
        sock = endpoint.listener
        try:
            if not isinstance(sock, socket.socket):
                raise BackendError(f"the {backend.name} tier's egress listener is not a socket")
            return self.gateway().serve(sock, sandbox_id=spec.id, command_id=command_id)
        except BaseException:
            sock.close()
            raise

    def _client_config(self, backend: IsolationBackend, spec: SandboxSpec,
                       policy: NetworkPolicy) -> dict[str, str]:
        """The presets' client environment; their config files written first if changed."""
        files = self.indexes.files(policy.presets)
        if files:
            try:
                _write_changed(backend.files(spec), files)
            except CorralError as exc:
                # The sandbox's own doing (a directory where the file goes, a full disk): its
                # client then lacks the config; the gateway still allows only the index hosts.
                logger.warning("sandbox %s: could not write package client config: %s",
                               spec.id, exc)
        return self.indexes.environment(policy.presets, require_lock=policy.require_lock)

    def _refuser(self, backend: IsolationBackend, spec: SandboxSpec) -> str:
        """The proxy URL of the sandbox's refusing listener, made on its first command and
        kept until it is destroyed (``forget``): one per sandbox, not one per command, so a
        sandbox without network pays no listener on its hot path. Its refusals are the
        sandbox's (they name no command: every command shares it)."""
        with self._lock:
            held = self._refusers.get(spec.id)
        if held is not None:
            return held[1]
        endpoint = backend.egress_endpoint(spec)
        handle = self._serve(backend, endpoint, spec, lambda: self._only_command(spec.id))
        with self._lock:
            held = self._refusers.setdefault(spec.id, (handle, endpoint.proxy_url))
        if held[0] is not handle:  # a command beside this one made it first
            handle.close()
        return held[1]

    def _only_command(self, sandbox_id: str) -> str:
        """The command a refused connection is of: the sandbox's one running command ("" when
        several run at once: the refusal is then the sandbox's, never a guessed command's)."""
        with self._lock:
            running = self._running.get(sandbox_id, [])
            return running[0] if len(running) == 1 else ""

    def forget(self, sandbox_id: str) -> None:
        """Close the sandbox's refusing listener (its destroy; before its namespace goes)."""
        with self._lock:
            held = self._refusers.pop(sandbox_id, None)
        if held is not None:
            held[0].close()

    def forget_gone(self, is_live: Callable[[str], bool]) -> None:
        """Close the refusing listeners of sandboxes destroyed by another process."""
        with self._lock:
            gone = [sandbox_id for sandbox_id in self._refusers if not is_live(sandbox_id)]
        for sandbox_id in gone:
            self.forget(sandbox_id)

    def close(self) -> None:
        with self._lock:
            held, self._refusers = list(self._refusers.values()), {}
        for handle, _ in held:
            handle.close()
        if self._gateway is not None:
            self._gateway.close()


def _proxy_environment(proxy: str) -> dict[str, str]:
    env = {}
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        env[name] = env[name.lower()] = proxy
    env["NO_PROXY"] = env["no_proxy"] = "localhost,127.0.0.1,::1"
    return env


def _write_changed(fs: WorkspaceFS, files: Mapping[str, bytes | None]) -> None:
    """Make each directory (``None``) and write each file through the workspace API (never
    following the sandbox's symlinks out), unless it already holds exactly that: most commands
    then write nothing."""
    for path, data in files.items():
        if data is None:
            fs.make_dir(path)
            continue
        if fs.exists(path) and fs.read(path) == data:
            continue
        parent = path.rsplit("/", 1)[0]
        fs.make_dir(parent)
        fs.write(path, data)


def network_spec(network: Mapping[str, Any]) -> NetworkSpec:
    """A stored policy back in the form ``create`` takes."""
    if not network or network.get("mode") == "none" and not network.get("deny"):
        return "none"
    spec: dict[str, Any] = {"allow": list(network.get("allow") or []),
                            "deny": list(network.get("deny") or [])}
    if network.get("presets"):
        spec.update(presets=list(network["presets"]),
                    require_lock=network.get("require_lock") is True)
    return spec
