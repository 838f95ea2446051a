"""Serve diffusers pipeline folders (Wan) one denoising step per iteration; see `entry.py` for usage."""

from phyai_ray.models.diffusers_pipeline.entry import DiffusersPipelineEntry

__all__ = ["DiffusersPipelineEntry"]
