"""The egress gateway: one asyncio loop, on its own thread, serving every sandbox's proxy listener.

A listener is a socket bound to 127.0.0.1 *inside* a sandbox's network namespace (the backend makes
it there), one per command, so every decision is attributed to the command whose environment named
the port. The sandbox has no route: this listener is its only way out, and when the gateway is not
serving, nothing answers (fail closed).

Per connection: parse the request with h11; refuse ambiguous framing (``framing.py``), IP
literals, userinfo, a Host header that disagrees with the target, anything the policy does not
allow; resolve the name with the host's resolver and refuse if any answer is a forbidden address;
connect to the vetted address itself (no second lookup). ``CONNECT`` is an opaque tunnel, except for
hosts a secret of this sandbox is bound to: those are intercepted with the deployment CA so the
placeholder can be swapped for the value.

One request per client connection, plain or intercepted: the response carries ``Connection:
close`` and whatever the client pipelined after the first request is never parsed or forwarded,
so every request that leaves is its own vetted decision (a second host needs a new connection).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ipaddress
import logging
import socket
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import h11

from ..errors import BackendError
from .addresses import Network, forbidden_reason
from .framing import Refused as _Refused
from .framing import (
    body_framing,
    default_port,
    inner_target,
    origin_form,
    outbound_headers,
    split_url,
)
from .policy import NetworkPolicy, Rule, clip, is_ip_literal, normalize_host, parse_port
from .refusals import explain, printable

if TYPE_CHECKING:
    from .ca import CertificateAuthority

__all__ = ["BoundSecret", "Decision", "EgressContext", "Gateway", "ListenerHandle"]

logger = logging.getLogger(__name__)

_HEAD_TIMEOUT_S = 30.0
_CONNECT_TIMEOUT_S = 10.0
_CALL_TIMEOUT_S = 30.0
_CHUNK = 65536
# Upstream response headers the sandbox never gets; h11 re-frames the response itself.
_HOP_BY_HOP = {b"connection", b"keep-alive", b"proxy-connection", b"proxy-authorization",
               b"proxy-authenticate", b"te", b"trailer", b"upgrade"}


@dataclass(frozen=True, slots=True)
class BoundSecret:
    """A secret exposed to one sandbox: its placeholder there, its value, where it may go."""

    name: str
    placeholder: str
    value: str
    hosts: tuple[Rule, ...]

    def bound_to(self, host: str, port: int) -> bool:
        return any(rule.matches(host, port) for rule in self.hosts)


@dataclass(frozen=True, slots=True)
class EgressContext:
    """What the gateway asks the control plane, per connection (so updates apply at once)."""

    policy: NetworkPolicy
    secrets: tuple[BoundSecret, ...] = ()


@dataclass
class Decision:
    """One connection's outcome, reported when it ends."""

    sandbox_id: str
    command_id: str
    method: str
    host: str
    port: int
    verdict: str  # "allowed" or "denied"
    rule: str
    reason: str
    mode: str = ""  # "http", "tunnel", "intercept"
    address: str = ""
    bytes_up: int = 0
    bytes_down: int = 0
    started: float = field(default_factory=time.monotonic)
    duration_s: float = 0.0
    substituted: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method, "host": self.host, "port": self.port,
            "verdict": self.verdict, "rule": self.rule, "reason": self.reason,
            "mode": self.mode, "address": self.address, "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down, "duration_s": round(self.duration_s, 6),
            "secrets_substituted": list(self.substituted),
        }


Lookup = Callable[[str], EgressContext]
Report = Callable[[Decision], None]


@dataclass
class ListenerHandle:
    """Returned by ``Gateway.serve``; ``close`` stops the listener and its open connections."""

    port: int
    _gateway: Gateway
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _closed: bool = False

    def close(self) -> None:
        """Asked, not awaited: the command it served has ended (nothing of the sandbox's is
        left to connect), so the caller need not wait on the loop; a start still under way
        closes its server itself."""
        self._closed = True
        self._gateway._submit(self._aclose(), "close a listener")

    async def _aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


class Gateway:
    """See the module docstring. Thread-safe entry points: ``serve``, ``close``."""

    def __init__(
        self,
        *,
        lookup: Lookup,
        report: Report,
        ca: CertificateAuthority | Callable[[], CertificateAuthority],
        operator_cidrs: Sequence[Network] = (),
        pinned_hosts: dict[str, list[str]] | None = None,
        upstream_ca_file: str | None = None,
    ) -> None:
        self._lookup = lookup
        self._report = report
        # The CA and the upstream TLS context are wanted only by intercepted connections (a
        # secret-bound host): made on the first, so a gateway that only refuses (a sandbox
        # without network) loads no cryptography and no system trust store, ~70 ms of every
        # CLI command's start-up.
        self._ca_source = ca
        self._ca: CertificateAuthority | None = None
        self._upstream_ca_file = upstream_ca_file
        self._tls: ssl.SSLContext | None = None
        self._cidrs = tuple(operator_cidrs)
        self._pinned = {normalize_host(k): v for k, v in (pinned_hosts or {}).items()}
        self._loop = _new_loop()
        self._thread = threading.Thread(target=self._run, name="corral-egress", daemon=True)
        self._thread.start()

    def _authority(self) -> CertificateAuthority:
        # On the loop's thread only: no lock.
        if self._ca is None:
            source = self._ca_source
            self._ca = source() if callable(source) else source
        return self._ca

    @property
    def _upstream_tls(self) -> ssl.SSLContext:
        if self._tls is None:
            context = ssl.create_default_context(cafile=self._upstream_ca_file)
            context.set_alpn_protocols(["http/1.1"])
            self._tls = context
        return self._tls

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _call(self, coro: Awaitable[Any]) -> Any:
        # Its coroutines (a listener's start or close) take milliseconds: a loop that does
        # not answer is stuck, and every command waiting here would be stuck with it.
        future: concurrent.futures.Future[Any] = asyncio.run_coroutine_threadsafe(
            coro, self._loop)  # type: ignore[arg-type]
        try:
            return future.result(timeout=_CALL_TIMEOUT_S)
        except TimeoutError:
            future.cancel()
            raise BackendError(f"the egress gateway did not answer in {_CALL_TIMEOUT_S:.0f} s "
                               "(its event loop is stuck); restart the service, and report "
                               "it with the service log") from None

    def _submit(self, coro: Coroutine[Any, Any, None], what: str) -> None:
        """Run ``coro`` on the loop without waiting for it; a failure is logged."""
        def logged(future: concurrent.futures.Future[None]) -> None:
            if not future.cancelled() and future.exception() is not None:
                logger.error("egress gateway: could not %s: %s", what, future.exception())

        asyncio.run_coroutine_threadsafe(coro, self._loop).add_done_callback(logged)

    def close(self) -> None:
        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                self._call(self._loop.shutdown_default_executor())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        if not self._loop.is_running() and not self._loop.is_closed():
            self._loop.close()

    # -- listeners ----------------------------------------------------------------------------

    def serve(self, sock: socket.socket, *, sandbox_id: str,
              command_id: str | Callable[[], str]) -> ListenerHandle:
        """Serve proxy requests arriving on ``sock`` (already listening) for one command, or
        for a sandbox's commands (``command_id`` then names, as each connection comes, the
        command it is of, "" when that cannot be told)."""
        handle = ListenerHandle(port=sock.getsockname()[1], _gateway=self)

        async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            handle._tasks.add(task)
            try:
                await self._handle(reader, writer, sandbox_id,
                                   command_id() if callable(command_id) else command_id)
            finally:
                handle._tasks.discard(task)

        async def start() -> None:
            try:
                server = await asyncio.start_server(on_client, sock=sock, limit=_CHUNK)
            except BaseException:
                sock.close()
                raise
            if handle._closed:  # closed before it started: the close found no server
                server.close()
            else:
                handle._server = server

        # Not awaited: ``sock`` already listens, so the kernel queues what connects before
        # the loop takes the server up; a command need not wait on another thread to start.
        self._submit(start(), "start a listener")
        return handle

    # -- one client connection ----------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      sandbox_id: str, command_id: str) -> None:
        _tune(writer)
        conn = h11.Connection(h11.SERVER)
        decision: Decision | None = None
        try:
            request = await asyncio.wait_for(self._read_head(conn, reader), _HEAD_TIMEOUT_S)
            if not isinstance(request, h11.Request):
                return
            method = clip(request.method.decode("ascii", "replace"), 32)
            decision = Decision(sandbox_id, command_id, method, "", 0, "denied", "", "")
            context = self._lookup(sandbox_id)
            if method == "CONNECT":
                await self._connect(conn, reader, writer, request, context, decision)
            else:
                await self._forward(conn, reader, writer, request, context, decision)
        except _Refused as refused:
            # Refused before a request was parsed too (a malformed head): still a decision.
            if decision is None:
                decision = Decision(sandbox_id, command_id, "", "", 0, "denied", "", "")
            decision.verdict, decision.rule, decision.reason = "denied", refused.rule, \
                refused.reason
            await self._refuse(conn, writer, refused, decision)
        except (TimeoutError, h11.RemoteProtocolError, asyncio.IncompleteReadError) as exc:
            if decision is not None and decision.verdict == "allowed":
                decision.reason += f"; ended: {type(exc).__name__}: {clip(str(exc))}"
            else:
                await self._refuse(conn, writer, _Refused(400, "bad-request",
                                                          f"malformed proxy request: "
                                                          f"{clip(str(exc))}"), decision)
        except (ConnectionError, OSError) as exc:
            if decision is not None:
                decision.reason += f"; ended: {clip(str(exc))}"
        except asyncio.CancelledError:
            if decision is not None:
                decision.reason += "; ended: the command finished"
            raise
        except Exception as exc:
            # A bug here must still end in a decision, and must not put caller bytes unbounded
            # into the host's log (asyncio would log the whole exception).
            logger.error("egress gateway failed on a connection of %s: %s: %s", sandbox_id,
                         type(exc).__name__, clip(str(exc)))
            if decision is None:
                decision = Decision(sandbox_id, command_id, "", "", 0, "denied", "", "")
            if decision.verdict == "allowed":
                decision.reason += "; ended: internal error"
            else:
                decision.rule, decision.reason = "internal-error", "the gateway failed"
                await self._refuse(conn, writer, _Refused(502, "internal-error",
                                                          "the gateway failed on this request"),
                                   decision)
        finally:
            with contextlib.suppress(Exception):
                writer.close()
            if decision is not None:
                decision.duration_s = time.monotonic() - decision.started
                try:
                    self._report(decision)
                except Exception:  # reporting must never break the gateway
                    logger.exception("could not record an egress decision")

    async def _next_event(self, conn: h11.Connection, reader: asyncio.StreamReader) -> Any:
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            data = await reader.read(_CHUNK)
            conn.receive_data(data)

    async def _read_head(self, conn: h11.Connection, reader: asyncio.StreamReader) -> Any:
        """The next request head (or ConnectionClosed); a malformed one is refused by rule."""
        try:
            return await self._next_event(conn, reader)
        except h11.RemoteProtocolError as exc:
            text = str(exc)
            framing = "Content-Length" in text or "Transfer-Encoding" in text
            raise _Refused(400, "bad-framing" if framing else "bad-request",
                           f"malformed request: {clip(text)}"
                           + ("; send one Content-Length or Transfer-Encoding: chunked"
                              if framing else "")) from None

    async def _refuse(self, conn: h11.Connection, writer: asyncio.StreamWriter,
                      refused: _Refused, decision: Decision | None) -> None:
        """Answer ``refused`` as text/plain; a refusal by the policy says so, and which
        setting allows the host (``refusals.py``), in the reason phrase, a header and the body."""
        explained = None if decision is None else explain(
            rule=refused.rule, method=decision.method, host=decision.host, port=decision.port,
            sandbox_id=decision.sandbox_id)
        if explained is None:
            body = f"corral egress gateway: {printable(refused.reason, 2048)}\n".encode()
            reason = _REASONS.get(refused.status, b"")
        else:
            body = explained.body.encode()
            reason = explained.reason.encode()
        headers = [(b"content-type", b"text/plain; charset=utf-8"),
                   (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close"),
                   (b"x-corral-egress", f"denied; rule={printable(refused.rule, 200)}".encode()),
                   (b"x-corral-egress-reason", printable(refused.reason).encode())]
        if explained is not None:
            headers.append((b"x-corral-refused", explained.header.encode()))
        with contextlib.suppress(Exception):
            if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                writer.write(conn.send(h11.Response(status_code=refused.status, headers=headers,
                                                   reason=reason)))
                writer.write(conn.send(h11.Data(data=body)))
                writer.write(conn.send(h11.EndOfMessage()))
            await writer.drain()

    # -- decisions ----------------------------------------------------------------------------

    def _target(self, host_text: str, port: int, context: EgressContext,
                decision: Decision) -> str:
        """Validate and decide ``host:port``; return the normalised host or raise _Refused."""
        decision.host, decision.port = clip(host_text, 255), port
        if is_ip_literal(host_text):
            raise _Refused(403, "ip-literal", f"{clip(host_text)} is an IP address; only host "
                           "names can be allowed")
        try:
            host = normalize_host(host_text)
        except ValueError as exc:
            raise _Refused(400, "bad-host", clip(str(exc))) from None
        decision.host = host
        verdict = context.policy.decide(host, port)
        decision.rule, decision.reason = verdict.rule, verdict.reason
        if not verdict.allowed:
            raise _Refused(403, verdict.rule, verdict.reason)
        return host

    async def _resolve(self, host: str, port: int) -> list[str]:
        """Every answer vetted; any forbidden one refuses the whole name."""
        if host in self._pinned:
            answers = list(self._pinned[host])
        else:
            try:
                infos = await self._loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except socket.gaierror as exc:
                raise _Refused(502, "dns", f"cannot resolve {host}: {exc.strerror}") from None
            answers = list(dict.fromkeys(str(info[4][0]) for info in infos))
        if not answers:
            raise _Refused(502, "dns", f"{host} has no addresses")
        for answer in answers:
            address = ipaddress.ip_address(answer.split("%", 1)[0])
            why = forbidden_reason(address, self._cidrs)
            if why is not None:
                raise _Refused(403, "forbidden-address",
                               f"{host} resolves to {answer} ({why}); refused")
        return answers

    async def _open_upstream(self, host: str, port: int, decision: Decision,
                             tls: bool) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        answers = await self._resolve(host, port)
        last: Exception | None = None
        for answer in answers:
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(answer, port, limit=_CHUNK), _CONNECT_TIMEOUT_S)
                # Tuned before the TLS handshake: its round trips are where delayed ACKs bite.
                _tune(writer)
                if tls:
                    await asyncio.wait_for(
                        writer.start_tls(self._upstream_tls, server_hostname=host),
                        _CONNECT_TIMEOUT_S)
                decision.address = answer
                return reader, writer
            except (TimeoutError, OSError, ssl.SSLError) as exc:
                last = exc
        raise _Refused(502, "upstream", f"cannot connect to {host}:{port}: {last}")

    # -- CONNECT ------------------------------------------------------------------------------

    async def _connect(self, conn: h11.Connection, reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter, request: h11.Request,
                       context: EgressContext, decision: Decision) -> None:
        target = request.target.decode("ascii", "replace")
        host_text, sep, port_text = target.rpartition(":")
        port = parse_port(port_text)
        if not sep or port is None:
            raise _Refused(400, "bad-target", f"CONNECT target {clip(target)!r} is not host:port")
        for name, value in request.headers:
            if name == b"host" and value.decode("ascii", "replace").lower() not in (
                    target.lower(), host_text.lower()):
                raise _Refused(400, "host-mismatch",
                               f"Host header {clip(value.decode(errors='replace'))!r} disagrees "
                               f"with the CONNECT target {clip(target)!r}")
        host = self._target(host_text, port, context, decision)
        body_framing(request)  # a CONNECT with ambiguous framing is refused as well
        bound = [s for s in context.secrets if s.bound_to(host, port)]
        decision.mode = "intercept" if bound else "tunnel"
        up_reader, up_writer = await self._open_upstream(host, port, decision, tls=bool(bound))
        decision.verdict = "allowed"
        try:
            writer.write(conn.send(h11.Response(status_code=200, headers=[],
                                                reason=b"Connection established")))
            await writer.drain()
            early = conn.trailing_data[0]
            if bound:
                await self._intercept(reader, writer, early, host, port, up_reader, up_writer,
                                      bound, context, decision)
            else:
                if early:
                    up_writer.write(early)
                    decision.bytes_up += len(early)
                await self._pipe(reader, writer, up_reader, up_writer, decision)
        finally:
            with contextlib.suppress(Exception):
                up_writer.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    up_reader: asyncio.StreamReader, up_writer: asyncio.StreamWriter,
                    decision: Decision) -> None:
        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter, up: bool) -> None:
            try:
                while data := await src.read(_CHUNK):
                    dst.write(data)
                    if up:
                        decision.bytes_up += len(data)
                    else:
                        decision.bytes_down += len(data)
                    await dst.drain()
            finally:
                with contextlib.suppress(Exception):
                    if dst.can_write_eof():
                        dst.write_eof()

        await asyncio.gather(copy(reader, up_writer, True), copy(up_reader, writer, False),
                             return_exceptions=True)

    async def _intercept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         early: bytes, host: str, port: int, up_reader: asyncio.StreamReader,
                         up_writer: asyncio.StreamWriter, bound: list[BoundSecret],
                         context: EgressContext, decision: Decision) -> None:
        if early:
            # Bytes sent before our 200 (an eager ClientHello) cannot be replayed into the new
            # TLS layer; clients wait for the 200 after CONNECT in practice.
            raise _Refused(400, "early-data", "data sent before the tunnel was established")
        # TLS towards the sandbox with a leaf certificate for the host it asked for.
        await writer.start_tls(self._authority().server_context(host))
        conn = h11.Connection(h11.SERVER)
        try:
            request = await asyncio.wait_for(self._read_head(conn, reader), _HEAD_TIMEOUT_S)
            if not isinstance(request, h11.Request):
                return
            decision.method = f"CONNECT/{clip(request.method.decode('ascii', 'replace'), 32)}"
            inner_host = next((v for n, v in request.headers if n == b"host"), b"").decode(
                "ascii", "replace").lower()
            if inner_host not in (host, f"{host}:{port}"):
                raise _Refused(400, "host-mismatch", f"inner Host {clip(inner_host)!r} is not "
                               f"the CONNECT target {host}:{port}")
            # Checked before anything is substituted or sent: a refused request carries no
            # secret anywhere.
            target = inner_target(request, scheme="https", host=host, port=port)
            headers = outbound_headers(request, _host_value(host, port, tls=True))
        except _Refused as refused:
            # Answered inside the tunnel, where the client reads; the caller audits it.
            await self._refuse(conn, writer, refused, decision)
            raise
        await self._exchange(conn, reader, writer, request.method, target, headers, up_reader,
                             up_writer, bound, decision)

    # -- plain HTTP ---------------------------------------------------------------------------

    async def _forward(self, conn: h11.Connection, reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter, request: h11.Request,
                       context: EgressContext, decision: Decision) -> None:
        target = request.target.decode("ascii", "replace")
        if not target.lower().startswith("http://"):
            raise _Refused(400, "bad-target", f"a proxy request needs an absolute http:// URL, "
                           f"got {clip(target)!r} (use CONNECT for https)")
        parts, host_text, port = split_url(target)
        for name, value in request.headers:
            if name == b"host":
                given = value.decode("ascii", "replace").lower()
                if given not in (parts.netloc.lower(), f"{host_text.lower()}:{port}") \
                        and not (port == 80 and given == host_text.lower()):
                    raise _Refused(400, "host-mismatch", f"Host header {clip(given)!r} "
                                   f"disagrees with the request URL {clip(parts.netloc)!r}")
        host = self._target(host_text, port, context, decision)
        # Ambiguous framing and '//' paths are refused here, before any upstream is opened.
        headers = outbound_headers(request, _host_value(host, port, tls=False))
        path = origin_form(parts).encode("ascii")
        decision.mode = "http"
        up_reader, up_writer = await self._open_upstream(host, port, decision, tls=False)
        decision.verdict = "allowed"
        try:
            # Secrets are never substituted over plain HTTP: they would cross the network in
            # clear; the placeholder goes instead.
            await self._exchange(conn, reader, writer, request.method, path, headers,
                                 up_reader, up_writer, [], decision)
        finally:
            with contextlib.suppress(Exception):
                up_writer.close()

    # -- one request/response exchange (plain or intercepted) ---------------------------------

    async def _exchange(self, conn: h11.Connection, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter, method: bytes, target: bytes,
                        headers: list[tuple[bytes, bytes]], up_reader: asyncio.StreamReader,
                        up_writer: asyncio.StreamWriter, bound: list[BoundSecret],
                        decision: Decision) -> None:
        """One vetted request (``headers`` from ``outbound_headers``) and its response."""
        used: set[str] = set()

        def swap(data: bytes) -> bytes:
            for secret in bound:
                marker = secret.placeholder.encode()
                if marker in data:
                    data = data.replace(marker, secret.value.encode())
                    used.add(secret.name)
            return data

        upstream = h11.Connection(h11.CLIENT)
        up_writer.write(upstream.send(h11.Request(
            method=method, target=swap(target), headers=[(n, swap(v)) for n, v in headers])))
        # Request body, streamed.
        while True:
            event = await self._next_event(conn, reader)
            if isinstance(event, h11.Data):
                decision.bytes_up += len(event.data)
                up_writer.write(upstream.send(h11.Data(data=event.data)))
                await up_writer.drain()
            elif isinstance(event, h11.EndOfMessage):
                up_writer.write(upstream.send(h11.EndOfMessage()))
                await up_writer.drain()
                break
            else:
                raise h11.RemoteProtocolError("unexpected event in request body")
        decision.substituted = tuple(sorted(used))
        # Response, streamed back.
        while True:
            event = await self._next_event(upstream, up_reader)
            if isinstance(event, h11.InformationalResponse):
                continue
            if isinstance(event, h11.Response):
                out = [(n, v) for n, v in event.headers if n.lower() not in _HOP_BY_HOP]
                writer.write(conn.send(h11.Response(
                    status_code=event.status_code, reason=event.reason,
                    headers=[*out, (b"connection", b"close")])))
            elif isinstance(event, h11.Data):
                decision.bytes_down += len(event.data)
                writer.write(conn.send(h11.Data(data=event.data)))
                await writer.drain()
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                with contextlib.suppress(h11.LocalProtocolError):
                    writer.write(conn.send(h11.EndOfMessage()))
                await writer.drain()
                return


def _host_value(host: str, port: int, *, tls: bool) -> str:
    """``Host`` as the upstream expects it: the port only when not the scheme's default."""
    return host if port == default_port("https" if tls else "http") else f"{host}:{port}"


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (libuv: a faster hop through the gateway), else asyncio's own."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _tune(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)


_REASONS = {400: b"Bad Request", 403: b"Forbidden", 502: b"Bad Gateway", 504: b"Gateway Timeout"}
