"""The rendezvous side of elastic_emb: torchrun's ``elastic_emb`` backend and its wire contract.

Shared with the workers: ``keys`` (environment and store key names), ``decode`` (the restricted
decoder of torch's state), ``signing``, ``outage``, ``drain_acks`` and ``reader``. Agent side:
``handler`` (the ``torchrun.handlers`` entry point) and the modules it is built from.
Importing the package imports nothing: torch imports the entry point while importing its own
rendezvous package.

Design: ``docs/RDZV.md``.
"""
