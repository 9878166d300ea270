"""What the tests share, importable as ``tests.helpers`` (no ``sys.path`` edits):

* ``agents``: real torchrun agents on loopback (``python -m torch.distributed.run``) and their logs;
* workers run in those processes: ``rdzv_worker`` (the torchrun worker of the rendezvous tests and
  bench/resize.py), ``lifecycle_worker``, ``ep8_worker``, ``context_worker``, ``cma_worker``, ``adapters_worker``;
* ``etcd_fixture`` (a real etcd per test) and ``deploy_rules`` (the deploy/ checks);
* ``drill_report``: a restart-mode drill's report with the extra rounds of late nodes folded in.

Ports and per-rank processes come from :mod:`elastic_emb.testing.ports` and
:mod:`elastic_emb.testing.procs`, shared with bench/ and the drills. Child processes import these
modules with the repository root on ``PYTHONPATH`` (``procs.torchrun_env`` sets it).
"""
