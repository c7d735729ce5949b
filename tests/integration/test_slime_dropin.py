"""The RolloutStep slime drop-in never silently ignores a slime setting, and evaluates with slime's
defaults: a real replica on simulated engines, a real HTTP reward model, slime-shaped Samples
(tests/client/slime_types.py), and, with `SLIME_SRC`, slime's own code at the pinned commit."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import types
from typing import Any

import pytest

from rollout_grpc.integrations import slime_eval, slime_step
from rollout_grpc.integrations.slime_args import OWN_GENERATE, check_args
from tests.client.slime_types import Sample
from tests.harness import harness
from tests.support import slime_real
from tests.support.reward_server import RewardServer
from tests.support.service import PROMPT
from tests.support.slime_step import DataSource, args

CALLS: list[tuple[str, Any]] = []


def keep_first_group(args: Any, data: list[list[Sample]]) -> None:
    """A `--rollout-sample-filter-path` function (slime calls it with the kept groups)."""
    CALLS.append(("filter", [g[0].group_index for g in data]))


def see_every_group(args: Any, all_samples: list[list[Sample]], data_source: Any) -> None:
    """A `--rollout-all-samples-process-path` function (every generated group, kept or dropped)."""
    CALLS.append(("all", [(g[0].group_index, g[0].label) for g in all_samples]))


HERE = "tests.integration.test_slime_dropin"


@pytest.mark.parametrize(
    ("setting", "value", "named"),
    [
        ("custom_generate_function_path", "my.agent.generate", "--custom-generate-function-path"),
        ("rollout_sample_hook_path", ["my.hook"], "--rollout-sample-hook-path"),
        ("rollout_global_dataset", False, "--rollout-global-dataset"),
        ("rollout_top_p", 0.9, "--rollout-top-p"),
        ("custom_rm_path", "my.rm", "--custom-rm-path"),
        ("dynamic_sampling_filter_path", "my.filter", "--dynamic-sampling-filter-path"),
        ("rollout_sample_filter_path", "no.such.module.fn", "no.such.module.fn"),
        ("rollout_all_samples_process_path", f"{HERE}.missing", f"{HERE}.missing"),
    ],
)
def test_a_setting_the_drop_in_cannot_honour_is_refused_at_start_naming_it(
    setting: str, value: Any, named: str
) -> None:
    source = DataSource(["alternate"] * 2, n=2)
    setup = args("127.0.0.1:1", "http://127.0.0.1:1/rm", **{setting: value})
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        slime_step.generate_rollout(setup, 0, source)
    assert len(source.fresh) == 2, "refused before the data source was read"


def test_our_own_generate_function_is_what_the_step_does() -> None:
    check_args(args("t", "u", custom_generate_function_path=OWN_GENERATE))


@pytest.mark.parametrize(
    ("attribute", "value", "named"),
    [
        ("metadata", {"rm_type": "dapo"}, r'metadata\["rm_type"\]'),
        ("custom_rm_path", "my.rm", "custom_rm_path"),
        ("generate_function_path", "my.agent.generate", "generate_function_path"),
    ],
)
def test_a_sample_asking_for_its_own_reward_or_generation_is_refused(
    attribute: str, value: Any, named: str
) -> None:
    source = DataSource(["alternate"] * 2, n=2)
    setattr(source.fresh[1][0], attribute, value)
    with pytest.raises(ValueError, match=named):
        slime_step.generate_rollout(args("127.0.0.1:1", "http://127.0.0.1:1/rm"), 0, source)


async def test_the_post_rollout_hooks_run_as_slime_runs_them() -> None:
    CALLS.clear()
    async with harness("sim") as h, RewardServer() as rm:
        source = DataSource(["one", "alternate", "alternate"], n=2)
        setup = args(
            h.target,
            rm.url,
            over_sampling_batch_size=3,
            rollout_sample_filter_path=f"{HERE}.keep_first_group",
            rollout_all_samples_process_path=f"{HERE}.see_every_group",
        )
        groups = await asyncio.to_thread(slime_step.generate_rollout, setup, 3, source)
    assert [g[0].group_index for g in groups] == [1, 2]
    assert CALLS[0] == ("filter", [1, 2])
    kind, every = CALLS[1]
    assert kind == "all" and (0, "one") in every, "the filtered group is among all samples"


async def test_a_failing_reward_model_stops_the_rollout_with_its_reason() -> None:
    """It used to start rounds until the data source ran dry and blame the data source."""
    async with harness("sim") as h, RewardServer() as rm:
        rm.failing = True
        source = DataSource(["alternate"] * 6, n=2)
        setup = args(h.target, rm.url, over_sampling_batch_size=2)
        with pytest.raises(RuntimeError, match="reward"):
            await asyncio.to_thread(slime_step.generate_rollout, setup, 0, source)
    assert len(source.fresh) == 4, "one round, not every prompt of the data source"


# ---------------------------------------------------------------------------------------- eval


@dataclasses.dataclass
class EvalCfg:
    """The fields of slime's EvalDatasetConfig the eval reads (the real class is used with SLIME_SRC)."""

    name: str
    path: str = "unused.jsonl"
    rm_type: str | None = None
    n_samples_per_eval_prompt: int = 2
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = -1
    max_response_len: int = 5
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_new_tokens: int | None = None
    repetition_penalty: float | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    custom_rm_path: str | None = None
    custom_generate_function_path: str | None = None
    metadata_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)

    def inject_metadata(self, metadata: Any) -> dict[str, Any]:
        out = dict(metadata) if isinstance(metadata, dict) else {}
        if self.rm_type is not None:
            out["rm_type"] = self.rm_type
        return {**out, **self.metadata_overrides}


def eval_prompts(args: Any, cfg: Any) -> list[Sample]:
    """Three prompts per dataset, labelled for the reward server."""
    return [Sample(tokens=[*PROMPT, p], prompt=f"q{p}", label="parity") for p in range(3)]


async def run_eval(monkeypatch: pytest.MonkeyPatch, configs: list[Any]) -> Any:
    monkeypatch.setattr(slime_eval, "EVAL_PROMPTS", eval_prompts)
    async with harness("sim") as h, RewardServer() as rm:
        setup = args(h.target, rm.url, eval_datasets=configs, eval_reward_key=None, reward_key=None)
        out = await asyncio.to_thread(slime_step.generate_rollout, setup, 5, None, True)
        return out, rm.requests


async def test_evaluation_runs_every_dataset_through_the_service(monkeypatch: pytest.MonkeyPatch) -> None:
    out, requests = await run_eval(
        monkeypatch, [EvalCfg("aime"), EvalCfg("math500", n_samples_per_eval_prompt=1, max_response_len=3)]
    )
    assert set(out) == {"aime", "math500"}
    aime = out["aime"]
    assert [s.index for s in aime["samples"]] == list(range(6)), "3 prompts x 2 samples, indexes in order"
    assert all(s.response_length == 5 for s in aime["samples"]), "the dataset's own max_response_len"
    assert aime["rewards"] == [s.reward for s in aime["samples"]] and all(
        r in (0.0, 1.0) for r in aime["rewards"]
    )
    assert aime["truncated"] == [s.status is Sample.Status.TRUNCATED for s in aime["samples"]]
    assert [s.response_length for s in out["math500"]["samples"]] == [3, 3, 3]
    assert len(requests) == 9, "every eval sample scored by the reward model"


async def test_an_eval_dataset_setting_the_service_cannot_run_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ValueError, match="custom_generate_function_path"):
        await run_eval(monkeypatch, [EvalCfg("ok"), EvalCfg("agent", custom_generate_function_path="my.gen")])


def test_the_eval_sampling_parameters_fall_back_as_slimes() -> None:
    setup = types.SimpleNamespace(rollout_stop=["</s>"], rollout_skip_special_tokens=True)
    params = slime_eval.eval_sampling_params(setup, EvalCfg("x", temperature=0.3, no_stop_trim=False))
    assert params.temperature == pytest.approx(0.3) and list(params.stop) == ["</s>"]
    assert params.skip_special_tokens and not params.no_stop_trim and params.max_new_tokens == 5


# ------------------------------------------------------------------------ slime's own code (pinned)

needs_slime = pytest.mark.skipif(
    slime_real.root() is None,
    reason=f"SLIME_SRC is not set to a THUDM/slime checkout (tests written at {slime_real.PINNED})",
)


@needs_slime
def test_generate_rollout_has_slimes_signature() -> None:
    theirs = slime_real.function_parameters("slime/rollout/sglang_rollout.py", "generate_rollout")
    ours = [
        (p.name, ... if p.default is inspect.Parameter.empty else p.default)
        for p in inspect.signature(slime_step.generate_rollout).parameters.values()
    ]
    assert ours == theirs


@needs_slime
def test_the_outputs_and_samples_have_slimes_fields() -> None:
    assert slime_real.dataclass_fields("slime/rollout/base_types.py", "RolloutFnTrainOutput") == [
        "samples",
        "metrics",
    ]
    assert slime_real.dataclass_fields("slime/rollout/base_types.py", "RolloutFnEvalOutput") == [
        "data",
        "metrics",
    ]
    theirs = slime_real.dataclass_fields("slime/utils/types.py", "Sample")
    assert [f.name for f in dataclasses.fields(Sample)] == theirs, (
        "the test stand-in drifted from slime's Sample"
    )


@needs_slime
async def test_evaluation_with_slimes_own_dataset_config(monkeypatch: pytest.MonkeyPatch) -> None:
    eval_config = slime_real.load_file("slime/utils/eval_config.py", "_slime_eval_config")
    cfg = eval_config.EvalDatasetConfig(
        name="gsm8k",
        path="unused.jsonl",
        n_samples_per_eval_prompt=2,
        temperature=0.6,
        top_p=1.0,
        top_k=-1,
        max_response_len=4,
        metadata_overrides={"source": "eval"},
    )
    out, _ = await run_eval(monkeypatch, [cfg])
    samples = out["gsm8k"]["samples"]
    assert len(samples) == 6 and all(s.metadata == {"source": "eval"} for s in samples)
    assert all(s.response_length == 4 for s in samples)


async def test_rm_type_dapo_gives_slimes_whole_answer_in_sample_reward() -> None:
    """slime's `dapo` returns `{score, acc, pred}` and `--reward-key score` reads it: the drop-in
    writes the same object (a float here would break slime's `get_reward_value`)."""
    async with harness("sim") as h:
        source = DataSource(["7"], n=2)
        setup = args(
            h.target,
            "",
            rm_type="dapo",
            reward_key="score",
            dynamic_sampling_filter_path=None,
            rollout_batch_size=1,
        )
        [group] = await asyncio.to_thread(slime_step.generate_rollout, setup, 0, source)
    for sample in group:
        assert isinstance(sample.reward, dict) and set(sample.reward) == {"score", "acc", "pred"}
        assert sample.reward["score"] == -1.0 and sample.reward["acc"] is False
