"""kiln.ops.triton.dependent_launch: which launches wait for their predecessor (the GPU side is
checked in test_triton_kernels' sm_90 compile test and timed by `gpu_suite.sh pdl`)."""

import pytest
import torch

from kiln.ops.triton import dependent_launch


@pytest.fixture
def fresh(monkeypatch):
    dependent_launch._launch_args.cache_clear()
    yield monkeypatch
    dependent_launch._launch_args.cache_clear()


@pytest.mark.parametrize("value", ["0", "1", "2"])
def test_off_wherever_there_is_no_sm90(value, fresh):
    fresh.setenv("KILN_PDL", value)
    cpu = torch.device("cpu")
    assert dependent_launch.pdl_args(cpu) == {"PDL": 0, "launch_pdl": False}
    assert dependent_launch.gemv_pdl_args(cpu) == {"PDL": 0, "launch_pdl": False}


def test_a_bad_setting_is_refused_naming_the_choices(fresh):
    fresh.setenv("KILN_PDL", "yes")
    with pytest.raises(ValueError, match=r"KILN_PDL must be 0 \(off\), 1 .* got 'yes'"):
        dependent_launch.pdl_args(torch.device("cpu"))


def test_only_the_gemv_loads_before_the_wait(fresh):
    fresh.setenv("KILN_PDL", "2")
    fresh.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    gpu = torch.device("cuda", 0)
    assert dependent_launch.gemv_pdl_args(gpu) == {"PDL": 2, "launch_pdl": True}
    assert dependent_launch.pdl_args(gpu) == {"PDL": 1, "launch_pdl": True}
    fresh.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    dependent_launch._launch_args.cache_clear()
    assert dependent_launch.pdl_args(gpu) == {"PDL": 0, "launch_pdl": False}
