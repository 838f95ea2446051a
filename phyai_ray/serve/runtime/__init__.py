"""Where the Serve application runs: the app builder, its deployments, and what each group holds.

    app.py        build_app / create_app / group_handle: the bound application (two deployments)
    group.py      ReplicaGroup: the ingress deployment; one Serve replica is one replica group
    registry.py   GroupRegistry: every group's last report, failures, request totals
    runner.py     GroupRunner: a group's requests in and out (forwarding what a failed group never started)
    holder.py     EngineHolder: the group's engine, its health verdict, in-place restarts
    router.py     FewestInFlightRouter: Serve's request router, the group with the fewest in flight
    direct.py     a group's own port under Serve's direct ingress
    server.py     run_server / Server: Ray and Serve started for `phyai-ray serve`
    options.py    ServeOptions: the app's own settings (keys, limits, protocols) beside the engine's
    metrics.py    EdgeMetrics: Prometheus series of every group

What the application speaks (HTTP JSON, OpenAI, OIP, openpi) lives in `phyai_ray.serve.protocols`;
`group.py` mounts it. Ray Serve pickles `ReplicaGroup` and `GroupRegistry` by reference: a worker
imports them from this package.
"""
