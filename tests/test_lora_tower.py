"""LoRA adapters on the Qwen families' vision towers (`encode/tower_lora.py`), through the product's path, against PEFT.

Adapters are written by PEFT on the `tiny` preset (random non-zero factors): one on every linear of the tower's
blocks and its merger, one on a few tower linears and the language model's attention together (rsLoRA), one on
the language model alone. One `Pipeline.generate` batch (two encoder actors, the decode actor) mixes rows of
each with base rows, the same image under several adapters among them; every row's greedy tokens equal
`generate()` of `PeftModel.from_pretrained` (unmerged) given the request's pixels, so PEFT's own tower runs
the adapter. Neither the embedding cache nor the prefix cache hands an image's rows encoded under one tower
adapter to a request under another adapter or the base model, and what cannot be applied is refused naming the
module (and the family). A smaller batch holds the same on every other family.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import ray
import torch
from transformers import AutoImageProcessor, AutoModelForImageTextToText

from raypipe import Pipeline, SamplingParams
from raypipe.errors import InvalidInput
from raypipe.models import lora
from raypipe.models.registry import family_of, language_adapter, preset_checkpoint, vision_adapter
from raypipe.testing.lora_adapters import active_adapter, peft_model, write_adapters
from tests import decode_reference as ref
from tests.conftest import random_images, reference_embeddings

MAX_NEW = 10
TOWER = r".*visual\.(blocks\.\d+\.(attn\.(qkv|proj)|mlp\.(gate_proj|up_proj|down_proj))|merger\.mlp\.(0|2))"
ADAPTERS = {  # name -> LoraConfig fields (names no module path contains: PEFT picks tensors by substring)
    "tower": dict(r=4, lora_alpha=8, target_modules=TOWER),
    "mixed": dict(r=8, lora_alpha=6, use_rslora=True,
                  target_modules=r".*(visual\.blocks\.\d+\.attn\.qkv|visual\.merger\.mlp\.2|language_model.*\.(q_proj|v_proj))"),
    "text": dict(r=2, lora_alpha=4, target_modules=r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj)"),
}
# (prompt of decode_reference.REQUESTS, adapter): the image of prompt 1 under four towers' identities in one batch
ROWS = [(1, "tower"), (2, None), (3, "mixed"), (1, "text"), (2, "tower"), (0, "tower"), (1, None), (1, "mixed"),
        (3, "text")]
CACHE_SEEDS = (100, 200)  # images no other request of this module shows


class Reference:
    """PEFT's greedy tokens, the tower running the adapter on the request's own pixels."""

    def __init__(self, ckpt, folders):
        hf = AutoModelForImageTextToText.from_pretrained(ckpt).eval()
        self.processor = AutoImageProcessor.from_pretrained(ckpt)
        self.tokenizer, self.vision = language_adapter(ckpt).tokenizer, vision_adapter(ckpt)
        self.eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.peft = peft_model(hf, folders)

    def generate(self, i: int, name: str | None, seed: int = 0) -> list[int]:
        return self.generate_prompt(ref.prepare(i, self.tokenizer, self.vision, seed), name)

    def generate_prompt(self, prompt, name: str | None, max_new: int = MAX_NEW) -> list[int]:
        ids = torch.tensor([prompt.prompt_token_ids])
        kwargs = {}
        if prompt.visuals:
            processed = self.processor(images=[v.pixels for v in prompt.visuals], return_tensors="pt")
            assert processed["image_grid_thw"].tolist() == [list(g) for g in prompt.visual_grids]
            kwargs = dict(pixel_values=processed["pixel_values"], image_grid_thw=processed["image_grid_thw"],
                          mm_token_type_ids=(ids == self.peft.config.image_token_id).int())
        with active_adapter(self.peft, name), torch.no_grad():
            out = self.peft.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                     do_sample=False, **kwargs)
        tokens = out[0, ids.shape[1]:].tolist()
        return tokens[: tokens.index(self.eos) + 1] if self.eos in tokens else tokens


@pytest.fixture(scope="module")
def served(ray_local, tmp_path_factory):
    ckpt = preset_checkpoint("tiny")
    folders = write_adapters(ckpt, tmp_path_factory.mktemp("tower-lora"), ADAPTERS)
    reference = Reference(ckpt, folders)
    pipe = Pipeline.from_pretrained(ckpt, num_encoders=2, lora_modules={n: str(f) for n, f in folders.items()},
                                    max_num_seqs=8, max_model_len=512, block_size=8)
    try:
        yield pipe, reference, folders
    finally:
        pipe.shutdown()


def test_tower_adapters_are_read_as_the_encoders_part(served):
    pipe, _, _ = served
    assert sorted(pipe.tower_loras.configured) == ["mixed", "tower"]  # "text" targets no tower module


def test_mixed_batch_equals_peft_generate_with_the_adapter_on_the_tower(served):
    pipe, reference, _ = served
    expected = [reference.generate(i, name) for i, name in ROWS]
    base = {i: reference.generate(i, None) for i, _ in ROWS}
    # the tower adapters change every image row's tokens; on a text-only prompt the tower part does nothing
    assert all(expected[n] != base[i] for n, (i, name) in enumerate(ROWS) if name and i != 0)
    assert expected[ROWS.index((0, "tower"))] == base[0]
    outs = pipe.generate([ref.request(i) for i, _ in ROWS], SamplingParams(max_tokens=MAX_NEW),
                         lora=[name for _, name in ROWS])
    assert [o.token_ids for o in outs] == expected
    assert pipe.coordinator.last_report.cache_hits == 0


def test_no_cache_hands_one_adapters_image_rows_to_another(served):
    """Same image: under A then A, a hit in both caches; A then B, and base then A, no hit in either (the base
    tower's rows do serve a language-only adapter's request, whose prefix-cache blocks are its own). A prefix hit
    counts when it reaches past the image's first placeholder (the text before it is shared by other prompts)."""
    pipe, reference, _ = served

    def run(seed: int, name: str | None) -> tuple[int, bool]:
        """(embedding-cache hits, whether prefix-cache hits reached the image's rows)."""
        out, = pipe.generate([ref.request(3, seed)], SamplingParams(max_tokens=MAX_NEW), lora=name)
        assert out.token_ids == reference.generate(3, name, seed), (seed, name)
        prompt = ref.prepare(3, reference.tokenizer, reference.vision, seed)
        image_start = prompt.prompt_token_ids.index(reference.peft.config.image_token_id)
        return pipe.coordinator.last_report.cache_hits, out.num_cached_tokens > image_start

    first, second = CACHE_SEEDS
    assert run(first, "tower") == (0, False)
    assert run(first, "tower") == (1, True)  # A then A
    assert run(first, "mixed") == (0, False)  # A then B
    assert run(second, None) == (0, False)
    assert run(second, "tower") == (0, False)  # base then A
    assert run(second, "text") == (1, False)  # the base tower's rows; prefix blocks under "text" only
    assert run(second, "text") == (1, True)


def test_what_the_encoders_cannot_apply_is_refused_naming_the_module(served, tmp_path):
    pipe, _, folders = served
    ckpt = preset_checkpoint("tiny")
    family = family_of(ckpt)
    tower = vision_adapter(ckpt).load_tower(torch.device("cpu"), torch.float32).lora_root
    read = lora.read_tower_adapter("tower", folders["tower"], family)
    lora.check_tower_factors(read, tower, "lora_modules.tower")
    assert set(read.factors) >= {"blocks.0.attn.qkv", "merger.mlp.0", "merger.mlp.2"}
    renamed = dataclasses.replace(read, factors={"blocks.9.attn.qkv": read.factors["blocks.0.attn.qkv"]})
    with pytest.raises(InvalidInput, match=r"blocks\.9\.attn\.qkv.*not a layer of the vision tower"):
        lora.check_tower_factors(renamed, tower, "lora_modules.tower")
    conv = write_adapters(ckpt, tmp_path / "conv", {"conv": dict(r=2, lora_alpha=4, target_modules=r".*patch_embed\.proj")})
    with pytest.raises(InvalidInput, match=r"patch_embed\.proj.*linear layers only") as refused:
        lora.read_tower_adapter("conv", conv["conv"], family)
    assert refused.value.item == "lora_modules.conv"
    # the engine reads the language part: a tower module is the encoder's part where the family has one
    decoder = language_adapter(ckpt).load_model(torch.device("cpu"), torch.float32)
    assert lora.read_adapter("tower", folders["tower"], decoder, 16, family=family).factors == {}
    assert set(lora.read_adapter("mixed", folders["mixed"], decoder, 16, family=family).factors) == {
        f"layers.{n}.self_attn.{p}" for n in range(decoder.model.config.num_hidden_layers) for p in ("q_proj", "v_proj")}


def test_a_tower_adapter_of_a_family_whose_encoders_take_none_is_refused_naming_module_and_family(tmp_path):
    ckpt = preset_checkpoint("tiny-qwen3.5")
    folder = write_adapters(ckpt, tmp_path, {"tower": dict(r=2, lora_alpha=4, target_modules=r".*visual\.blocks\.0\.attn\.qkv")})
    decoder = language_adapter(ckpt).load_model(torch.device("cpu"), torch.float32)
    without = dataclasses.replace(family_of(ckpt), lora_tower_prefixes=())  # a family whose encoders take none
    with pytest.raises(InvalidInput, match=r"model\.visual\.blocks\.0\.attn\.qkv.*qwen3_5") as refused:
        lora.read_adapter("tower", folder["tower"], decoder, 16, family=without)
    assert refused.value.item == "lora_modules.tower"
    assert lora.read_tower_adapter("tower", folder["tower"], without) is None


def _family_adapters(tower: str, both: str) -> dict:
    """A tower-only adapter on the linears `tower` matches, and one (rsLoRA) on `both` tower and language ones."""
    return {"tower": dict(r=4, lora_alpha=8, target_modules=tower),
            "both": dict(r=8, lora_alpha=6, use_rslora=True, target_modules=both)}


_QWEN3_BOTH = r".*(visual\.blocks\.\d+\.attn\.qkv|visual\.merger\.linear_fc2|language_model.*\.(q_proj|v_proj|in_proj_qkv|out_proj))"
_SIGLIP = r"encoder\.layers\.\d+\.(self_attn\.(q_proj|k_proj|v_proj|out_proj)|mlp\.fc[12])"
# Every linear of each family's tower and projector in "tower"; the language model's attention (and gated delta
# nets, on the hybrid ones) in "both"
FAMILY_ADAPTERS = {
    "tiny-qwen3-vl": _family_adapters(  # deepstack mergers too
        r".*visual\.(blocks\.\d+\.(attn\.(qkv|proj)|mlp\.linear_fc[12])|(merger|deepstack_merger_list\.\d+)\.linear_fc[12])",
        _QWEN3_BOTH),
    "tiny-qwen3.5": _family_adapters(
        r".*visual\.(blocks\.\d+\.(attn\.(qkv|proj)|mlp\.linear_fc[12])|merger\.linear_fc[12])", _QWEN3_BOTH),
    "tiny-llava-ov": _family_adapters(
        rf".*(vision_tower\.{_SIGLIP}|multi_modal_projector\.linear_[12])",
        r".*(vision_tower\.encoder\.layers\.\d+\.self_attn\.q_proj|multi_modal_projector\.linear_2"
        r"|language_model.*\.(q_proj|v_proj))"),
    "tiny-step3": _family_adapters(  # the projector is one linear; the language model's gated attention too
        r".*(vision_model\.layers\.\d+\.(self_attn\.(q_proj|k_proj|v_proj|out_proj)|mlp\.fc[12])|multi_modal_projector)",
        r".*(vision_model\.layers\.\d+\.self_attn\.q_proj|multi_modal_projector|language_model.*\.(q_proj|v_proj|g_proj))"),
    "tiny-minicpmv": _family_adapters(  # the tower's own vit_merger too
        rf".*(vision_tower\.({_SIGLIP}|vit_merger\.linear_[12])|model\.merger\.mlp\.\d+\.linear_[12])",
        r".*(vision_tower\.encoder\.layers\.\d+\.self_attn\.q_proj|model\.merger\.mlp\.0\.linear_2"
        r"|language_model.*\.(q_proj|v_proj|in_proj_qkv|out_proj))"),
}


def _peft_features_generate(ckpt, peft, i: int, name: str | None, eos: int) -> list[int]:
    """PEFT's greedy tokens for prompt `i` on LLaVA-OneVision, MiniCPM-V or Step3: the family's transformers reference
    (features from `get_image_features`, then `generate()`) run on the PeftModel's wrapped model, `name` active
    (None: disabled), so the adapter's tower part computes the features and its language part the tokens."""
    from tests import llava_ov_reference, minicpmv_reference, step3_reference

    features_of, generate = {"llava_onevision": (llava_ov_reference.image_features, llava_ov_reference.generate),
                             "step3p7": (step3_reference.image_features, step3_reference.generate),
                             "minicpmv4_6": (minicpmv_reference.image_embeddings, minicpmv_reference.hf_generate),
                             }[family_of(ckpt).model_type]

    model = peft.base_model.model
    prompt = ref.prepare(i, language_adapter(ckpt).tokenizer, vision_adapter(ckpt))
    images = random_images(ref.REQUESTS[i][1], seed=i)  # those of ref.request(i)
    with active_adapter(peft, name):
        tokens = generate(model, prompt.prompt_token_ids, features_of(model, ckpt, images), MAX_NEW)
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


# `make test` runs two families, a deepstack tower (Qwen3-VL) and a features-path one with a resampler (MiniCPM-V);
# the others run with `make test-extended`
EXTENDED_FAMILIES = ("tiny-qwen3.5", "tiny-llava-ov", "tiny-step3")


@pytest.mark.parametrize("preset", [pytest.param(p, marks=[pytest.mark.extended] if p in EXTENDED_FAMILIES else [])
                                    for p in FAMILY_ADAPTERS])
def test_a_tower_adapter_equals_peft_generate_on_every_family_that_takes_one(ray_local, tmp_path, preset):
    """The same product path on Qwen3-VL (deepstack mergers), Qwen3.5 (a hybrid language model), LLaVA-OneVision
    (SigLIP tower and projector), Step3 (tower, a one-linear projector, MoE language model) and MiniCPM-V 4.6
    (tower, its vit_merger and the merger): one batch of tower-only,
    tower + language and base rows, the same image under each, over one encoder actor, equals PEFT's `generate()`
    with the adapter's tower part computing the image features; every adapter row differs from the base model's."""
    ckpt = preset_checkpoint(preset)
    adapters = FAMILY_ADAPTERS[preset]
    folders = write_adapters(ckpt, tmp_path, adapters)
    rows = [(3, "tower"), (3, None), (1, "both"), (3, "both"), (1, None)]
    if family_of(ckpt).model_type.startswith("qwen"):
        expected = Reference(ckpt, folders).generate
    else:
        peft = peft_model(AutoModelForImageTextToText.from_pretrained(ckpt).eval(), folders)
        eos = language_adapter(ckpt).eos_token_ids[0]

        def expected(i, name):
            return _peft_features_generate(ckpt, peft, i, name, eos)

    want = [expected(i, name) for i, name in rows]
    assert all(want[n] != expected(i, None) for n, (i, name) in enumerate(rows) if name)
    pipe = Pipeline.from_pretrained(ckpt, num_encoders=1, lora_modules={n: str(f) for n, f in folders.items()},
                                    max_num_seqs=8, max_model_len=512, block_size=8)
    try:
        assert sorted(pipe.tower_loras.configured) == ["both", "tower"]
        outs = pipe.generate([ref.request(i) for i, _ in rows], SamplingParams(max_tokens=MAX_NEW),
                             lora=[name for _, name in rows])
        assert [o.token_ids for o in outs] == want
    finally:
        pipe.shutdown()


def test_an_adapter_loaded_at_run_time_is_read_checked_and_keyed_by_its_fingerprint(served, tmp_path):
    """What Serve's EncoderGroup does for `/v1/load_lora_adapter` and a request naming the adapter at a replica
    (`TowerLoras.load`, `for_request`): the tower part's fingerprint is the engine's for the same folder, the
    image is encoded as PEFT's tower encodes it under that adapter, and files changed since the load are refused.
    (The endpoint itself, with an adapter configured at start and one loaded at run time, was checked against
    PEFT by a Serve test kept out of the suite for its ~100 s start.)"""
    pipe, reference, folders = served
    ckpt = preset_checkpoint("tiny")
    decoder = language_adapter(ckpt).load_model(torch.device("cpu"), torch.float32)
    fingerprint = lora.read_adapter("later", folders["mixed"], decoder, 16, family=family_of(ckpt)).fingerprint
    assert pipe.tower_loras.load("later", str(folders["mixed"])) == fingerprint
    assert pipe.tower_loras.load("plain", str(folders["text"])) is None  # no tower part: the base tower
    tower = pipe.tower_loras.for_request("later", str(folders["mixed"]), fingerprint)
    prompt = ref.prepare(1, reference.tokenizer, reference.vision, seed=400)
    [embedding] = ray.get([e.ref for e in pipe.coordinator.submit(prompt.visuals, [tower])])
    reference.peft.set_adapter("mixed")
    [expected] = reference_embeddings(reference.peft.base_model.model, ckpt, [v.pixels for v in prompt.visuals])
    torch.testing.assert_close(embedding, expected, atol=1e-5, rtol=1e-4)
    changed = shutil.copytree(folders["mixed"], tmp_path / "changed")
    (changed / "adapter_config.json").write_text((changed / "adapter_config.json").read_text() + "\n")  # other bytes
    with pytest.raises(InvalidInput, match="changed since it was loaded"):
        pipe.tower_loras.for_request("moved", str(changed), fingerprint)


def test_a_batch_job_with_an_adapter_per_row_equals_peft_generate(served, tmp_path):
    """`raypipe batch --task generate --lora NAME=PATH ... --lora-column adapter` over a manifest: each row's encoder
    units run its adapter's tower part and its decode the language part; each row's text is PEFT's greedy text for
    the same image, prompt and adapter (the base model's for an empty one), rows name their adapter as their model,
    and a row naming an adapter the job lacks is an error row."""
    import json

    import numpy as np
    import pyarrow.parquet as pq
    from PIL import Image

    from raypipe.batch import run_batch
    from raypipe.cli import build_parser
    from raypipe.jobs.batch import options_from_args
    from raypipe.models.prompt import build_prompt

    _, reference, folders = served
    (tmp_path / "in").mkdir()
    rng = np.random.default_rng(7)
    adapters = {"img0.png": "mixed", "img1.png": "tower", "img2.png": "", "img3.png": "text", "img4.png": "nope"}
    for (name, adapter), (h, w) in zip(adapters.items(), [(56, 84), (90, 60), (84, 84), (60, 60), (56, 56)]):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(tmp_path / "in" / name)
    manifest = tmp_path / "rows.jsonl"
    manifest.write_text("".join(json.dumps({"path": f"in/{n}", "adapter": a}) + "\n" for n, a in adapters.items()))
    flags = [f for name in ADAPTERS for f in ("--lora", f"{name}={folders[name]}")]
    args = build_parser().parse_args(["batch", "--model", str(preset_checkpoint("tiny")), "--input", str(manifest),
                                      "--output", str(tmp_path / "out"), "--task", "generate", "--max-tokens", "8",
                                      "--prompt", "What is in this picture?", *flags, "--lora-column", "adapter"])
    options = options_from_args(args)
    assert options.lora is None and options.loras == tuple(ADAPTERS)
    summary = run_batch(options)
    assert summary.processed == 5 and summary.errors == {"lora_not_found": 1}
    rows = {r["id"]: r for part in sorted((tmp_path / "out").glob("part-*")) for r in pq.read_table(part).to_pylist()}
    assert rows["in/img4.png"]["error"] == "lora_not_found" and "'nope'" in rows["in/img4.png"]["error_message"]
    for name, adapter in list(adapters.items())[:4]:
        row = rows[f"in/{name}"]
        messages = [{"role": "user", "content": [{"type": "image", "image": (tmp_path / "in" / name).read_bytes()},
                                                 {"type": "text", "text": "What is in this picture?"}]}]
        prompt = build_prompt(messages, reference.tokenizer, reference.vision)
        tokens = reference.generate_prompt(prompt, adapter or None, max_new=8)
        if adapter:  # the adapter changes this row: equality below is the adapter's doing
            assert tokens != reference.generate_prompt(prompt, None, max_new=8), name
        assert row["model"] == (adapter or str(preset_checkpoint("tiny"))) and row["error"] is None, name
        assert row["text"] == reference.tokenizer.decode(tokens, skip_special_tokens=True), name


def test_a_batch_adapter_must_be_configured_and_generate(served):
    from raypipe.batch import BatchOptions
    from raypipe.decode.config import EngineConfig

    _, _, folders = served
    engine = EngineConfig(lora_modules={"mixed": str(folders["mixed"])})
    with pytest.raises(ValueError, match="lora names an adapter of engine.lora_modules"):
        BatchOptions(input="in", output="out", task="generate", engine=engine, lora="other")
    with pytest.raises(ValueError, match="takes task generate"):
        BatchOptions(input="in", output="out", task="embed", engine=engine, lora="mixed")
    with pytest.raises(ValueError, match="lora_column takes task generate, adapters in engine.lora_modules and no lora"):
        BatchOptions(input="in", output="out", task="generate", engine=engine, lora="mixed", lora_column="adapter")


def test_batch_lora_flags_name_one_adapter_for_every_row_or_several_for_a_column(served):
    from raypipe.cli import build_parser
    from raypipe.jobs.batch import options_from_args

    _, _, folders = served
    base = ["batch", "--model", "tiny", "--input", "in", "--output", "out", "--task", "generate"]
    one = options_from_args(build_parser().parse_args([*base, "--lora", f"mixed={folders['mixed']}"]))
    assert one.lora == "mixed" and one.lora_column is None and one.loras == ("mixed",)
    two = [*base, "--lora", f"mixed={folders['mixed']}", "--lora", f"text={folders['text']}"]
    with pytest.raises(ValueError, match="2 --lora adapters need --lora-column"):
        options_from_args(build_parser().parse_args(two))
    column = options_from_args(build_parser().parse_args([*two, "--lora-column", "adapter"]))
    assert column.lora is None and column.engine.lora_modules == {"mixed": str(folders["mixed"]),
                                                                  "text": str(folders["text"])}


def test_a_refused_batch_adapter_leaves_no_job_in_its_output_so_the_corrected_command_runs_there(served, tmp_path):
    """A missing adapter folder, or a rank above the engine's, is refused before the output folder records the job:
    once it recorded the job (the bad path in its fingerprint) first, and the command with the path corrected was
    refused as a different job."""
    from PIL import Image

    from raypipe.batch import BatchOptions, output, run_batch
    from raypipe.config import ModelConfig
    from raypipe.decode.config import EngineConfig
    from raypipe.storage import open_filesystem

    _, _, folders = served
    (tmp_path / "in").mkdir()
    Image.fromarray(random_images([(56, 84)])[0]).save(tmp_path / "in" / "a.png")
    out = tmp_path / "out"

    def job(folder, **engine) -> BatchOptions:
        return BatchOptions(input=str(tmp_path / "in"), output=str(out), task="generate", lora="mixed",
                            model=ModelConfig("tiny", num_encoders=1),
                            engine=EngineConfig(lora_modules={"mixed": str(folder)}, **engine))

    with pytest.raises(InvalidInput, match="no adapter_config.json") as missing:
        run_batch(job(tmp_path / "nowhere"))
    assert missing.value.code == "lora_adapter_not_found"
    with pytest.raises(InvalidInput, match=r"r=8 exceeds EngineConfig.max_lora_rank=4") as rank:
        run_batch(job(folders["mixed"], max_lora_rank=4))
    assert rank.value.code == "invalid_lora_adapter"
    assert not (out / output.JOB_FILE).exists()
    output.check_job(*open_filesystem(str(out)), job(folders["mixed"]).fingerprint())  # the corrected job: taken
