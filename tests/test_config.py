"""One `ModelConfig` for the CLI, `Pipeline`, Serve's `AppArgs` and batch: same fields, same checks."""

import dataclasses

import pytest

from raypipe.cli import build_parser
from raypipe.config import ModelConfig, model_config_from_args


def test_model_config_checks_values():
    with pytest.raises(ValueError, match="num_encoders"):
        ModelConfig(num_encoders=0)
    with pytest.raises(ValueError, match="cost model"):
        ModelConfig(cost_model="pixels")
    with pytest.raises(ValueError, match="max_encoders"):
        ModelConfig(num_encoders=3, max_encoders=2)
    assert ModelConfig(num_encoders=2, max_encoders=5).encoder_range == (2, 5)
    assert ModelConfig(num_encoders=2).encoder_range == (2, 2)


def test_cli_flags_are_model_config_fields():
    args = build_parser().parse_args(["encode", "x.png", "--out", "e.npz", "--model", "small", "--num-encoders", "3",
                                      "--encoder-gpus", "0.5", "--cost-model", "attention"])
    assert model_config_from_args(args) == ModelConfig(model="small", num_encoders=3, encoder_gpus=0.5,
                                                       cost_model="attention")


def test_serve_app_args_give_the_same_model_config():
    from raypipe.serve.app import AppArgs

    args = AppArgs(model="small", num_encoders=3, encoder_gpus=0.5, cost_model="attention", cache_bytes=1024)
    assert args.as_model_config() == ModelConfig(model="small", num_encoders=3, encoder_gpus=0.5,
                                                 cost_model="attention", cache_bytes=1024)
    shared = {f.name for f in dataclasses.fields(ModelConfig)} & set(AppArgs.model_fields)
    assert {"model", "num_encoders", "encoder_gpus", "cost_model", "cache_bytes"} <= shared
