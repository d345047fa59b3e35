"""A tensor-parallel decode group for LLaVA-OneVision (Qwen2 text model; every layer full attention), two
ranks over gloo: greedy tokens equal one device's and transformers' generate(), K=1 and K=8, for requests
with images and one with an image and a video, arriving while others run. Visual rows are transformers'
own features (the group is the language side only)."""

from __future__ import annotations

import numpy as np
import pytest

from raypipe import SamplingParams
from raypipe.decode.config import EngineConfig
from raypipe.decode.engine import LLMEngine
from raypipe.models.prompt import VideoOptions, build_prompt
from raypipe.models.registry import vision_adapter
from raypipe.parallel import runner_factory
from tests import decode_reference
from tests import llava_ov_reference as ref
from tests import minicpmv_video_reference as vref
from tests.conftest import random_images
from tests.test_tensor_parallel import on_both

MAX_NEW = 12
FPS = 2.0  # the video is a frames list at 2 frames per second (as in test_llava_ov_video.py)
REQUESTS = [("Say something.", []), ("What is in this picture?", [(100, 60)]),
            ("Compare these three, please:", [(40, 170), (300, 290), (20, 30)]), ("hi", [(500, 70)])]


@pytest.fixture(scope="module")
def engines(llava_ckpt, ray_local):
    made = []
    for tp in (1, 2):
        config = EngineConfig(max_num_seqs=8, max_model_len=1024, num_threads=1, tensor_parallel_size=tp)
        made.append(LLMEngine(llava_ckpt, config, runner_factory=runner_factory(config)))
    yield made
    for engine in made:
        engine.shutdown()


@pytest.fixture(scope="module")
def cases(llava_ckpt, llava_hf_model, engines):
    tokenizer, vision = engines[0].tokenizer, vision_adapter(llava_ckpt)
    out = []
    for i, (text, sizes) in enumerate(REQUESTS):
        images = random_images(sizes, seed=i)
        prompt = build_prompt(decode_reference.messages(text, images), tokenizer, vision)
        features = ref.image_features(llava_hf_model, llava_ckpt, images)
        out.append((prompt, features, ref.generate(llava_hf_model, prompt.prompt_token_ids, features, MAX_NEW)))
    with pytest.MonkeyPatch.context() as monkeypatch:
        vref.install(monkeypatch)  # transformers' video processor without torchvision
        source = np.random.default_rng(5).integers(0, 256, (11, 80, 64, 3), dtype=np.uint8)
        images = random_images([(160, 100)], seed=6)
        parts = [{"type": "image", "image": images[0]}, {"type": "video", "video": list(source)},
                 {"type": "text", "text": "Describe the clip."}]
        prompt = build_prompt([{"role": "user", "content": parts}], tokenizer, vision, video=VideoOptions())
        features = ref.image_features(llava_hf_model, llava_ckpt, images)
        video = ref.video_features(llava_hf_model, ref.preprocess_video(llava_ckpt, source, FPS))
    want = ref.generate(llava_hf_model, prompt.prompt_token_ids, features, MAX_NEW, video=video)
    out.append((prompt, [*features, video], want))
    eos = engines[0].adapter.eos_token_ids[0]
    return [(p, f, w[: w.index(eos) + 1] if eos in w else w) for p, f, w in out]


@pytest.mark.parametrize("k", [1, 8])
def test_group_greedy_equals_one_device_and_generate(engines, cases, k):
    one, two = on_both(engines, k, cases, [SamplingParams(max_tokens=MAX_NEW)] * len(cases), "llava")
    assert two == one == [w for _, _, w in cases]
    assert len({tuple(w) for _, _, w in cases}) > 1
