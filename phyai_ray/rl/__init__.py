"""RL loops: rollout replicas a trainer drives (states, sleep / wake, weight sync, `EngineActor`).

    trainer                                       rollout replicas (Engine or EngineActor)
    sender = WeightSender("gloo")
    sender.init_transfer(engine)        ------->  init_weight_transfer: ranks join a transfer group
    sender.update(engine, model.named_parameters(), version=3)
        start_weight_update(3, lease)   ------->  UPDATING: dispatch stops, ranks drain, the lease starts
        update_weights(...) + send      ------->  every rank checks names / shapes / dtypes, then
                                                  receives and loads the buckets one by one
        finish_weight_update()          ------->  caches reset, version 3 published, state restored

A mismatch refuses the update before any weight changes (`WeightUpdateRefusedError`; the replicas
keep their previous version); a lease that expires returns an untouched replica and fails one
that loaded part of the update (`phyai_ray.executors.updates`, `phyai_ray.rank.loading`).

A list of targets, `sender.update([engine_a, engine_b, actor_c], params, version=v)`, is one
fleet: staged on every rank while v - 1 serves, each rank's digest verified, then switched
together, or rolled back everywhere (`fleet.py`: `FleetReport`, `FleetUpdateError`).

This package is what a trainer holds: `EngineActor` (actor.py), `WeightSender` (sender.py), fleet
updates (fleet.py) and the sending half of a transfer (transfer.py). What a rank runs (its control lane, loading, receiving
buckets) is in `phyai_ray.rank`; nothing below the engine imports this package.
"""
