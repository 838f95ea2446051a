"""External engines opened one after another in the same torchrun processes reuse the launcher's world."""

import pytest

from tests.scripts.launch import describe, torchrun

pytestmark = pytest.mark.torchrun


def test_four_sequential_external_engines_in_one_torchrun_job(tmp_path):
    proc = torchrun("tests.scripts.reopen_external", [str(tmp_path)], nproc=2, timeout_s=120)
    assert proc.returncode == 0, describe(proc)
    for rank in (0, 1):
        lines = (tmp_path / f"rank{rank}.txt").read_text().splitlines()
        assert lines == [f"engine {i} {rank} True" for i in range(4)], describe(proc)
