"""What the process may use (tokenmill/resources.py) read from cgroup and /proc files the tests write,
the thread governor's policy under a fake clock, and the memory check refusing a model that does
not fit before anything is allocated."""
import os

import pytest

from tokenmill import resources
from tokenmill.engine.threads import ThreadGovernor


def _fake(tmp_path, cgroup_line: str, files: dict[str, str], meminfo_kb: int = 8 << 20) -> tuple[str, str]:
    root, proc = tmp_path / "cgroup", tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup_line + "\n")
    (proc / "meminfo").write_text(f"MemTotal: {2 * meminfo_kb} kB\nMemAvailable: {meminfo_kb} kB\n")
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return str(root), str(proc)


def test_threads_follow_the_affinity_mask_and_the_cgroup_v2_quota(tmp_path):
    root, proc = _fake(tmp_path, "0::/box/job", {"box/cpu.max": "250000 100000", "box/job/cpu.max": "max 100000"})
    assert resources.cgroup_cpu_limit(root, proc) == 2.5
    threads, why = resources.usable_cores(root, proc, affinity=set(range(64)))
    assert threads == 3 and "quota 2.5" in why  # a 2.5-CPU quota on a 64-core host: 3 threads, not 64
    assert resources.usable_cores(root, proc, affinity={0, 1})[0] == 2  # fewer cores than the quota
    root, proc = _fake(tmp_path / "open", "0::/", {"cpu.max": "max 100000"})
    assert resources.usable_cores(root, proc, affinity={0, 3, 5})[0] == 3


def test_threads_follow_a_cgroup_v1_quota(tmp_path):
    root, proc = _fake(tmp_path, "4:cpu,cpuacct:/docker/abc", {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "100000",
                                                                 "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000"})
    assert resources.usable_cores(root, proc, affinity=set(range(16)))[0] == 1


def test_memory_available_is_the_least_of_cgroup_room_and_memavailable(tmp_path):
    root, proc = _fake(tmp_path, "0::/box", {"box/memory.max": str(3 << 30), "box/memory.current": str(1 << 30)},
                       meminfo_kb=16 << 20)
    avail, why = resources.memory_available(root, proc)
    assert avail == 2 << 30 and "cgroup memory limit 3.00 GiB" in why
    root, proc = _fake(tmp_path / "v1", "5:memory:/m", {"memory/m/memory.limit_in_bytes": str(1 << 62),
                                                         "memory/m/memory.usage_in_bytes": "0"}, meminfo_kb=1 << 20)
    assert resources.memory_available(root, proc) == (1 << 30, "MemAvailable")


def test_check_fits_names_both_numbers_and_what_to_change(tmp_path):
    root, proc = _fake(tmp_path, "0::/", {"memory.max": str(2 << 30), "memory.current": "0"})
    resources.check_fits(1 << 30, 256 << 20, "m.gguf", root, proc)  # 1.75 GiB of 2: fits
    with pytest.raises(ValueError) as e:
        resources.check_fits(3 << 30, 1 << 30, "m.gguf", root, proc)
    msg = str(e.value)
    assert "needs 4.50 GiB" in msg and "weights 3.00 GiB" in msg and "KV cache 1.00 GiB" in msg
    assert "may use 2.00 GiB" in msg and "--kv-cache-memory" in msg and "--max-model-len" in msg


def test_engine_refuses_a_model_that_does_not_fit_before_loading_it(tmp_path, monkeypatch, default_model):
    from tokenmill import LLM

    root, proc = _fake(tmp_path, "0::/", {"memory.max": str(600 << 20), "memory.current": "0"})
    monkeypatch.setattr(resources, "CGROUP_ROOT", root)
    monkeypatch.setattr(resources, "PROC", proc)
    with pytest.raises(ValueError, match=r"does not fit in memory: it needs [\d.]+ GiB .* may use 0\.59 GiB"):
        LLM(model=default_model, kv_cache_memory=64 << 20)
    monkeypatch.setattr(resources, "CGROUP_ROOT", _fake(tmp_path / "big", "0::/", {"memory.max": str(4 << 30)})[0])
    LLM(model=default_model, kv_cache_memory=64 << 20)  # the same model fits under a larger limit


class _Clock:
    def __init__(self) -> None:
        self.t, self.delay, self.others = 0.0, 0, 0.0

    def advance(self, seconds: float, contended_share: float, others_cores: float | None = None) -> None:
        """`others_cores`: the cores other processes kept busy meanwhile (default: one, when contended)."""
        self.t += seconds
        self.delay += int(contended_share * seconds * 1e9)
        self.others += seconds * (others_cores if others_cores is not None else contended_share > 0.5)

    def governor(self, threads: int, calls: list) -> ThreadGovernor:
        return ThreadGovernor(threads, read_delay=lambda: self.delay, clock=lambda: self.t, set_threads=calls.append,
                              read_others=lambda: self.others)


def test_governor_drops_a_thread_under_contention_and_takes_it_back_after():
    clock, threads = _Clock(), []
    gov = clock.governor(4, threads)
    for _ in range(4):  # uncontended: nothing changes
        clock.advance(0.5, 0.01)
        gov.tick()
    assert gov.threads == 4 and threads == []
    clock.advance(0.5, 0.9)
    gov.tick()
    clock.advance(0.5, 0.9)
    gov.tick()
    assert gov.threads == 2 and threads == [3, 2]
    clock.advance(0.5, 0.01)  # the waiting stopped at 2 threads; after the probe wait one more is tried
    gov.tick()
    clock.advance(2.0, 0.01)
    gov.tick()
    assert threads[-1] == 3
    clock.advance(0.5, 0.9)  # ... and given back when the waiting returns; the next try waits twice as long
    gov.tick()
    assert threads[-1] == 2 and gov._probe_wait == 4.0
    for _ in range(5):
        clock.advance(2.0, 0.01)
        gov.tick()
    assert gov.threads == 4  # free cores again: back to all of them


def test_governor_keeps_its_threads_when_the_waiting_is_its_own_process():
    """The threads wait for a core while no other process is busy (the server's own event loop),
    or while a light neighbour runs in bursts: all threads stay."""
    clock, threads = _Clock(), []
    gov = clock.governor(2, threads)
    for others in (0.0, 0.3, 0.45):
        for _ in range(4):
            clock.advance(0.5, 0.8, others)
            gov.tick()
    assert gov.threads == 2 and threads == []
    clock.advance(0.5, 0.8, 0.7)  # a busy neighbour
    gov.tick()
    assert threads == [1]


def test_other_processes_cpu_time_excludes_this_process(tmp_path):
    from tokenmill.engine.threads import other_cpu_seconds

    cpus = sorted(os.sched_getaffinity(0))
    lines = ["cpu  1 1 1 1 1 1 1 1 0 0"] + [f"cpu{c} 100 0 50 999 7 5 5 3 0 0" for c in cpus]
    lines.append(f"cpu{max(cpus) + 1} 1000 0 0 0 0 0 0 0 0 0")  # a core this process may not use
    (tmp_path / "stat").write_text("\n".join(lines) + "\n")
    (tmp_path / "self").mkdir()
    fields = ["S"] + ["0"] * 10 + ["60", "20"] + ["0"] * 30  # utime 60, stime 20 ticks
    (tmp_path / "self" / "stat").write_text("42 (tokenmill (x)) " + " ".join(fields) + "\n")
    hz = os.sysconf("SC_CLK_TCK")
    assert other_cpu_seconds(str(tmp_path)) == pytest.approx((160 * len(cpus) - 80) / hz)
    assert other_cpu_seconds(str(tmp_path / "missing")) == 0.0


def test_governor_is_off_with_one_thread():
    gov = ThreadGovernor(1, read_delay=lambda: 0, clock=lambda: 0.0, set_threads=lambda n: pytest.fail("set"))
    assert not gov.enabled
    gov.tick()


def test_run_queue_delay_reads_this_process():
    from tokenmill.engine.threads import run_queue_delay_ns

    if not os.path.exists("/proc/self/task"):
        pytest.skip("no /proc here")
    assert run_queue_delay_ns() >= 0
