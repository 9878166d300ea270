"""etcd-v3 calls per second of elastic_emb's client, against a real etcd on loopback.

Three transports of the same ``EtcdV3Client`` (elastic_emb/rdzv/etcd_v3.py), measured in one run
against one etcd (Debian's etcd-server, started here on free loopback ports):

- ``kept``: the client as shipped, one kept-alive HTTP/1.1 connection reused across calls;
- ``fresh``: the same code with no idle connection kept (``MAX_IDLE = 0``): a TCP connect per call;
- ``urllib``: one ``urllib.request.urlopen`` per call, the transport before connections were kept
  (the baseline).

Per transport, three operations a rendezvous does: ``get`` (one range), ``check`` (a transaction
of two ranges: what a watcher polls), ``add`` (``EtcdV3Store.add``: a range and a
compare-and-swap). Reported: calls per second, the median of ``--runs`` runs of ``--calls``
calls each, runs of the transports interleaved; and each transport's ratio to ``urllib``.
``--tls``: etcd serves HTTPS with a self-signed certificate (made here with ``openssl``) and
requires it as the client certificate too, as a cluster's etcd does: every new connection then
costs a TLS handshake.

    python bench/etcd_calls.py --runs 5 --calls 300 --out out/etcd_calls.json
    python bench/etcd_calls.py --runs 5 --calls 300 --tls --out out/etcd_calls_tls.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from elastic_emb.rdzv import etcd_v3 as v3
from elastic_emb.testing.etcd import EtcdServer, TLSFiles, etcd_binary

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, as a script or as -m bench.*
from _report import write_json  # noqa: E402


class UrllibClient(v3.EtcdV3Client):
    """The baseline: every call a new connection through urllib."""

    def _post(self, url: str, target: str, data: bytes, headers: Mapping[str, str]) -> bytes:
        req = urllib.request.Request(url + target, data=data, headers=dict(headers), method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.options.read_timeout, context=self._ssl) as r:  # noqa: S310
                return r.read()
        except urllib.error.HTTPError as exc:
            return exc.read() or b"{}"
        except OSError as exc:
            raise v3._MemberDown(f"{type(exc).__name__}: {exc}") from None


class FreshClient(v3.EtcdV3Client):
    """The shipped transport with no idle connection kept: a connect per call."""

    def _checkin(self, url, conn) -> None:
        conn.close()


TRANSPORTS = {"kept": v3.EtcdV3Client, "fresh": FreshClient, "urllib": UrllibClient}


def rate(store: v3.EtcdV3Store, op: str, calls: int, tag: str) -> float:
    if op == "get":
        store.set(f"{tag}/g", b"v")
        fn = lambda i: store.client.get(store._key(f"{tag}/g"))  # noqa: E731
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
        raise SystemExit("etcd is not installed (Debian package etcd-server)")
    samples: dict[str, dict[str, list[float]]] = {t: {op: [] for op in ("get", "check", "add")} for t in TRANSPORTS}
    with tempfile.TemporaryDirectory() as tmp:
        tls, options = None, v3.ClientOptions()
        if args.tls:
            cert, key = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
            subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                            "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                           check=True, capture_output=True, timeout=60)
            tls = TLSFiles(cert=Path(cert), key=Path(key), ca=Path(cert))
            options = v3.ClientOptions(protocol="https", ca_cert=cert, ssl_cert=cert, ssl_cert_key=key)
        with EtcdServer(os.path.join(tmp, "etcd"), tls=tls) as server:
            stores = {t: v3.EtcdV3Store(cls.from_endpoint(server.endpoint, options), prefix=f"/bench/{t}/")
                      for t, cls in TRANSPORTS.items()}
            for run in range(args.runs):
                for op in ("get", "check", "add"):
                    for t, store in stores.items():  # interleaved: load on the machine hits all alike
                        samples[t][op].append(rate(store, op, args.calls, f"{op}{run}"))
    version = subprocess.run([etcd_binary(), "--version"], capture_output=True, text=True, timeout=10).stdout.split("\n")[0]
    medians = {t: {op: statistics.median(v) for op, v in ops.items()} for t, ops in samples.items()}
    ratios = {t: {op: medians[t][op] / medians["urllib"][op] for op in ops} for t, ops in medians.items()}
    print(f"{'transport':>9} {'op':>6} {'calls/s':>9} {'vs urllib':>9}")
    for t in TRANSPORTS:
        for op in ("get", "check", "add"):
            print(f"{t:>9} {op:>6} {medians[t][op]:9.0f} {ratios[t][op]:8.2f}x")
    print(f"(medians of {args.runs} runs x {args.calls} calls; one etcd on loopback{' over TLS' if args.tls else ''}; "
          f"add = range + compare-and-swap)")
    if args.out:
        write_json(args.out, "etcd_calls", {"runs": args.runs, "calls": args.calls, "tls": args.tls, "samples": samples,
                                            "medians": medians, "ratios_to_urllib": ratios}, extra={"etcd": version})


if __name__ == "__main__":
    main()
