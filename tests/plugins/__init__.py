"""Small plugins the tests serve: `tests.plugins.tiny` (row-parallel TP and inline probes)."""
