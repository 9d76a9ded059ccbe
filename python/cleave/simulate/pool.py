"""A pool of hosts with free CPUs, memory and GPUs, and the placement rule the simulator uses:
every fit check is one vectorised comparison over all hosts (docs/simulate.md, "Placement")."""

from __future__ import annotations

import numpy as np

from cleave.simulate.nodes import Hosts

# Keys of the placement score, far enough apart to act lexicographically.
_TIER = 1e9


class Pool:
    def __init__(self, hosts: Hosts):
        self.hosts = hosts
        self.free_cpu = hosts.cpu.copy()
        self.free_mem = hosts.mem.copy()
        self.free_gpu = hosts.gpu.copy()
        self.has_gpu = hosts.gpu > 0
        # (app, role) -> instances of it on each host, for max_instance_per_node.
        self.density: dict[tuple[int, int], np.ndarray] = {}

    def _count(self, key: tuple[int, int]) -> np.ndarray:
        counts = self.density.get(key)
        if counts is None:
            counts = self.density[key] = np.zeros(len(self.hosts), dtype=np.int32)
        return counts

    def place(self, cpu: float, mem: float, gpu: float, key: tuple[int, int], density: int) -> int:
        """The host chosen for one instance (and its resources taken), or -1 if none fits.
        Best fit: a GPU instance goes where the fewest GPUs stay free after it, then the fewest
        CPUs; a CPU-only one prefers hosts with no free GPU (so GPUs stay usable), then the
        fewest CPUs left."""
        fits = (self.free_cpu >= cpu) & (self.free_mem >= mem) & (self.free_gpu >= gpu)
        if density:
            fits &= self._count(key) < density
        candidates = np.flatnonzero(fits)
        if not len(candidates):
            return -1
        left_cpu = self.free_cpu[candidates] - cpu
        if gpu:
            score = (self.free_gpu[candidates] - gpu) * _TIER + left_cpu
        else:
            score = (self.free_gpu[candidates] > 0) * _TIER + left_cpu
        host = int(candidates[np.argmin(score)])
        self.take(host, cpu, mem, gpu, key, 1)
        return host

    def take(self, host: int, cpu: float, mem: float, gpu: float, key, sign: int) -> None:
        self.free_cpu[host] -= sign * cpu
        self.free_mem[host] -= sign * mem
        self.free_gpu[host] -= sign * gpu
        self._count(key)[host] += sign

    def add_host(self, kind: int) -> None:
        """One more empty host of `hosts.types[kind]`: a pool that grows (any-mix sizing)."""
        t, h = self.hosts.types[kind], self.hosts
        h.cpu, h.mem = np.append(h.cpu, t.cpus), np.append(h.mem, t.mem)
        h.gpu, h.kind = np.append(h.gpu, t.gpus), np.append(h.kind, kind)
        self.free_cpu = np.append(self.free_cpu, t.cpus)
        self.free_mem = np.append(self.free_mem, t.mem)
        self.free_gpu = np.append(self.free_gpu, t.gpus)
        self.has_gpu = h.gpu > 0
        for key, counts in self.density.items():
            self.density[key] = np.append(counts, 0)

    def release(self, host: int, cpu: float, mem: float, gpu: float, key) -> None:
        self.take(host, cpu, mem, gpu, key, -1)

    def allocation(self) -> tuple[float, float]:
        """Allocated fractions of the pool's (CPUs, GPUs)."""
        cpu_total, gpu_total = self.hosts.cpu.sum(), self.hosts.gpu.sum()
        cpu = 1 - self.free_cpu.sum() / cpu_total
        gpu = 1 - self.free_gpu.sum() / gpu_total if gpu_total else 0.0
        return float(cpu), float(gpu)
