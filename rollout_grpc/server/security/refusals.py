"""What a flood of refused calls may cost: a rate of failed authentications per peer address, and
a bounded number of audit lines for refusals.

Refusing a call is cheap once nothing is decoded before authentication (the gRPC door reads no
request bytes of an unauthenticated caller), but each refusal still leaves an audit line: 1000
unauthenticated Pause calls wrote 230 KB of audit log, and a log that an attacker can fill hides
the lines that matter. So:

* `AuthFailureLimiter`: a token bucket of failed authentications per peer host (the address
  without its port). Past the bucket the caller gets RESOURCE_EXHAUSTED with a retry hint instead
  of UNAUTHENTICATED and no audit line. A valid credential from the same address is always let
  in: behind a proxy (nginx) every caller shares the proxy's address, and one misconfigured or
  hostile client must not lock the others out. Guessing tokens is no attack worth slowing (they
  are random secrets); the limit exists to make floods back off and stay out of the log.
* `RefusalSampler`: a global token bucket of audit lines for refusals; a refusal past it is only
  counted, and the count is written with the next line that is let through
  (`suppressed_refusals`), so the log says how many were left out.

The peer table is bounded (`max_peers`, oldest dropped first): addresses are the caller's to
choose on IPv6.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from rollout_grpc.server.domain.errors import ResourceExhausted


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string (`ipv4:10.0.0.1:5000`, `ipv6:[::1]:5000`), port dropped."""
    if peer.startswith(("ipv4:", "ipv6:")):
        host, sep, port = peer.rpartition(":")
        if sep and port.isdigit():
            return host
    return peer


class _Bucket:
    """One token bucket: `burst` at once, refilled at `rate_per_s` (0 = never refilled)."""

    __slots__ = ("at", "tokens")

    def __init__(self, tokens: float, at: float) -> None:
        self.tokens = tokens
        self.at = at

    def take(self, now: float, rate_per_s: float, burst: int) -> float:
        """Take one token: 0.0 when there was one, else the seconds until there is one."""
        self.tokens = min(float(burst), self.tokens + (now - self.at) * rate_per_s)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / rate_per_s if rate_per_s > 0 else 60.0


class AuthFailureLimiter:
    """Failed authentications per peer host: `burst` at once, then `rate_per_s`."""

    def __init__(
        self,
        rate_per_s: float,
        burst: int,
        *,
        max_peers: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`burst` 0 disables the limit."""
        self._rate = max(0.0, rate_per_s)
        self._burst = burst
        self._max_peers = max(1, max_peers)
        self._clock = clock
        self._peers: OrderedDict[str, _Bucket] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self._burst > 0

    def failed(self, peer: str) -> None:
        """Count one failed authentication of `peer`; ResourceExhausted when over its budget."""
        if not self.enabled:
            return
        host = peer_host(peer)
        now = self._clock()
        bucket = self._peers.get(host)
        if bucket is None:
            bucket = self._peers[host] = _Bucket(float(self._burst), now)
            while len(self._peers) > self._max_peers:
                self._peers.popitem(last=False)
        else:
            self._peers.move_to_end(host)
        wait = bucket.take(now, self._rate, self._burst)
        if wait > 0:
            raise ResourceExhausted(
                f"too many failed authentications from this address (auth_failure_rate_per_s="
                f"{self._rate:g}, auth_failure_burst={self._burst}); retry in {wait:.1f} s with a "
                "valid credential",
                wait,
            )


class RefusalSampler:
    """At most `burst` audit lines of refusals at once, then `rate_per_s`; the rest are counted."""

    def __init__(self, rate_per_s: float, burst: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        """`burst` 0 audits every refusal (no sampling)."""
        self._rate = max(0.0, rate_per_s)
        self._burst = burst
        self._clock = clock
        self._bucket = _Bucket(float(burst), clock())
        self.suppressed = 0

    def admit(self) -> int | None:
        """None: leave this refusal's line out (counted). Else the number left out since the last
        line that was written, to be written with this one."""
        if self._burst <= 0:
            return 0
        if self._bucket.take(self._clock(), self._rate, self._burst) > 0:
            self.suppressed += 1
            return None
        count, self.suppressed = self.suppressed, 0
        return count
