"""Every default is written once, in its config dataclass; the front ends derive theirs from it.

The sources: `ModelConfig` (model, encoders, cache), `EngineConfig` (decode engine), `SamplingParams`
(sampling), `ServeLimits` (serve limits), `PrefixRouting` (Decoder routing), `BatchOptions` (batch jobs).
CLI flags, Serve's `AppArgs` and `Pipeline.from_pretrained` must agree with them.

The rule for deployments/config.yaml: every value under the application's `args:` (and its
`engine:` and `limits:`) equals the code's default, except the keys in `DELIBERATE`, which are
deployment choices that differ on purpose (none today). The values are listed so an operator sees
the knobs; this test keeps them from drifting. Deployment options (replicas, autoscaling, resources,
max_ongoing_requests, health checks) are the other way round: they live in config.yaml only, and
the `@serve.deployment` decorators carry none.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import pathlib

import pytest

from raypipe.batch import BatchOptions
from raypipe.cli import build_parser
from raypipe.config import EngineConfig, ModelConfig, TokenBudgets
from raypipe.inputs.sampling import SamplingParams
from raypipe.serve.kuberay import load_serve_config
from raypipe.serve.limits import ServeLimits
from raypipe.serve.prefix_affinity import PrefixRouting

SERVE = pathlib.Path(__file__).resolve().parents[1] / "raypipe" / "serve"
DELIBERATE: set[str] = set()  # config.yaml args keys ("limits.max_body_bytes", ...) that differ from code on purpose


def defaults(config_class) -> dict:
    """Field -> default, read here rather than through raypipe.config.defaults, the helper under test."""
    return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(config_class)
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}


def subparsers() -> dict[str, argparse.ArgumentParser]:
    [action] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


def flag_defaults(parser: argparse.ArgumentParser) -> dict:
    """Each flag's default, less the switches of the command's own output (--help, --debug, --verbose)."""
    return {a.dest: a.default for a in parser._actions if a.dest not in ("help", "debug", "verbose")}


def model_defaults(config: ModelConfig, *, ranged: bool = False) -> dict:
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return {**values, "num_encoders": config.encoder_range} if ranged else values


@pytest.mark.parametrize("command", ["demo", "encode", "generate", "batch"])
def test_cli_flag_defaults_are_the_dataclasses(command):
    if command == "batch":
        options = defaults(BatchOptions)
        # Its model's and engine's fields, then its own (its max_tokens is BatchOptions', not SamplingParams').
        sources = [model_defaults(options.pop("model"), ranged=True), dataclasses.asdict(options.pop("engine")), options]
    else:
        sources = [model_defaults(ModelConfig()), defaults(SamplingParams), defaults(EngineConfig)]
    checked = set()
    for dest, default in flag_defaults(subparsers()[command]).items():
        source = next((s for s in sources if dest in s), None)
        if source is not None:
            assert default == source[dest], f"raypipe {command} --{dest.replace('_', '-')}: {default!r} != {source[dest]!r}"
            checked.add(dest)
    assert {"model", "num_encoders", "encoder_gpus", "cost_model"} <= checked


def test_serve_flags_only_override_the_config_file():
    """`raypipe serve`'s defaults are config.yaml's: a flag left out changes nothing."""
    serve = flag_defaults(subparsers()["serve"])
    assert all(default is None for default in serve.values())
    assert {"max_num_seqs", "max_model_len", "dtype", "enable_prefix_caching", "tensor_parallel_size"} <= serve.keys()
    help_text = " ".join(subparsers()["serve"].format_help().split())
    assert f"engine.max_num_seqs (code default: {defaults(EngineConfig)['max_num_seqs']})" in help_text


def test_app_args_defaults_are_model_config():
    from raypipe.serve.app import AppArgs

    model = defaults(ModelConfig)
    shared = AppArgs.model_fields.keys() & model.keys()
    assert {"model", "num_encoders", "encoder_gpus", "cost_model", "cache_bytes"} <= shared
    for name in shared:
        assert AppArgs.model_fields[name].default == model[name], name


def test_config_yaml_args_are_the_code_defaults():
    from raypipe.serve.app import AppArgs

    [app] = load_serve_config()["applications"]
    code = {name: field.default for name, field in AppArgs.model_fields.items()}
    nested = {"engine": defaults(EngineConfig), "limits": defaults(ServeLimits), "encoder_budgets": defaults(TokenBudgets),
              "routing": defaults(PrefixRouting)}
    differ = set()
    for key, value in app["args"].items():
        if key in nested:
            differ |= {f"{key}.{k}" for k, v in value.items() if v != nested[key][k]}
        elif value != code[key]:
            differ.add(key)
    assert differ == DELIBERATE, "config.yaml's args differ from the code's defaults; change the code's default " \
                                 "or list the key in DELIBERATE with its reason"


def test_deployment_options_live_in_config_yaml_only():
    decorated = {}
    for path in SERVE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for decorator in node.decorator_list:
                    if ast.unparse(getattr(decorator, "func", decorator)) == "serve.deployment":
                        decorated[node.name] = decorator
    assert set(decorated) == {"Ingress", "EncoderGroup", "Decoder", "ResponseStore", "LoraRegistry"}
    for name, decorator in decorated.items():
        assert not isinstance(decorator, ast.Call), f"{name}'s decorator sets {ast.unparse(decorator)}"
    [app] = load_serve_config()["applications"]
    for deployment in app["deployments"]:
        assert {"max_ongoing_requests", "autoscaling_config", "ray_actor_options"} <= deployment.keys(), deployment
    assert {d["name"] for d in app["deployments"]} == set(decorated)


def test_from_pretrained_has_no_defaults_of_its_own(monkeypatch):
    from raypipe.pipeline import Pipeline

    for param in inspect.signature(Pipeline.from_pretrained).parameters.values():
        if param.name == "model":
            assert param.default == ModelConfig().model
        elif param.kind is param.KEYWORD_ONLY:
            assert param.default is None, f"{param.name}={param.default!r}: a default belongs in a config dataclass"
    monkeypatch.setattr(Pipeline, "from_config", classmethod(lambda cls, config, **kw: (config, kw)))
    config, kw = Pipeline.from_pretrained("small", num_encoders=3, cache_bytes=0, num_scheduler_steps=2)
    assert config == ModelConfig(model="small", num_encoders=3, cache_bytes=0)
    assert kw["engine_config"] == EngineConfig(num_scheduler_steps=2)
    config, kw = Pipeline.from_pretrained()
    assert config == ModelConfig() and kw["engine_config"] == EngineConfig()
    with pytest.raises(TypeError, match="num_encoder"):
        Pipeline.from_pretrained(num_encoder=3)
