"""In-process resizes: the surviving workers re-form without a restart.

- :mod:`~elastic_emb.inprocess.resize`: one resize, detect -> drain -> rebuild -> reshard;
- :mod:`~elastic_emb.inprocess.joiners`: admitting new workers into a running generation;
- :mod:`~elastic_emb.inprocess.interruptible`: a store whose waits a resize can interrupt;
- :mod:`~elastic_emb.inprocess.rollcall`: who of the old generation is still alive.
"""
