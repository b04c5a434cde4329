"""What plain TCP carries between the two emulated hosts: the link limit.

    measure_link(hosts, streams=1, both_ways=False, seconds=0.5) -> GB/s per direction

Runs a receiver on one host and a sender on the other (inside their
namespaces, over the same veth link the collectives use) with `streams`
parallel connections; with `both_ways`, a second pair runs the other way at
the same time, as an all-gather's or reduce-scatter's traffic does. The
figure is bytes received over the receiver's time from first to last byte,
per direction (the lower of the two directions when both run). Call it a few
times and keep the best: the link is noisy, and what a collective could reach
is the best the link gave in the same run.

Run as a script it is one end of that measurement (what measure_link starts).
"""

import json
import socket
import subprocess
import sys
import threading
import time

CHUNK = 4 << 20
PORT = 29650


def _receive(port, streams):
    listener = socket.create_server(("0.0.0.0", port), backlog=streams)
    conns = [listener.accept()[0] for _ in range(streams)]
    counts, first, last = [0] * streams, [None] * streams, [0.0] * streams

    def drain(i):
        buf = bytearray(CHUNK)
        while True:
            got = conns[i].recv_into(buf)
            if got == 0:
                return
            now = time.perf_counter()
            first[i] = first[i] or now
            last[i] = now
            counts[i] += got

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = max(last) - min(f for f in first if f is not None)
    print(json.dumps({"bytes": sum(counts), "seconds": seconds}), flush=True)


def _send(address, port, streams, seconds):
    conns = []
    deadline = time.monotonic() + 10
    while len(conns) < streams:
        try:
            conns.append(socket.create_connection((address, port)))
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
    payload = bytes(CHUNK)
    end = time.perf_counter() + seconds

    def pump(conn):
        while time.perf_counter() < end:
            conn.sendall(payload)
        conn.close()

    threads = [threading.Thread(target=pump, args=(c,)) for c in conns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def measure_link(hosts, streams=1, both_ways=False, seconds=0.5):
    """GB/s per direction between hosts 0 and 1 (test/multihost.TwoHosts)."""
    directions = [(0, 1), (1, 0)] if both_ways else [(1, 0)]
    receivers, senders = [], []
    for i, (to, frm) in enumerate(directions):
        port = PORT + i
        receivers.append(hosts.popen(to, [sys.executable, __file__, "receive", str(port),
                                          str(streams)], stdout=subprocess.PIPE, text=True))
    for i, (to, frm) in enumerate(directions):
        senders.append(hosts.popen(frm, [sys.executable, __file__, "send", hosts.addresses[to],
                                         str(PORT + i), str(streams), str(seconds)]))
    rates = []
    for proc in senders:
        proc.wait(timeout=60)
    for proc in receivers:
        out, _ = proc.communicate(timeout=60)
        result = json.loads(out.strip().splitlines()[-1])
        rates.append(result["bytes"] / result["seconds"] / 1e9)
    return min(rates)


def measure_link_limits(hosts, ranks_per_host=1, rounds=3):
    """One way and both ways at once, with one stream and with as many as our
    collectives use (one per pair of ranks at the same position on the two
    hosts); the best of `rounds` rounds each. GB/s per direction, by name."""
    limits = {}
    for both_ways in (False, True):
        for streams in sorted({1, ranks_per_host}):
            key = f"{'both ways' if both_ways else 'one way'}, {streams} stream" + \
                ("s" if streams > 1 else "")
            limits[key] = max(measure_link(hosts, streams, both_ways) for _ in range(rounds))
    return limits


def best(limits, both_ways):
    """The best figure of `limits` (measure_link_limits) in one pattern."""
    pattern = "both ways" if both_ways else "one way"
    return max(v for k, v in limits.items() if k.startswith(pattern))


if __name__ == "__main__":
    if sys.argv[1] == "receive":
        _receive(int(sys.argv[2]), int(sys.argv[3]))
    else:
        _send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
