"""Host memory sizing: psutil or /proc/meminfo, capped by a (fake) cgroup limit; never ImportError."""
import logging
import sys

import pytest

from cb_kernels.engine import memory
from cb_kernels.engine.memory import GIB, HostMemory, host_pool_bytes, read_cgroup_limit, read_host_memory


@pytest.fixture
def fake_cgroup_v2(tmp_path):
    """A cgroup v2 directory with a 2 GiB limit of which 512 MiB is in use."""
    (tmp_path / "memory.max").write_text(f"{2 * GIB}\n")
    (tmp_path / "memory.current").write_text(f"{GIB // 2}\n")
    return tmp_path


@pytest.fixture
def fake_cgroup_v1(tmp_path):
    d = tmp_path / "memory"
    d.mkdir()
    (d / "memory.limit_in_bytes").write_text(f"{3 * GIB}\n")
    (d / "memory.usage_in_bytes").write_text(f"{GIB}\n")
    return tmp_path


@pytest.fixture
def no_proc_cgroup(tmp_path):
    p = tmp_path / "self_cgroup"
    p.write_text("0::/\n")
    return p


def test_cgroup_v2_limit(fake_cgroup_v2, no_proc_cgroup):
    assert read_cgroup_limit(fake_cgroup_v2, no_proc_cgroup) == (2 * GIB, GIB // 2)


def test_cgroup_v2_unlimited(tmp_path, no_proc_cgroup):
    (tmp_path / "memory.max").write_text("max\n")
    assert read_cgroup_limit(tmp_path, no_proc_cgroup) is None


def test_cgroup_v2_own_directory(tmp_path):
    """The process's own v2 group (from /proc/self/cgroup) wins over the root's."""
    (tmp_path / "memory.max").write_text("max\n")
    own = tmp_path / "user.slice" / "job"
    own.mkdir(parents=True)
    (own / "memory.max").write_text(f"{GIB}\n")
    (own / "memory.current").write_text("0\n")
    proc = tmp_path / "self_cgroup"
    proc.write_text("0::/user.slice/job\n")
    assert read_cgroup_limit(tmp_path, proc) == (GIB, 0)


def test_cgroup_v1_limit_and_unlimited(fake_cgroup_v1, no_proc_cgroup):
    assert read_cgroup_limit(fake_cgroup_v1, no_proc_cgroup) == (3 * GIB, GIB)
    (fake_cgroup_v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert read_cgroup_limit(fake_cgroup_v1, no_proc_cgroup) is None


def test_no_cgroup(tmp_path, no_proc_cgroup):
    assert read_cgroup_limit(tmp_path, no_proc_cgroup) is None


def test_usable_is_capped_by_cgroup_headroom():
    assert HostMemory(10 * GIB, 2 * GIB, GIB // 2).usable == GIB + GIB // 2
    assert HostMemory(GIB, 8 * GIB, 0).usable == GIB
    assert HostMemory(GIB, GIB, 2 * GIB).usable == 0


def test_auto_size_obeys_fake_cgroup(fake_cgroup_v2, monkeypatch):
    monkeypatch.setenv("CBK_CGROUP_ROOT", str(fake_cgroup_v2))
    monkeypatch.setattr(memory, "_own_cgroup_v2_dir", lambda root, proc: None)
    mem = read_host_memory()
    assert mem.cgroup_limit == 2 * GIB and mem.usable <= GIB + GIB // 2
    assert host_pool_bytes(None, 0.5, memory=mem) == int(mem.usable * 0.5)


def test_psutil_hidden_reads_meminfo(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  8000000 kB\nMemFree:  100 kB\nMemAvailable:  4000000 kB\n")
    monkeypatch.setitem(sys.modules, "psutil", None)
    mem = read_host_memory(cgroup_root=tmp_path, meminfo=meminfo)
    assert mem.available == 4000000 * 1024 and mem.source == str(meminfo)
    assert host_pool_bytes(None, 0.25, memory=mem) == 1000000 * 1024


def test_psutil_hidden_real_proc(monkeypatch):
    monkeypatch.setitem(sys.modules, "psutil", None)
    assert host_pool_bytes(None) > 0


def test_requested_size_clamped_with_warning(caplog):
    mem = HostMemory(4 * GIB, source="test")
    assert host_pool_bytes(1, 0.5, memory=mem) == GIB
    with caplog.at_level(logging.WARNING, logger="cb_kernels.engine"):
        assert host_pool_bytes(100, 0.5, memory=mem) == 2 * GIB
    assert "clamped" in caplog.text and "cpu_offload_gib" in caplog.text
    assert host_pool_bytes(0, memory=mem) == 0


@pytest.mark.parametrize("bad, exc", [(-1, ValueError), (float("nan"), ValueError),
                                      (float("inf"), ValueError), ("2", TypeError), (True, TypeError)])
def test_bad_requested_size(bad, exc):
    with pytest.raises(exc, match="cpu_offload_gib"):
        host_pool_bytes(bad, memory=HostMemory(GIB))


@pytest.mark.parametrize("bad", [0, 1.5, -0.1])
def test_bad_safety_fraction(bad):
    with pytest.raises(ValueError, match="safety_fraction"):
        host_pool_bytes(None, bad, memory=HostMemory(GIB))
