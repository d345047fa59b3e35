"""LoRA adapters (`EngineConfig.lora_modules`, `raypipe/models/lora.py`) against PEFT itself.

Adapters are written here by PEFT (`get_peft_model` on the preset's transformers model, random non-zero
factors, `save_pretrained`): attention only, MLP only with rsLoRA scaling, and every linear of the language
model, of three ranks. One batch mixes rows of each adapter and rows of none, joining staggered, with
images, at K=1 and K=8; every row's greedy tokens equal `generate()` of `PeftModel.from_pretrained`
(unmerged) with that adapter active (or disabled), on a full-attention family (Qwen2.5-VL) and the hybrid
one (Qwen3.5: gated-delta-net rows and their state snapshots). Every adapter changes the base model's
tokens, so the equality says something. The prefix cache never hands one adapter's blocks to another or
to the base model, and PEFT saves raypipe cannot apply exactly are refused naming the field or module
(reading an adapter, and the engine's start with it). The compiled decode step serves adapters too.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil

import pytest
import torch
from transformers import AutoModelForImageTextToText

from raypipe import SamplingParams
from raypipe.decode.config import EngineConfig
from raypipe.decode.engine import LLMEngine
from raypipe.errors import InvalidInput
from raypipe.models import lora
from raypipe.models.registry import family_of, language_adapter, preset_checkpoint, vision_adapter
from raypipe.testing.lora_adapters import active_adapter, peft_model, write_adapters
from tests import decode_reference as ref

MAX_NEW = 12
LANGUAGE = r".*language_model.*\."
# Names no module path contains: PEFT picks an adapter's tensors out of several by substring
ADAPTERS = {  # name -> LoraConfig fields
    "red": dict(r=4, lora_alpha=8, target_modules=LANGUAGE + r"(q_proj|k_proj|v_proj|o_proj|in_proj_qkv|out_proj)"),
    "green": dict(r=8, lora_alpha=6, use_rslora=True, target_modules=LANGUAGE + r"(gate_proj|up_proj|down_proj)"),
    "blue": dict(r=2, lora_alpha=4, target_modules=LANGUAGE + r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|"
                                                             r"down_proj|in_proj_qkv|in_proj_z|out_proj)"),
}
# (prompt of decode_reference.REQUESTS, adapter): text, one image, three images, several adapters per prompt
ROWS = [(0, "red"), (1, None), (2, "green"), (3, "blue"), (0, None), (1, "red"), (3, "green")]


class Served:
    """A preset's adapters, PEFT's greedy tokens for every row and the engines serving them. A compressed-tensors
    quantized preset (`base`: the preset it quantizes, whose modules the adapters are written on) is PEFT's model
    as transformers decompresses it (`CompressedTensorsConfig(dequantize=True)`, the quantized tests' oracle)."""

    def __init__(self, preset: str, folder, base: str | None = None):
        from transformers import CompressedTensorsConfig

        self.ckpt = preset_checkpoint(preset)
        self.adapters_on = preset_checkpoint(base or preset)  # the checkpoint adapters are written on
        self.folders = write_adapters(self.adapters_on, folder, ADAPTERS)
        decompressed = dict(quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.float32) if base else {}
        hf = AutoModelForImageTextToText.from_pretrained(self.ckpt, **decompressed).eval()
        tokenizer, vision = language_adapter(self.ckpt).tokenizer, vision_adapter(self.ckpt)
        self.prompts = [ref.prepare(i, tokenizer, vision) for i in range(4)]
        self.embeds = [ref.embeddings(hf, self.ckpt, p) for p in self.prompts]  # the tower takes no adapter
        eos = hf.generation_config.eos_token_id
        self.eos = eos[0] if isinstance(eos, list) else eos
        peft = peft_model(hf, self.folders)
        self.expected = {}
        for i, name in set(ROWS) | {(i, None) for i, _ in ROWS}:
            with active_adapter(peft, name):
                self.expected[i, name] = self._generate(peft, i)
        self.engines = ref.engine_pool(self.ckpt, max_num_seqs=4, max_model_len=512, block_size=8,
                                       lora_modules={n: str(f) for n, f in self.folders.items()})

    def _generate(self, model, i: int) -> list[int]:
        return ref.hf_generate(model, self.prompts[i], self.embeds[i], MAX_NEW, cut_at=self.eos)

    def case(self, i: int):
        return self.prompts[i].without_pixels(), self.embeds[i]


@pytest.fixture(scope="module", params=["tiny", "tiny-qwen3.5"])
def served(request, tmp_path_factory):
    made = Served(request.param, tmp_path_factory.mktemp(f"lora-{request.param}"))
    with made.engines as engines:
        made.engine = engines
        yield made


def run(served, k: int, rows, tag: str):
    """Outputs of `rows` ((prompt index, adapter)) submitted 4 ms apart: later rows join a running batch."""
    return run_on(served, served.engine(k), rows, tag)


def run_on(served, engine, rows, tag: str):
    async def one(n, i, name):
        await asyncio.sleep(0.004 * n)
        prompt, embeds = served.case(i)
        return await engine.generate_output(f"{tag}-{n}", prompt, embeds, SamplingParams(max_tokens=MAX_NEW), lora=name)

    async def every():
        return await asyncio.gather(*(one(n, i, name) for n, (i, name) in enumerate(rows)))

    return asyncio.run(every())


@pytest.mark.parametrize("slots", [[1, 2, 0], [2, 1, 1, 0, 2], [0, 3], [2, 2, 2], [3, 1, 2], [1, 0, 0, 3]])
def test_a_decode_forwards_grouped_delta_is_each_rows_own_adapter(slots):
    """Decode rows grouped by slot (`lora.Segments`: empty positions, base rows, one slot for all), through
    sibling layers that read one input (one gather of its rows, kept for the next sibling), equal each row's
    `x @ A_s @ B_s` computed alone, and the dense (prefill) path over the same rows."""
    torch.manual_seed(0)
    rows, rank, base = lora.LoraRows(), 4, [torch.nn.Linear(16, n) for n in (16, 8, 8)]
    layers = [lora.LoraLinear(b, rows, num_slots=4, max_rank=rank, dtype=torch.float32, device="cpu") for b in base]
    factors = {(i, s): (torch.randn(16, rank), torch.randn(rank, b.out_features)) for i, b in enumerate(base)
               for s in (1, 2, 3)}
    for (i, s), (a, b) in factors.items():
        layers[i].set_slot(s, a, b)
    x = torch.randn(len(slots), 1, 16)
    expected = [torch.stack([base[i](x[r, 0]) + (x[r, 0] @ factors[i, s][0] @ factors[i, s][1] if s else 0)
                             for r, s in enumerate(slots)])[:, None] for i in range(3)]
    with torch.inference_mode(), rows.using(slots, torch.float32, torch.device("cpu")):
        gathers = []
        original = torch.Tensor.index_select
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.Tensor, "index_select", lambda t, *a: gathers.append(t.data_ptr()) or original(t, *a))
            grouped = [layer(x) for layer in layers]
        dense = [layer(torch.cat([x, x], dim=1)) for layer in layers]  # two tokens a row: the dense path
    for got, dense_got, want in zip(grouped, dense, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dense_got, torch.cat([want, want], dim=1), rtol=1e-5, atol=1e-5)
    mixed = len(set(slots)) > 1  # one slot for every row needs no grouping: one dense GEMM pair
    assert gathers.count(x.data_ptr()) == (1 if mixed else 0)  # x's rows gathered once for the three


def test_every_adapter_changes_the_base_models_tokens(served):
    assert {name for _, name in ROWS} == {None, *ADAPTERS}
    for i, name in ROWS:
        assert name is None or served.expected[i, name] != served.expected[i, None], (i, name)


@pytest.mark.parametrize("k", [1, 8])
def test_mixed_batch_equals_peft_generate_per_adapter(served, k):
    outs = run(served, k, ROWS, f"mixed-{k}")
    assert [o.token_ids for o in outs] == [served.expected[row] for row in ROWS]
    assert served.engine(k).decode_step["mode"] == "eager"
    siblings = re.search(r"\((\d+) of them as q/k/v or gate/up siblings", served.engine(k).weights)
    assert siblings and int(siblings[1]) > 0, served.engine(k).weights  # the adapted layers' bases share GEMMs


def test_prefix_cache_is_keyed_by_adapter(served):
    """Cached prompt tokens (`RequestOutput.num_cached_tokens`) of prompts no other test sends: a block
    computed under one adapter is a hit for that adapter only, never for another or for the base model;
    a hit's tokens equal those computed without it."""
    engine = served.engine(8)
    first, second = (engine.tokenizer.encode(f"{word} prompt of the adapter-keyed prefix cache test, " * 8)[:40]
                     for word in ("First", "Second"))

    def cached(tag, prompt, name):
        out = asyncio.run(engine.generate_output(tag, prompt, (), SamplingParams(max_tokens=MAX_NEW), lora=name))
        return out.num_cached_tokens, out.token_ids

    a = cached("a", first, "red")
    hit, tokens = cached("a-again", first, "red")
    assert a[0] == 0 and hit > 0 and tokens == a[1]  # A then A: a hit (Qwen3.5: at a state snapshot), same tokens
    assert cached("b", first, "green")[0] == 0  # A then B: no hit
    assert cached("base", second, None)[0] == 0 and cached("a-after-base", second, "red")[0] == 0


def test_unknown_adapter_is_refused_naming_it(served):
    with pytest.raises(InvalidInput) as refused:
        run(served, 8, [(0, "nope")], "unknown")
    assert refused.value.item == "lora" and "'nope'" in str(refused.value)


def _edited(src, dst, **fields):
    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**config, **fields}))
    return dst


def test_adapters_raypipe_cannot_apply_are_refused_naming_the_field(tmp_path):
    ckpt = preset_checkpoint("tiny")
    decoder = language_adapter(ckpt).load_model(torch.device("cpu"), torch.float32)
    folders = write_adapters(ckpt, tmp_path / "saved", {
        "good": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], exclude_modules=r".*visual.*"),
        "table": dict(r=4, lora_alpha=8, target_modules=["embed_tokens"])})
    good = folders["good"]
    assert lora.read_adapter("good", good, decoder, max_lora_rank=16).factors
    for field, value in (("use_dora", True), ("modules_to_save", ["lm_head"]), ("bias", "all"),
                         ("rank_pattern", {"q_proj": 8}), ("r", 32)):
        with pytest.raises(InvalidInput) as refused:
            lora.read_adapter("bad", _edited(good, tmp_path / field, **{field: value}), decoder, max_lora_rank=16)
        assert refused.value.item == f"lora_modules.bad.{field}", field
    with pytest.raises(InvalidInput) as refused:  # a listed target that matches nothing
        lora.read_adapter("bad", _edited(good, tmp_path / "typo", target_modules=["q_proj", "v_projj"]), decoder, 16)
    assert refused.value.item == "lora_modules.bad.target_modules" and "v_projj" in str(refused.value)
    with pytest.raises(InvalidInput) as refused:  # adapters on the vision tower: tests/test_lora_tower.py
        lora.read_adapter("bad", folders["table"], decoder, max_lora_rank=16, family=family_of(ckpt))
    assert refused.value.item == "lora_modules.bad" and "embed_tokens" in str(refused.value)


EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # PEFT: every adapter of a model the same list
EXPERT_ADAPTERS = {  # names no module path contains: PEFT picks tensors by substring
    "amber": dict(r=4, lora_alpha=8, target_modules=[], target_parameters=EXPERTS),
    "teal": dict(r=2, lora_alpha=6, use_rslora=True, target_modules=LANGUAGE + r"(q_proj|v_proj)",
                  target_parameters=EXPERTS),
}
EXPERT_TEXTS = ["Tell me a story about a lighthouse.", "a b c d e f", "What is the capital of France?"]
EXPERT_ROWS = [(0, "amber"), (1, None), (2, "teal"), (1, "amber"), (0, None), (2, "amber")]


class ExpertCase:
    """EXPERT_ADAPTERS written on a MoE preset, its prompts, and PEFT's greedy tokens for every EXPERT_ROWS row."""

    def __init__(self, preset: str, folder, hf=None, base: str | None = None):
        """`hf`: PEFT's model (default: transformers' of the preset, fp32); `base`: the preset the adapters are
        written on (a quantized preset's unquantized one)."""
        self.ckpt = preset_checkpoint(preset)
        self.folders = write_adapters(preset_checkpoint(base or preset), folder, EXPERT_ADAPTERS)
        hf = hf if hf is not None else AutoModelForImageTextToText.from_pretrained(self.ckpt).eval()
        self.peft = peft_model(hf, self.folders)
        self.language = language_adapter(self.ckpt)
        self.prompts = [self.language.tokenizer.encode(text) for text in EXPERT_TEXTS]
        self.want = [self.peft_tokens(i, name) for i, name in EXPERT_ROWS]

    def peft_tokens(self, i: int, name: str | None) -> list[int]:
        ids = torch.tensor([self.prompts[i]])
        with active_adapter(self.peft, name), torch.no_grad():
            out = self.peft.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False)
        tokens = out[0, ids.shape[1]:].tolist()
        ends = [n for n, t in enumerate(tokens) if t in self.language.eos_token_ids]
        return tokens[: ends[0] + 1] if ends else tokens

    def run(self, engine, tag: str) -> list[list[int]]:
        """Every EXPERT_ROWS row's tokens from `engine`, submitted 4 ms apart (K=8: rows join a running batch)."""
        async def one(n, i, name):
            await asyncio.sleep(0.004 * n)
            out = await engine.generate_output(f"{tag}-{n}", self.prompts[i], (), SamplingParams(max_tokens=MAX_NEW),
                                               lora=name)
            return out.token_ids

        async def every():
            return await asyncio.gather(*(one(n, i, name) for n, (i, name) in enumerate(EXPERT_ROWS)))

        return asyncio.run(every())


@pytest.mark.parametrize("preset", ["tiny-qwen3-vl-moe", "tiny-qwen3.5-moe", "tiny-step3"])
def test_adapters_on_moe_experts_equal_peft_generate(preset, tmp_path):
    """PEFT's `target_parameters` on the fused experts (`models/lora_experts.py`), alone and with attention
    linears (rsLoRA), on the three MoE families (Step3's clamped SwiGLU too): a staggered K=8 batch mixing both
    adapters with base rows equals `PeftModel.generate()` per row, and every adapter changes the base tokens."""
    case = ExpertCase(preset, tmp_path)
    assert all(case.want[n] != case.peft_tokens(i, None) for n, (i, name) in enumerate(EXPERT_ROWS) if name)
    engine = LLMEngine(case.ckpt, EngineConfig(max_num_seqs=4, max_model_len=256, num_scheduler_steps=8,
                                               lora_modules={n: str(f) for n, f in case.folders.items()}))
    try:
        assert case.run(engine, "experts") == case.want
    finally:
        engine.shutdown()


def dequantized_reference(preset: str) -> torch.nn.Module:
    """transformers' model of a quantized MoE preset with every weight decompressed by transformers' own op, fp32: FP8
    block-wise experts by its `Fp8Dequantize` (tests/test_quantized_moe.py), compressed-tensors by its quantizer with
    `dequantize=True`. What it left in bf16 (norms, routers, the tower; decompressed experts) is exact in fp32, as
    the engine's copies are."""
    if preset.endswith("-fp8"):
        from tests.test_quantized_moe import reference_model

        return reference_model(preset_checkpoint(preset), torch.float32)[0].float()
    from transformers import CompressedTensorsConfig

    return AutoModelForImageTextToText.from_pretrained(
        preset_checkpoint(preset), dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    ).eval().float()


@pytest.mark.parametrize("preset, base", [("tiny-qwen3-vl-moe-fp8", "tiny-qwen3-vl-moe"),
                                          ("tiny-qwen3.5-moe-w4a16", "tiny-qwen3.5-moe")])
def test_adapters_on_quantized_experts_equal_peft_over_transformers_dequantized_model(preset, base, tmp_path):
    """Quantized experts kept as stored (FP8 block-wise in e4m3, models/quantized/fp8_block.py; compressed-tensors
    int4 per expert, compressed.py), with the experts' adapters: the loop rebuilds each routed expert's weights for
    the forward. PEFT runs over transformers' model of the same checkpoint, decompressed by transformers' own ops.
    The compressed-tensors case was refused before ("target_parameters adapt only fused experts modules")."""
    case = ExpertCase(preset, tmp_path, hf=dequantized_reference(preset), base=base)
    assert all(case.want[n] != case.peft_tokens(i, None) for n, (i, name) in enumerate(EXPERT_ROWS) if name)
    engine = LLMEngine(case.ckpt, EngineConfig(max_num_seqs=4, max_model_len=256, num_scheduler_steps=8,
                                               dtype="float32",
                                               lora_modules={n: str(f) for n, f in case.folders.items()}))
    try:
        assert case.run(engine, "quantized-experts") == case.want
    finally:
        engine.shutdown()


def test_adapters_on_experts_raypipe_cannot_apply_are_refused_naming_the_field(tmp_path):
    """A target parameter other than the experts' two, and experts cut in a way no tensor-parallel split declares
    (a rank's width split names its slice: tests/test_tensor_parallel_lora.py)."""
    ckpt = preset_checkpoint("tiny-qwen3-vl-moe")
    decoder = language_adapter(ckpt).load_model(torch.device("cpu"), torch.float32)
    folder = write_adapters(ckpt, tmp_path / "saved", {"amber": EXPERT_ADAPTERS["amber"]})["amber"]
    read = lora.read_adapter("amber", folder, decoder, max_lora_rank=16)
    assert read.name == "amber" and set(read.factors) == {f"layers.{n}.{p}" for n in range(decoder.model.config.num_hidden_layers)
                                 for p in EXPERTS}
    with pytest.raises(InvalidInput) as refused:
        lora.read_adapter("bad", _edited(folder, tmp_path / "router", target_parameters=["mlp.gate.weight"]), decoder, 16)
    assert refused.value.item == "lora_modules.bad.target_parameters" and "mlp.gate.weight" in str(refused.value)
    experts = decoder.model.get_submodule("layers.0.mlp.experts")
    width = experts.gate_up_proj.shape[1] // 2  # half of every expert's width, with no `width_part` to say which
    experts.gate_up_proj = torch.nn.Parameter(torch.cat((experts.gate_up_proj[:, : width // 2],
                                                         experts.gate_up_proj[:, width: width + width // 2]), 1))
    with pytest.raises(InvalidInput, match="neither the layer's nor a tensor-parallel rank's") as refused:
        lora.read_adapter("amber", folder, decoder, max_lora_rank=16)
    assert refused.value.item == "lora_modules.amber"


def test_engine_start_refuses_what_it_cannot_serve(tmp_path):
    """At start: fewer CPU-kept adapters than slots, and a bad adapter (the engine does not start)."""
    ckpt = preset_checkpoint("tiny")
    good = write_adapters(ckpt, tmp_path, {"good": dict(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                        exclude_modules=r".*visual.*")})["good"]
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineConfig(max_loras=4, max_cpu_loras=2)
    with pytest.raises(InvalidInput) as refused:
        LLMEngine(ckpt, EngineConfig(max_model_len=256, lora_modules={"bad": str(_edited(good, tmp_path / "dora",
                                                                                          use_dora=True))}))
    assert refused.value.item == "lora_modules.bad.use_dora"


# One preset: compiling costs a minute a model on 2 cores, and the hybrid family's static step has its own test
# (tests/test_static_step_kinds.py); the adapter rows work the same over every layer kind.
@pytest.mark.parametrize("served", ["tiny"], indirect=True)
def test_the_compiled_decode_step_serves_mixed_adapters_equal_to_peft_and_takes_run_time_loads(served):
    """The static-shape step (`decode/compiled_step.py`, torch.compile on CPU) with adapter slots: started with
    "red" (attention layers) and given "green" (MLP layers, wrapped after the step compiled) and "blue" at run time,
    the mixed batch equals PEFT at K=8; a second batch mixing the adapters otherwise compiles nothing new (one
    graph per bucket serves any mix)."""
    from torch._dynamo.utils import counters

    engine = LLMEngine(served.ckpt, EngineConfig(
        max_num_seqs=4, max_model_len=512, block_size=8, num_scheduler_steps=8, compiled_decode=True,
        decode_batch_buckets=(4,), decode_kv_buckets=(512,), lora_modules={"red": str(served.folders["red"])}))
    try:
        for name in ("green", "blue"):
            engine.load_lora(name, str(served.folders[name]))
        assert [o.token_ids for o in run_on(served, engine, ROWS, "compiled")] == [served.expected[r] for r in ROWS]
        assert engine.decode_step["mode"] == "torch.compile"
        compiled = counters["stats"]["unique_graphs"]
        other_mix = [(3, "green"), (1, "red"), (2, None), (0, "red"), (3, "blue")]
        assert [o.token_ids for o in run_on(served, engine, other_mix, "mix")] == [served.expected[r]
                                                                                  for r in other_mix]
        assert counters["stats"]["unique_graphs"] == compiled
    finally:
        engine.shutdown()


# --- adapters loaded and unloaded while the engine runs (lora_pool.py) -------------------------------------------

@pytest.fixture(scope="module")
def runtime(served):
    """An engine started without adapters, 2 device slots and 2 CPU-kept adapters for 3 adapters: every one is
    loaded at run time (`load_lora`), and a batch of all three must wait for slots and re-read one from disk."""
    engine = LLMEngine(served.ckpt, EngineConfig(max_num_seqs=4, max_model_len=512, block_size=8, max_loras=2,
                                                 max_cpu_loras=2))
    try:
        yield engine
    finally:
        engine.shutdown()


async def _collect(engine, tag: str, i: int, name: str | None, served, salt: str | None = None, max_tokens=MAX_NEW):
    """(token ids, cached prompt tokens) of prompt `i` under adapter `name`."""
    prompt, embeds = served.case(i)
    tokens, cached = [], None
    async for delta in engine.generate(tag, prompt, embeds, SamplingParams(max_tokens=max_tokens), name,
                                       cache_salt=salt):
        tokens += delta.token_ids
        cached = delta.num_cached_tokens
    return tokens, cached


def test_adapters_loaded_at_run_time_equal_peft_with_fewer_slots_than_adapters(served, runtime):
    """Three adapters, two slots: rows wait for a slot (never fail; the rule itself is held in
    test_decode_scheduler), slots are rewritten; with two kept in CPU memory one is read again; every row
    still equals PEFT."""
    for name, folder in served.folders.items():
        runtime.load_lora(name, str(folder))
    outs = [o.token_ids for o in run_on(served, runtime, ROWS, "runtime")]
    assert outs == [served.expected[row] for row in ROWS]
    stats = runtime.stats()
    # every adapter was written into one of the two slots; "red", first loaded, had left CPU memory
    assert stats["lora_slot_writes"] >= 3 and stats["lora_reads"] >= 1, stats


def test_a_name_loaded_again_with_other_weights_never_hits_the_old_blocks(served, runtime):
    """The prefix cache keys an adapter by its weights, not its name: "swap" unloaded and loaded again from
    another folder answers as the new adapter, with no cached prompt token from the old one (a name-keyed cache
    hands it the old adapter's K/V). The salt keeps other tests' blocks out of the count."""
    runtime.load_lora("swap", str(served.folders["green"]))
    first = asyncio.run(_collect(runtime, "swap-1", 3, "swap", served, salt="reload"))
    again = asyncio.run(_collect(runtime, "swap-2", 3, "swap", served, salt="reload"))
    assert first == (served.expected[3, "green"], 0) and again[1] > 0  # same weights: a hit
    runtime.unload_lora("swap")
    runtime.load_lora("swap", str(served.folders["blue"]))
    assert asyncio.run(_collect(runtime, "swap-3", 3, "swap", served, salt="reload")) == (served.expected[3, "blue"], 0)
    runtime.unload_lora("swap")


def test_unload_lets_running_requests_finish_and_refuses_new_ones(served, runtime):
    """vLLM's rules: loading a served name again is refused (400), unloading an unknown one is a not-found;
    requests running with an adapter when it is unloaded finish with it, later ones are refused naming it."""
    with pytest.raises(InvalidInput) as refused:
        runtime.load_lora("red", str(served.folders["red"]))
    assert refused.value.code == "lora_already_loaded" and "'red'" in str(refused.value)
    with pytest.raises(InvalidInput) as refused:
        runtime.unload_lora("nope")
    assert refused.value.code == "lora_not_found" and "'nope'" in str(refused.value)
    runtime.load_lora("brief", str(served.folders["red"]))

    async def unload_while_running():
        prompt, embeds = served.case(1)
        stream = runtime.generate("brief-1", prompt, embeds, SamplingParams(max_tokens=MAX_NEW), "brief")
        tokens = list((await anext(stream)).token_ids)  # running: its first token is out
        runtime.unload_lora("brief")
        async for delta in stream:
            tokens += delta.token_ids
        return tokens

    assert asyncio.run(unload_while_running()) == served.expected[1, "red"]
    with pytest.raises(InvalidInput) as refused:
        asyncio.run(_collect(runtime, "brief-2", 1, "brief", served))
    assert refused.value.code == "lora_not_found" and "'brief'" in str(refused.value)


def test_a_bad_adapter_loaded_at_run_time_is_refused_naming_the_field(served, runtime, tmp_path):
    bad = _edited(served.folders["red"], tmp_path / "dora", use_dora=True)
    with pytest.raises(InvalidInput) as refused:
        runtime.load_lora("dora", str(bad))
    assert refused.value.item == "lora_path.use_dora"
    with pytest.raises(InvalidInput) as refused:
        runtime.load_lora("missing", str(tmp_path / "missing"))
    assert refused.value.code == "lora_adapter_not_found" and "lora_path" == refused.value.item
    assert "dora" not in runtime.loras.names() and "missing" not in runtime.loras.names()


def test_an_adapter_loaded_from_object_storage_equals_the_same_folder(served, runtime, monkeypatch):
    """`s3://` through raypipe.storage, against a loopback S3-protocol server (moto): the adapter read from the bucket
    has the fingerprint of the same bytes read locally and answers as PEFT does."""
    import logging

    import pyarrow.fs as pafs
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        for name, value in (("AWS_ENDPOINT_URL_S3", f"http://{host}:{port}"), ("AWS_ACCESS_KEY_ID", "testing"),
                            ("AWS_SECRET_ACCESS_KEY", "testing"), ("AWS_REGION", "us-east-1")):
            monkeypatch.setenv(name, value)
        fs = pafs.S3FileSystem(endpoint_override=f"{host}:{port}", scheme="http", region="us-east-1",
                               access_key="testing", secret_key="testing", allow_bucket_creation=True)
        fs.create_dir("adapters")
        for path in served.folders["red"].iterdir():
            with fs.open_output_stream(f"adapters/red/{path.name}") as out:
                out.write(path.read_bytes())
        local = lora.read_adapter("red", served.folders["red"], runtime.runner.model, max_lora_rank=16)
        assert runtime.load_lora("from-s3", "s3://adapters/red") == local.fingerprint
        assert asyncio.run(_collect(runtime, "s3-1", 1, "from-s3", served))[0] == served.expected[1, "red"]
        runtime.unload_lora("from-s3")
    finally:
        server.stop()
