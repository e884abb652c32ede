"""TCP hole punching: a simultaneous open from the ports a relayed circuit uses.

Two peers behind NATs each hold a TCP connection to the relay (their two ends of a
circuit, :mod:`swarm.net.relay`), opened from a socket with SO_REUSEPORT; the relay
told each the address it sees the other's connection come from (the other's NAT
mapping). Both then connect, at about the same moment (the relay answers both ends of
a circuit together), from that same local port to the other's mapped address. Each
outbound SYN creates the NAT's conntrack entry that lets the other's SYN in as a reply:
a NAT that keeps the source port for a new destination (Linux MASQUERADE does while
the port is free) and drops, rather than refuses, unsolicited SYNs lets the two SYNs
meet, and the kernel completes a simultaneous open. A NAT that picks a new port per
destination (symmetric NAT) defeats it: the address the relay saw is not the one the
SYN comes from. Failures are retried until ``deadline``; then the circuit stays relayed.

A NAT that answers an unsolicited SYN with a reset (the lab's MASQUERADE namespaces do:
a SYN to the NAT's own address meets no listener; a firewall that drops it does not)
also ends the sender's conntrack entry, so the two SYNs must cross within about one
round trip. So attempts are dense (every :data:`RETRY_DELAY` seconds, each failing
within a round trip), which makes crossing likely within ``deadline``. (A first SYN
with a small TTL, to open our own NAT without reaching the other, does not work on
Linux: the ICMP time-exceeded coming back aborts a connect in SYN-SENT.)

This is not DCUtR (libp2p's ``/libp2p/dcutr``): py-libp2p 0.8.1's TCP transport binds no
SO_REUSEPORT socket, so a libp2p connection cannot be punched; the data-plane
connection, whose sockets are ours, is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

from swarm.net.relay import reusable_socket

logger = logging.getLogger(__name__)

#: Seconds one connect attempt may take (the kernel retransmits a SYN after 1 s).
ATTEMPT_TIMEOUT = 2.5
RETRY_DELAY = 0.2


async def punch(local: tuple[str, int], remote: tuple[str, int], deadline: float
                ) -> socket.socket | None:
    """A TCP connection from ``local`` to ``remote`` by simultaneous open, or None when
    none opened within ``deadline`` seconds (the other side punches at the same time)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline
    family = socket.AF_INET6 if ":" in remote[0] else socket.AF_INET
    attempt = 0
    while (left := end - loop.time()) > 0:
        attempt += 1
        sock = reusable_socket(family)
        try:
            sock.bind(local)
            async with asyncio.timeout(min(ATTEMPT_TIMEOUT, left)):
                await loop.sock_connect(sock, remote)
        except (OSError, TimeoutError) as exc:
            sock.close()
            logger.debug("hole punch %s -> %s, attempt %d: %r", local, remote, attempt, exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.sleep(min(RETRY_DELAY, max(0.0, end - loop.time())))
            continue
        except BaseException:
            sock.close()
            raise
        logger.info("hole punched %s -> %s (attempt %d)", local, remote, attempt)
        return sock
    return None
