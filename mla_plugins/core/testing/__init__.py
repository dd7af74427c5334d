"""Test helpers shipped with the package, for our tests and the adapters' (no framework imports)."""
