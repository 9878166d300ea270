"""Former home of the test etcd launcher; it now lives in :mod:`elastic_emb.testing.etcd` (test
tooling, not the library). Kept so old imports keep working."""

from elastic_emb.testing.etcd import (  # noqa: F401
    ETCD_BINARY_ENV,
    EtcdCluster,
    EtcdServer,
    EtcdUnavailable,
    command,
    etcd_binary,
    health,
    wait_healthy,
)
