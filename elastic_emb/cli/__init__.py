"""The ``elastic-emb`` command: demo, drills, state inspection and the preStop drain client.

- :mod:`~elastic_emb.cli.main`: the commands;
- :mod:`~elastic_emb.cli.console`: terminal output (tables, progress);
- :mod:`~elastic_emb.cli.drain`: the drain request a Kubernetes preStop hook sends.
"""
