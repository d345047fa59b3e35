"""Sampling controls, against transformers' own logits processors (or a plain reference where it has none).

Unit tests feed one batch of random logits whose rows each have their own parameters through the
sampler and compare every row with the transformers processor applied to that row alone; engine
tests compare greedy decoding with the controls on against `generate()` with the same processors,
and check that seeded sampling with every control on is independent of K and of the batch.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.modeling_outputs import BaseModelOutputWithPooling

from raypipe import InvalidInput, SamplingParams
from raypipe.decode.config import EngineConfig
from raypipe.decode.engine import LLMEngine
from raypipe.decode.sampler import SamplingBatch, process, sample, warp
from raypipe.decode.sequence import Sequence
from raypipe.models.registry import vision_adapter
from tests import decode_reference as ref

VOCAB = 300
EOS = 7


def seqs_for(params: list[SamplingParams], outputs: list[list[int]], prompts: list[list[int]]) -> list[Sequence]:
    out = []
    for i, (p, ids, prompt) in enumerate(zip(params, outputs, prompts)):
        seq = Sequence(f"r{i}", prompt, torch.zeros(3, len(prompt), dtype=torch.long), 0, None, p, lambda _: None)
        seq.output_ids = list(ids)
        out.append(seq)
    return out


def batch_of(params, outputs, prompts, stop=frozenset({EOS})):
    seqs = seqs_for(params, outputs, prompts)
    return seqs, SamplingBatch.build(seqs, [stop] * len(seqs), VOCAB, torch.device("cpu"))


def random_case(rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=g) * 3
    prompts = [torch.randint(0, VOCAB, (5 + i,), generator=g).tolist() for i in range(rows)]
    outputs = [torch.randint(0, VOCAB, (i,), generator=g).tolist() for i in range(rows)]  # repeats included
    return logits, prompts, outputs


def test_logit_bias_and_repetition_penalty_match_transformers():
    logits, prompts, outputs = random_case(5)
    params = [SamplingParams(logit_bias={3: 5.0, 11: -100.0}), SamplingParams(repetition_penalty=1.7),
              SamplingParams(repetition_penalty=0.6, logit_bias={prompts[2][0]: 2.5}), SamplingParams(),
              SamplingParams(repetition_penalty=1.2)]
    _, batch = batch_of(params, outputs, prompts)
    got = process(logits, batch)
    for row, p in enumerate(params):
        input_ids = torch.tensor([prompts[row] + outputs[row]])
        want = logits[row: row + 1]
        if p.logit_bias:
            want = SequenceBiasLogitsProcessor({(t,): b for t, b in p.logit_bias.items()})(input_ids, want)
        if p.repetition_penalty != 1.0:
            want = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(input_ids, want)
        torch.testing.assert_close(got[row], want[0], msg=f"row {row}")


def test_presence_and_frequency_penalties_follow_openai_on_output_tokens_only():
    logits, prompts, outputs = random_case(4, seed=1)
    outputs[3] = [9, 9, 9, 4]
    params = [SamplingParams(presence_penalty=1.5), SamplingParams(frequency_penalty=0.7),
              SamplingParams(presence_penalty=-0.5, frequency_penalty=2.0), SamplingParams(frequency_penalty=1.0)]
    _, batch = batch_of(params, outputs, prompts)
    got = process(logits, batch)
    for row, p in enumerate(params):
        counts = torch.bincount(torch.tensor(outputs[row], dtype=torch.long), minlength=VOCAB).float()
        want = logits[row] - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
        torch.testing.assert_close(got[row], want)
    assert got[3, 9] == pytest.approx(logits[3, 9].item() - 3.0)


def test_penalty_counts_advance_every_step_on_the_device():
    logits, prompts, _ = random_case(2, seed=2)
    params = [SamplingParams(frequency_penalty=1.0), SamplingParams()]
    seqs, batch = batch_of(params, [[], []], prompts)
    first = sample(logits, batch)
    # The sampled token of every row is now counted, in the sequences' own tensors too.
    assert [int(s.token_counts[t]) for s, t in zip(seqs, first.tolist())] == [1, 1]
    second = process(logits, batch)
    assert second[0, first[0]] == pytest.approx(logits[0, first[0]].item() - 1.0)


def test_min_tokens_masks_stop_ids_like_transformers_until_reached():
    logits, prompts, outputs = random_case(3, seed=3)
    logits[:, EOS] = 50.0  # EOS would win
    params = [SamplingParams(min_tokens=3, max_tokens=8), SamplingParams(min_tokens=1), SamplingParams()]
    outputs = [[1], [], [1, 2]]
    seqs, batch = batch_of(params, outputs, prompts)
    for step in range(3):
        got = process(logits, batch)
        for row, p in enumerate(params):
            input_ids = torch.tensor([prompts[row] + outputs[row] + [0] * step])
            want = MinNewTokensLengthLogitsProcessor(len(prompts[row]), p.min_tokens, EOS)(input_ids, logits[row: row + 1])
            torch.testing.assert_close(got[row], want[0], msg=f"row {row} step {step}")
        sample(logits, batch)
    assert batch.num_output.tolist() == [4, 3, 5]


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, 0, 1.0, 0.1), (0.7, 0, 1.0, 0.3), (1.3, 50, 1.0, 0.05), (0.9, 0, 0.8, 0.2), (1.0, 20, 0.9, 0.0)])
def test_warpers_match_transformers_chain(temperature, top_k, top_p, min_p):
    logits, prompts, outputs = random_case(3, seed=4)
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    _, batch = batch_of([p, SamplingParams(temperature=1.0), p], outputs, prompts)
    probs = warp(logits, batch)
    chain = [TemperatureLogitsWarper(temperature)]
    chain += [TopKLogitsWarper(top_k)] if top_k else []
    chain += [TopPLogitsWarper(top_p)] if top_p < 1.0 else []
    chain += [MinPLogitsWarper(min_p)] if min_p else []
    for row in (0, 2):
        scores = logits[row: row + 1]
        for warper in chain:
            scores = warper(torch.zeros(1, 1, dtype=torch.long), scores)
        want = scores.softmax(dim=-1)[0]
        got = probs[row] / probs[row].sum()
        assert torch.equal(got > 0, want > 0), f"kept tokens differ (row {row})"
        torch.testing.assert_close(got, want)


def test_logprobs_are_raw_log_softmax_with_sorted_top_tokens():
    logits, prompts, outputs = random_case(3, seed=5)
    params = [SamplingParams(logprobs=5, logit_bias={1: 100.0}), SamplingParams(), SamplingParams(logprobs=0)]
    seqs, batch = batch_of(params, outputs, prompts)
    tokens = sample(logits, batch)
    got = batch.take_logprobs(seqs)
    reference = logits.log_softmax(dim=-1)
    assert got[1] is None and got[0][0].token_id == 1 == tokens[0]  # biased choice, raw log-probability
    assert got[0][0].logprob == pytest.approx(reference[0, 1].item(), abs=1e-5)
    values, ids = reference[0].topk(5)
    assert [t for t, _ in got[0][0].top] == ids.tolist()
    assert [v for _, v in got[0][0].top] == pytest.approx(values.tolist(), abs=1e-5)
    assert got[2][0].top == [] and got[2][0].logprob == pytest.approx(reference[2, tokens[2]].item(), abs=1e-5)


def test_bad_words_match_transformers_on_the_output_and_advance_every_step():
    """vLLM's bad words are transformers' `NoBadWordsLogitsProcessor` applied to the output alone (not the
    prompt): a one-token word is banned always, a longer word's last token where the output ends with the rest."""
    logits, prompts, _ = random_case(4, seed=8)
    outputs = [[], [5, 6], [5, 6, 9], [40, 41]]
    bans = [[[3], [8, 9]], [[6, 12], [5, 6, 13], [1]], [[5, 6, 14], [9, 15]], [[41, 16], [99, 41, 17]]]
    params = [SamplingParams(bad_words_token_ids=b) for b in bans]
    seqs, batch = batch_of(params, outputs, prompts)
    got = process(logits, batch)
    for row, words in enumerate(bans):
        input_ids = torch.tensor([outputs[row] or [0]])  # [0] ends with no word's prefix: nothing but bans of one
        want = NoBadWordsLogitsProcessor(words)(input_ids, logits[row: row + 1].clone())[0]
        torch.testing.assert_close(got[row], want, msg=f"row {row}")
    assert torch.isinf(got[1, 13]) and torch.isinf(got[2, 15]) and torch.isinf(got[3, 16]) and got[3, 17] > -1e9
    # Row 0 is made to sample 8, after which 9 is banned; its tail advances inside the round.
    logits[0] = -10.0
    logits[0, 8], logits[0, 9] = 5.0, 1.0
    assert sample(logits, batch)[0] == 8
    logits[0, 8] = -100.0
    assert torch.isinf(process(logits, batch)[0, 9]) and sample(logits, batch)[0] != 9


def test_a_ban_never_leaves_a_row_without_a_token():
    """Where `allowed_token_ids` leaves only banned tokens, the row keeps them (no argmax over all -inf)."""
    logits, prompts, outputs = random_case(2, seed=9)
    params = [SamplingParams(allowed_token_ids=[4, 5], bad_words_token_ids=[[4], [5]]),
              SamplingParams(allowed_token_ids=[4, 5], bad_words_token_ids=[[4]])]
    _, batch = batch_of(params, outputs, prompts)
    tokens = sample(logits, batch).tolist()
    assert tokens[0] in (4, 5) and tokens[1] == 5


def test_tiny_temperature_is_greedy_and_never_nan():
    logits, prompts, outputs = random_case(2, seed=6)
    logits[:, 0] = -1e30  # the token a NaN row used to pick
    params = [SamplingParams(temperature=1e-38), SamplingParams(temperature=1e-20, top_p=0.5, min_p=0.1)]
    assert all(p.greedy for p in params)
    _, batch = batch_of(params, outputs, prompts)
    assert sample(logits, batch).tolist() == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("field, value", [
    ("min_p", -0.1), ("min_p", 1.5), ("repetition_penalty", 0.0), ("presence_penalty", 2.5),
    ("frequency_penalty", -3), ("logit_bias", {1: 101.0}), ("logit_bias", {-1: 1.0}), ("logit_bias", [1]),
    ("min_tokens", -1), ("logprobs", 21), ("logprobs", -1), ("bad_words_token_ids", [[]]),
    ("bad_words_token_ids", [[1] * 33]), ("bad_words_token_ids", [[-1]]), ("bad_words_token_ids", [[1]] * 201)])
def test_new_fields_refuse_nonsense(field, value):
    with pytest.raises(InvalidInput) as info:
        SamplingParams(**{field: value})
    assert info.value.item == f"sampling_params.{field}"


# ---- through the engine ----

MAX_NEW = 20


@pytest.fixture(scope="module")
def engines(tiny_ckpt):
    made = {k: LLMEngine(tiny_ckpt, EngineConfig(max_num_seqs=6, max_model_len=384, num_scheduler_steps=k))
            for k in (1, 8)}
    yield made
    for engine in made.values():
        engine.shutdown()


@pytest.fixture(scope="module")
def cases(tiny_ckpt, hf_model, engines):
    tokenizer = engines[1].tokenizer
    vision = vision_adapter(tiny_ckpt)
    out = []
    for i in (0, 1, 2):
        prompt = ref.prepare(i, tokenizer, vision)
        out.append((prompt, ref.embeddings(hf_model, tiny_ckpt, prompt)))
    return out


@pytest.mark.parametrize("k", [1, 8])
def test_greedy_with_processors_equals_generate(engines, cases, hf_model, k):
    engine = engines[k]
    eos = engine.adapter.eos_token_ids[0]
    for case, (prompt, embeds) in enumerate(cases):
        plain = ref.hf_generate(hf_model, prompt, embeds, MAX_NEW, eos)
        bias = {plain[2]: -100.0, plain[5]: 4.0}  # forbid one greedy token, favour another
        want = ref.hf_generate(hf_model, prompt, embeds, MAX_NEW, eos, repetition_penalty=1.5,
                               sequence_bias={(t,): b for t, b in bias.items()})
        params = SamplingParams(max_tokens=MAX_NEW, repetition_penalty=1.5, logit_bias=bias, logprobs=3)
        out = asyncio.run(engine.generate_output(f"proc-{k}-{case}", prompt, embeds, params))
        assert out.token_ids == want, f"case {case}"
        assert want != plain
        assert [lp.token_id for lp in out.logprobs] == out.token_ids
        assert all(len(lp.top) == 3 and lp.top[0][1] >= lp.top[-1][1] for lp in out.logprobs)


def test_min_tokens_holds_off_eos_like_generate(engines, cases, hf_model, monkeypatch):
    engine = engines[8]
    prompt, embeds = cases[0]
    plain = ref.hf_generate(hf_model, prompt, embeds, MAX_NEW, -1)
    eos = plain[3]  # make an early greedy token the EOS, as in test_eos_stops_unless_ignored
    monkeypatch.setattr(engine.output, "eos_token_ids", frozenset({eos}))
    want = ref.hf_generate(hf_model, prompt, embeds, MAX_NEW, eos, min_new_tokens=10, eos_token_id=eos)
    out = asyncio.run(engine.generate_output("min-tokens", prompt, embeds,
                                             SamplingParams(max_tokens=MAX_NEW, min_tokens=10)))
    assert out.token_ids == want and len(want) > 10 and eos not in want[:10]
    early = asyncio.run(engine.generate_output("no-min", prompt, embeds, SamplingParams(max_tokens=MAX_NEW)))
    assert early.token_ids == plain[:4] and early.finish_reason == "stop"


def test_logprobs_of_greedy_tokens_equal_generate_scores(engines, cases, hf_model):
    prompt, embeds = cases[1]
    device = hf_model.device
    ids = torch.tensor([prompt.prompt_token_ids], device=device)
    kwargs = dict(image_grid_thw=torch.tensor(prompt.visual_grids), mm_token_type_ids=(ids == hf_model.config.image_token_id).int(),
                  mm_encoder_outputs={"image": BaseModelOutputWithPooling(pooler_output=tuple(embeds))})
    with torch.no_grad():
        gen = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                output_logits=True, return_dict_in_generate=True, **kwargs)
    want = torch.cat(gen.logits).float().log_softmax(dim=-1)  # (steps, V)
    out = asyncio.run(engines[8].generate_output("lp", prompt, embeds, SamplingParams(max_tokens=8, ignore_eos=True,
                                                                                      logprobs=2)))
    assert out.token_ids == gen.sequences[0, ids.shape[1]:].tolist()
    for step, lp in enumerate(out.logprobs):
        assert lp.logprob == pytest.approx(want[step, lp.token_id].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == want[step].topk(2).indices.tolist()


def test_seeded_sampling_with_every_control_is_independent_of_k_and_batch(engines, cases):
    prompt, embeds = cases[2]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.8, top_k=50, top_p=0.95, min_p=0.05, seed=77,
                            repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3,
                            logit_bias={5: 3.0}, min_tokens=5, logprobs=1)
    alone = {k: asyncio.run(engines[k].generate_output(f"seeded-{k}", prompt, embeds, params)) for k in (1, 8)}
    assert alone[1].token_ids == alone[8].token_ids

    async def busy():
        engine = engines[8]
        noise = [engine.generate_output(f"noise-{i}", cases[i % 2][0], cases[i % 2][1],
                                        SamplingParams(max_tokens=12 + i, temperature=1.0, frequency_penalty=1.0,
                                                       seed=i if i % 2 else None, logprobs=i))
                 for i in range(4)]
        results = await asyncio.gather(*noise, engine.generate_output("seeded-busy", prompt, embeds, params))
        return results[-1]

    crowded = asyncio.run(busy())
    assert crowded.token_ids == alone[8].token_ids
    assert [lp.logprob for lp in crowded.logprobs] == pytest.approx([lp.logprob for lp in alone[8].logprobs], abs=1e-4)
    unseeded = asyncio.run(engines[8].generate_output("unseeded", prompt, embeds,
                                                      dataclasses.replace(params, seed=None)))
    assert unseeded.token_ids != alone[8].token_ids  # it does sample


# ---- vLLM's output fields: allowed_token_ids, skip_special_tokens, include_stop_str_in_output ----

def test_allowed_token_ids_equal_generate_with_the_others_suppressed(engines, cases, hf_model):
    """`allowed_token_ids` against transformers' own processor for it (`suppress_tokens`: every other id);
    a special token is among the allowed, so `skip_special_tokens` decides whether its text is in the output."""
    engine = engines[8]
    prompt, embeds = cases[0]
    plain = ref.hf_generate(hf_model, prompt, embeds, MAX_NEW, -1)
    special = engine.tokenizer.convert_tokens_to_ids("<|im_start|>")
    allowed = sorted({plain[1], plain[4], 97, 98, special})
    vocab = hf_model.config.get_text_config().vocab_size
    want = ref.hf_generate(hf_model, prompt, embeds, MAX_NEW, -1,
                           suppress_tokens=[t for t in range(vocab) if t not in allowed])
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, allowed_token_ids=allowed)
    out = asyncio.run(engine.generate_output("allowed", prompt, embeds, params))
    assert out.token_ids == want and set(want) <= set(allowed) and want != plain
    assert special in want, "the test needs the special token in the output"
    kept = asyncio.run(engine.generate_output("allowed-special", prompt, embeds,
                                              dataclasses.replace(params, skip_special_tokens=False)))
    assert kept.token_ids == want
    assert kept.text == engine.tokenizer.decode(want, skip_special_tokens=False) and "<|im_start|>" in kept.text
    assert out.text == engine.tokenizer.decode(want, skip_special_tokens=True) and "<|im_start|>" not in out.text


def test_allowed_token_ids_outside_the_vocabulary_are_refused(engines, cases):
    prompt, embeds = cases[0]
    params = SamplingParams(max_tokens=4, allowed_token_ids=[3, 10**6])
    with pytest.raises(InvalidInput) as info:
        asyncio.run(engines[1].generate_output("allowed-oov", prompt, embeds, params))
    assert info.value.item == "sampling_params.allowed_token_ids"


@pytest.mark.parametrize("k", [1, 8])
def test_bad_words_equal_generate_with_bad_words_ids(engines, cases, hf_model, k):
    """A one-token word and a two-token word, each against `generate(bad_words_ids=...)`; the two-token word
    is the greedy output's tokens 4 and 5, so its ban applies at step 5 (inside a K=8 round)."""
    engine = engines[k]
    prompt, embeds = cases[1]
    plain = ref.hf_generate(hf_model, prompt, embeds, MAX_NEW, -1)
    assert prompt.prompt_token_ids[-1] != plain[4]  # transformers also matches the prompt's end; vLLM does not
    for name, words in (("one", [[plain[2]]]), ("two", [[plain[4], plain[5]]])):
        want = ref.hf_generate(hf_model, prompt, embeds, MAX_NEW, -1, bad_words_ids=words)
        params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, bad_words_token_ids=words)
        out = asyncio.run(engine.generate_output(f"bad-{name}-{k}", prompt, embeds, params))
        assert out.token_ids == want and want != plain, name
    never = [plain[5], plain[4]]  # a word the greedy output never writes changes nothing
    assert never not in [plain[i: i + 2] for i in range(len(plain) - 1)]
    unbanned = asyncio.run(engine.generate_output(f"bad-none-{k}", prompt, embeds, SamplingParams(
        max_tokens=MAX_NEW, ignore_eos=True, bad_words_token_ids=[never])))
    assert unbanned.token_ids == plain


def test_bad_words_outside_the_vocabulary_are_refused(engines, cases):
    prompt, embeds = cases[0]
    with pytest.raises(InvalidInput) as info:
        asyncio.run(engines[1].generate_output("bad-oov", prompt, embeds,
                                               SamplingParams(max_tokens=4, bad_words_token_ids=[[3, 10**6]])))
    assert info.value.item == "sampling_params.bad_words_token_ids"


@pytest.mark.parametrize("k", [1, 8])
def test_include_stop_str_in_output_ends_the_text_after_the_stop(engines, cases, k):
    engine = engines[k]
    prompt, embeds = cases[1]
    whole = asyncio.run(engine.generate_output(f"whole-{k}", prompt, embeds,
                                               SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))).text
    stop = whole[len(whole) // 2: len(whole) // 2 + 3]
    cut = whole.index(stop)
    for include, end in ((False, cut), (True, cut + len(stop))):
        params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, stop=[stop], include_stop_str_in_output=include)
        out = asyncio.run(engine.generate_output(f"stop-{k}-{include}", prompt, embeds, params))
        assert out.text == whole[:end] and out.finish_reason == "stop", (include, stop, whole)
