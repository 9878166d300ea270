"""The worker side of one elastic job: start, commit, re-form.

- :mod:`~elastic_emb.lifecycle.manager`: :class:`Lifecycle`, what a training loop drives;
- :mod:`~elastic_emb.lifecycle.records`: its validated records (config, resize events, reports);
- :mod:`~elastic_emb.lifecycle.committer`: commits of the tables to the snapshot tier;
- :mod:`~elastic_emb.lifecycle.first_base`: the first full copy of a generation;
- :mod:`~elastic_emb.lifecycle.default_group`: the default process group per generation.

Users import the public names from :mod:`elastic_emb`.
"""
