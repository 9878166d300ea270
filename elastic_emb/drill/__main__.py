"""``python -m elastic_emb.drill --scenario NAME|FILE [--out DIR]``: the same as ``elastic-emb drill``."""

from elastic_emb.cli.console import run_command
from elastic_emb.drill.command import drill_cmd

if __name__ == "__main__":
    run_command(drill_cmd, prog_name="python -m elastic_emb.drill")
