"""How a group with more replicas than the smallest group gets the exchanged shard.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 6 \\
        tests/workers/ingroup_bench.py [MIB_PER_RANK ...]

Layout: unequal groups [2, 4] with S = 1 on 6 gloo processes, so R = (2, 4) replicas and
R_min = 2 (with S = 2 both rules below coincide: R_min = 1). For each buffer size (MiB
of fp32 per rank) it times one exchange of a random buffer with
:class:`fl_accel.mesh_transport.MeshTransport` under two rules:

* "chunked" (fl_accel): C = R_min = 2 chunks; replicas 0 and 1 of each group exchange
  one chunk each over "fl"; group 0 (R = C) all-gathers, group 1 (R > C) broadcasts
  each chunk from its owner over its 4 replicas;
* "one_exchanger" (xffl): C = 1; replica 0 of each group exchanges the whole buffer
  and broadcasts it over its group.

Both give the same weighted mean (checked bitwise). Printed per rule and size: the
median over REPS of the slowest rank's seconds, and this rank 0's bytes per axis
(fl_accel.comm accounting). Loopback only: every link is equally fast here.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from _scenario import exchange_mean as mean
from fl_accel.comm import CommMeter, CommStats
from fl_accel.exchange import Membership
from fl_accel.mesh import FLLayout
from fl_accel.mesh_transport import MeshTransport

REPS = 5


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sizes = [float(a) for a in sys.argv[1:]] or [4.0, 32.0]
    layout = FLLayout((2, 4), 1, "fl_hsdp")
    f, r, s = layout.coords(rank)
    weights = layout.weights("size")

    def groups(chunks):
        """Process groups of the "fl" exchange for C chunks (replicas c < C), and dp_replicate."""
        fl, rep = None, None
        for c in range(chunks):
            ranks = [layout.rank(g, c, 0) for g in range(layout.num_groups)]
            pg = dist.new_group(ranks)
            if rank in ranks:
                fl = pg
        for g in range(layout.num_groups):
            ranks = list(layout.group_ranks(g))
            pg = dist.new_group(ranks)
            if rank in ranks:
                rep = pg
        return fl, rep

    rules = {}
    for name, chunks in (("chunked", layout.min_replicas), ("one_exchanger", 1)):
        fl, rep = groups(chunks)
        rules[name] = (MeshTransport(fl_group=fl if r < chunks else None, replicate_group=rep,
                                     membership=Membership(2, f, weights), num_chunks=chunks,
                                     chunk_index=r if r < chunks else None, replicas=layout.replicas_of(f),
                                     chunk_owners=tuple(layout.rank(f, c, 0) for c in range(chunks))),
                       fl, rep)
    for mib in sizes:
        n = int(mib * 2**20 / 4)
        x = torch.randn(n, generator=torch.Generator().manual_seed(f))  # replicas of a group hold the same values
        results = {}
        for name, (transport, fl, rep) in rules.items():
            times = []
            for i in range(REPS + 1):
                stats = CommStats()
                buckets = {pg: axis for pg, axis in ((fl, "fl"), (rep, "dp_replicate")) if pg is not None}
                dist.barrier()
                t0 = time.perf_counter()
                with CommMeter(stats, buckets):
                    out = mean(transport, [x])[0]
                took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                if i:  # the first run warms up the connections
                    times.append(took.item())
            results[name] = out.clone()
            if rank == 0:
                by_axis = {a: stats[a].bytes for a in ("fl", "dp_replicate")}
                print(f"[ingroup] {mib:g} MiB/rank {name}: median {statistics.median(times):.4f} s "
                      f"(min {min(times):.4f}) rank0 bytes {by_axis}", flush=True)
            if rank == 2:
                by_axis = {a: stats[a].bytes for a in ("fl", "dp_replicate")}
                print(f"[ingroup] {mib:g} MiB/rank {name}: rank2 (group 1, replica 0) bytes {by_axis}", flush=True)
        same = torch.tensor([float(torch.equal(results["chunked"], results["one_exchanger"]))])
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
        if rank == 0:
            print(f"[ingroup] {mib:g} MiB/rank: both rules give bitwise the same mean on every rank: "
                  f"{bool(same.item())}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
