"""deployments/model_plan.py and ServeConfig.models: which deployments a multi-model config runs,
which models share a detokenizer, what a bad list is refused for, and the Serve YAML / CLI views
of it. CPU only, no Ray cluster."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from cluster.cli import main
from cluster.serve_yaml import REPO_ROOT, serve_schema_dict
from core.config import EngineConfig, ServeConfig, load_serve_config
from core.errors import InvalidArgumentError
from deployments.model_plan import detok_key, plan_models

EXAMPLE = REPO_ROOT / "deployments/configs/multi-model.yaml"


def listed(*names: str, **per_model) -> list[dict]:
    return [{"engine": {"model": {"name": name}}, **per_model.get(name, {})} for name in names]


def test_a_single_model_config_keeps_its_deployments():
    [only] = plan_models(ServeConfig())
    assert (only.name, only.llm_deployment, only.detok_deployment) == ("orpheus-tiny", "LLMStage", "DetokStage")
    assert only.view == ServeConfig() and ServeConfig().served_models()[0].engine == ServeConfig().engine


def test_each_model_gets_its_llm_deployment_and_s3gen_models_share_one_detok():
    config = ServeConfig(models=listed("orpheus-tiny", "csm-tiny", "cosyvoice2-tiny", "chatterbox-tiny"))
    plan = {served.name: served for served in plan_models(config)}
    assert {name: (s.llm_deployment, s.detok_deployment) for name, s in plan.items()} == {
        "orpheus-tiny": ("LLMStage-orpheus-tiny", "DetokStage-snac"),
        "csm-tiny": ("LLMStage-csm-tiny", "DetokStage-mimi"),
        "cosyvoice2-tiny": ("LLMStage-cosyvoice2-tiny", "DetokStage-s3gen"),
        "chatterbox-tiny": ("LLMStage-chatterbox-tiny", "DetokStage-s3gen"),
    }
    assert plan["cosyvoice2-tiny"].shares_detok_with == ("chatterbox-tiny",)
    assert plan["orpheus-tiny"].shares_detok_with == ()
    for name, served in plan.items():  # each stage sees its own model's engine and no list
        assert served.view.engine.model.name == name and served.view.models == ()


def test_detokenizers_differing_in_weights_or_settings_are_not_shared():
    seeded = EngineConfig.model_validate({"model": {"name": "chatterbox-tiny", "seed": 7}})
    assert detok_key(EngineConfig.model_validate({"model": {"name": "cosyvoice2-tiny"}})) != detok_key(seeded)
    config = ServeConfig(models=[*listed("cosyvoice2-tiny"), {"engine": seeded.model_dump()}])
    assert [s.detok_deployment for s in plan_models(config)] == ["DetokStage-s3gen", "DetokStage-s3gen-2"]


def test_a_shared_detok_with_other_deployment_settings_is_refused_naming_the_field():
    config = ServeConfig(models=listed("cosyvoice2-tiny", "chatterbox-tiny",
                                       **{"chatterbox-tiny": {"detok": {"num_replicas": 2}}}))  # fmt: skip
    with pytest.raises(InvalidArgumentError) as err:
        plan_models(config)
    assert err.value.field == "models[1].detok" and "shares its detokenizer with cosyvoice2-tiny" in str(err.value)


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"models": listed("csm-tiny", "csm-tiny")}, "models: csm-tiny listed more than once"),
        ({"models": listed("csm-tiny"), "engine": {"model": {"name": "dia-tiny"}}}, "engine: give each model's"),
        ({"models": listed("csm-tiny"), "llm": {"num_replicas": 2}}, "llm: give each model's"),
        ({"models": [{"engine": {"model": {"name": "csm-tiny"}, "cache": {"num_slots": 4},
                                 "scheduler": {"max_batch_size": 4}}}]},
         "max_streams_per_replica must be <= models\\[0\\].engine.cache.num_slots"),
        ({"models": [{"engine": {"model": {"name": "csm-tiny"}}, "lm": {}}]}, "models.0.lm"),
    ],
)  # fmt: skip
def test_a_bad_model_list_is_refused_naming_the_field(data, field):
    with pytest.raises(ValidationError, match=field):
        ServeConfig.model_validate(data)


def test_the_example_config_renders_one_deployment_per_llm_and_shared_detok():
    config = load_serve_config(EXAMPLE)
    rendered = serve_schema_dict(config)
    ServeDeploySchema.model_validate(rendered)
    [app] = rendered["applications"]
    assert [d["name"] for d in app["deployments"]] == [
        "Router", "LLMStage-orpheus-tiny", "DetokStage-snac", "LLMStage-csm-tiny", "DetokStage-mimi",
        "LLMStage-cosyvoice2-tiny", "DetokStage-s3gen", "LLMStage-chatterbox-tiny",
    ]  # fmt: skip
    assert ServeConfig.model_validate(app["args"]) == config  # the app builder reads the same config back
    assert "models" not in serve_schema_dict(ServeConfig())["applications"][0]["args"]  # one model: as before


def test_voxray_models_config_lists_the_served_models_and_their_deployments(capsys):
    assert main(["models", "--config", str(EXAMPLE)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "orpheus-tiny  (default): LLMStage-orpheus-tiny -> DetokStage-snac"
    assert "chatterbox-tiny: LLMStage-chatterbox-tiny -> DetokStage-s3gen, shared with cosyvoice2-tiny" in out
