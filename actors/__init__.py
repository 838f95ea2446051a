"""Ray actor classes: the per-rank worker actor and the executor that groups ranks into a replica.

This package imports Ray; `phyai_ray` reaches it only when a local or cluster engine is built.
"""
