"""``python -m elastic_emb.drill --scenario NAME|FILE --out DIR``: the same as ``elastic-emb drill``."""

from elastic_emb.cli import drill_cmd

if __name__ == "__main__":
    drill_cmd(prog_name="python -m elastic_emb.drill")
