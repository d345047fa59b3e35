"""Deterministic tiny checkpoints of real architectures, written as real HF checkpoint folders.

Nothing is downloaded: the weights come from a seeded random init, the tokenizer is a byte-level
BPE with no merges plus Qwen's special tokens. Everything is then loaded back through the same code
path as a user's checkpoint (transformers' `from_pretrained` or raypipe's own loaders).

`initializer_range=0.2` (not the default 0.02) everywhere: with small weights a random model emits
the same greedy tokens even when positions or image order are wrong, so it could not serve as a
test oracle.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile

PRESET_VERSION = "v2"

# Qwen's special tokens, in the order the real vocabulary has them.
QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# Qwen2.5-VL's chat template, reduced to what raypipe serves (text and image parts).
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# name -> (vision kwargs, text kwargs, image-processor pixel bounds)
_QWEN2_5_VL_SHAPES = {
    # CPU test oracle: depth 2 = one window block + one full-attention block.
    "tiny": dict(
        vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, fullatt_block_indexes=[1]),
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, mrope_section=[2, 3, 3]),
        min_pixels=28 * 28 * 4,
        max_pixels=28 * 28 * 256,
    ),
    # Realistic shape scaled to a CPU (~70M parameters): used by benchmarks, not tests.
    "small": dict(
        vision=dict(depth=8, hidden_size=256, intermediate_size=688, num_heads=4, fullatt_block_indexes=[3, 7]),
        text=dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, mrope_section=[8, 12, 12]),
        min_pixels=28 * 28 * 4,
        max_pixels=28 * 28 * 1024,  # Qwen2.5-VL ships 28*28*1280
    ),
}

def _preset_families() -> dict[str, str]:
    """Preset name -> model family (`model_type`) of the checkpoint it writes."""
    from raypipe.models.minicpmv4_6_preset import SHAPES as MINICPMV_SHAPES
    from raypipe.models.step3_preset import STEP3_SHAPES

    return {**{name: "qwen2_5_vl" for name in _QWEN2_5_VL_SHAPES},
            **{name: "minicpmv4_6" for name in MINICPMV_SHAPES}, **{name: "step3p7" for name in STEP3_SHAPES}}


PRESETS = tuple(_preset_families())


def default_cache_dir() -> pathlib.Path:
    root = os.environ.get("RAYPIPE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "raypipe")
    return pathlib.Path(root) / "presets"


def resolve_model(model: str | os.PathLike) -> pathlib.Path:
    """A name in `PRESETS` names a preset (written on first use); `s3://...` a checkpoint in object
    storage (copied to this node's cache once, see `raypipe.models.remote`); anything else a local folder."""
    if isinstance(model, str) and model in PRESETS:
        return preset_checkpoint(model)
    if isinstance(model, str) and model.startswith("s3://"):
        from raypipe.models.remote import fetch_model

        return fetch_model(model)
    path = pathlib.Path(model)
    if not (path / "config.json").is_file():
        from raypipe.errors import InvalidInput

        raise InvalidInput(f"no config.json in {str(path)!r}: expected a preset name {PRESETS}, a local HF "
                           "checkpoint folder or an s3:// URI", item="model")
    return path


def model_for_actors(model: str | os.PathLike, checkpoint: pathlib.Path) -> str:
    """What to hand actors that may start on other nodes: a preset name or an s3:// URI, which each
    node resolves to its own local copy, else the local folder's absolute path."""
    model = os.fspath(model)
    return model if model in PRESETS or model.startswith("s3://") else str(checkpoint.resolve())


def tiny_checkpoint(path: str | os.PathLike | None = None) -> pathlib.Path:
    """The tiny Qwen2.5-VL checkpoint folder, written once (deterministically) and reused."""
    return preset_checkpoint("tiny", path)


def preset_checkpoint(name: str, path: str | os.PathLike | None = None) -> pathlib.Path:
    family = _preset_families()[name]
    target = pathlib.Path(path) if path is not None else default_cache_dir() / f"{name}-{family}-{PRESET_VERSION}"
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the target and rename: concurrent actors may race to create the same preset.
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        if family == "qwen2_5_vl":
            _write_qwen2_5_vl(staging, _QWEN2_5_VL_SHAPES[name])
        elif family == "step3p7":
            from raypipe.models.step3_preset import write_step3

            write_step3(staging, name, PRESET_VERSION)
        else:
            from raypipe.models import minicpmv4_6_preset

            minicpmv4_6_preset.write(staging, name, PRESET_VERSION)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def build_byte_tokenizer(special_tokens: list[str], chat_template: str, *, eos: str, pad: str):
    """Byte-level BPE without merges (lossless for any text) plus a family's special tokens."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_symbols = list(bytes_to_unicode().values())
    vocab = {symbol: i for i, symbol in enumerate(byte_symbols)}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=special_tokens[0], eos_token=eos, pad_token=pad)
    tokenizer.add_special_tokens({"additional_special_tokens": special_tokens})
    tokenizer.chat_template = chat_template
    return tokenizer


def _write_qwen2_5_vl(folder: pathlib.Path, shape: dict) -> None:
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = build_byte_tokenizer(QWEN_SPECIAL_TOKENS, QWEN_CHAT_TEMPLATE, eos="<|im_end|>", pad="<|endoftext|>")
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in QWEN_SPECIAL_TOKENS}
    vocab_size = 64 * -(-len(tokenizer) // 64)  # rounded up, like real checkpoints
    text = dict(shape["text"])
    mrope_section = text.pop("mrope_section")
    init = 0.2
    config = Qwen2_5_VLConfig(
        vision_config=dict(shape["vision"], out_hidden_size=text["hidden_size"], patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           initializer_range=init),
        text_config=dict(text, vocab_size=vocab_size, max_position_embeddings=4096, initializer_range=init,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": mrope_section},
                         bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                         pad_token_id=ids["<|endoftext|>"]),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        initializer_range=init,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    processor = Qwen2VLImageProcessorPil(min_pixels=shape["min_pixels"], max_pixels=shape["max_pixels"],
                                         patch_size=14, merge_size=2, temporal_patch_size=2)
    processor.save_pretrained(folder)
    (folder / "raypipe_preset.json").write_text(json.dumps({"version": PRESET_VERSION}))
