"""The etcd v3 client of ``inner=etcd-v3``: etcd's JSON gateway over ``http.client``, with member failover.

- :class:`EtcdV3Client`: the v3 calls the rendezvous needs (range, txn, put, delete, lease grant),
  kept connections, failover over the members of the endpoint, token authentication, TLS;
- :class:`ClientOptions`: the validated ``--rdzv-conf`` keys :data:`CONF_KEYS`, passed to the
  workers in :data:`ENV_OPTIONS`;
- :class:`EtcdV3ConnectionError`: no member could serve a call (the outage guard retries it).

Design: ``docs/RDZV.md`` (section "The client").
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import select
import ssl
import threading
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from elastic_emb.errors import EtcdUnreachable, EtcdV3Error

DEFAULT_PORT = 2379
ENV_OPTIONS = "ELASTIC_EMB_ETCD_OPTIONS"  # JSON of ClientOptions minus secrets, agent -> workers
CONF_KEYS = frozenset(
    {"read_timeout", "protocol", "ca_cert", "ssl_cert", "ssl_cert_key", "user", "password_file", "ttl"}
)

# gRPC status codes the gateway returns when a member cannot serve the call (try another one).
_UNAVAILABLE, _DEADLINE_EXCEEDED, _UNAUTHENTICATED = 14, 4, 16
_NOT_FOUND, _PERMISSION_DENIED = 5, 7
# etcd's answers (3.4/3.5) to a call without valid credentials; some come as INVALID_ARGUMENT.
_AUTH_MESSAGES = ("user name is empty", "authentication failed", "invalid auth token", "user name not found")
LEASE_GONE = "requested lease not found"  # a write attached to a lease etcd does not have (NOT_FOUND)
# What to do about each kind of refusal (one clause, appended to the error's line).
REMEDIES = {
    "authentication": "etcd has authentication on: give --rdzv-conf user=NAME,password_file=PATH of an etcd user "
    "whose password is that file's first line",
    "permission": "grant the --rdzv-conf user read-write on the prefix /torch/elastic/ "
    "(etcdctl role grant-permission ROLE --prefix=true readwrite /torch/elastic/)",
    "lease": "etcd no longer has the lease (its data was wiped, or the lease revoked): a new one is taken",
    "request": "etcd refused the request itself; check the etcd version (3.4 or newer) and its logs",
}
_MEMBER_DOWN_MESSAGES = ("no leader", "leader changed", "timed out", "not capable", "too many requests")
MAX_IDLE = 4  # idle keep-alive connections kept per member
# a reused connection failing with one of these read no reply: the member had closed it
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


class EtcdV3ConnectionError(EtcdUnreachable, RendezvousConnectionError):
    """:class:`~elastic_emb.errors.EtcdUnreachable` that is also torch's ``RendezvousConnectionError``
    (which torch's rendezvous treats as a connection problem, not a failure)."""


class ClientOptions(BaseModel):
    """How to reach etcd: the ``--rdzv-conf`` keys of this backend, validated."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    read_timeout: float = Field(default=10.0, gt=0, le=600)
    protocol: Literal["http", "https"] = "http"
    ca_cert: str | None = None
    ssl_cert: str | None = None
    ssl_cert_key: str | None = None
    user: str | None = None
    password_file: str | None = None
    ttl: int = Field(default=7200, ge=10, le=30 * 86400)

    @classmethod
    def from_conf(cls, conf: Mapping[str, Any]) -> "ClientOptions":
        """The options from ``--rdzv-conf`` (other keys and empty values are ignored).

        Args:
            conf: the ``--rdzv-conf`` mapping.

        Returns:
            The validated options.

        Raises:
            ValueError: for a value out of range, ``user`` without ``password_file`` (or the
                reverse), or ``ssl_cert_key`` without ``ssl_cert``, naming the keys.
        """
        values = {k: v for k, v in conf.items() if k in CONF_KEYS and v not in (None, "")}
        if isinstance(values.get("protocol"), str):
            values["protocol"] = values["protocol"].strip().lower()
        try:
            options = cls(**values)
        except ValidationError as exc:
            bad = "; ".join(f"{e['loc'][0]}={values.get(e['loc'][0])!r}: {e['msg']}" for e in exc.errors())
            raise ValueError(f"invalid --rdzv-conf for inner=etcd-v3: {bad}") from None
        if (options.user is None) != (options.password_file is None):
            raise ValueError(
                "--rdzv-conf for inner=etcd-v3: give user and password_file together (etcd's token "
                f"authentication), got user={options.user!r}, password_file={options.password_file!r}"
            )
        if options.ssl_cert_key and not options.ssl_cert:
            raise ValueError(
                f"--rdzv-conf ssl_cert_key={options.ssl_cert_key!r} needs ssl_cert (the client certificate)"
            )
        return options

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "ClientOptions":
        """The agent's options (:data:`ENV_OPTIONS`), else ``PET_RDZV_CONF``'s, else the defaults.

        Args:
            env: the environment to read (default: ``os.environ``).

        Returns:
            The validated options.

        Raises:
            ValueError: when :data:`ENV_OPTIONS` is not valid JSON of valid options, or
                ``PET_RDZV_CONF`` holds invalid options.
        """
        env = os.environ if env is None else env
        if env.get(ENV_OPTIONS):
            try:
                return cls.from_conf(json.loads(env[ENV_OPTIONS]))
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{ENV_OPTIONS}={env[ENV_OPTIONS][:200]!r} is not valid: {exc}") from None
        conf = {}
        for item in env.get("PET_RDZV_CONF", "").split(","):
            key, sep, value = item.partition("=")
            if sep:
                conf[key.strip()] = value.strip()
        return cls.from_conf(conf)

    def to_env(self) -> str:
        """The options as the value of :data:`ENV_OPTIONS`.

        Returns:
            JSON of the options that are set (``password_file`` names a file, not the secret).
        """
        return self.model_dump_json(exclude_none=True)


def refusal_kind(code: Any, message: str) -> str:
    """What an etcd refusal is about.

    Args:
        code: the gRPC status code of etcd's answer.
        message: etcd's message.

    Returns:
        ``"authentication"``, ``"permission"``, ``"lease"`` or ``"request"`` (anything else).
    """
    if code == _UNAUTHENTICATED or any(m in message for m in _AUTH_MESSAGES):
        return "authentication"
    if code == _PERMISSION_DENIED or "permission denied" in message:
        return "permission"
    if LEASE_GONE in message or (code == _NOT_FOUND and "lease" in message):
        return "lease"
    return "request"


def parse_endpoints(endpoint: str, protocol: str = "http") -> list[str]:
    """The base URLs of the members an endpoint lists.

    Args:
        endpoint: ``HOST[:PORT][,HOST[:PORT]...]`` (``[IPv6]:PORT`` too); the port defaults to 2379.
        protocol: ``http`` or ``https``.

    Returns:
        One ``protocol://host:port`` per member, in order.

    Raises:
        ValueError: naming the bad part, or when the endpoint names no member.
    """
    urls = []
    for part in (p.strip() for p in (endpoint or "").split(",")):
        if not part:
            continue
        if part.startswith("["):  # [IPv6]:PORT
            host, _, port = part.partition("]")
            host, port = host + "]", port.removeprefix(":") or str(DEFAULT_PORT)
        else:
            host, sep, port = part.partition(":")
            port = port if sep else str(DEFAULT_PORT)
        if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
            raise ValueError(f"etcd endpoint {part!r} (in {endpoint!r}) must be HOST:PORT; separate members with ','")
        urls.append(f"{protocol}://{host}:{port}")
    if not urls:
        raise ValueError(f"etcd endpoint {endpoint!r} names no member: give HOST:PORT[,HOST:PORT...]")
    return urls


def _b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text or "")


class KeyValue(BaseModel):
    """One key as etcd returns it: key, value and its create and modification revisions."""

    model_config = ConfigDict(frozen=True)

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int

    @classmethod
    def of(cls, kv: Mapping[str, Any]) -> "KeyValue":
        """The key from the gateway's JSON.

        Args:
            kv: one entry of a reply's ``kvs`` (base64 key and value, revisions as strings).

        Returns:
            The decoded key.
        """
        return cls(
            key=_unb64(kv.get("key")),
            value=_unb64(kv.get("value")),
            create_revision=int(kv.get("create_revision", 0)),
            mod_revision=int(kv.get("mod_revision", 0)),
        )


class EtcdV3Client:
    """The few v3 calls the rendezvous needs, over etcd's JSON gateway, with member failover.

    Thread-safe. Every call may raise :class:`EtcdV3ConnectionError` (no member could serve it)
    or :class:`~elastic_emb.errors.EtcdV3Error` (etcd refused it).

    Args:
        endpoints: the members' base URLs (:func:`parse_endpoints`).
        options: the client options (default: the defaults).

    Raises:
        ValueError: when ``endpoints`` is empty or the TLS files cannot be loaded.
    """

    def __init__(self, endpoints: Sequence[str], options: ClientOptions | None = None) -> None:
        self.options = options or ClientOptions()
        self.endpoints = list(endpoints)
        if not self.endpoints:
            raise ValueError("EtcdV3Client needs at least one endpoint URL")
        self._current = 0
        self._token: str | None = None
        self._lock = threading.Lock()
        self._ssl = self._ssl_context() if self.options.protocol == "https" else None
        self._idle: dict[str, list[http.client.HTTPConnection]] = {}  # member URL -> idle connections
        self._pid = os.getpid()  # a forked child must not share its parent's sockets

    @classmethod
    def from_endpoint(cls, endpoint: str, options: ClientOptions | None = None) -> "EtcdV3Client":
        """A client of the members an endpoint lists.

        Args:
            endpoint: ``HOST[:PORT][,HOST[:PORT]...]``.
            options: the client options (default: the defaults).

        Returns:
            The client (nothing is connected yet).

        Raises:
            ValueError: for an invalid endpoint or TLS files that cannot be loaded.
        """
        options = options or ClientOptions()
        return cls(parse_endpoints(endpoint, options.protocol), options)

    def _ssl_context(self) -> ssl.SSLContext:
        o = self.options
        try:
            ctx = ssl.create_default_context(cafile=o.ca_cert)
            if o.ssl_cert:
                ctx.load_cert_chain(o.ssl_cert, o.ssl_cert_key)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(
                f"etcd TLS files ca_cert={o.ca_cert!r} ssl_cert={o.ssl_cert!r} "
                f"ssl_cert_key={o.ssl_cert_key!r} cannot be loaded: {exc}"
            ) from None
        return ctx

    # -- transport ------------------------------------------------------------------------------

    def call(self, path: str, body: Mapping[str, Any]) -> dict:
        """POST ``body`` to ``/v3/<path>`` on the first member that can serve it.

        Starts with the member that served the last call; an expired auth token is renewed once.

        Args:
            path: the gateway path after ``/v3/``, e.g. ``kv/range``.
            body: the request as JSON-able data.

        Returns:
            etcd's reply.

        Raises:
            EtcdV3ConnectionError: when no member could serve it (unreachable, no leader, timed out).
            EtcdV3Error: when etcd refused the call, or the password file cannot be read.
        """
        errors = []
        with self._lock:
            start = self._current
        for i in range(len(self.endpoints)):
            index = (start + i) % len(self.endpoints)
            url = self.endpoints[index]
            try:
                reply = self._call_one(url, path, body)
            except _MemberDown as exc:
                errors.append(f"{url}: {exc}")
                continue
            with self._lock:
                self._current = index
            return reply
        raise EtcdV3ConnectionError(
            f"no etcd member could serve /v3/{path}: {'; '.join(errors)}. Check that etcd is running and reachable "
            f"at the --rdzv-endpoint (members separated by ',')"
        )

    def _call_one(self, url: str, path: str, body: Mapping[str, Any], *, retry_auth: bool = True) -> dict:
        if self.options.user and self._token is None and not path.startswith("auth/"):
            self._authenticate(url)
        headers = {"Content-Type": "application/json"}
        if self._token and not path.startswith("auth/"):
            headers["Authorization"] = self._token
        raw = self._post(url, f"/v3/{path}", json.dumps(body).encode(), headers)
        try:
            reply = json.loads(raw or b"{}")
        except ValueError:
            raise _MemberDown(f"not a JSON reply: {raw[:120]!r}") from None
        if not isinstance(reply, dict):
            raise _MemberDown(f"not a JSON object: {raw[:120]!r}")
        if "error" in reply or ("code" in reply and "header" not in reply):
            code = reply.get("code")
            message = str(reply.get("message") or reply.get("error"))
            if code == _UNAUTHENTICATED or "invalid auth token" in message:
                if retry_auth and self.options.user:
                    self._token = None
                    return self._call_one(url, path, body, retry_auth=False)
            if code in (_UNAVAILABLE, _DEADLINE_EXCEEDED) or any(m in message for m in _MEMBER_DOWN_MESSAGES):
                raise _MemberDown(f"etcd: {message} (code {code})")
            kind = refusal_kind(code, message)
            raise EtcdV3Error(
                f"etcd refused /v3/{path} at {url} ({kind}): {message} (code {code}); {REMEDIES[kind]}", code, kind
            )
        return reply

    def _post(self, url: str, target: str, data: bytes, headers: Mapping[str, str]) -> bytes:
        """One POST on a kept connection to ``url``; the body of any status (etcd's gateway
        answers errors as JSON with a 4xx/5xx status). A reused connection that the member had
        closed is retried once on a fresh one."""
        for attempt in range(2):
            conn, reused = self._checkout(url)
            try:
                conn.request("POST", target, body=data, headers=headers)
                reply = conn.getresponse()
                raw = reply.read()
            except _STALE as exc:
                conn.close()
                if reused and attempt == 0:
                    continue  # closed by the member while idle: once more, on a fresh connection
                raise _MemberDown(f"{type(exc).__name__}: {exc}") from None
            except (OSError, http.client.HTTPException) as exc:  # refused, DNS, timeout, TLS, bad reply
                conn.close()
                raise _MemberDown(f"{type(exc).__name__}: {exc}") from None
            if reply.will_close:
                conn.close()
            else:
                self._checkin(url, conn)
            return raw
        raise AssertionError("unreachable")  # pragma: no cover

    def _checkout(self, url: str) -> tuple[http.client.HTTPConnection, bool]:
        """An idle connection to ``url`` that is still open, else a new one; and whether reused."""
        with self._lock:
            if self._pid != os.getpid():  # forked: the parent's sockets are not ours to use
                self._idle, self._pid = {}, os.getpid()
            idle = self._idle.get(url) or []
            while idle:
                conn = idle.pop()
                if _open(conn):
                    return conn, True
                conn.close()
        parts = urllib.parse.urlsplit(url)
        if parts.scheme == "https":
            return http.client.HTTPSConnection(
                parts.hostname, parts.port, timeout=self.options.read_timeout, context=self._ssl
            ), False
        return http.client.HTTPConnection(parts.hostname, parts.port, timeout=self.options.read_timeout), False

    def _checkin(self, url: str, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            idle = self._idle.setdefault(url, [])
            if len(idle) < MAX_IDLE and self._pid == os.getpid():
                return idle.append(conn)
        conn.close()

    def _authenticate(self, url: str) -> None:
        path = self.options.password_file
        try:
            password = open(path).read().rstrip("\r\n")  # noqa: SIM115 - a small secret file
        except OSError as exc:
            raise EtcdV3Error(
                f"--rdzv-conf password_file={path!r} cannot be read ({type(exc).__name__}); give a file this user "
                "can read whose first line is the etcd password",
                kind="authentication",
            ) from None
        reply = self._call_one(
            url, "auth/authenticate", {"name": self.options.user, "password": password}, retry_auth=False
        )
        token = reply.get("token")
        if not token:
            raise EtcdV3Error(
                f"etcd at {url} returned no auth token for --rdzv-conf user={self.options.user!r}; "
                f"{REMEDIES['authentication']}",
                kind="authentication",
            )
        self._token = str(token)

    # -- key-value calls ------------------------------------------------------------------------

    def get(self, key: bytes | str) -> KeyValue | None:
        """One key.

        Args:
            key: the etcd key.

        Returns:
            The key, or None when it does not exist.
        """
        kvs = self.call("kv/range", {"key": _b64(key)}).get("kvs") or []
        return KeyValue.of(kvs[0]) if kvs else None

    def get_many(self, keys: Sequence[bytes | str]) -> dict[bytes, KeyValue]:
        """The keys that exist, read in one transaction (one round trip, one revision).

        Args:
            keys: the etcd keys.

        Returns:
            The existing keys by key bytes.
        """
        reply = self.call("kv/txn", {"success": [{"request_range": {"key": _b64(k)}} for k in keys]})
        out = {}
        for resp in reply.get("responses") or []:
            for kv in (resp.get("response_range") or {}).get("kvs") or []:
                item = KeyValue.of(kv)
                out[item.key] = item
        return out

    def put(self, key: bytes | str, value: bytes | str, lease: int = 0) -> int:
        """Write ``value`` under ``key``.

        Args:
            key: the etcd key.
            value: the value.
            lease: a lease id to attach the key to (0: none).

        Returns:
            The revision of the write.
        """
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return int(self.call("kv/put", body)["header"]["revision"])

    def delete(self, key: bytes | str) -> int:
        """Delete ``key``.

        Args:
            key: the etcd key.

        Returns:
            The number of keys deleted (0 or 1).
        """
        return int(self.call("kv/deleterange", {"key": _b64(key)}).get("deleted", 0))

    def put_if(
        self,
        key: bytes | str,
        value: bytes | str,
        *,
        mod_revision: int | None = None,
        prev_value: bytes | None = None,
        lease: int = 0,
    ) -> tuple[bool, int, KeyValue | None]:
        """Write ``value`` if the key's ``mod_revision`` is the given one (0: the key is absent) or
        its value is ``prev_value``, in one transaction with the read of the current value.

        Args:
            key: the etcd key.
            value: the value to write.
            mod_revision: the key's expected modification revision (None or 0: absent).
            prev_value: the key's expected value; takes precedence over ``mod_revision``.
            lease: a lease id to attach the key to (0: none).

        Returns:
            ``(written, revision, current)``: whether it wrote, the store's revision after the
            call, and the key's current value when it did not write (None when absent).
        """
        if prev_value is not None:
            compare = {"key": _b64(key), "target": "VALUE", "result": "EQUAL", "value": _b64(prev_value)}
        else:
            compare = {"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(mod_revision or 0)}
        put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            put["lease"] = str(lease)
        reply = self.call(
            "kv/txn",
            {
                "compare": [compare],
                "success": [{"request_put": put}],
                "failure": [{"request_range": {"key": _b64(key)}}],
            },
        )
        revision = int(reply["header"]["revision"])
        if reply.get("succeeded"):
            return True, revision, None
        kvs = ((reply.get("responses") or [{}])[0].get("response_range") or {}).get("kvs") or []
        return False, revision, KeyValue.of(kvs[0]) if kvs else None

    def grant_lease(self, ttl: int) -> int:
        """A new lease.

        Args:
            ttl: its time to live in seconds.

        Returns:
            The lease id.
        """
        return int(self.call("lease/grant", {"TTL": str(ttl)})["ID"])


class _MemberDown(Exception):
    """One member could not serve a call (internal: the client moves on to the next)."""


def _open(conn: http.client.HTTPConnection) -> bool:
    """Whether an idle connection is still usable: its socket exists and has nothing to read (an
    idle HTTP connection that reads as ready was closed by the member, or holds stray bytes)."""
    sock = conn.sock
    if sock is None:
        return False
    try:
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        return not poller.poll(0)
    except (OSError, ValueError):
        return False
