"""A batch generate job over Qwen3.5 with its thinking switch: every row's text equals `Pipeline.generate`'s
for the same image and switch (the pipeline is checked against transformers in test_qwen3_5_decode.py), and
a JSON schema with thinking on is refused before any work starts (the schema would constrain the reasoning)."""

from __future__ import annotations

import pytest

from raypipe.batch import BatchOptions, run_batch
from raypipe.config import ModelConfig
from tests.test_batch import _images, _read_output

MODEL = "tiny-qwen3.5"


def test_generate_job_with_thinking_off_matches_pipeline(tmp_path, ray_local):
    from raypipe import Pipeline, SamplingParams
    from raypipe.models.registry import preset_checkpoint

    images = _images(3, seed=11)
    for name, data in images.items():
        (tmp_path / "in" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "in" / name).write_bytes(data)
    summary = run_batch(BatchOptions(input=str(tmp_path / "in"), output=str(tmp_path / "out"), task="generate",
                                     max_tokens=8, enable_thinking=False, model=ModelConfig(MODEL, num_encoders=1)))
    rows = {row["id"]: row for row in _read_output(str(tmp_path / "out"), None).to_pylist()}
    assert summary.processed == len(images) and not summary.errors
    names = sorted(images)
    requests = [{"messages": [{"role": "user", "content": [{"type": "image", "image": images[name]},
                                                             {"type": "text", "text": "Describe this image."}]}],
                 "chat_template_kwargs": {"enable_thinking": False}} for name in names]
    with Pipeline.from_pretrained(preset_checkpoint(MODEL), num_encoders=1, cache_bytes=0) as pipe:
        expected = pipe.generate(requests, SamplingParams(max_tokens=8, temperature=0.0))
        thinking = pipe.generate([{**requests[0], "chat_template_kwargs": None}],
                                 SamplingParams(max_tokens=8, temperature=0.0))
    assert [rows[name]["text"] for name in names] == [out.text for out in expected]
    assert thinking[0].token_ids != expected[0].token_ids  # the switch reached the template


def test_json_schema_with_thinking_on_is_refused(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.png").write_bytes(next(iter(_images(1).values())))
    with pytest.raises(ValueError, match="enable_thinking"):
        run_batch(BatchOptions(input=str(tmp_path / "in"), output=str(tmp_path / "out"), task="generate",
                               json_schema="{}", model=ModelConfig(MODEL, num_encoders=1)))
