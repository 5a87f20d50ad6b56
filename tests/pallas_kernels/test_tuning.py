"""The tuning table: the tiling rules read the device's numbers, not constants of one GPU."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import pytest

from jaxserve.pallas_kernels import dispatch
from jaxserve.pallas_kernels.ragged_paged_attention import tiling as rt, tuning


@pytest.fixture
def device(monkeypatch):
    """Pretend the first device is a GPU of the given kind and SM count."""
    def use(kind: str, sms: int):
        fake = SimpleNamespace(platform="gpu", device_kind=kind, core_count=sms)
        monkeypatch.setattr(jax, "devices", lambda *a: [fake])
        dispatch.device_info.cache_clear()
    yield use
    dispatch.device_info.cache_clear()


def test_without_a_gpu_the_rules_trace_the_h200s_tilings():
    assert tuning.tuning() == tuning.H200 and dispatch.num_sms() == 132


def test_sm_count_comes_from_the_device(device):
    device("NVIDIA H200", 132)
    assert tuning.tuning() is tuning.H200 or tuning.tuning() == tuning.H200
    device("NVIDIA H100 PCIe", 114)       # not in the table: H200's numbers, its own SM count
    t = tuning.tuning()
    assert t.num_sms == 114 and t.decode_programs_per_sm == tuning.H200.decode_programs_per_sm
    device("NVIDIA H200", 0)              # a device that does not say: the table's count
    assert dispatch.num_sms() == 132


def test_tiling_rules_follow_the_sm_count(device):
    # 16 sequences x 8 kv heads = 128 programs: one wave of one program an SM on 132 SMs, so
    # the pipelined 128-key tiling; on a GPU of 114 SMs the same grid is past one program an
    # SM, where the two-programs-an-SM rule takes 64-key steps.
    device("NVIDIA H200", 132)
    assert rt.pipelined_decode(16, 16, 32, 8, None) == 128
    device("NVIDIA H100 PCIe", 114)
    assert rt.pipelined_decode(16, 16, 32, 8, None) == 64
    assert rt.waves(4 * 114, 4) == 1 and rt.waves(4 * 114 + 1, 4) == 2
