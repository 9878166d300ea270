"""etcd-v3 calls per second of elastic_emb's client, against a real etcd on loopback.

Three transports of the same ``EtcdV3Client`` (elastic_emb/rdzv/etcd_v3_client.py), measured in one run
against one etcd (Debian's etcd-server, started here on free loopback ports):

- ``kept``: the client as shipped, one kept-alive HTTP/1.1 connection reused across calls;
- ``fresh``: the client's calls over a new ``http.client`` connection per call: a TCP connect per call;
- ``urllib``: the client's calls over one ``urllib.request.urlopen`` per call, the transport before
  connections were kept (the baseline).

The baselines are the shipped client with its public ``call`` overridden (the same request bodies,
built by its ``get``, ``get_many`` and ``put_if``), so only the transport differs.

Per transport, three operations a rendezvous does: ``get`` (one range), ``check`` (a transaction
of two ranges: what a watcher polls), ``add`` (``EtcdV3Store.add``: a range and a
compare-and-swap). Reported: calls per second, the median of ``--runs`` runs of ``--calls``
calls each, runs of the transports interleaved; and each transport's ratio to ``urllib``.
``--tls``: etcd serves HTTPS with a self-signed certificate (made here with ``openssl``) and
requires it as the client certificate too, as a cluster's etcd does: every new connection then
costs a TLS handshake.

    python bench/etcd_calls.py --runs 5 --calls 300 --out out/etcd_calls.json
    python bench/etcd_calls.py --runs 5 --calls 300 --tls --out out/etcd_calls_tls.json

Without an etcd binary (Debian package etcd-server) it says so and exits 0, measuring nothing.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from elastic_emb.rdzv.etcd_v3 import EtcdV3Store
from elastic_emb.rdzv.etcd_v3_client import ClientOptions, EtcdV3Client
from elastic_emb.testing.etcd import EtcdServer, TLSFiles, etcd_binary

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, as a script or as -m bench.*
from _report import write_json  # noqa: E402


class PerCallClient(EtcdV3Client):
    """The library's calls (the same JSON bodies, built by its ``get``, ``get_many`` and
    ``put_if``) over a new connection per call, through ``opener``: the baselines."""

    opener = "urllib"

    def __init__(self, endpoints, options: ClientOptions | None = None) -> None:
        super().__init__(endpoints, options)
        o = self.options
        self.tls = None
        if o.protocol == "https":
            self.tls = ssl.create_default_context(cafile=o.ca_cert)
            if o.ssl_cert:
                self.tls.load_cert_chain(o.ssl_cert, o.ssl_cert_key)

    def call(self, path: str, body) -> dict:
        url, data = f"{self.endpoints[0]}/v3/{path}", json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.opener == "urllib":
            req = urllib.request.Request(url, data=data, headers=headers, method="POST")
            try:
                timeout = self.options.read_timeout
                with urllib.request.urlopen(req, timeout=timeout, context=self.tls) as r:  # noqa: S310
                    raw = r.read()
            except urllib.error.HTTPError as exc:
                raw = exc.read() or b"{}"
        else:
            parts = urllib.parse.urlsplit(url)
            conn = (
                http.client.HTTPSConnection(
                    parts.hostname, parts.port, timeout=self.options.read_timeout, context=self.tls
                )
                if parts.scheme == "https"
                else http.client.HTTPConnection(parts.hostname, parts.port, timeout=self.options.read_timeout)
            )
            try:
                conn.request("POST", parts.path, body=data, headers=headers)
                raw = conn.getresponse().read()
            finally:
                conn.close()
        reply = json.loads(raw or b"{}")
        if "error" in reply or ("code" in reply and "header" not in reply):
            raise RuntimeError(f"etcd refused /v3/{path}: {reply}")
        return reply


class UrllibClient(PerCallClient):
    """The baseline: every call a new connection through urllib (the transport before kept connections)."""

    opener = "urllib"


class FreshClient(PerCallClient):
    """Every call a new ``http.client`` connection, closed after the reply: the handshake's cost."""

    opener = "http.client"


TRANSPORTS = {"kept": EtcdV3Client, "fresh": FreshClient, "urllib": UrllibClient}


def rate(store: EtcdV3Store, op: str, calls: int, tag: str) -> float:
    if op == "get":
        store.set(f"{tag}/g", b"v")
        key = store.prefix + f"{tag}/g"  # (the store keeps its keys under its prefix)
        fn = lambda i: store.client.get(key)  # noqa: E731
    elif op == "check":
        store.set(f"{tag}/a", b"1")
        store.set(f"{tag}/b", b"2")
        fn = lambda i: store.check([f"{tag}/a", f"{tag}/b"])  # noqa: E731
    else:
        fn = lambda i: store.add(f"{tag}/n", 1)  # noqa: E731
    t0 = time.perf_counter()
    for i in range(calls):
        fn(i)
    took = time.perf_counter() - t0
    if op == "add" and int(store.get(f"{tag}/n")) != calls:
        raise SystemExit(f"add: counter {tag}/n is {store.get(f'{tag}/n')!r}, expected {calls}")
    return calls / took


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--calls", type=int, default=300, help="calls per run")
    ap.add_argument("--tls", action="store_true", help="etcd over HTTPS with client certificates")
    ap.add_argument("--out", default=None, help="JSON output path")
    args = ap.parse_args(argv)
    if args.runs < 1 or args.calls < 1:
        ap.error(f"--runs={args.runs} and --calls={args.calls} must be >= 1")
    if etcd_binary() is None:
        print("bench/etcd_calls.py: etcd is not installed (Debian package etcd-server); none measured")
        return
    samples: dict[str, dict[str, list[float]]] = {t: {op: [] for op in ("get", "check", "add")} for t in TRANSPORTS}
    with tempfile.TemporaryDirectory() as tmp:
        tls, options = None, ClientOptions()
        if args.tls:
            cert, key = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
            subprocess.run(
                [
                    "openssl",
                    "req",
                    "-x509",
                    "-newkey",
                    "rsa:2048",
                    "-nodes",
                    "-keyout",
                    key,
                    "-out",
                    cert,
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
            tls = TLSFiles(cert=Path(cert), key=Path(key), ca=Path(cert))
            options = ClientOptions(protocol="https", ca_cert=cert, ssl_cert=cert, ssl_cert_key=key)
        with EtcdServer(os.path.join(tmp, "etcd"), tls=tls) as server:
            stores = {
                t: EtcdV3Store(cls.from_endpoint(server.endpoint, options), prefix=f"/bench/{t}/")
                for t, cls in TRANSPORTS.items()
            }
            for run in range(args.runs):
                for op in ("get", "check", "add"):
                    for t, store in stores.items():  # interleaved: load on the machine hits all alike
                        samples[t][op].append(rate(store, op, args.calls, f"{op}{run}"))
    version = subprocess.run([etcd_binary(), "--version"], capture_output=True, text=True, timeout=10).stdout.split(
        "\n"
    )[0]
    medians = {t: {op: statistics.median(v) for op, v in ops.items()} for t, ops in samples.items()}
    ratios = {t: {op: medians[t][op] / medians["urllib"][op] for op in ops} for t, ops in medians.items()}
    print(f"{'transport':>9} {'op':>6} {'calls/s':>9} {'vs urllib':>9}")
    for t in TRANSPORTS:
        for op in ("get", "check", "add"):
            print(f"{t:>9} {op:>6} {medians[t][op]:9.0f} {ratios[t][op]:8.2f}x")
    print(
        f"(medians of {args.runs} runs x {args.calls} calls; one etcd on loopback{' over TLS' if args.tls else ''}; "
        f"add = range + compare-and-swap)"
    )
    if args.out:
        write_json(
            args.out,
            "etcd_calls",
            {
                "runs": args.runs,
                "calls": args.calls,
                "tls": args.tls,
                "samples": samples,
                "medians": medians,
                "ratios_to_urllib": ratios,
            },
            extra={"etcd": version},
        )


if __name__ == "__main__":
    main()
