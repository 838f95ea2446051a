"""Real-time chunking for a batch in one set of ops (`GuidanceBatch`) equals each frame's own guidance.

Run: `.venv/bin/python -m pytest tests/test_rtc_batch.py -q` (no Ray).

The policies' hot loop guides every robot of an expert step at once; here rows with and without
guidance, different delays, horizons and times (t = 1 and t = 0 included, where the gain's
formula divides by zero), for both rules, against `Guidance.velocity` row by row.
"""

from __future__ import annotations

import pytest
import torch

from phyai_ray.stepwise.rtc import Guidance, GuidanceBatch, RTCRule
from tests.tolerances import reordered

RULES = [RTCRule.lerobot({"prefix_attention_schedule": "EXP"}), RTCRule(max_guidance_weight=None)]


@pytest.mark.parametrize("rule", RULES)
def test_a_batch_is_guided_as_each_row_alone(rule):
    gen = torch.Generator().manual_seed(0)
    chunk, dim = 12, 5
    specs = [(8, 2, 6), None, (12, 0, None), (3, 3, 4), None]
    guides = [None if s is None else Guidance.build(rule, torch.randn(s[0], dim, generator=gen), s[1], s[2], chunk, dim)
              for s in specs]
    x = torch.randn(len(specs), chunk, dim, generator=gen)
    v = torch.randn(len(specs), chunk, dim, generator=gen)
    pulled = rule.max_guidance_weight is None  # divides by remaining: never 0 there
    remaining = torch.tensor([1.0, 0.5, 0.3, 0.9, 0.1] if pulled else [1.0, 0.5, 0.0, 0.7, 1.0])
    got = GuidanceBatch(guides).velocity(x, v, remaining)
    for row, guide in enumerate(guides):
        want = v[row] if guide is None else guide.velocity(x[row], v[row], float(remaining[row]))
        torch.testing.assert_close(got[row], want, **reordered(torch.float32, terms=dim, like=want))  # a row of a batch


def test_no_guided_row_is_v_itself_and_one_rule_per_batch():
    v = torch.randn(2, 4, 3)
    assert GuidanceBatch([None, None]).velocity(v, v, torch.ones(2)) is v
    guides = [Guidance.build(rule, torch.zeros(2, 3), 0, None, 4, 3) for rule in RULES]
    with pytest.raises(ValueError, match="one RTCRule"):
        GuidanceBatch(guides)
