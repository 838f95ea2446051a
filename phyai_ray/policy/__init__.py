"""What robot-policy plugins share (`reference_policy`, `reference_flow_policy`): sizes and checks.

    config.py   PolicyConfig (state, action and model sizes, the seed) and policy_args, the checked
                parse of a policy's plugin_args that subclasses reuse with their own fields
    frames.py   check_observation (one robot frame: `state`, optional `step`, known keys only) and
                StepsInBatches (a single-frame `step` run as a batch of one)

The layers such a policy is built from are in `phyai_ray.nn`.
"""
