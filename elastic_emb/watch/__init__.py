"""The worker's view of membership changes.

- :mod:`~elastic_emb.watch.watcher`: :class:`Watcher`, polls the rendezvous for changes;
- :mod:`~elastic_emb.watch.membership`: the membership record a watcher reports;
- :mod:`~elastic_emb.watch.selfstop`: a worker that must stop itself (evicted, left).
"""
