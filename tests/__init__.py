"""Test suite of phyai-ray; a package so that test plugins import as `tests.plugins.tiny`."""
