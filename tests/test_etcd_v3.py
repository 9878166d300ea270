"""``inner=etcd-v3`` at the backend level, against a real etcd (Debian's etcd-server on loopback).

The semantics torch's own backends are held to (``get_state`` None when absent, a corrupt state
raises ``RendezvousStateError``, compare-and-swap on the token, stale/None/invalid tokens return
the current state with ``has_set=False``), the c10d ``Store`` the agent and the watchers use,
member failover in a 3-member cluster, and etcd's token authentication. The drills (torchrun
agents, SIGKILLs, bit-for-bit verification) are in tests/test_etcd.py.
"""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.request
from datetime import timedelta
from types import SimpleNamespace

import pytest
import structlog
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousStateError

from elastic_emb.rdzv import etcd_v3 as v3
from elastic_emb.rdzv import etcd_v3_client as v3client
from elastic_emb.testing.etcd import EtcdCluster
from tests.helpers.etcd_fixture import (
    etcd_server,  # noqa: F401  (the fixture)
    require_etcd,
)


@pytest.fixture(autouse=True)
def _no_leaked_client_options(monkeypatch):
    """create_backend puts its options into os.environ (for an agent's workers): undo that after
    each test, or a later test's subprocesses (a drain CLI) would read this test's TLS or auth."""
    monkeypatch.setenv(v3client.ENV_OPTIONS, "")  # recorded as unset-before: the undo removes what the test sets
    monkeypatch.delenv(v3client.ENV_OPTIONS)


def _backend(server, run_id="job", **conf):
    params = SimpleNamespace(endpoint=server.endpoint, run_id=run_id, config=conf)
    backend, store = v3.create_backend(params)
    return backend, store


@pytest.mark.slow
def test_state_semantics_of_torch_backends(etcd_server):
    backend, _ = _backend(etcd_server)
    assert backend.name == "etcd-v3"
    assert backend.get_state() is None
    # None token, no state: set, a token comes back.
    state, token, has_set = backend.set_state(b"\x80state-1")
    assert (state, has_set) == (b"\x80state-1", True) and isinstance(token, int) and token > 0
    assert backend.get_state() == (b"\x80state-1", token)
    # None token, a state exists: nothing written, the current state and token come back.
    assert backend.set_state(b"other") == (b"\x80state-1", token, False)
    # The current token: written, a new token.
    state2, token2, has_set = backend.set_state(b"state-2", token)
    assert (state2, has_set) == (b"state-2", True) and token2 > token
    # A stale token: nothing written.
    assert backend.set_state(b"stale write", token) == (b"state-2", token2, False)
    # Invalid tokens (not one this backend issued): the current state, nothing written.
    for bad in ("abc", -1, 0, "0", True, 1.5, object(), "12x"):
        assert backend.set_state(b"invalid write", bad) == (b"state-2", token2, False), bad
    assert backend.get_state() == (b"state-2", token2)
    # The same token as a string (torch keeps tokens opaque; a decimal string is accepted).
    _, token3, has_set = backend.set_state(b"state-3", str(token2))
    assert has_set and token3 > token2


@pytest.mark.slow
def test_two_writers_with_one_token_exactly_one_wins(etcd_server):
    a, _ = _backend(etcd_server, run_id="race")
    b, _ = _backend(etcd_server, run_id="race")
    _, token, _ = a.set_state(b"base")
    results = {}
    barrier = threading.Barrier(2)

    def write(name, backend):
        barrier.wait(5)
        results[name] = backend.set_state(name.encode(), token)

    threads = [threading.Thread(target=write, args=(n, be)) for n, be in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    wins = [n for n, r in results.items() if r[2]]
    assert len(wins) == 1, results
    (loser,) = set(results) - set(wins)
    assert results[loser][:2] == (wins[0].encode(), results[wins[0]][1])  # the loser sees the winner's state


@pytest.mark.slow
def test_corrupt_state_raises_state_error_and_absent_stale_token_is_none(etcd_server):
    backend, _ = _backend(etcd_server, run_id="corrupt")
    client = v3client.EtcdV3Client.from_endpoint(etcd_server.endpoint)
    client.put(v3.state_key("corrupt"), b"%%% not base64 %%%")
    with pytest.raises(RendezvousStateError, match="corrupt"):
        backend.get_state()
    with pytest.raises(RendezvousStateError):
        backend.set_state(b"x", 1)  # stale token: the current (corrupt) state is decoded, and refused
    client.delete(v3.state_key("corrupt"))
    assert backend.set_state(b"x", 12345) is None  # a stale token and no state: nothing to return


@pytest.mark.slow
def test_state_key_is_leased_for_ttl(etcd_server):
    backend, _ = _backend(etcd_server, run_id="leased", ttl="60")
    backend.set_state(b"s")
    client = v3client.EtcdV3Client.from_endpoint(etcd_server.endpoint)
    kv = client.call("kv/range", {"key": base64.b64encode(v3.state_key("leased").encode()).decode()})["kvs"][0]
    lease = int(kv["lease"])
    ttl = client.call("lease/timetolive", {"ID": str(lease)})
    assert 50 <= int(ttl["TTL"]) <= 60 and int(ttl["grantedTTL"]) == 60, ttl


@pytest.mark.slow
def test_a_lease_etcd_no_longer_has_is_replaced_at_the_next_write(etcd_server):
    # as after etcd restarts with an empty data directory: the backend's lease is gone, and
    # every write attached to it fails until the lease is renewed (ttl/3 later), unless replaced
    backend, _ = _backend(etcd_server, run_id="revoked", ttl="600")
    _, token, written = backend.set_state(b"first")
    assert written
    client = v3client.EtcdV3Client.from_endpoint(etcd_server.endpoint)
    key = base64.b64encode(v3.state_key("revoked").encode()).decode()
    old_lease = int(client.call("kv/range", {"key": key})["kvs"][0]["lease"])
    client.call("lease/revoke", {"ID": str(old_lease)})  # deletes the key attached to it, too
    assert backend.get_state() is None
    assert backend.set_state(b"second", None)[2]  # written, under a new lease
    kv = client.call("kv/range", {"key": key})["kvs"][0]
    assert base64.b64decode(kv["value"]) == base64.b64encode(b"second")
    assert int(kv["lease"]) not in (0, old_lease)


@pytest.mark.slow
def test_store_set_get_add_check_wait_compare_delete(etcd_server):
    _, store = _backend(etcd_server)
    store.set_timeout(timedelta(seconds=2))
    store.set("k", b"\x00\xffbytes")
    store.set("s", "text")
    assert store.get("k") == b"\x00\xffbytes" and store.get("s") == b"text"
    assert store.check(["k", "s"]) and not store.check(["k", "missing"])
    assert store.add("n", 3) == 3 and store.add("n", 4) == 7 and store.get("n") == b"7"
    start = time.monotonic()
    with pytest.raises(LookupError, match="missing"):
        store.get("missing")
    assert 2.0 <= time.monotonic() - start < 5.0
    threading.Timer(0.3, store.set, args=("late", b"1")).start()
    store.wait(["late"], timedelta(seconds=5))
    assert store.compare_set("cas", b"", b"first") == b"first"  # expected '' and absent: set
    assert store.compare_set("cas", b"wrong", b"second") == b"first"
    assert store.compare_set("cas", b"first", b"second") == b"second"
    assert store.delete_key("cas") and not store.delete_key("cas") and not store.check(["cas"])
    assert store.num_keys() >= 4


@pytest.mark.slow
def test_store_add_is_atomic_under_contention(etcd_server):
    _, store = _backend(etcd_server)
    results: list[int] = []

    def adds():
        for _ in range(25):
            results.append(store.add("counter", 1))

    threads = [threading.Thread(target=adds) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == list(range(1, 101)) and store.get("counter") == b"100"


@pytest.mark.slow
def test_store_works_behind_torch_prefix_store_as_the_agent_uses_it(etcd_server):
    """The dynamic rendezvous wraps the store in a C++ PrefixStore per round; the agent's
    RendezvousStoreInfo (MASTER_ADDR/PORT) and barriers go through it."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

    _, store = _backend(etcd_server)
    prefixed = dist.PrefixStore("torch.rendezvous.job.3", store)
    info = RendezvousStoreInfo.build(0, prefixed, local_addr="127.0.0.1", server_port=45678)
    assert (info.master_addr, info.master_port) == ("127.0.0.1", 45678)
    assert prefixed.add("c", 2) == 2 and prefixed.check(["c"])
    assert store.get("torch.rendezvous.job.3/c") == b"2"


@pytest.mark.slow
def test_cluster_failover_when_the_leader_dies_and_a_clear_error_when_all_do(tmp_path):
    require_etcd()
    with EtcdCluster(tmp_path / "etcd", 3) as cluster:
        params = SimpleNamespace(endpoint=cluster.endpoint, run_id="ha", config={"read_timeout": "5"})
        backend, store = v3.create_backend(params)
        _, token, _ = backend.set_state(b"one")
        killed = cluster.kill()  # the leader
        assert not cluster.members[killed].running
        deadline = time.monotonic() + 30  # an election takes about a second; bounded retries
        while True:
            try:
                _, token2, ok = backend.set_state(b"two", token)
                break
            except RendezvousConnectionError:
                assert time.monotonic() < deadline, "the two surviving members never served the write"
                time.sleep(0.2)
        assert ok and backend.get_state() == (b"two", token2)
        store.set("after", b"failover")
        cluster.start()  # the killed member rejoins with its data and catches up
        only = v3client.EtcdV3Client([cluster.members[killed].url])
        deadline = time.monotonic() + 20
        while (only.get(v3.STORE_PREFIX + "after") or SimpleNamespace(value=None)).value != b"failover":
            assert time.monotonic() < deadline, "the restarted member never caught up"
            time.sleep(0.1)
        for m in cluster.members:
            m.kill()
        start = time.monotonic()
        with pytest.raises(v3client.EtcdV3ConnectionError) as info:
            backend.get_state()
        assert isinstance(info.value, RendezvousConnectionError) and isinstance(info.value, ConnectionError)
        assert all(m.url in str(info.value) for m in cluster.members) and "--rdzv-endpoint" in str(info.value)
        assert time.monotonic() - start < 10


def _post(url, path, body):
    req = urllib.request.Request(f"{url}/v3/{path}", data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())


@pytest.mark.slow
def test_token_authentication_with_a_password_file(etcd_server, tmp_path):
    url = etcd_server.url
    _post(url, "auth/role/add", {"name": "root"})
    _post(url, "auth/user/add", {"name": "root", "password": "rootpw"})
    _post(url, "auth/user/grant", {"user": "root", "role": "root"})
    _post(url, "auth/enable", {})
    secret = tmp_path / "password"
    secret.write_text("rootpw\n")
    backend, store = _backend(etcd_server, run_id="authed", user="root", password_file=str(secret))
    assert backend.set_state(b"s")[2] and backend.get_state()[0] == b"s"
    store.set("k", b"v")
    assert store.get("k") == b"v"
    # Without credentials etcd refuses: a clear error, not a hang.
    with pytest.raises(v3.EtcdRefusedError, match="refused") as info:
        v3.EtcdV3RendezvousBackend(v3client.EtcdV3Client.from_endpoint(etcd_server.endpoint), "authed").get_state()
    assert info.value.kind == "authentication"
    secret.write_text("wrong\n")
    with pytest.raises(v3.EtcdV3Error, match="authentication failed|invalid"):
        v3client.EtcdV3Client.from_endpoint(
            etcd_server.endpoint, v3client.ClientOptions(user="root", password_file=str(secret))
        ).get("x")


def _enable_auth_with_a_reader(url):
    """etcd with authentication on: user root (all keys, password rootpw) and user reader (password
    readerpw), who may only read the rendezvous state's prefix."""
    state = base64.b64encode(v3.STATE_PREFIX.encode()).decode()
    end = base64.b64encode(v3._prefix_end(v3.STATE_PREFIX)).decode()
    for name, password in (("root", "rootpw"), ("reader", "readerpw")):
        _post(url, "auth/role/add", {"name": name})
        _post(url, "auth/user/add", {"name": name, "password": password})
        _post(url, "auth/user/grant", {"user": name, "role": name})
    _post(url, "auth/role/grant", {"name": "reader", "perm": {"permType": "READ", "key": state, "range_end": end}})
    _post(url, "auth/enable", {})


@pytest.mark.slow
def test_etcd_refusals_are_named_by_kind_and_never_retried_as_an_outage(etcd_server, tmp_path):
    """A refusal is an answer: the outage guard passes it on at the first call (a connection error
    it would retry for store_outage_timeout), named authentication or permission with its remedy;
    at the agent's start it is a one-line configuration error."""
    from elastic_emb import RendezvousConfigError
    from elastic_emb.rdzv.outage import OutageGuard, is_connection_error

    _enable_auth_with_a_reader(etcd_server.url)
    (tmp_path / "reader").write_text("readerpw\n")
    (tmp_path / "wrong").write_text("nope\n")

    def client(**options):
        return v3client.EtcdV3Client.from_endpoint(etcd_server.endpoint, v3client.ClientOptions(**options))

    no_user = v3.EtcdV3RendezvousBackend(client(), "job")
    wrong = v3.EtcdV3RendezvousBackend(client(user="root", password_file=str(tmp_path / "wrong")), "job")
    reader = v3.EtcdV3RendezvousBackend(client(user="reader", password_file=str(tmp_path / "reader")), "job")
    assert reader.get_state() is None  # reading is allowed
    cases = [
        (no_user.get_state, "authentication", "user name is empty"),
        (wrong.get_state, "authentication", "authentication failed"),
        (lambda: reader.set_state(b"s"), "permission", "permission denied"),
    ]
    guard = OutageGuard(etcd_server.endpoint, 30.0, structlog.get_logger("test"))
    for call, kind, answer in cases:
        calls = []

        def counted(call=call):
            calls.append(1)
            return call()

        with pytest.raises(v3.EtcdRefusedError) as info:
            guard.call("state", counted)
        exc = info.value
        assert calls == [1], f"a {kind} refusal was retried {len(calls)} times"
        assert not is_connection_error(exc) and not isinstance(exc, RendezvousConnectionError)
        assert exc.kind == kind and f"({kind})" in str(exc) and answer in str(exc), str(exc)
        assert v3client.REMEDIES[kind] in str(exc) and "\n" not in str(exc)
    assert guard.down_for is None and guard.outages == 0  # no outage was ever recorded

    params = SimpleNamespace(
        endpoint=etcd_server.endpoint,
        run_id="job",
        config={"user": "root", "password_file": str(tmp_path / "wrong")},
    )
    with pytest.raises(RendezvousConfigError) as start:
        v3.create_backend(params)
    line = str(start.value)
    assert line.startswith("elastic_emb rendezvous: inner=etcd-v3: etcd refused") and "\n" not in line
    assert "(authentication)" in line and "password_file" in line, line


@pytest.mark.slow
def test_torchrun_stops_on_an_etcd_refusal_in_one_line_naming_it_not_as_an_outage(etcd_server, tmp_path):
    # etcd with authentication on and a wrong password: before, the refusal was retried as an
    # outage for store_outage_timeout and reported as "unreachable"
    from tests.test_bad_input import _torchrun_refusal

    _enable_auth_with_a_reader(etcd_server.url)
    (tmp_path / "password").write_text("wrong\n")
    conf = f"inner=etcd-v3,user=root,password_file={tmp_path / 'password'}"
    last = _torchrun_refusal(conf, "job", etcd_server.endpoint, tmp_path)
    assert last.startswith("elastic_emb rendezvous: inner=etcd-v3: etcd refused"), last
    assert "(authentication)" in last and "authentication failed" in last and "unreachable" not in last, last


@pytest.mark.slow
def test_tls_with_client_certificates(tmp_path):
    """etcd serving HTTPS and requiring a client certificate: the --rdzv-conf keys protocol,
    ca_cert, ssl_cert and ssl_cert_key reach it; without the client certificate every call fails
    with EtcdV3ConnectionError naming the TLS error, and without the CA the server is not trusted."""
    require_etcd()
    import shutil
    import subprocess

    from elastic_emb.testing.etcd import EtcdServer, TLSFiles

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (it makes the test's self-signed certificate)")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    tls = TLSFiles(cert=cert, key=key, ca=cert)  # self-signed: its own CA, and the client's certificate too
    with EtcdServer(tmp_path / "etcd", tls=tls) as server:
        assert server.url.startswith("https://")
        conf = {"protocol": "https", "ca_cert": str(cert), "ssl_cert": str(cert), "ssl_cert_key": str(key)}
        backend, store = _backend(server, run_id="tls", **conf)
        assert backend.set_state(b"over tls")[2] and backend.get_state()[0] == b"over tls"
        store.set("k", b"v")
        assert store.get("k") == b"v"
        no_client_cert = v3client.ClientOptions(protocol="https", ca_cert=str(cert), read_timeout=5)
        with pytest.raises(v3client.EtcdV3ConnectionError, match=server.url):
            v3client.EtcdV3Client.from_endpoint(server.endpoint, no_client_cert).get("k")
        untrusted = v3client.ClientOptions(protocol="https", ssl_cert=str(cert), ssl_cert_key=str(key), read_timeout=5)
        with pytest.raises(v3client.EtcdV3ConnectionError, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
            v3client.EtcdV3Client.from_endpoint(server.endpoint, untrusted).get("k")


def test_conf_keys_and_endpoints_are_validated():
    from elastic_emb.rdzv.conf import INNER_BACKENDS, ListenerConfig

    # The backend registry (which imports no torch) lists the same keys this module reads.
    assert INNER_BACKENDS["etcd-v3"].conf_keys == v3client.CONF_KEYS
    ListenerConfig.from_params({"inner": "etcd-v3", "user": "u", "password_file": "/p", "ttl": "60"})
    with pytest.raises(ValueError, match="password_file"):
        ListenerConfig.from_params({"inner": "c10d", "password_file": "/p"})
    assert v3client.parse_endpoints("a:1,b:2, c") == ["http://a:1", "http://b:2", "http://c:2379"]
    assert v3client.parse_endpoints("[::1]:23", "https") == ["https://[::1]:23"]
    for bad in ("", "a:b", "a:1:2", "a:70000"):
        with pytest.raises(ValueError, match="HOST:PORT|names no member"):
            v3client.parse_endpoints(bad)
    with pytest.raises(ValueError, match="protocol"):
        v3client.ClientOptions.from_conf({"protocol": "ftp"})
    with pytest.raises(ValueError, match="user and password_file together"):
        v3client.ClientOptions.from_conf({"user": "root"})
    with pytest.raises(ValueError, match="ssl_cert_key"):
        v3client.ClientOptions.from_conf({"ssl_cert_key": "/k.pem"})
    with pytest.raises(ValueError, match="cannot be loaded"):
        v3client.EtcdV3Client(["https://x:1"], v3client.ClientOptions(protocol="https", ca_cert="/nonexistent/ca.pem"))
    opts = v3client.ClientOptions.from_conf({"read_timeout": "3", "protocol": "HTTPS", "join_timeout": "9"})
    assert (opts.read_timeout, opts.protocol) == (3.0, "https")
    # The agent hands its options to the workers; PET_RDZV_CONF is the preStop hook's fallback.
    assert v3client.ClientOptions.from_env({v3client.ENV_OPTIONS: opts.to_env()}) == opts
    assert v3client.ClientOptions.from_env({"PET_RDZV_CONF": "inner=etcd-v3,read_timeout=7"}).read_timeout == 7.0
    with pytest.raises(ValueError, match=v3client.ENV_OPTIONS):
        v3client.ClientOptions.from_env({v3client.ENV_OPTIONS: "{not json"})


@pytest.mark.slow
def test_calls_keep_one_connection_and_reconnect_after_a_member_restart(etcd_server):
    """A client reuses its connection across calls (one per concurrent caller, at most MAX_IDLE
    idle); after the member restarted (SIGKILL, start again on the same port) the next call opens
    a fresh connection instead of failing on the dead one."""
    client = v3client.EtcdV3Client.from_endpoint(etcd_server.endpoint)
    url = client.endpoints[0]
    client.put("k", b"v")
    (conn,) = client._idle[url]
    first = conn.sock.getsockname()
    for _ in range(20):
        assert client.get("k").value == b"v"
    assert [c.sock.getsockname() for c in client._idle[url]] == [first]  # the same TCP connection, 21 calls
    barrier = threading.Barrier(8)

    def calls():
        barrier.wait(10)
        for _ in range(5):
            client.get("k")

    threads = [threading.Thread(target=calls) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert 1 <= len(client._idle[url]) <= v3client.MAX_IDLE
    etcd_server.kill()
    etcd_server.start()
    assert client.get("k").value == b"v"  # the idle connections were dead: seen, replaced
    assert [c.sock.getsockname() for c in client._idle[url]] != [first]


def _one_shot_http_server(replies: int):
    """A loopback HTTP server that answers the first request of each connection (keep-alive) and
    closes the connection on the next one without a reply: a member closing an idle connection
    just as the client reuses it. Returns (url, connections accepted, stop)."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    accepted: list[int] = []
    stop = threading.Event()
    body = json.dumps({"header": {"revision": "1"}, "kvs": []}).encode()

    def serve():
        deadline = time.monotonic() + 30
        while not stop.is_set() and time.monotonic() < deadline and len(accepted) < replies:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            accepted.append(1)
            with conn:
                try:
                    conn.settimeout(5)
                    data = conn.recv(65536)
                    while data and b"\r\n\r\n" not in data:  # bounded by the 5 s socket timeout
                        data += conn.recv(65536)
                    head, _, rest = data.partition(b"\r\n\r\n")
                    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                    while len(rest) < length:  # the whole request read: the next recv is the next request
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        rest += chunk
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                        + str(len(body)).encode()
                        + b"\r\n\r\n"
                        + body
                    )
                    conn.recv(65536)  # the next request on this connection: closed unanswered
                except OSError:
                    pass
        listener.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}", accepted, stop


@pytest.mark.slow
def test_a_kept_connection_closed_unanswered_is_retried_once_on_a_fresh_one():
    url, accepted, stop = _one_shot_http_server(replies=3)
    try:
        client = v3client.EtcdV3Client([url], v3client.ClientOptions(read_timeout=5))
        assert client.get("a") is None and len(accepted) == 1
        assert client.get("b") is None and len(accepted) == 2  # the kept one failed unanswered: a new one served it
    finally:
        stop.set()


@pytest.mark.slow
def test_a_member_that_never_replies_fails_within_read_timeout():
    import socket

    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (backlog), never answers
        client = v3client.EtcdV3Client(
            [f"http://127.0.0.1:{silent.getsockname()[1]}"], v3client.ClientOptions(read_timeout=0.5)
        )
        start = time.monotonic()
        with pytest.raises(v3client.EtcdV3ConnectionError, match="timed out"):
            client.get("k")
        assert time.monotonic() - start < 5.0


@pytest.mark.slow
def test_the_in_process_world_store_takes_a_multi_member_endpoint(etcd_server):
    """The generations formed in process (resize.py) get their store from the watcher's reader:
    over etcd-v3 it is a v3 client of every listed member (python-etcd, used before, could not parse
    'a:1,b:2' and every in-process join of the store-member-loss drill fell back to restart).
    The first member listed is down here: the client goes on to the next one."""
    from elastic_emb.testing.ports import free_port
    from elastic_emb.watch.watcher import RendezvousReader

    reader = RendezvousReader("etcd-v3", f"127.0.0.1:{free_port()},{etcd_server.endpoint}", "multi")
    store = reader.world_store(5.0)
    assert isinstance(store, v3.EtcdV3Store)
    store.set("gen1/key", "value")
    assert store.get("gen1/key") == b"value" and store.add("gen1/count", 2) == 2
    assert store.compare_set("gen1/mark", "", "1") == b"1"  # agreements raise the mark with compare_set
    assert store.compare_set("gen1/mark", "1", "2") == b"2"
