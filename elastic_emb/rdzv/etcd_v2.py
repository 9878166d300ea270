"""torch's etcd-v2 ``EtcdStore`` with the one operation it lacks: ``compare_set``.

With ``--rdzv-conf inner=etcd-v2,resize=in_process`` the generations the survivors form in
process keep their store keys in etcd (the rendezvous store outlives every node; see
``resize.py``). Every generation's agreement raises the run's generation mark with
``compare_set`` (``topology.py``), which torch's ``EtcdStore`` does not implement (its base
class raises "Not implemented" from C++). etcd v2 has the atomic primitive: a write guarded by
``prevExist=false`` (create) or ``prevValue`` (swap). Keys and values are encoded the way
``EtcdStore`` encodes them, so ``get``/``wait`` on the same store see what ``compare_set`` wrote.
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore


class CasEtcdStore(EtcdStore):
    """``EtcdStore`` plus ``compare_set`` with ``TCPStore``'s semantics: set ``desired`` when the
    key holds ``expected`` (or is missing and ``expected`` is empty) and return the value the key
    holds afterwards; a missing key with a non-empty ``expected`` is left missing and
    ``expected`` is returned."""

    def compare_set(self, key, expected_value, desired_value) -> bytes:
        import etcd  # python-etcd, present wherever EtcdStore can be built

        path = self.prefix + self._encode(key)
        expected, desired = self._to_bytes(expected_value), self._to_bytes(desired_value)
        try:
            if expected == b"":
                self.client.write(key=path, value=self._encode(desired), prevExist=False)
            else:
                self.client.write(key=path, value=self._encode(desired), prevValue=self._encode(expected))
            return desired
        except etcd.EtcdAlreadyExist:
            pass  # another writer created it first: report what it holds
        except etcd.EtcdCompareFailed:
            pass  # it holds something else: report that
        except etcd.EtcdKeyNotFound:
            return expected
        return self._decode(self.client.get(key=path).value)

    @staticmethod
    def _to_bytes(value) -> bytes:
        return value if isinstance(value, bytes) else str(value).encode()
