"""What ONE rank does, whoever hosts it (the caller's thread, a torchrun process, a Ray actor).

    runner.py   RankRunner: the plugin's per-rank model, its step and public methods run with the
                rank's named groups active; init_distributed forms the replica's world
    control.py  RankControl: the control lane of a rank (pause, sleep, wake, reset, weight updates)
    loading.py  WeightLoader: a weight update checked against the model, then loaded bucket by bucket
    receive.py  the bucket format and how a rank receives buckets (object store, gloo / nccl, CUDA IPC)

A trainer's side of a weight update (planning and sending buckets, `WeightSender`, `EngineActor`)
is in `phyai_ray.rl`; nothing here imports it.
"""
