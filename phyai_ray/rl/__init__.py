"""RL loops: rollout replicas a trainer drives (states, sleep / wake, weight sync, `EngineActor`).

    trainer                                       rollout replicas (Engine or EngineActor)
    sender = WeightSender("gloo")
    sender.init_transfer(engine)        ------->  init_weight_transfer: ranks join a transfer group
    sender.update(engine, model.named_parameters(), version=3)
        start_weight_update(3)          ------->  UPDATING: dispatch stops, ranks drain
        update_weights(...) + send      ------->  every rank receives the buckets and loads them
        finish_weight_update()          ------->  caches reset, version 3 published, state restored
"""
