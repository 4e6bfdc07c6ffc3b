"""Network addresses as the flags and protocols give them: HOST:PORT, an IPv6 host in
brackets ([::1]:7000). One parser for the coordinator of a process group, a worker's
listening address and the peers it is sent to."""

from __future__ import annotations

import ipaddress


def parse_address(text: str, what: str = "an address", listening: bool = False) -> tuple[str, int]:
    """(host, port) of HOST:PORT, the host without its brackets; ValueError naming `what`
    and the reason. listening: port 0 is allowed (any free port)."""
    host, colon, port = str(text).rpartition(":")
    if not colon or not host or not port.isdigit():
        raise ValueError(f"{what} is HOST:PORT, not {text!r}")
    lowest = 0 if listening else 1
    if not lowest <= int(port) <= 65535:
        raise ValueError(f"{what} needs a port in [{lowest}, 65535], not {text!r}")
    if host.startswith("["):
        if not host.endswith("]"):
            raise ValueError(f"an IPv6 host goes in brackets, [::1]:PORT, not {text!r}")
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ValueError(f"{host[1:-1]!r} in {text!r} is not an IPv6 address") from None
        return host[1:-1], int(port)
    if ":" in host or any(c.isspace() for c in host):
        raise ValueError(f"{what} is HOST:PORT (IPv6 in brackets), not {text!r}")
    return host, int(port)


def format_address(host: str, port: int) -> str:
    """HOST:PORT, an IPv6 host in brackets: what parse_address reads back."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
