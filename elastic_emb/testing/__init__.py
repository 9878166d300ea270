"""Helpers for tests and drills of elastic_emb and of contexts built on it (not used by the library
at run time)."""
