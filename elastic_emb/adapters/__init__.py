"""Contexts over other frameworks' sharded embeddings, so the lifecycle can make them elastic.

:mod:`elastic_emb.adapters.torchrec`: a TorchRec ``DistributedModelParallel`` (optional extra
``elastic-emb[torchrec]``). Each adapter implements :class:`elastic_emb.protocol.ShardedContext`
and passes :mod:`elastic_emb.testing.conformance`.
"""
