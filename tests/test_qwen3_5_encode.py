"""Qwen3.5 images and videos sharded over encoder workers equal transformers' `get_image_features` and
`get_video_features` on the whole batch (the merger's rows: Qwen3.5's tower has no deepstack levels),
fp32 atol 1e-5 rtol 1e-4, over 1/2/3 workers; a long video's chunks of temporal groups spread over several
workers. The batch, the worker fixture and the check are test_qwen3_vl_encode.py's, over the MoE preset's tower
(`Qwen3_5MoeVisionModel`; the dense preset's tower class is loaded by the decode and serve tests)."""

import pytest

from tests.test_qwen3_vl_encode import check_sharded, pool, reference_batch  # noqa: F401 - `pool` is a fixture


@pytest.fixture(scope="module")
def reference():
    return reference_batch("tiny-qwen3.5-moe")


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_sharded_embeddings_match_transformers(pool, reference, workers):  # noqa: F811
    check_sharded(pool, reference, workers, levels=0)
