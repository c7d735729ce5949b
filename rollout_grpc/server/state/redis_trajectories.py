"""`TrajectoryStore` in Redis (or Valkey): agent sessions every replica and worker of a fleet reads.

Each operation is one Lua script (its claim check, caps and writes atomic on the server, on the
server's clock), as for the step buffers (redis_store.py, whose client settings this module
shares). Keys, under `rollout:traj:`:

* `c:<id>`: the session id's owner (a Redis TTL of `ttl_s`, renewed by every turn; kept after
  the session is collected, so the id stays its owner's);
* `s:<id>` (hash: owner, roles, turn count, bytes) and `t:<id>` (list of encoded turns);
* per owner: `live:<owner>` (sorted set id -> expiry ms), `bytes:<owner>`, `retired:<owner>`
  (collected ids, trimmed to `max_sessions_per_owner`).

An expired session is swept by the next operation on its owner (its bytes given back); every key
also carries a Redis TTL of twice `ttl_s`, renewed on each write, so an owner never seen again
leaves nothing behind.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from rollout_grpc.server.state.redis_store import PREFIX, RedisStore, connect, display_url, redis_call
from rollout_grpc.server.state.trajectories import StoredSession, TrajectoryCaps

T = TypeVar("T")

#: Key prefix of the sessions (inside the state store's).
TRAJ_PREFIX = PREFIX + "traj:"

_PRELUDE = """
local P = ARGV[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function sweep(o)
  local live = P .. 'live:' .. o
  for _, sid in ipairs(redis.call('ZRANGEBYSCORE', live, '-inf', now, 'LIMIT', 0, 64)) do
    local s = P .. 's:' .. sid
    if redis.call('HGET', s, 'owner') == o then
      redis.call('DECRBY', P .. 'bytes:' .. o, tonumber(redis.call('HGET', s, 'bytes') or '0'))
      redis.call('DEL', s, P .. 't:' .. sid)
    end
    redis.call('ZREM', live, sid)
  end
end
"""

#: ARGV[2] session id. nil, or {owner, roles, turns}.
_READ = (
    _PRELUDE
    + """
local sid = ARGV[2]
local o = redis.call('GET', P .. 'c:' .. sid)
if not o then return nil end
sweep(o)
local s = P .. 's:' .. sid
if redis.call('HGET', s, 'owner') ~= o then return {o, '', {}} end
return {o, redis.call('HGET', s, 'roles') or '', redis.call('LRANGE', P .. 't:' .. sid, 0, -1)}
"""
)

#: ARGV[2] owner, [3] id, [4] expected turns, [5] turn, [6] roles, [7] max sessions, [8] max
#: bytes, [9] ttl ms. "" or the refusal (trajectories.REFUSED_*).
_APPEND = (
    _PRELUDE
    + """
local o, sid = ARGV[2], ARGV[3]
local s, tl, c = P .. 's:' .. sid, P .. 't:' .. sid, P .. 'c:' .. sid
local prev = redis.call('HGET', s, 'owner')
if prev and prev ~= o then sweep(prev) end
sweep(o)
local claim = redis.call('GET', c)
if claim and claim ~= o then return 'owner' end
prev = redis.call('HGET', s, 'owner')
if prev and prev ~= o then return 'owner' end
local n = tonumber(redis.call('HGET', s, 'n') or '0')
if n ~= tonumber(ARGV[4]) then return 'conflict' end
local live, ob = P .. 'live:' .. o, P .. 'bytes:' .. o
if n == 0 and redis.call('ZCARD', live) >= tonumber(ARGV[7]) then return 'max_sessions_per_owner' end
local size = #ARGV[5] + #ARGV[6] - #(redis.call('HGET', s, 'roles') or '')
if tonumber(redis.call('GET', ob) or '0') + size > tonumber(ARGV[8]) then
  return 'max_session_bytes_per_owner'
end
local ttl = tonumber(ARGV[9])
redis.call('RPUSH', tl, ARGV[5])
redis.call('HSET', s, 'owner', o, 'roles', ARGV[6], 'n', n + 1)
redis.call('HINCRBY', s, 'bytes', size)
redis.call('INCRBY', ob, size)
redis.call('ZADD', live, now + ttl, sid)
redis.call('ZREM', P .. 'retired:' .. o, sid)
redis.call('SET', c, o, 'PX', ttl)
for _, k in ipairs({s, tl, live, ob}) do redis.call('PEXPIRE', k, 2 * ttl) end
return ''
"""
)

#: ARGV[2] owner, [3] id, [4] max sessions (kept retired ids), [5] ttl ms, [6] turns read.
#: 0: the session holds other than [6] turns now (nothing changed).
_REMOVE = (
    _PRELUDE
    + """
local o, sid = ARGV[2], ARGV[3]
local c, s = P .. 'c:' .. sid, P .. 's:' .. sid
sweep(o)
if redis.call('GET', c) ~= o then return 1 end
local live, ob = P .. 'live:' .. o, P .. 'bytes:' .. o
if redis.call('HGET', s, 'owner') == o then
  if tonumber(redis.call('HGET', s, 'n') or '0') ~= tonumber(ARGV[6]) then return 0 end
  redis.call('DECRBY', ob, tonumber(redis.call('HGET', s, 'bytes') or '0'))
  redis.call('DEL', s, P .. 't:' .. sid)
  redis.call('ZREM', live, sid)
end
local ttl = tonumber(ARGV[5])
local r = P .. 'retired:' .. o
redis.call('ZREMRANGEBYSCORE', r, '-inf', now - ttl)
redis.call('ZADD', r, now, sid)
redis.call('SET', c, o, 'PX', ttl)
redis.call('PEXPIRE', r, 2 * ttl)
local extra = redis.call('ZCARD', r) - tonumber(ARGV[4])
if extra > 0 then
  for _, old in ipairs(redis.call('ZRANGE', r, 0, extra - 1)) do
    redis.call('ZREM', r, old)
    if redis.call('GET', P .. 'c:' .. old) == o and not redis.call('ZSCORE', live, old) then
      redis.call('DEL', P .. 'c:' .. old)
    end
  end
end
return 1
"""
)

_USAGE = (
    _PRELUDE
    + """
local o = ARGV[2]
sweep(o)
return {redis.call('ZCARD', P .. 'live:' .. o), tonumber(redis.call('GET', P .. 'bytes:' .. o) or '0')}
"""
)


class RedisTrajectories:
    """`TrajectoryStore` in one Redis (the one `--state-store` names)."""

    def __init__(
        self,
        url: str,
        caps: TrajectoryCaps | None = None,
        *,
        password_file: str = "",
        ca_file: str = "",
        timeout_s: float = 5.0,
    ) -> None:
        client = connect(url, password_file=password_file, ca_file=ca_file, timeout_s=timeout_s)
        self._start(display_url(url), client, caps, owns_client=True)

    @classmethod
    def sharing(cls, store: RedisStore, caps: TrajectoryCaps | None = None) -> RedisTrajectories:
        """The sessions in the Redis of `store` over its connection pool: a replica keeps one pool
        to its store, and closing the sessions leaves the pool to the store."""
        sessions = cls.__new__(cls)
        sessions._start(store.name, store.client, caps, owns_client=False)
        return sessions

    def _start(self, name: str, client: Any, caps: TrajectoryCaps | None, *, owns_client: bool) -> None:
        self.name = name
        self.trajectory_caps = caps or TrajectoryCaps()
        self._client = client
        self._owns_client = owns_client
        scripts = {"read": _READ, "append": _APPEND, "remove": _REMOVE, "usage": _USAGE}
        self._scripts = {name: client.register_script(body) for name, body in scripts.items()}

    async def _call(self, op: Callable[[], Awaitable[T]]) -> T:
        return await redis_call(self.name, op)

    async def _run(self, script: str, *args: Any) -> Any:
        return await self._call(lambda: self._scripts[script](keys=[], args=[TRAJ_PREFIX, *args]))

    def _ttl_ms(self) -> int:
        return max(1, int(self.trajectory_caps.ttl_s * 1000))

    async def read_session(self, session_id: str) -> StoredSession | None:
        found = await self._run("read", session_id)
        if not found:
            return None
        owner, roles, turns = found
        return StoredSession(owner.decode(), [bytes(t) for t in turns], bytes(roles))

    async def append_turn(self, owner: str, session_id: str, expected: int, turn: bytes, roles: bytes) -> str:
        caps = self.trajectory_caps
        answer = await self._run(
            "append",
            owner,
            session_id,
            expected,
            turn,
            roles,
            caps.max_sessions_per_owner,
            caps.max_bytes_per_owner,
            self._ttl_ms(),
        )
        return answer.decode() if isinstance(answer, bytes) else str(answer)

    async def remove_session(self, owner: str, session_id: str, turns: int) -> bool:
        caps = self.trajectory_caps
        args = (owner, session_id, caps.max_sessions_per_owner, self._ttl_ms(), turns)
        return bool(await self._run("remove", *args))

    async def usage(self, owner: str) -> tuple[int, int]:
        count, size = await self._run("usage", owner)
        return int(count), int(size)

    async def close(self) -> None:
        if self._owns_client:
            await self._client.aclose()
