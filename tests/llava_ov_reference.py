"""transformers' own LLaVA-OneVision paths, the oracle of the LLaVA-OneVision tests.

`LlavaOnevisionProcessor` cannot be constructed here (its constructor looks up the video processor
class, which needs torchvision), so `processor` builds one without `__init__` and sets the
attributes its call reads: `apply_chat_template(tokenize=True)` then runs as transformers wrote it
(`chat_inputs`), and so do `replace_image_token`, `_get_number_of_features` and `replace_video_token`,
on the Pillow image processor's output and on `LlavaOnevisionVideoProcessor.preprocess`'s
(transformers' own, with `minicpmv_video_reference`'s stand-in for the two torchvision kernels: install
it first).

How the processor is handed a prompt's images decides their views: as one prompt's list (`[images]`,
what `apply_chat_template` does) an image alone gets AnyRes tiles and several get their base view
each (`batch_num_images`); as a flat list (`tile_every_image`) every image gets its tiles.
"""

from __future__ import annotations

import json
import pathlib

import PIL.Image
import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from raypipe.models.llava_onevision.vision import load_image_processor

# (height, width): tall, wide, square, tiny, large (3x3 tiles, shrunk past anyres_max_4), extreme ratios.
SIZES = [(100, 60), (40, 170), (56, 56), (20, 30), (300, 290), (160, 100), (30, 400), (500, 70), (120, 230)]


def processor(ckpt):
    from transformers import AutoTokenizer, LlavaOnevisionProcessor

    settings = json.loads((pathlib.Path(ckpt) / "processor_config.json").read_text())
    proc = object.__new__(LlavaOnevisionProcessor)
    proc.image_processor = load_image_processor(ckpt)
    proc.tokenizer = AutoTokenizer.from_pretrained(ckpt)
    proc.chat_template = proc.tokenizer.chat_template
    proc.num_image_tokens = settings["num_image_tokens"]
    proc.vision_feature_select_strategy = settings["vision_feature_select_strategy"]
    proc.vision_aspect_ratio = settings["vision_aspect_ratio"]
    proc.image_token = settings["image_token"]
    proc.video_token = settings["video_token"]
    return proc


def chat_inputs(ckpt, messages: list[dict]) -> dict:
    """`apply_chat_template(messages, tokenize=True, return_dict=True)`: prompt ids and pixel inputs, image parts'
    arrays given as PIL images."""
    as_pil = [m if isinstance(m["content"], str) else {**m, "content": [
        {**p, "image": PIL.Image.fromarray(p["image"])} if p["type"] == "image" else p for p in m["content"]]}
        for m in messages]
    return processor(ckpt).apply_chat_template(as_pil, tokenize=True, return_dict=True, add_generation_prompt=True,
                                               return_tensors="pt")


def video_processor(ckpt):
    from transformers.models.llava_onevision.video_processing_llava_onevision import LlavaOnevisionVideoProcessor

    return LlavaOnevisionVideoProcessor.from_pretrained(ckpt)


def preprocess_video(ckpt, source, source_fps: float, **kwargs):
    """`preprocess` of one video given all its source frames `(N, H, W, 3)` at `source_fps`, sampling frames itself.
    The frames are RGB already: its RGB conversion (a torchvision kernel, the identity on 3 channels) is off."""
    from tests.minicpmv_video_reference import metadata

    return video_processor(ckpt).preprocess([source], video_metadata=[metadata(source, source_fps)],
                                             do_sample_frames=True, do_convert_rgb=False, return_tensors="pt", **kwargs)


def _images(ckpt, images, tile_every_image: bool):
    """The image processor's output for one prompt's images (or, `tile_every_image`, a flat list)."""
    return load_image_processor(ckpt)(list(images) if tile_every_image else [list(images)], return_tensors="pt")


def prompt_ids(ckpt, text: str, images, videos=(), tile_every_image: bool = False) -> list[int]:
    """What `LlavaOnevisionProcessor(images=[images], videos=videos, text=text)` tokenizes (a flat `images` list
    with `tile_every_image`): each `<image>` replaced by `replace_image_token` for its image, each `<video>` by
    `replace_video_token` (`videos`: `preprocess_video` outputs)."""
    proc = processor(ckpt)
    for token, items, expand in ((proc.image_token, images, proc.replace_image_token),
                                 (proc.video_token, videos, proc.replace_video_token)):
        if not len(items):
            continue
        processed = _images(ckpt, items, tile_every_image) if token == proc.image_token else {
            "pixel_values_videos": [v["pixel_values_videos"][0] for v in items]}
        pieces = text.split(token)
        assert len(pieces) == len(items) + 1
        text = pieces[0] + "".join(expand(processed, i) + piece for i, piece in enumerate(pieces[1:]))
    return proc.tokenizer(text, add_special_tokens=False)["input_ids"]


def image_features(hf_model, ckpt, images, tile_every_image: bool = False) -> list[torch.Tensor]:
    """Per-image rows from `get_image_features` (tower, selection, projector, packing) for one prompt's images
    (`tile_every_image`: a flat list, every image tiled)."""
    if not len(images):
        return []
    processed = _images(ckpt, images, tile_every_image)
    with torch.no_grad():
        out = hf_model.model.get_image_features(processed["pixel_values"], processed["image_sizes"],
                                                batch_num_images=processed["batch_num_images"]).pooler_output
    return [feature.cpu() for feature in out]


def video_features(hf_model, processed) -> torch.Tensor:
    """One video's rows from `get_video_features` (tower, selection, projector, 2x2 pooling, newline)."""
    with torch.no_grad():
        return hf_model.model.get_video_features(
            processed["pixel_values_videos"], vision_feature_layer=hf_model.config.vision_feature_layer,
            vision_feature_select_strategy=hf_model.config.vision_feature_select_strategy).pooler_output[0]


def generate(hf_model, prompt_ids: list[int], features: list[torch.Tensor], max_new_tokens: int,
             video: torch.Tensor | None = None) -> list[int]:
    """Greedy `generate()` with the image features (and one video's) given; new ids (all of them: no EOS cut)."""
    ids = torch.tensor([prompt_ids])
    outputs = {}
    if features:
        outputs["image"] = BaseModelOutputWithPooling(pooler_output=tuple(features))
    if video is not None:
        outputs["video"] = BaseModelOutputWithPooling(pooler_output=video[None])
    kwargs = {"mm_encoder_outputs": outputs} if outputs else {}
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, **kwargs)
    return out[0, ids.shape[1]:].tolist()


def generate_chat(hf_model, inputs: dict, max_new_tokens: int) -> list[int]:
    """Greedy `generate()` on `chat_inputs`' output as it is (pixels, image sizes, `batch_num_images`); new ids."""
    with torch.no_grad():
        out = hf_model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()
