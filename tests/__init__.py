"""elastic_emb's test suite (a package, so tests import their helpers as ``tests.helpers``)."""
