"""Scripts the tests launch under torchrun (`torchrun --nproc_per_node=2 -m tests.scripts.<name>`)."""
