"""A stand-in for slime's `Sample` (slime is not installable here): same field names, types, defaults.

Facts from THUDM/slime `slime/utils/types.py` (HEAD 624b824a): a dataclass whose `status` is the
nested `Sample.Status` enum with string values, `weight_versions: list[str]` (one per engine call),
`reward: float | dict | None`, `metadata: dict`, `loss_mask`/`rollout_log_probs` optional lists,
`rollout_routed_experts` an int32 array, `spec_info` / `prefix_cache_info` nested dataclasses, and
`to_dict`/`from_dict` that keep unknown attributes (restored with setattr). Written from those facts
for the tests; no slime code is copied.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpecInfo:
    spec_accept_token_num: int = 0
    spec_draft_token_num: int = 0
    spec_verify_ct: int = 0
    completion_token_num: int = 0


@dataclass
class PrefixCacheInfo:
    cached_tokens: int = 0
    total_prompt_tokens: int = 0


@dataclass
class Sample:
    """slime's rollout record (field order and defaults as in slime)."""

    class Status(enum.Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    multimodal_train_input_id: str | None = None
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_top_p_token_ids: list[int] | None = None
    rollout_top_p_token_offsets: list[int] | None = None
    rollout_routed_experts: Any = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None
    status: Sample.Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    train_metadata: dict[str, Any] | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0
    spec_info: SpecInfo = field(default_factory=SpecInfo)
    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)

    def to_dict(self) -> dict[str, Any]:
        """slime's serialisation: the instance dict, status as its value, nested infos as dicts."""
        value = dict(self.__dict__)
        value["status"] = self.status.value
        value["spec_info"] = dict(self.spec_info.__dict__)
        value["prefix_cache_info"] = dict(self.prefix_cache_info.__dict__)
        return value

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Sample:
        """The inverse of to_dict; unknown keys become attributes."""
        data = dict(data)
        data["status"] = Sample.Status(data["status"])
        data["spec_info"] = SpecInfo(**data.get("spec_info", {}))
        data["prefix_cache_info"] = PrefixCacheInfo(**data.get("prefix_cache_info", {}))
        names = set(Sample.__dataclass_fields__)
        sample = Sample(**{k: v for k, v in data.items() if k in names})
        for key, value in data.items():
            if key not in names:
                setattr(sample, key, value)
        return sample
