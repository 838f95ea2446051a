"""The stepwise room: what value-sequence plugins share (denoising and flow-matching loops, robot frames).

    sequence.py    Sequence (one request: its value, steps taken of its steps, progress) and Running
                   (the sequences on a rank, batched per step: admit, one step of all, finished ones out)
    schedulers.py  per-request scheduler state: own_scheduler (a copy per request), ScheduledSequence,
                   Cohort (requests that joined together share one scheduler over their rows)
    rtc.py         real-time chunking, one meaning for every policy: RTCRule, prefix_weights, Guidance
    frames.py      the one robot frame format (parse and check, openpi's names): FrameLayout,
                   RobotFrame, parse_frame, openpi_aliases
    fields.py      the field checks frames.py is built from (numbers, ints in range, camera images)
    policy.py      PolicyConfig and policy_args (a policy's checked plugin_args), StepsInBatches

Used by `diffusers_pipeline`, `lerobot_policy`, `reference_flow_policy` and `reference_policy`; it
imports no plugin. The layers those plugins build from are in `phyai_ray.nn`.
"""
