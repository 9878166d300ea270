"""Data positions that survive resizes: :class:`~elastic_emb.data.sampler.ElasticSampler`."""

from elastic_emb.data.sampler import ElasticSampler

__all__ = ["ElasticSampler"]
