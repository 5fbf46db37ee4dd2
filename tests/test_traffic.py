"""kiln traffic reproduces the worked numbers for d = 4096, bf16 (Llama-3-8B)."""

import subprocess
import sys

import pytest

from kiln.models.presets import PRESETS
from kiln.tools.traffic import traffic


def test_worked_numbers():
    r = traffic(PRESETS["llama-3-8b"], 2)
    assert r.fused_per_call == 40_960
    assert r.reference_per_call == 253_976
    assert r.ratio == pytest.approx(6.2, abs=0.05)
    assert r.sites == 64
    assert r.extra_per_token / 1e6 == pytest.approx(13.63, abs=0.005)
    assert r.weight_bytes / 1e9 == pytest.approx(15.0, abs=0.02)
    assert r.extra_share(256) == pytest.approx(0.23, abs=0.005)
    assert r.weight_floor_ms(3.35) == pytest.approx(4.48, abs=0.005)
    assert r.tokens_for_share(r.extra_share(256)) == pytest.approx(256)


def test_cli_says_it_is_a_model():
    out = subprocess.run([sys.executable, "-m", "kiln.cli", "traffic", "--tokens", "256"],
                         capture_output=True, text=True, check=True).stdout
    assert "MODEL" in out and "not a measurement" in out
    assert "40,960" in out and "253,976" in out and "13.63 MB" in out and "4.48 ms" in out
    assert "23.3%" in out
