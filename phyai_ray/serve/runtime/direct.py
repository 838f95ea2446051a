"""A group's own port under Serve's direct ingress, and where clients find it.

    phyai-ray serve reference_flow_policy --device cpu --direct-ingress
    curl -s -H "Authorization: Bearer $KEY" localhost:8000/v1/replicas \
        | jq '.replicas[] | {group, state, direct_host, direct_port}'

With RAY_SERVE_ENABLE_DIRECT_INGRESS=1 Serve gives every group's Serve replica an HTTP port of its
own, from RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT..MAX_HTTP_PORT (30000..31000 by default). Serve
2.60 has no public call that names a replica's port, so the replica reads it from its own sockets
(`own_direct_port`: a listener of this very process in that range, never another process's), sends
it with its report to the registry, and `/v1/replicas` lists it per group (`direct_host`,
`direct_port`). A replaced group comes with a new port: the route lists the new group's port, and
the gone group's no more. `server.direct_ports` reads the same from the driver (what `phyai-ray
serve --direct-ingress` prints).

The sockets are read from /proc (Linux), as the socket lane does.
"""

from __future__ import annotations

import os
import socket

DIRECT_INGRESS_ENV = "RAY_SERVE_ENABLE_DIRECT_INGRESS"
_WILDCARDS = ("0.0.0.0", "::")


def enabled() -> bool:
    """Whether Serve runs direct ingress in this Ray instance (the variable is set before Ray starts)."""
    return os.environ.get(DIRECT_INGRESS_ENV) == "1"


def http_range() -> tuple[int, int]:
    """The ports Serve hands out for direct-ingress HTTP (its defaults: 30000..31000)."""
    low = int(os.environ.get("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", "30000"))
    return low, int(os.environ.get("RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT", "31000"))


def listening(proc: str = "/proc/self") -> list[tuple[str, int]]:
    """(address, port) of every TCP socket the process listens on: its socket inodes (`fd/`) matched
    against the namespace's tables (`net/tcp`, `net/tcp6`), whose other rows are other processes'."""
    inodes = set()
    for fd in os.listdir(f"{proc}/fd"):
        try:
            target = os.readlink(f"{proc}/fd/{fd}")
        except OSError:  # closed since listed
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            with open(f"{proc}/net/{table}") as rows:
                lines = rows.read().splitlines()[1:]
        except OSError:  # no IPv6 in this kernel
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                found.append((_address(address, family), int(port, 16)))
    return found


def _address(hex_address: str, family: int) -> str:
    """/proc's address (32-bit words in host order, little-endian here) as text: 0100007F -> 127.0.0.1."""
    raw = bytes.fromhex(hex_address)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(family, raw)


def own_direct_port() -> tuple[str, int] | None:
    """(host, port) of this process's direct-ingress HTTP listener, or None (not started yet, or
    direct ingress off). A wildcard bind (--host 0.0.0.0) is reported as the node's address."""
    low, high = http_range()
    for host, port in listening():
        if low <= port <= high:
            if host in _WILDCARDS:
                import ray

                host = ray.util.get_node_ip_address()
            return host, port
    return None
