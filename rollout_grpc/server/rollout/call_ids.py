"""Engine-side call ids: one per replica, owner, request id and attempt, never shared.

Engines are shared by every replica of the fleet and by every caller, and they know a call only by
the id it was sent with: an abort by that id ends *every* call the engine tracks under it. A
caller's request id alone is therefore no engine id (two replicas, or two callers, may use the same
one: alice aborting her `shared-8` would end bob's `shared-8` too). The domain builds the id of
each engine call here, and an adapter only maps it to its engine's form
(`EngineAdapter.engine_request_id`):

    <instance>.<owner tag>~<request id, escaped>~<attempt>~

* `instance`: random hex drawn when the replica starts (`CallIds.new`), so no two replicas (nor
  two runs of one) build the same id: 48 bits, so among 10 000 replica starts the chance that two
  share a token is below 2 x 10^-7 (and their owner tags, under different keys, would still differ).
* `owner tag`: an HMAC of the caller's identity under a key that never leaves the replica, so the
  engines (and their logs) never see identities, and a guessed identity cannot be confirmed; two
  identities of one replica share a tag with chance 2^-48 per pair.
* `request id`: the caller's, with `%` and `~` percent-escaped, so that it holds no `~`.
* the trailing `~` terminates the id: every id has exactly three `~` and ends with one, so no id is
  a prefix of another (an engine that aborts by prefix, like SGLang, cannot reach a second call).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, field

#: Separates the parts of a call id and terminates it; never left inside a part.
SEPARATOR = "~"
#: Hex digits of the replica instance token and of the owner tag (48 bits each).
TOKEN_HEX = 12
#: Owners whose tags a replica keeps at most (identities of its callers; an owner past it is
#: hashed again, never tagged differently).
TAG_CACHE = 4096


def _escape(request_id: str) -> str:
    """`request_id` without `~` (percent-escaped, `%` first, so the escaping is injective)."""
    return request_id.replace("%", "%25").replace(SEPARATOR, "%7E")


@dataclass(frozen=True, slots=True)
class CallIds:
    """Builds this replica's engine call ids (see the module docstring for the scheme)."""

    #: The replica instance token: public, it is in every engine id of this replica (and logged).
    instance: str
    #: The owner-tag key: secret, it never leaves the replica.
    _key: bytes = field(repr=False)

    @classmethod
    def new(cls) -> CallIds:
        """A fresh instance token and key (one per replica start)."""
        return cls(secrets.token_hex(TOKEN_HEX // 2), secrets.token_bytes(32))

    #: Owner tags already computed (an HMAC per engine call was ~10 us of each Generate; the
    #: fourteenth pass in bench/profile_notes.md). Emptied when it holds `TAG_CACHE` owners.
    _tags: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    def owner_tag(self, owner: str) -> str:
        """A short stand-in for `owner` that engines may see; not reversible without the key."""
        tag = self._tags.get(owner)
        if tag is None:
            if len(self._tags) >= TAG_CACHE:
                self._tags.clear()
            tag = hmac.new(self._key, owner.encode(), hashlib.sha256).hexdigest()[:TOKEN_HEX]
            self._tags[owner] = tag
        return tag

    def call_id(self, owner: str, request_id: str, attempt: int) -> str:
        """The id of engine call `attempt` (0 first, then failovers) of `owner`'s `request_id`."""
        scope = f"{self.instance}.{self.owner_tag(owner)}"
        return f"{scope}{SEPARATOR}{_escape(request_id)}{SEPARATOR}{attempt}{SEPARATOR}"
