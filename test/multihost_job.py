"""The job test_multihost.py runs with torchrun on two emulated hosts.

One process per rank; what it checks or measures is chosen by --mode, and
every rank reports one JSON record (report()), which the test reads back.

  collectives  every collective family at awkward sizes, against values
               computed locally (fsdp_ext), plus a gloo all_reduce cross-check
  train        a few steps of our fully_shard and upstream's, over fsdp_ext
               and gloo: each rank reports the losses
  kill         --victim SIGKILLs itself mid-step; survivors report the error
               and how long it took
  link         all ranks enter an all_reduce that --victim's host never joins;
               the test takes that host's link down and survivors report
"""

import argparse
import datetime
import json
import os
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist

import torch_fsdp_ext  # noqa: F401  (registers the backend)

SIZES = [0, 1, 3, 8191]


def report(rank, **fields):
    """One JSON record per rank, in $RESULT_DIR/<rank>.json (shared by both
    hosts: same file system), and on stdout for the reader of a failure."""
    text = json.dumps(fields)
    print(f"RESULT {rank} {text}", flush=True)
    path = os.path.join(os.environ["RESULT_DIR"], f"{rank}.json")
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def check_collectives(rank, world):
    def expect(name, got, want):
        if not torch.equal(got, want):
            raise AssertionError(f"{name}: rank {rank} got {got.tolist()[:8]}..., "
                                 f"expected {want.tolist()[:8]}...")

    checked = 0
    for n in SIZES:
        for dtype in (torch.float32, torch.int64, torch.bfloat16):
            # Small integers: exact in bfloat16 whatever the summation order.
            base = (torch.arange(n) % 16).to(dtype)
            # all_gather_into_tensor / all_gather (uneven: rank r has n + r)
            out = torch.empty(n * world, dtype=dtype)
            dist.all_gather_into_tensor(out, base + rank)
            expect("all_gather_into_tensor", out,
                   torch.cat([base + r for r in range(world)]))
            parts = [torch.empty(n + r, dtype=dtype) for r in range(world)]
            dist.all_gather(parts, torch.full((n + rank,), rank, dtype=dtype))
            for r in range(world):
                expect("all_gather", parts[r], torch.full((n + r,), r, dtype=dtype))
            # reduce_scatter_tensor, all_reduce (SUM and MAX), reduce
            full = torch.cat([base + r * 2 for r in range(world)]) + rank
            shard = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(shard, full)
            expect("reduce_scatter_tensor", shard,
                   (base + rank * 2) * world + sum(range(world)))
            summed = base + rank
            dist.all_reduce(summed)
            expect("all_reduce", summed, base * world + sum(range(world)))
            biggest = base + rank
            dist.all_reduce(biggest, op=dist.ReduceOp.MAX)
            expect("all_reduce max", biggest, base + world - 1)
            reduced = base + rank
            dist.reduce(reduced, dst=world - 1)
            if rank == world - 1:
                expect("reduce", reduced, base * world + sum(range(world)))
            # broadcast from the last rank (on the other host than rank 0)
            sent = base + 100 if rank == world - 1 else torch.zeros(n, dtype=dtype)
            dist.broadcast(sent, src=world - 1)
            expect("broadcast", sent, base + 100)
            checked += 7
        # all_to_all_single, gather / scatter, point to point
        chunks = torch.arange(world * n, dtype=torch.float32) + 1000 * rank
        received = torch.empty(world * n)
        dist.all_to_all_single(received, chunks)
        expect("all_to_all_single", received,
               torch.cat([torch.arange(rank * n, (rank + 1) * n, dtype=torch.float32) + 1000 * r
                          for r in range(world)]))
        gathered = [torch.empty(n) for _ in range(world)] if rank == 0 else None
        dist.gather(torch.full((n,), float(rank)), gathered, dst=0)
        if rank == 0:
            for r in range(world):
                expect("gather", gathered[r], torch.full((n,), float(r)))
        scattered = torch.empty(n)
        dist.scatter(scattered, [torch.full((n,), float(r)) for r in range(world)]
                     if rank == 0 else None, src=0)
        expect("scatter", scattered, torch.full((n,), float(rank)))
        ring = torch.full((n,), float(rank))
        incoming = torch.empty(n)
        ops = [dist.P2POp(dist.isend, ring, (rank + 1) % world),
               dist.P2POp(dist.irecv, incoming, (rank - 1) % world)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        expect("send/recv ring", incoming, torch.full((n,), float((rank - 1) % world)))
        checked += 4
    # Bucketed (coalesced) collectives, as FSDP issues them.
    tensors = [torch.full((n,), float(rank)) for n in SIZES]
    with dist._coalescing_manager(async_ops=True) as manager:
        for t in tensors:
            dist.all_reduce(t)
    manager.wait()
    for t in tensors:
        expect("coalesced all_reduce", t, torch.full_like(t, float(sum(range(world)))))
    # Buffers allocated from the group (FSDP's zero-copy path): shared memory
    # within each host whenever collectives go hierarchical.
    cpu = torch.device("cpu")
    backend = dist.group.WORLD._get_backend(cpu)
    # Hierarchical (and so shared memory within each host) when every host
    # holds the same number of ranks, at least two.
    hostnames = [None] * world
    dist.all_gather_object(hostnames, socket.gethostname())
    per_host = [hostnames.count(h) for h in set(hostnames)]
    hierarchical = len(set(per_host)) == 1 and per_host[0] >= 2
    assert backend.supports_tensor_alloc(cpu) == hierarchical, (world, hierarchical)
    if hierarchical:
        for n in (1, 3, 8191, 300000):
            out = backend.allocate_tensor(n * world, dtype=torch.float32, device=cpu)
            mine = out.narrow(0, rank * n, n)
            mine.copy_(torch.arange(n, dtype=torch.float32) + rank)
            dist.all_gather_into_tensor(out, mine)
            expect("all_gather_into_tensor (group buffers)", out,
                   torch.cat([torch.arange(n, dtype=torch.float32) + r for r in range(world)]))
            full = backend.allocate_tensor(n * world, dtype=torch.float32, device=cpu)
            full.copy_(torch.arange(n * world, dtype=torch.float32) % 7 + rank)
            shard = backend.allocate_tensor(n, dtype=torch.float32, device=cpu)
            dist.reduce_scatter_tensor(shard, full)
            want = (torch.arange(n * world, dtype=torch.float32) % 7).narrow(0, rank * n, n)
            expect("reduce_scatter_tensor (group buffers)", shard,
                   want * world + sum(range(world)))
            checked += 2
    dist.barrier()
    # The same all_reduce over gloo, as a cross-check of the setup itself.
    gloo = dist.new_group(backend="gloo")
    x = torch.arange(8191, dtype=torch.float64) + rank
    y = x.clone()
    dist.all_reduce(x)
    dist.all_reduce(y, group=gloo)
    expect("fsdp_ext vs gloo all_reduce", x, y)
    report(rank, checked=checked + 2, host=socket.gethostname(),
           liveness=count_liveness_connections(rank, world, hostnames))


def count_liveness_connections(rank, world, hostnames):
    """Two more groups over every rank and one over the first and last rank
    (on different hosts), then this process's liveness connections, counted
    by the backend and by the kernel: they must be one per process on the
    other host, shared by all the groups (comm/peer_liveness.h)."""
    from torch_fsdp_ext import _C

    groups = [dist.new_group(backend="fsdp_ext") for _ in range(2)]
    groups.append(dist.new_group(ranks=[0, world - 1], backend="fsdp_ext"))
    for group in groups:
        if group != dist.GroupMember.NON_GROUP_MEMBER:
            dist.all_reduce(torch.ones(3), group=group)
    endpoints = [None] * world
    dist.all_gather_object(endpoints, _C._liveness_endpoint())

    def parse(endpoint):  # "ip,ip,...:port" -> ({ip, ...}, port)
        addresses, port = endpoint.rsplit(":", 1)
        return set(addresses.split(",")), int(port)

    # A liveness socket joins this process's listener to a process on the
    # other host, or this process to such a process's listener. Matched on
    # address and port together: ports alone collide by chance, since each
    # host (namespace) numbers its ports on its own.
    my_addresses, my_port = parse(endpoints[rank])
    other_host = [parse(e) for r, e in enumerate(endpoints) if hostnames[r] != hostnames[rank]]
    other_addresses = set().union(*(a for a, _ in other_host))
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])

    def address_port(field):  # /proc/net/tcp's "0100007F:1F90": the address in host byte order
        address, port = field.split(":")
        return socket.inet_ntoa(int(address, 16).to_bytes(4, sys.byteorder)), int(port, 16)

    matched = []
    with open("/proc/self/net/tcp") as table:
        for line in table.readlines()[1:]:
            fields = line.split()
            if fields[3] != "01" or fields[9] not in inodes:  # established, ours
                continue
            local, remote = address_port(fields[1]), address_port(fields[2])
            accepted = (local[0] in my_addresses and local[1] == my_port
                        and remote[0] in other_addresses)
            made = any(remote[0] in a and remote[1] == p for a, p in other_host)
            if accepted or made:
                matched.append(f"{local[0]}:{local[1]} -> {remote[0]}:{remote[1]}")
    sockets = len(matched)
    dist.barrier()
    return {"backend": _C._liveness_connection_count(), "sockets": sockets,
            "other_host_ranks": sum(h != hostnames[rank] for h in hostnames),
            "matched": matched, "endpoints": endpoints}


def train(rank, world, steps):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from torch.distributed.fsdp import fully_shard as upstream_fully_shard

    from torch_fsdp_ext import fully_shard as our_fully_shard

    losses = {}
    gloo = dist.new_group(backend="gloo")

    def build(shard, mesh, host_shared=False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 32),
                                                          torch.nn.ReLU())
                                      for _ in range(3)], torch.nn.Linear(32, 4))
        for block in model:
            shard(block, mesh=mesh)
        shard(model, mesh=mesh)
        if host_shared:
            model.set_host_shared_parameters()
        return model

    def run(model):
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        generator = torch.Generator().manual_seed(1 + rank)
        out = []
        for _ in range(steps):
            x = torch.randn(8, 32, generator=generator)
            loss = model(x).pow(2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total, group=gloo)
            out.append(total.item())
        return out

    for backend, group in (("fsdp_ext", None), ("gloo", gloo)):
        mesh = torch.distributed.device_mesh.DeviceMesh.from_group(
            group or dist.group.WORLD, "cpu")
        for name, shard in (("ours", our_fully_shard), ("upstream", upstream_fully_shard)):
            losses[f"{name}/{backend}"] = run(build(shard, mesh))
    if world == 4:
        # Host-shared parameters: HSDP with a shard group per host (replicas
        # across the hosts), and FSDP over both hosts (a copy per host, the
        # other host's shards sent into it: Note [host-shared parameters
        # across hosts]) on both backends; each against ours without.
        from torch.distributed.device_mesh import init_device_mesh

        hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        losses["ours/hsdp"] = run(build(our_fully_shard, hsdp))
        losses["ours/hsdp+host-shared"] = run(build(our_fully_shard, hsdp, host_shared=True))
        for backend, group in (("fsdp_ext", None), ("gloo", gloo)):
            mesh = torch.distributed.device_mesh.DeviceMesh.from_group(
                group or dist.group.WORLD, "cpu")
            losses[f"ours/{backend}+host-shared"] = run(
                build(our_fully_shard, mesh, host_shared=True))
    report(rank, losses=losses)


def kill(rank, world, victim, marker, op):
    """--victim SIGKILLs itself; the others report what the backend told them.

    all_reduce: it dies while the others already wait in the next all_reduce.
    all_gather: it dies with a large all-gather in flight (4 MiB per rank, so
    over hosts its phases run in pieces: Note [pipelined hierarchical
    phases]) while the others keep all-gathering until the backend tells them.
    """
    # torchrun's agent SIGTERMs the victim's host-mates as soon as it sees
    # the victim die; they ignore that to report what the backend told them.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if op == "all_gather":
        shard = torch.full((1 << 20,), float(rank))
        out = torch.empty(world << 20)

        def collective(async_op=False):
            return dist.all_gather_into_tensor(out, shard, async_op=async_op)
    else:
        x = torch.ones(4096)

        def collective(async_op=False):
            return dist.all_reduce(x, async_op=async_op)
    for _ in range(3):
        collective()
    dist.barrier()
    if rank == victim:
        if op == "all_gather":
            collective(async_op=True)
            time.sleep(0.003)
        else:
            time.sleep(0.5)
        # Says when, so survivors can tell how long noticing took (one
        # clock: both hosts are namespaces of one machine).
        with open(marker, "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    try:
        collective()
        while op == "all_gather" and time.monotonic() - started < 60:
            collective()
        report(rank, error=None)
    except Exception as error:  # noqa: BLE001  (reported to the test)
        now, elapsed = time.time(), time.monotonic() - started
        with open(marker) as f:
            death = float(f.read())
        try:
            dist.all_reduce(torch.ones(3))
            refused = None
        except Exception as again:  # noqa: BLE001
            refused = str(again)
        report(rank, error=str(error), type=type(error).__name__, seconds=elapsed,
               noticed_after=now - death, refused=refused)


def link(rank, world, victim, marker):
    x = torch.ones(4096)
    dist.all_reduce(x)
    dist.barrier()
    if rank == 0:
        with open(marker, "w") as f:
            f.write("ready")
    if rank == victim:
        # Never joins: the test takes this host's link down meanwhile.
        time.sleep(20)
    started = time.monotonic()
    try:
        dist.all_reduce(x)
        report(rank, error=None)
    except Exception as error:  # noqa: BLE001
        report(rank, error=str(error), type=type(error).__name__,
               seconds=time.monotonic() - started)


def stray(rank, world, marker):
    """Issue 38, on 2 hosts x 2 ranks (0, 1 | 2, 3), gloo as the default group.
    Each host's ranks first make a group of their own (every process then has
    its liveness listener, with no connection across hosts). A group over a new
    pair across hosts, (0, 2), is the baseline; then rank 0 opens stray
    connections to rank 3's listener -- silent, a forged hello in the old
    format and one in the new with a wrong token (both naming rank 1's
    process), garbage, an oversized length -- and the group over the new pair
    (1, 3) is made while they wait in the backlog. The strays then leave
    (which must not look like rank 1 dying), and rank 1 SIGKILLs itself:
    rank 3 reports how soon its op on that group failed."""
    import socket as sockets
    import struct

    from torch_fsdp_ext import _C

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # torchrun's agent, after the kill
    for ranks in ([0, 1], [2, 3]):
        dist.new_group(ranks, backend="fsdp_ext")
    endpoints = [None] * world
    dist.all_gather_object(endpoints, _C._liveness_endpoint())

    def timed_group(ranks):
        dist.barrier()
        start = time.monotonic()
        group = dist.new_group(ranks, backend="fsdp_ext")
        if rank in ranks:
            dist.all_reduce(torch.ones(1), group=group)  # the group is made (lazily) by now
        return group, time.monotonic() - start

    _, baseline = timed_group([0, 2])
    strays = []
    if rank == 0:
        addresses, port = endpoints[3].rsplit(":", 1)
        target = (addresses.split(",")[0], int(port))
        peer = endpoints[1].encode()
        for payload in (b"",  # silent
                        struct.pack("<I", len(peer)) + peer,  # the old hello: a length, an endpoint
                        b"fsdpxlv1" + struct.pack("<I", len(peer)) + peer + b"0" * 32,
                        b"GET / HTTP/1.0\r\n\r\n",
                        b"fsdpxlv1" + struct.pack("<I", 1 << 30)):
            client = sockets.create_connection(target, timeout=5)
            client.sendall(payload)
            strays.append(client)
    dist.barrier()
    group, with_strays = timed_group([1, 3])
    refused = _C._liveness_refused_connections()
    for client in strays:
        client.close()
    dist.barrier()
    time.sleep(0.5)
    if rank in (1, 3):
        dist.all_reduce(torch.ones(3), group=group)  # the strays leaving lost no peer
    dist.barrier()
    fields = {"baseline": baseline, "with_strays": with_strays, "refused": refused}
    if rank == 1:
        with open(marker, "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 3:
        started = time.monotonic()
        try:
            dist.all_reduce(torch.ones(3), group=group)
            fields["error"] = None
        except Exception as error:  # noqa: BLE001  (reported to the test)
            fields.update(error=str(error), type=type(error).__name__,
                          seconds=time.monotonic() - started)
    report(rank, **fields)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True,
                        choices=["collectives", "train", "kill", "link", "stray"])
    parser.add_argument("--victim", type=int, default=0)
    parser.add_argument("--op", choices=["all_reduce", "all_gather"], default="all_reduce",
                        help="kill: the collective the survivors are in when the victim dies")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--marker", default="")
    parser.add_argument("--timeout", type=float, default=60)
    parser.add_argument("--linger-rank", type=int, default=-1,
                        help="this rank leaves 1 s after the others: it closes its endpoints "
                             "after its peers on the other host have gone")
    parser.add_argument("--backend", default="fsdp_ext",
                        help="the default group's backend (gloo: the baseline of kill runs)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.mode == "collectives":
        check_collectives(rank, world)
    elif args.mode == "train":
        train(rank, world, args.steps)
    elif args.mode == "kill":
        kill(rank, world, args.victim, args.marker, args.op)
    elif args.mode == "stray":
        stray(rank, world, args.marker)
    else:
        link(rank, world, args.victim, args.marker)
    sys.stdout.flush()
    # Survivors of a failure leave at once: no destroy_process_group on a
    # broken group, no exit barrier with a dead peer.
    if args.mode in ("kill", "link", "stray"):
        os._exit(0)
    if rank == args.linger_rank:
        time.sleep(1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
