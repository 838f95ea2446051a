"""HTTP serving edge: the tensor JSON codec and (later) the Ray Serve app."""
