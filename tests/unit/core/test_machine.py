"""What a process may use: cores (affinity capped by its CPU quota) and memory (the RAM
capped by its memory limit), a container's limits included.

The parsing tests build a process's ``/proc/self/{cgroup,mountinfo}`` and the cgroup files
as data in a folder (the shapes cgroup v1, v2, with and without a cgroup namespace, write);
the last test puts a real process in a real cgroup with a quota, where this machine lets
the test make one."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vqserve.core.machine import (
    _cgroup_chains,
    available_cores,
    available_memory,
    cpu_quota_cores,
    memory_limit_bytes,
)


def fake_proc(tmp: Path, cgroup: str, mounts: list[tuple[str, str, str, str]], files: dict[str, str]) -> str:
    """A /proc/self with ``cgroup`` lines and one mountinfo line per (root, mount point,
    fstype, super options), mount points under ``tmp``; ``files``: cgroup files by path
    relative to ``tmp``."""
    proc = tmp / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    lines = [f"{30 + i} 23 0:{40 + i} {root} {tmp / mount.lstrip('/')} rw,relatime - {fstype} {fstype} {options}"
             for i, (root, mount, fstype, options) in enumerate(mounts)]
    (proc / "mountinfo").write_text("\n".join(["22 1 8:1 / / rw - ext4 /dev/vda rw", *lines]) + "\n")
    for rel, text in files.items():
        path = tmp / rel.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for _root, mount, _fs, _opt in mounts:
        (tmp / mount.lstrip("/")).mkdir(parents=True, exist_ok=True)
    return str(proc)


def test_cgroup_v2_in_a_namespace_reads_its_own_cpu_max(tmp_path):
    proc = fake_proc(tmp_path, "0::/\n", [("/", "/sys/fs/cgroup", "cgroup2", "rw,nsdelegate")],
                     {"sys/fs/cgroup/cpu.max": "250000 100000\n"})
    assert cpu_quota_cores(proc) == 2  # 2.5 cores: 2 busy workers, none throttled


def test_cgroup_v2_without_a_limit_has_no_quota(tmp_path):
    proc = fake_proc(tmp_path, "0::/\n", [("/", "/sys/fs/cgroup", "cgroup2", "rw")],
                     {"sys/fs/cgroup/cpu.max": "max 100000\n"})
    assert cpu_quota_cores(proc) is None


def test_cgroup_v2_without_a_namespace_takes_the_smallest_quota_up_the_tree(tmp_path):
    """A host's view (a systemd slice, a pod's cgroup): the process's own folder says
    nothing, its pod's parent folder says 4 cores, a grandparent 16."""
    proc = fake_proc(tmp_path, "0::/kubepods/pod1/ctr\n", [("/", "/sys/fs/cgroup", "cgroup2", "rw")], {
        "sys/fs/cgroup/kubepods/pod1/ctr/cpu.max": "max 100000\n",
        "sys/fs/cgroup/kubepods/pod1/cpu.max": "400000 100000\n",
        "sys/fs/cgroup/kubepods/cpu.max": "1600000 100000\n",
        "sys/fs/cgroup/cpu.max": "max 100000\n"})
    assert cpu_quota_cores(proc) == 4


def test_cgroup_v1_container_sees_its_own_cgroup_at_the_mount(tmp_path):
    """Docker on cgroup v1: /proc/self/cgroup names the host's path, but the container has
    its own cgroup mounted at /sys/fs/cgroup/cpu,cpuacct (root = that path)."""
    proc = fake_proc(tmp_path, "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n",
                     [("/docker/abc", "/sys/fs/cgroup/cpu,cpuacct", "cgroup", "rw,cpu,cpuacct")],
                     {"sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "800000\n",
                      "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    assert cpu_quota_cores(proc) == 8


def test_cgroup_v1_without_a_quota_and_a_hybrid_unified_mount_have_none(tmp_path):
    """This development machine's shape: v1 cpu at /, no quota (-1), a cgroup2 mount with
    no cpu controller (no cpu.max)."""
    proc = fake_proc(tmp_path, "1:cpu:/\n2:cpuacct:/\n0::/\n",
                     [("/", "/sys/fs/cgroup/cpu", "cgroup", "rw,cpu"),
                      ("/", "/sys/fs/cgroup/unified", "cgroup2", "rw")],
                     {"sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1\n", "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n"})
    assert cpu_quota_cores(proc) is None


def test_unreadable_or_garbled_files_mean_no_quota(tmp_path):
    assert cpu_quota_cores(str(tmp_path / "nowhere")) is None
    proc = fake_proc(tmp_path, "0::/\n", [("/", "/sys/fs/cgroup", "cgroup2", "rw")],
                     {"sys/fs/cgroup/cpu.max": "lots\n"})
    assert cpu_quota_cores(proc) is None


def test_memory_limits_in_v2_v1_and_up_the_tree(tmp_path):
    for case in "abc":
        (tmp_path / case).mkdir()
    v2 = fake_proc(tmp_path / "a", "0::/pod/ctr\n", [("/", "/sys/fs/cgroup", "cgroup2", "rw")], {
        "sys/fs/cgroup/pod/ctr/memory.max": "max\n", "sys/fs/cgroup/pod/memory.max": "2147483648\n"})
    assert memory_limit_bytes(v2) == 2 << 30
    v1 = fake_proc(tmp_path / "b", "4:memory:/docker/abc\n0::/\n",
                   [("/docker/abc", "/sys/fs/cgroup/memory", "cgroup", "rw,memory")],
                   {"sys/fs/cgroup/memory/memory.limit_in_bytes": "536870912\n"})
    assert memory_limit_bytes(v1) == 512 << 20
    unlimited = fake_proc(tmp_path / "c", "4:memory:/\n0::/\n", [("/", "/sys/fs/cgroup/memory", "cgroup", "rw,memory")],
                          {"sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n"})
    assert memory_limit_bytes(unlimited) is None  # the kernel's "no limit" in v1
    assert memory_limit_bytes(str(tmp_path / "nowhere")) is None
    assert 0 < available_memory()


@given(st.integers(1_000, 64_000_000), st.integers(1_000, 1_000_000))
def test_a_quota_gives_its_whole_cores_rounded_down_at_least_one(quota, period):
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        proc = fake_proc(Path(tmp), "0::/\n", [("/", "/sys/fs/cgroup", "cgroup2", "rw")],
                         {"sys/fs/cgroup/cpu.max": f"{quota} {period}\n"})
        assert cpu_quota_cores(proc) == max(1, quota // period)


def _cgroup_v1(controller: str) -> Path | None:
    """This process's own cgroup v1 folder for ``controller`` (found as the server finds it),
    if it may make a child cgroup there, or None."""
    for version, folders in _cgroup_chains("/proc/self", controller):
        if version == 1 and os.access(folders[0], os.W_OK):
            return folders[0]
    return None


def _run_in_cgroup(controller: str, settings: dict[str, str], code: str) -> list[str]:
    """Run Python ``code`` in a new child cgroup of ``controller`` with ``settings`` (file ->
    value) written first; its printed words. The cgroup is removed afterwards."""
    folder = _cgroup_v1(controller) / f"vqserve-test-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    try:
        for name, value in settings.items():
            (folder / name).write_text(value)
        done = subprocess.run(["sh", "-c", f'echo $$ > {folder}/tasks && exec "$0" -c "$1"', sys.executable, code],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()
    finally:
        folder.rmdir()


@pytest.mark.skipif(_cgroup_v1("cpu") is None, reason="needs a writable cgroup v1 cpu hierarchy (root)")
def test_a_process_in_a_cgroup_with_a_quota_sizes_itself_by_the_quota():
    """A real cgroup with 1.5 cores of quota: the process inside counts 1 core, and sizes
    by it what the machine's cores sized: a CPU plan's model calls at once, each
    front-end's decode threads, the front-ends of a stand-in accelerator."""
    code = ("from vqserve.core.machine import available_cores, cpu_quota_cores;"
            "from vqserve.commands.serve import resolve_frontends;"
            "from vqserve.export.runtimes.execution import default_model_workers;"
            "from vqserve.serve.api.decoding import default_decode_threads;"
            "print(available_cores(), cpu_quota_cores(), default_model_workers('cpu'), default_decode_threads(),"
            "      resolve_frontends('auto', 'synthetic:0', 'cpu'))")
    got = _run_in_cgroup("cpu", {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "150000"}, code)
    assert got == ["1", "1", "1", "1", "1"]
    assert available_cores() >= 1


@pytest.mark.skipif(_cgroup_v1("memory") is None, reason="needs a writable cgroup v1 memory hierarchy (root)")
def test_a_process_in_a_cgroup_with_a_memory_limit_sizes_its_model_calls_by_it():
    """A real cgroup limited to 1 GiB: the process inside may use 1 GiB, and the CPU pixel
    budget per model call is a quarter of that at 300 bytes a pixel (about 0.9 megapixels),
    not 4 megapixels."""
    code = ("from vqserve.core.machine import available_memory, memory_limit_bytes;"
            "from vqserve.serve.engine.local import default_batch_pixels;"
            "print(memory_limit_bytes(), available_memory(), default_batch_pixels('cpu', 1))")
    got = _run_in_cgroup("memory", {"memory.limit_in_bytes": str(1 << 30)}, code)
    assert got == [str(1 << 30), str(1 << 30), str((1 << 30) // 4 // 300)]
