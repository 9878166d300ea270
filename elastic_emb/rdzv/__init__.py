"""The rendezvous side of elastic_emb: torchrun's ``elastic_emb`` backend and its wire contract.

- ``keys``: environment names and store keys shared by the agent and the workers (with
  ``decode``, ``outage`` and ``signing``, all the worker side imports from this package);
- ``decode``: the restricted decoder of torch's rendezvous state and the one plain view of it;
- ``outage``: the store-outage tracker both sides use, and the agent's retrying guard;
- ``signing``: HMAC signatures on the control keys when the job has a secret (both sides);
- ``conf``: the backend's ``--rdzv-conf`` keys and the registry of inner backends;
- ``guarded``: the agent's store wrappers (outage guard, state validation before torch unpickles);
- ``liveness``: the agent's judgement of the running round's members (restarting, departed, dead);
- ``torch_compat``: every private torch name the backend touches, checked at import;
- ``handler``: the backend itself (the ``torchrun.handlers`` entry point).

Importing the package imports nothing: torch imports the entry point while importing its own
rendezvous package.
"""
