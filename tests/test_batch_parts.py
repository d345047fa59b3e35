"""Batch pieces that need no Ray: cost packing, part files and their reconciliation, input listing."""

import json

import numpy as np
import pyarrow as pa
import pytest

from raypipe.batch import output, packing
from raypipe.batch.inputs import list_inputs
from raypipe.storage import open_filesystem


def test_cost_packs_are_even_and_cover_every_item_once():
    rng = np.random.default_rng(0)
    costs = [float(c) for c in np.concatenate([rng.uniform(4, 64, 40), rng.uniform(900, 1024, 6)])]  # thumbnails + 4K
    packs = packing.by_cost(costs, budget=1024)
    assert sorted(i for p in packs for i in p) == list(range(len(costs)))
    sums = [sum(costs[i] for i in p) for p in packs]
    assert len(packs) == round(sum(costs) / 1024)
    assert max(sums) - min(sums) <= max(costs)  # LPT: no pack more than one item above another
    counts = packing.by_count(len(costs), 8)  # the fixed-count baseline is far less even here
    count_sums = [sum(costs[i] for i in p) for p in counts]
    assert max(count_sums) / np.mean(count_sums) > max(sums) / np.mean(sums)


def test_cost_packs_are_never_coarser_than_count_packs():
    """Thumbnails under a budget of several large images: as many packs as fixed-count batching would
    make (one pack per decode slice would leave one encoder a 32-image straggler), still even in cost."""
    costs = [float(c) for c in np.random.default_rng(1).uniform(4, 64, 32)]
    assert len(packing.by_cost(costs, budget=4096)) == 1  # the budget alone: the whole slice in one pack
    packs = packing.by_cost(costs, budget=4096, per_pack=8)
    assert len(packs) == len(packing.by_count(len(costs), 8)) == 4
    assert sorted(i for p in packs for i in p) == list(range(len(costs)))
    sums = [sum(costs[i] for i in p) for p in packs]
    assert max(sums) - min(sums) <= max(costs)
    assert len(packing.by_cost(costs, budget=64, per_pack=8)) == round(sum(costs) / 64)  # the budget binds


def test_reconcile_keeps_each_id_in_one_part(tmp_path):
    fs, root = open_filesystem(str(tmp_path))

    def part(ids):
        return output.write_part(fs, root, pa.table({"id": ids, "error": [None] * len(ids)},
                                                    schema=pa.schema([("id", pa.string()), ("error", pa.string())])))

    part(["a", "b", "c"])
    part(["c", "d"])  # c twice, as after a write retried with different rows
    assert output.write_part(fs, root, pa.table({"id": ["b", "a", "c"], "error": [None] * 3})) in output.part_files(fs, root)
    assert len(output.part_files(fs, root)) == 2  # same ids, any order: the same file, not a third one
    assert output.reconcile(fs, root) == 1
    ids = [i for ids in output.ids_by_file(fs, root).values() for i in ids]
    assert sorted(ids) == ["a", "b", "c", "d"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def test_job_fingerprint_is_recorded_and_checked(tmp_path):
    fs, root = open_filesystem(str(tmp_path))
    output.check_job(fs, root, {"model": "tiny", "task": "embed"})
    output.check_job(fs, root, {"model": "tiny", "task": "embed"})
    assert json.loads((tmp_path / output.JOB_FILE).read_text()) == {"model": "tiny", "task": "embed"}
    with pytest.raises(ValueError, match="different model"):
        output.check_job(fs, root, {"model": "small", "task": "embed"})


def test_listing_and_manifest(tmp_path):
    (tmp_path / "in" / "sub").mkdir(parents=True)
    for name in ["b.png", "a.JPG", "sub/c.webp", "notes.txt"]:
        (tmp_path / "in" / name).write_bytes(b"x")
    listed = list_inputs(str(tmp_path / "in"))
    assert listed.column("id").to_pylist() == ["a.JPG", "b.png", "sub/c.webp"]
    assert listed.column("uri").to_pylist()[2] == str(tmp_path / "in" / "sub" / "c.webp")
    manifest = tmp_path / "m.jsonl"
    manifest.write_text('{"path": "in/b.png", "q": "hi", "a": "docs"}\n{"path": "s3://bucket/k.png", "q": null, "a": ""}\n')
    table = list_inputs(str(manifest), prompt_column="q", lora_column="a")
    assert table.to_pylist() == [{"id": "in/b.png", "uri": str(tmp_path / "in" / "b.png"), "prompt": "hi", "lora": "docs"},
                                 {"id": "s3://bucket/k.png", "uri": "s3://bucket/k.png", "prompt": None, "lora": None}]
    with pytest.raises(ValueError, match="has no column 'adapter'"):
        list_inputs(str(manifest), lora_column="adapter")
    with pytest.raises(ValueError, match="lora_column name columns of a manifest"):
        list_inputs(str(tmp_path / "in"), lora_column="a")  # a folder: once every row silently took the default
    manifest.write_text('{"path": "in/b.png"}\n{"path": "in/b.png"}\n')
    with pytest.raises(ValueError, match="not unique"):
        list_inputs(str(manifest))


def test_decode_stage_ships_pixels_at_the_towers_size(tmp_path, tiny_ckpt):
    """Only what the tower consumes travels to the encoders; rows still report the original size."""
    from PIL import Image

    from raypipe.batch import stages
    from raypipe.config import ImageLimits
    from raypipe.inputs.video import VideoLimits
    from raypipe.models.registry import vision_adapter

    sizes = {"big.png": (1400, 1000), "wide.png": (90, 610), "thumb.png": (30, 41)}  # (height, width)
    rng = np.random.default_rng(0)
    for name, (h, w) in sizes.items():
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(tmp_path / name)
    batch = list_inputs(str(tmp_path))
    packs = stages.read_and_pack(batch, model=str(tiny_ckpt), image_limits=ImageLimits(), video_limits=VideoLimits(),
                                 s3=None, cost_model="patches", budget=None, per_pack=8)
    rows = pa.concat_tables([stages._from_ipc(p) for p in packs.column("pack").to_pylist()]).to_pylist()
    adapter = vision_adapter(str(tiny_ckpt))
    assert adapter.tower_size(1400, 1000)[0] * adapter.tower_size(1400, 1000)[1] < 1400 * 1000 / 4  # the big one shrinks
    assert sorted(r["id"] for r in rows) == sorted(sizes)
    for row in rows:
        h, w = sizes[row["id"]]
        tower_h, tower_w = adapter.tower_size(h, w)
        assert (row["height"], row["width"]) == (h, w)  # the original image's size, as the output reports it
        assert len(row["pixels"]) == tower_h * tower_w * 3  # resized before it travels
        assert stages._visual(row).pixels.shape == (tower_h, tower_w, 3)


def test_a_json_schema_on_a_thinking_model_is_refused_before_the_output_records_the_job(tmp_path):
    """The refusal comes before the output folder records the job (it once came after, and the command with
    thinking turned off was then refused there as a different job)."""
    from PIL import Image

    from raypipe.batch import BatchOptions, run_batch
    from raypipe.config import ModelConfig

    (tmp_path / "in").mkdir()
    Image.new("RGB", (32, 32)).save(tmp_path / "in" / "a.png")

    def job(**thinking) -> BatchOptions:
        return BatchOptions(input=str(tmp_path / "in"), output=str(tmp_path / "out"), task="generate",
                            json_schema='{"type": "object"}', model=ModelConfig("tiny-qwen3.5"), **thinking)

    with pytest.raises(ValueError, match="json_schema would constrain this model's reasoning"):
        run_batch(job())
    assert not (tmp_path / "out" / output.JOB_FILE).exists()
    output.check_job(*open_filesystem(str(tmp_path / "out")), job(enable_thinking=False).fingerprint())
