"""Oracle for Qwen2.5-VL positions: the original implementation's rule written out plainly, and greedy
decoding with transformers' own text model driven at those explicit positions.

The rule (Qwen's original `get_rope_index`, vLLM's `get_mrope_input_positions`): text tokens take
consecutive positions, equal on the three axes, starting one past the largest position so far; a
visual item starting at `s` puts its tokens at `s + (time, row, column)` over its merged grid, time
`int(group * seconds_per_grid * tokens_per_second)` for a video, 0 for an image; generated tokens
follow the prompt's largest position. An EVS-pruned video's kept tokens keep their places in the
whole video's grid, and the text after it starts past the whole video.

Kept apart from raypipe's code on purpose (plain loops over lists), and unlike transformers 5.23's
`get_rope_index`, which starts the text after a visual item at `s + max(rows, columns)`.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def rule_positions(ids: list[int], visuals: list[tuple], config, kept: list | None = None) -> tuple[torch.Tensor, int]:
    """`(positions (3, len(ids)), first generated token's position)`. `visuals`: per visual item in
    prompt order `(kind, (t, h, w) in patches, seconds_per_grid or None)`; `kept`: per item None or
    a bool per token of the whole item."""
    placeholders = {config.image_token_id, config.video_token_id}
    merge = config.vision_config.spatial_merge_size
    per_second = config.vision_config.tokens_per_second
    axes = ([], [], [])
    start = 0  # where the next text token or visual item goes
    i = item = 0
    while i < len(ids):
        if ids[i] not in placeholders:
            for axis in axes:
                axis.append(start)
            start += 1
            i += 1
            continue
        kind, (t, h, w), seconds = visuals[item]
        cells = []
        for group in range(t):
            time = int(group * seconds * per_second) if kind == "video" else 0
            for row in range(h // merge):
                for column in range(w // merge):
                    cells.append((start + time, start + row, start + column))
        end = max(max(cell) for cell in cells) + 1
        mask = kept[item] if kept else None
        if mask is not None:
            cells = [cell for cell, keep in zip(cells, mask.tolist(), strict=True) if keep]
        for cell in cells:
            for axis, value in zip(axes, cell):
                axis.append(value)
        i += len(cells)
        start = end
        item += 1
    assert item == len(visuals)
    return torch.tensor(axes), start


@torch.no_grad()
def greedy_at_positions(hf_model, ids: list[int], visual_rows: torch.Tensor | None, positions: torch.Tensor,
                        first_generated: int, max_new: int, eos: int) -> list[int]:
    """Greedy tokens from transformers' text model (`Qwen2_5_VLTextModel`, `Qwen3VLTextModel`) + `lm_head`: the
    prompt's embeddings with `visual_rows` (every placeholder's row, in prompt order) scattered in, prefilled
    at `positions`, then token `n` fed at `first_generated + n`; up to and including `eos`. Rows wider than
    the hidden size carry Qwen3-VL's deepstack levels after it: they go to the text model's own deepstack
    inputs (`visual_pos_masks`, `deepstack_visual_embeds`)."""
    text_model = hf_model.model.language_model
    input_ids = torch.tensor([ids])
    embeds = text_model.embed_tokens(input_ids)
    deepstack = {}
    if visual_rows is not None:
        config = hf_model.config
        slots = (input_ids[0] == config.image_token_id) | (input_ids[0] == config.video_token_id)
        assert int(slots.sum()) == visual_rows.shape[0]
        width = embeds.shape[-1]
        embeds[0, slots] = visual_rows[:, :width].to(embeds.dtype)
        if visual_rows.shape[1] > width:
            deepstack = {"visual_pos_masks": slots[None],
                         "deepstack_visual_embeds": list(visual_rows[:, width:].split(width, dim=-1))}
    cache = DynamicCache(config=text_model.config)
    hidden = text_model(inputs_embeds=embeds, position_ids=positions[:, None], past_key_values=cache,
                        use_cache=True, **deepstack).last_hidden_state
    tokens = []
    for step in range(max_new):
        token = int(hf_model.lm_head(hidden[:, -1]).argmax(-1))
        tokens.append(token)
        if token == eos:
            break
        at = torch.full((3, 1, 1), first_generated + step)
        hidden = text_model(input_ids=torch.tensor([[token]]), position_ids=at, past_key_values=cache,
                            use_cache=True).last_hidden_state
    return tokens
