"""torch's etcd-v2 ``EtcdStore`` with the one operation it lacks: ``compare_set``.

:class:`CasEtcdStore` is the store of the generations the survivors form in process with
``--rdzv-conf inner=etcd-v2,resize=in_process``, whose agreements need ``compare_set``
(torch's ``EtcdStore`` raises "Not implemented" for it). It uses etcd v2's guarded writes
(``prevExist=false``, ``prevValue``) and ``EtcdStore``'s encoding of keys and values.

Design: ``docs/RDZV.md`` (section "``compare_set`` on etcd-v2").
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore


class CasEtcdStore(EtcdStore):
    """``EtcdStore`` plus ``compare_set`` with ``TCPStore``'s semantics: set ``desired`` when the
    key holds ``expected`` (or is missing and ``expected`` is empty) and return the value the key
    holds afterwards; a missing key with a non-empty ``expected`` is left missing and
    ``expected`` is returned."""

    def compare_set(self, key, expected_value, desired_value) -> bytes:
        """Set ``key`` to ``desired_value`` if it holds ``expected_value`` (empty: if it is missing).

        Args:
            key: the store key (encoded as ``EtcdStore`` encodes keys).
            expected_value: the value the key must hold; ``b""`` or ``""`` for a missing key.
            desired_value: the value to write.

        Returns:
            The value the key holds afterwards: ``desired_value`` when written, the current value
            when another writer got there first, ``expected_value`` when the key is missing and
            ``expected_value`` is not empty.
        """
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
