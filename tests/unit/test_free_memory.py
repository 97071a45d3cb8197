"""The host memory the rows' rules and the miner read (xc/free_memory.py): MemAvailable, or less where the process's cgroup
(a container's, a Slurm job's) has a memory limit, v2 or v1, on its own cgroup or an ancestor; fake trees."""

from __future__ import annotations

from xc.free_memory import FreeMemory, cgroup_free, host_memory

GIB = 1 << 30
V1_NO_LIMIT = 9223372036854771712  # what cgroup v1 reports where no limit is set


def _files(root, files: dict[str, str]):
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def _host(tmp_path, proc_cgroup: str, tree: dict[str, str], available_gib: int = 64) -> dict:
    _files(tmp_path, {"meminfo": f"MemTotal: {128 << 20} kB\nMemAvailable: {available_gib << 20} kB\n",
                      "self_cgroup": proc_cgroup, **{f"cgroup/{k}": v for k, v in tree.items()}})
    return dict(meminfo=tmp_path / "meminfo", proc_cgroup=tmp_path / "self_cgroup", cgroup_root=tmp_path / "cgroup")


def test_no_limit_leaves_memavailable(tmp_path):
    paths = _host(tmp_path, "0::/user.slice/job\n", {"user.slice/job/memory.max": "max\n",
                                                          "user.slice/job/memory.current": f"{GIB}\n",
                                                          "user.slice/memory.max": "max\n"})
    assert cgroup_free(paths["proc_cgroup"], paths["cgroup_root"]) is None
    assert host_memory(**paths) == FreeMemory(64 * GIB, "MemAvailable")


def test_the_tightest_v2_limit_of_the_cgroup_and_its_ancestors_binds(tmp_path):
    # Slurm: 16 GiB on the job (6 GiB charged, 1 GiB of it inactive page cache), 13 GiB on the step (1 GiB charged)
    paths = _host(tmp_path, "0::/job_7/step_0\n", {
        "job_7/memory.max": f"{16 * GIB}\n", "job_7/memory.current": f"{6 * GIB}\n",
        "job_7/memory.stat": f"anon {5 * GIB}\ninactive_file {GIB}\nactive_file 0\n",
        "job_7/step_0/memory.max": f"{13 * GIB}\n", "job_7/step_0/memory.current": f"{GIB}\n"})
    assert cgroup_free(paths["proc_cgroup"], paths["cgroup_root"]) == (11 * GIB, 16 * GIB, "v2")
    assert host_memory(**paths) == FreeMemory(11 * GIB, "cgroup v2 limit 16 GiB")
    assert host_memory(**dict(paths, meminfo=_host(tmp_path / "small", "", {}, available_gib=8)["meminfo"])) == \
        FreeMemory(8 * GIB, "MemAvailable")  # the host has less free than the limit leaves: the host's figure


def test_a_container_sees_its_own_cgroup_as_the_root(tmp_path):
    # a cgroup namespace: /proc/self/cgroup says "/", the limit is on the mounted root itself
    paths = _host(tmp_path, "0::/\n", {"memory.max": f"{4 * GIB}\n", "memory.current": f"{GIB}\n"})
    assert host_memory(**paths) == FreeMemory(3 * GIB, "cgroup v2 limit 4 GiB")
    # a path that is not under the mount (the host's name of the container's cgroup): the root's limit
    paths = _host(tmp_path, "0::/system.slice/docker-1.scope\n", {})
    assert host_memory(**paths) == FreeMemory(3 * GIB, "cgroup v2 limit 4 GiB")


def test_cgroup_v1_limit_and_its_no_limit_value(tmp_path):
    v1 = "12:pids:/\n4:cpu,memory:/docker/abc\n0::/\n"
    paths = _host(tmp_path, v1, {"memory/memory.limit_in_bytes": f"{V1_NO_LIMIT}\n",
                                 "memory/docker/abc/memory.limit_in_bytes": f"{V1_NO_LIMIT}\n",
                                 "memory/docker/abc/memory.usage_in_bytes": f"{GIB}\n"})
    assert cgroup_free(paths["proc_cgroup"], paths["cgroup_root"]) is None
    _files(tmp_path / "cgroup", {"memory/docker/abc/memory.limit_in_bytes": f"{8 * GIB}\n",
                                 "memory/docker/abc/memory.stat": f"inactive_file {GIB}\ntotal_inactive_file {2 * GIB}\n",
                                 "memory/docker/abc/memory.usage_in_bytes": f"{3 * GIB}\n"})
    assert host_memory(**paths) == FreeMemory(7 * GIB, "cgroup v1 limit 8 GiB")


def test_over_the_limit_is_nothing_left_and_no_cgroup_fs_is_no_limit(tmp_path):
    paths = _host(tmp_path, "0::/\n", {"memory.max": f"{GIB}\n", "memory.current": f"{2 * GIB}\n"})
    assert host_memory(**paths) == FreeMemory(0, "cgroup v2 limit 1 GiB")
    missing = dict(paths, proc_cgroup=tmp_path / "none", cgroup_root=tmp_path / "none")
    assert host_memory(**missing) == FreeMemory(64 * GIB, "MemAvailable")
    assert host_memory(tmp_path / "no-meminfo", tmp_path / "none", tmp_path / "none").source == "physical memory"
