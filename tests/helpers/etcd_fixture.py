"""pytest fixture ``etcd_server``: a real etcd (Debian's etcd-server) on free loopback ports.

Started in the test's temp dir with :class:`elastic_emb.testing.etcd.EtcdServer` (v2 API on, the
/health wait bounded by 20 s), stopped at teardown (SIGTERM, SIGKILL after 5 s), and checked to
be gone. When etcd is not installed the test is skipped with that reason, except in CI (``CI``
set), where .ci/run installs etcd-server and its absence is a failure.

(Named etcd_fixture.py, not etcd.py: a worker run as a script from tests/helpers/ has that
directory on its path, where an etcd.py would shadow python-etcd's ``etcd`` package, which
torch's etcd-v2 rendezvous imports.)

Use: ``from tests.helpers.etcd_fixture import etcd_server  # noqa: F401`` in a test module.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from elastic_emb.testing.etcd import EtcdServer, etcd_binary

CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_etcd() -> None:
    if etcd_binary() is None:
        if CI:
            pytest.fail("etcd is not installed in CI: .ci/apt-packages lists etcd-server, which .ci/run installs")
        pytest.skip("etcd is not installed here (Debian package etcd-server); CI installs it")
    try:
        import etcd  # noqa: F401  python-etcd, for torch's etcd-v2 rendezvous
    except ImportError:
        pytest.fail("python-etcd is not installed: pip install -e '.[etcd-v2]' (make venv installs it)")


@pytest.fixture
def etcd_server(tmp_path) -> Iterator[EtcdServer]:
    require_etcd()
    server = EtcdServer(tmp_path / "etcd", start_timeout=20.0)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        assert not server.running, f"etcd (pid {server.proc.pid}) outlived the test"
