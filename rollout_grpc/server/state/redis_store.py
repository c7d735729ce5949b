"""`BufferStore` in Redis (or Valkey): the state every replica and worker of a fleet shares.

Every operation is one Lua script, so its caps, its expiry sweep and its writes are atomic on the
server: two replicas putting for one owner at once cannot pass a cap together. Keys are built in
the scripts from one prefix, which suits one Redis (a primary with replicas), not Redis Cluster.
Time is the server's (`TIME`), so replicas with skewed clocks agree on expiries.

Keys per owner: `g:<owner>` (list of group blobs, oldest first), `idx:<owner>` (list of
`index:size`), `bytes:<owner>`; `lost:<owner>` (list of lost indexes, `LOST_TTL_S`);
`lease:<owner>` (sorted set lease -> expiry ms); `held:<owner>` (hash lease -> the comma-separated
group indexes its step holds only in its process, `LOST_TTL_S`: swept to the lost list when the
lease is gone unended). Shared: `total` (bytes of every buffer) and
`expiry` (sorted set owner -> expiry ms of its buffer). Buffers carry no Redis TTL: an expired one
is swept by the next operation (at most 64 owners per call) and its indexes move to the owner's
lost list, so the bytes total never drifts and no group vanishes unreported.

Only this module and its fleet bus (`redis_bus.py`) import `redis` (an import contract in
pyproject.toml says so).
"""

from __future__ import annotations

import asyncio
import urllib.parse
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from rollout_grpc.server.state.api import (
    LOST_TTL_S,
    MAX_LOST,
    MAX_VERSIONS,
    BufferCaps,
    Holding,
    StoredGroup,
    StoreUnavailable,
)

T = TypeVar("T")

#: Key prefix of everything this store writes.
PREFIX = "rollout:"
#: Poll interval bounds while a continue step waits for another step's drain lease.
_POLL_MIN_S = 0.01
_POLL_MAX_S = 0.2

_PRELUDE = f"""
local P = ARGV[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function note_lost(o, idx)
  local key = P .. 'lost:' .. o
  if redis.call('LLEN', key) < {MAX_LOST} then redis.call('RPUSH', key, idx) end
  redis.call('EXPIRE', key, {LOST_TTL_S})
end
local function sweep()
  local expired = redis.call('ZRANGEBYSCORE', P .. 'expiry', '-inf', now, 'LIMIT', 0, 64)
  for _, o in ipairs(expired) do
    for _, e in ipairs(redis.call('LRANGE', P .. 'idx:' .. o, 0, -1)) do
      note_lost(o, string.match(e, '^(-?%d+):'))
    end
    redis.call('DECRBY', P .. 'total', tonumber(redis.call('GET', P .. 'bytes:' .. o) or '0'))
    redis.call('DEL', P .. 'g:' .. o, P .. 'idx:' .. o, P .. 'bytes:' .. o)
    redis.call('ZREM', P .. 'expiry', o)
  end
end
sweep()
local o = ARGV[2]
"""

_PUT = (
    _PRELUDE
    + """
local maxg, maxb, maxt, ttl = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local n = tonumber(ARGV[7])
local count = redis.call('LLEN', P .. 'g:' .. o)
local b = tonumber(redis.call('GET', P .. 'bytes:' .. o) or '0')
local total = tonumber(redis.call('GET', P .. 'total') or '0')
local refused = {}
for k = 0, n - 1 do
  local idx, size, blob = ARGV[8 + 3 * k], tonumber(ARGV[9 + 3 * k]), ARGV[10 + 3 * k]
  if #refused == 0 and count < maxg and b + size <= maxb and total + size <= maxt then
    redis.call('RPUSH', P .. 'g:' .. o, blob)
    redis.call('RPUSH', P .. 'idx:' .. o, idx .. ':' .. size)
    count, b, total = count + 1, b + size, total + size
  else
    table.insert(refused, k)
  end
end
if count > 0 then
  redis.call('SET', P .. 'bytes:' .. o, b)
  redis.call('SET', P .. 'total', total)
  redis.call('ZADD', P .. 'expiry', now + ttl, o)
end
return refused
"""
)

#: Every group of the owner, oldest first; the buffer empties (its bytes leave the total).
_TAKE_ALL = """
local blobs = redis.call('LRANGE', P .. 'g:' .. o, 0, -1)
redis.call('DECRBY', P .. 'total', tonumber(redis.call('GET', P .. 'bytes:' .. o) or '0'))
redis.call('DEL', P .. 'g:' .. o, P .. 'idx:' .. o, P .. 'bytes:' .. o)
redis.call('ZREM', P .. 'expiry', o)
return blobs
"""

_TAKE = _PRELUDE + _TAKE_ALL

#: ARGV[3] lease. The taken indexes appended to the lease's held groups, then `_TAKE_ALL`, atomically;
#: a lease that is not live takes nothing.
_TAKE_HELD = (
    _PRELUDE
    + f"""
local expiry = redis.call('ZSCORE', P .. 'lease:' .. o, ARGV[3])
if not expiry or tonumber(expiry) <= now then return {{}} end
local taken = {{}}
for _, e in ipairs(redis.call('LRANGE', P .. 'idx:' .. o, 0, -1)) do
  table.insert(taken, string.match(e, '^(-?%d+):'))
end
if #taken > 0 then
  local key = P .. 'held:' .. o
  local held = table.concat(taken, ',')
  local before = redis.call('HGET', key, ARGV[3])
  if before and before ~= '' then held = before .. ',' .. held end
  redis.call('HSET', key, ARGV[3], held)
  redis.call('EXPIRE', key, {LOST_TTL_S})
end
"""
    + _TAKE_ALL
)

_HOLDING = (
    _PRELUDE
    + """
return {redis.call('LRANGE', P .. 'idx:' .. o, 0, -1), tonumber(redis.call('GET', P .. 'bytes:' .. o) or '0')}
"""
)

_TOTAL = _PRELUDE + "return tonumber(redis.call('GET', P .. 'total') or '0')\n"

_NOTE_LOST = (
    _PRELUDE
    + """
for k = 3, #ARGV do note_lost(o, ARGV[k]) end
return 0
"""
)

#: Leases of the owner that expired unended (their replica died): their held groups, less those
#: the owner has buffered since, go to its lost list. Run before the lost list or the leases are read.
_SWEEP_HELD = """
local function sweep_held()
  local key = P .. 'held:' .. o
  local entries = redis.call('HGETALL', key)
  if #entries == 0 then return end
  local buffered = {}
  for _, e in ipairs(redis.call('LRANGE', P .. 'idx:' .. o, 0, -1)) do
    buffered[string.match(e, '^(-?%d+):')] = true
  end
  for k = 1, #entries, 2 do
    local expiry = redis.call('ZSCORE', P .. 'lease:' .. o, entries[k])
    if not expiry or tonumber(expiry) <= now then
      for idx in string.gmatch(entries[k + 1], '[^,]+') do
        if not buffered[idx] then note_lost(o, idx) end
      end
      redis.call('HDEL', key, entries[k])
    end
  end
end
sweep_held()
"""

#: ARGV[3] lease, ARGV[4] its held indexes, comma-separated ("" : none). Only a live lease holds.
_HOLD_GROUPS = (
    _PRELUDE
    + f"""
local expiry = redis.call('ZSCORE', P .. 'lease:' .. o, ARGV[3])
if not expiry or tonumber(expiry) <= now then return 0 end
local key = P .. 'held:' .. o
if ARGV[4] == '' then redis.call('HDEL', key, ARGV[3]) return 1 end
redis.call('HSET', key, ARGV[3], ARGV[4])
redis.call('EXPIRE', key, {LOST_TTL_S})
return 1
"""
)

_TAKE_LOST = (
    _PRELUDE
    + _SWEEP_HELD
    + """
local lost = redis.call('LRANGE', P .. 'lost:' .. o, 0, -1)
redis.call('DEL', P .. 'lost:' .. o)
return lost
"""
)

#: ARGV[3] lease, ARGV[4] ttl ms, ARGV[5] "1": only extend a lease that is live (0 otherwise: it
#: ended, or expired and its held groups are being reported lost; it is not revived).
_LEASE = (
    _PRELUDE
    + """
local key = P .. 'lease:' .. o
if ARGV[5] == '1' then
  local expiry = redis.call('ZSCORE', key, ARGV[3])
  if not expiry or tonumber(expiry) <= now then return 0 end
end
redis.call('ZADD', key, now + tonumber(ARGV[4]), ARGV[3])
redis.call('PEXPIRE', key, tonumber(ARGV[4]))
return 1
"""
)

_END_LEASE = (
    _PRELUDE
    + """
redis.call('ZREM', P .. 'lease:' .. o, ARGV[3])
redis.call('HDEL', P .. 'held:' .. o, ARGV[3])
return 0
"""
)

_LEASES_HELD = (
    _PRELUDE
    + _SWEEP_HELD
    + """
local key = P .. 'lease:' .. o
redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
return redis.call('ZCARD', key)
"""
)


# Fleet leases (`fleet-lease:<name>`, the holder with a Redis TTL) and the weight-version order
# (`versions`, a list oldest first). These take no sweep: they touch no buffer.
#: KEYS[1] lease key; ARGV[1] holder, ARGV[2] ttl ms. "" when held now, else the holder.
_TAKE_FLEET_LEASE = """
local current = redis.call('GET', KEYS[1])
if current and current ~= ARGV[1] then return current end
redis.call('SET', KEYS[1], ARGV[1], 'PX', tonumber(ARGV[2]))
return ''
"""

_RENEW_FLEET_LEASE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
return 1
"""

_RELEASE_FLEET_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 0
"""

#: KEYS[1] the order; ARGV[1] label. {1 or 0, order}: api.advance_order, atomically.
_ADVANCE_VERSION = f"""
local label = ARGV[1]
local newest = redis.call('LINDEX', KEYS[1], -1)
local function decimal(s)
  if not string.match(s, '^%d+$') then return nil end
  local d = string.gsub(s, '^0+', '')
  return d
end
local ok = 1
if newest ~= label then
  if redis.call('LPOS', KEYS[1], label) then
    ok = 0
  elseif newest then
    local a, b = decimal(label), decimal(newest)
    if a and b and (#a < #b or (#a == #b and a <= b)) then ok = 0 end
  end
  if ok == 1 then
    redis.call('RPUSH', KEYS[1], label)
    redis.call('LTRIM', KEYS[1], -{MAX_VERSIONS}, -1)
  end
end
return {{ok, redis.call('LRANGE', KEYS[1], 0, -1)}}
"""


def check_url(url: str) -> None:
    """Refuse a store URL this module cannot use, naming the flag (ValueError)."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("redis", "rediss"):
        raise ValueError(f"--state-store: {url!r} is neither redis:// nor rediss://")
    if parsed.password:
        raise ValueError(
            "--state-store: the URL holds a password; put it in a file named by "
            "--state-store-password-file (a command line is visible to every local user)"
        )


def display_url(url: str) -> str:
    """The URL as errors name it (never with credentials: check_url refuses them anyway)."""
    parsed = urllib.parse.urlsplit(url)
    return f"{parsed.scheme}://{parsed.hostname}:{parsed.port or 6379}{parsed.path or '/0'}"


async def redis_call(name: str, op: Callable[[], Awaitable[T]]) -> T:
    """Run one operation on the store named `name`; a Redis or socket error is `StoreUnavailable`
    naming the store (every module that speaks to Redis answers its callers so)."""
    try:
        return await op()
    except (RedisError, OSError) as exc:
        raise StoreUnavailable(name, f"{type(exc).__name__}: {exc}") from exc


def connect(
    url: str, *, password_file: str = "", ca_file: str = "", timeout_s: float = 5.0
) -> aioredis.Redis:
    """A client of the store at `url` (checked: ValueError naming the flag)."""
    check_url(url)
    kwargs: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "health_check_interval": 30,
    }
    if password_file:
        try:
            kwargs["password"] = Path(password_file).read_text().strip()
        except OSError as exc:
            raise ValueError(
                f"--state-store-password-file: cannot read {password_file}: {exc.strerror}"
            ) from None
    if ca_file and url.startswith("rediss://"):
        kwargs["ssl_ca_certs"] = ca_file
    client: aioredis.Redis = aioredis.Redis.from_url(url, **kwargs)
    return client


class RedisStore:
    """`BufferStore` in one Redis."""

    def __init__(
        self,
        url: str,
        caps: BufferCaps | None = None,
        *,
        password_file: str = "",
        ca_file: str = "",
        timeout_s: float = 5.0,
    ) -> None:
        self.name = display_url(url)
        self.caps = caps or BufferCaps()
        self._client = connect(url, password_file=password_file, ca_file=ca_file, timeout_s=timeout_s)
        scripts = {
            "put": _PUT,
            "take": _TAKE,
            "take_held": _TAKE_HELD,
            "holding": _HOLDING,
            "total": _TOTAL,
            "note_lost": _NOTE_LOST,
            "take_lost": _TAKE_LOST,
            "lease": _LEASE,
            "end_lease": _END_LEASE,
            "leases_held": _LEASES_HELD,
            "hold_groups": _HOLD_GROUPS,
            "take_fleet_lease": _TAKE_FLEET_LEASE,
            "renew_fleet_lease": _RENEW_FLEET_LEASE,
            "release_fleet_lease": _RELEASE_FLEET_LEASE,
            "advance_version": _ADVANCE_VERSION,
        }
        self._scripts = {name: self._client.register_script(body) for name, body in scripts.items()}

    @property
    def client(self) -> aioredis.Redis:
        """The connection pool's client, shared by the fleet bus (`redis_bus.py`)."""
        return self._client

    async def _call(self, op: Callable[[], Awaitable[T]]) -> T:
        return await redis_call(self.name, op)

    async def _run(self, script: str, owner: str, *args: Any) -> Any:
        return await self._call(lambda: self._scripts[script](keys=[], args=[PREFIX, owner, *args]))

    async def put(self, owner: str, groups: Sequence[StoredGroup]) -> list[int]:
        caps = self.caps
        args: list[Any] = [
            caps.max_groups_per_owner,
            caps.max_bytes_per_owner,
            caps.max_bytes_total,
            int(caps.ttl_s * 1000),
            len(groups),
        ]
        for g in groups:
            args += [g.index, g.size, g.blob]
        refused = await self._run("put", owner, *args)
        return [int(i) for i in refused]

    async def take(self, owner: str) -> list[bytes]:
        return list(await self._run("take", owner))

    async def take_held(self, owner: str, lease: str) -> list[bytes]:
        return list(await self._run("take_held", owner, lease))

    async def holding(self, owner: str) -> Holding:
        entries, size = await self._run("holding", owner)
        indexes = frozenset(int(e.split(b":", 1)[0]) for e in entries)
        return Holding(len(entries), int(size), indexes)

    async def total_bytes(self) -> int:
        return int(await self._run("total", ""))

    async def note_lost(self, owner: str, indexes: Sequence[int]) -> None:
        if indexes:
            await self._run("note_lost", owner, *indexes)

    async def take_lost(self, owner: str) -> list[int]:
        return [int(i) for i in await self._run("take_lost", owner)]

    async def begin_drain(self, owner: str, lease: str) -> None:
        await self._run("lease", owner, lease, int(self.caps.lease_ttl_s * 1000), "0")

    async def renew_drain(self, owner: str, lease: str) -> bool:
        return bool(await self._run("lease", owner, lease, int(self.caps.lease_ttl_s * 1000), "1"))

    async def end_drain(self, owner: str, lease: str) -> None:
        await self._run("end_lease", owner, lease)

    async def hold_groups(self, owner: str, lease: str, indexes: Sequence[int]) -> None:
        await self._run("hold_groups", owner, lease, ",".join(str(int(i)) for i in indexes))

    async def wait_drains(self, owner: str, timeout_s: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        pause = _POLL_MIN_S
        # A poll, not pub/sub: a lease of a killed replica ends by expiring, which publishes nothing.
        while int(await self._run("leases_held", owner)):
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(min(pause, max(0.0, deadline - loop.time())))
            pause = min(pause * 2, _POLL_MAX_S)
        return True

    async def ping(self) -> None:
        await self._call(self._client.ping)

    async def close(self) -> None:
        await self._client.aclose()

    async def _keyed(self, script: str, key: str, *args: Any) -> Any:
        return await self._call(lambda: self._scripts[script](keys=[PREFIX + key], args=list(args)))

    async def take_lease(self, name: str, holder: str, ttl_s: float) -> str:
        current = await self._keyed(
            "take_fleet_lease", f"fleet-lease:{name}", holder, max(1, int(ttl_s * 1000))
        )
        return current.decode() if isinstance(current, bytes) else str(current)

    async def renew_lease(self, name: str, holder: str, ttl_s: float) -> bool:
        return bool(
            await self._keyed("renew_fleet_lease", f"fleet-lease:{name}", holder, max(1, int(ttl_s * 1000)))
        )

    async def release_lease(self, name: str, holder: str) -> None:
        await self._keyed("release_fleet_lease", f"fleet-lease:{name}", holder)

    async def advance_version(self, label: str) -> tuple[bool, list[str]]:
        ok, order = await self._keyed("advance_version", "versions", label)
        return bool(ok), [v.decode() for v in order]

    async def version_order(self) -> list[str]:
        order: list[bytes] = await self._call(
            lambda: self._client.lrange(PREFIX + "versions", 0, -1)  # type: ignore[arg-type,return-value]
        )
        return [v.decode() for v in order]

    async def bump_pause_epoch(self) -> int:
        epoch = await self._call(lambda: self._client.incr(PREFIX + "pause-epoch"))
        return int(epoch)

    async def pause_epoch(self) -> int:
        epoch = await self._call(lambda: self._client.get(PREFIX + "pause-epoch"))
        return int(epoch or 0)
