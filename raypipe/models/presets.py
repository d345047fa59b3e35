"""Writing deterministic tiny checkpoints of real architectures, shared by every family's `preset.py`.

Nothing is downloaded: weights come from a seeded random init, the tokenizer is a byte-level BPE
with no merges plus the family's special tokens. The checkpoint is then loaded back through the
same code path as a user's checkpoint (transformers' `from_pretrained` or raypipe's own loaders).

Families use `initializer_range=0.2` (not the default 0.02) everywhere: with small weights a random
model emits the same greedy tokens even when positions or image order are wrong, so it could not
serve as a test oracle.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable

PRESET_VERSION = "v7"  # part of the cache folder name: bump when any family's preset changes


def cache_root() -> pathlib.Path:
    """raypipe's on-disk cache: preset checkpoints here, compiled decode steps (`compiled_step.py`)."""
    return pathlib.Path(os.environ.get("RAYPIPE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "raypipe"))


def default_cache_dir() -> pathlib.Path:
    return cache_root() / "presets"


def write_once(target: pathlib.Path, write: Callable[[pathlib.Path], None]) -> pathlib.Path:
    """`target`, written by `write(folder)` unless it is complete already.

    Written beside the target and renamed: concurrent actors may race to create the same preset.
    """
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def build_byte_tokenizer(special_tokens: list[str], chat_template: str, *, eos: str, pad: str,
                         unk: str | None = None, named: dict[str, str] | None = None, added: tuple[str, ...] = ()):
    """Byte-level BPE without merges (lossless for any text) plus a family's special tokens.

    `named` are extra special tokens a processor reads as tokenizer attributes (MiniCPM-V's
    `image_token`, `slice_start_token`, ...). `added` are single tokens that are not special, so
    decoding with `skip_special_tokens` keeps them (Qwen3's `<think>` and `</think>`)."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {symbol: i for i, symbol in enumerate(bytes_to_unicode().values())}
    extra = {"extra_special_tokens": dict(named)} if named else {}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=unk or special_tokens[0], eos_token=eos,
                               pad_token=pad, **extra)
    tokenizer.add_special_tokens({"additional_special_tokens": special_tokens})
    if added:
        tokenizer.add_tokens(list(added))
    tokenizer.chat_template = chat_template
    return tokenizer


# Qwen2.5's words for tools in the system turn and for the call format it answers in.
_TOOLS = ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
          "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
          "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}"
          "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
          "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
          "<args-json-object>}\n</tool_call>")


# Qwen3 / Qwen3.5's rule for past reasoning: an assistant turn after the last user turn (a tool-call loop
# within one query) writes its `reasoning_content` as a thinking block; earlier turns drop it.
PAST_REASONING = ("{% if loop.index0 > ns.last_query and message['reasoning_content'] %}"
                  "<think>\n{{ message['reasoning_content'] }}\n</think>\n\n{% endif %}")
_LAST_QUERY = ("{% set ns = namespace(last_query=-1) %}{% for message in messages %}"
               "{% if message['role'] == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}")


def chat_template(image_part: str, default_system: str | None = None, video_part: str | None = None,
                  generation_tail: str = "", past_reasoning: str = "") -> str:
    """A Qwen2.5-style chat template that renders text parts, `image_part` for each image part and
    `video_part` for each video part (families that take videos), and tools as Qwen2.5's does: the
    tools listed in the system turn, an assistant's calls as `<tool_call>` blocks, tool results as
    `<tool_response>` blocks in one user turn.

    `default_system`: a system turn put first when the conversation has none (Qwen2.5-VL's); with
    tools and no system turn, one holding the tools is put first either way. `generation_tail`:
    what the generation prompt writes after `<|im_start|>assistant\n` (Qwen3.5's thinking switch);
    `past_reasoning`: what an assistant turn writes before its content (`PAST_REASONING` for Qwen3.5)."""
    video = ("{% elif part['type'] in ('video', 'video_url') %}" + video_part) if video_part else ""
    content = ("{% if message['content'] is string %}{{ message['content'] }}"
               "{% else %}{% for part in message['content'] %}"
               "{% if part['type'] in ('image', 'image_url') %}" + image_part
               + video
               + "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
               "{% endfor %}{% endif %}")
    tools_alone = _TOOLS if default_system else _TOOLS.lstrip()
    system = ("{% if loop.first and message['role'] != 'system' %}"
              + (f"<|im_start|>system\n{default_system}{{% if tools %}}{_TOOLS}{{% endif %}}<|im_end|>\n"
                 if default_system else f"{{% if tools %}}<|im_start|>system\n{tools_alone}<|im_end|>\n{{% endif %}}")
              + "{% endif %}")
    calls = ("{% for call in message['tool_calls'] or [] %}"
             "{% if message['content'] or not loop.first %}\n{% endif %}"
             "<tool_call>\n{\"name\": \"{{ call['function']['name'] }}\", \"arguments\": "
             "{{ call['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}")
    template = (
        (_LAST_QUERY if past_reasoning else "")
        + "{% for message in messages %}"
        + system
        + "{% if message['role'] == 'tool' %}"
        "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
        "\n<tool_response>\n" + content + "\n</tool_response>"
        "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
        "{% else %}"
        "<|im_start|>{{ message['role'] }}\n"
        + ("{% if message['role'] == 'assistant' %}" + past_reasoning + "{% endif %}" if past_reasoning else "")
        + content
        + "{% if loop.first and message['role'] == 'system' and tools %}" + _TOOLS + "{% endif %}"
        + calls
        + "<|im_end|>\n"
        "{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n" + generation_tail + "{% endif %}"
    )
    return template.replace("%}\n", "%}{{ '\\n' }}")  # transformers renders with trim_blocks: it drops those


def slow_linear_attention_decay(layers, seed: int = 1) -> None:
    """Give every gated-delta-net head of `layers` a slow decay, so the recurrent state remembers the prompt.

    transformers draws each head's decay rate A from [0.01, 16]: most heads forget within a few
    tokens, and a tiny model's answer would depend only on the chat template's fixed suffix
    (measured on MiniCPM-V 4.6: the same greedy tokens with or without the image). Slow heads keep the
    prompt in the state, so a wrong state, order or padding leak changes the output."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    for layer in layers:
        if hasattr(layer, "linear_attn"):
            a_log = layer.linear_attn.A_log
            a_log.data = torch.empty(a_log.shape).uniform_(0.01, 0.2, generator=generator).log()


def padded_vocab_size(tokenizer) -> int:
    """The tokenizer's size rounded up to a multiple of 64, like real checkpoints."""
    return 64 * -(-len(tokenizer) // 64)


def save_preset(folder: pathlib.Path, model, tokenizer, *, eos_id: int, pad_id: int) -> None:
    """Model (safetensors) and tokenizer, greedy generation stopping at `eos_id`, and the version marker."""
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    (folder / "raypipe_preset.json").write_text(json.dumps({"version": PRESET_VERSION}))
