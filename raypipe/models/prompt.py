"""Requests -> token ids with expanded placeholders, plus the visual items they refer to.

A request is OpenAI-style chat `messages` (content parts `text`, `image_url` / `video_url` with a
data: URL, or `image` / `video` with a PIL image / array / bytes / list of frames), a dict holding
`messages`, or a dict holding raw `prompt_token_ids` with `images` and `videos`. Each visual content
part has a kind (`VISUAL_PART_KINDS`), and each kind its placeholder token (`placeholder_token_ids`
of the vision adapter). The checkpoint's chat template renders one image token per image
(Qwen: `<|vision_start|><|image_pad|><|vision_end|>`; Step3: `<im_patch>`); each is then replaced by
the family's placeholder for that image (`VisionAdapter.placeholder_ids`: Qwen, its token count of
`<|image_pad|>`; MiniCPM-V, image id, overview and slice rows; Step3, crop and global-view runs with
their layout tokens), computed from the image size alone. A video's placeholder is its run of
`<|video_pad|>` tokens, shortened to the planned count when EVS prunes it (`raypipe.models.evs`).
Before that, the family sees the prompt's items together (`VisionAdapter.prompt_visuals`): LLaVA-OneVision
gives each image of a several-image prompt its base view only, unless the request asks for
`tile_every_image` (a request dict's `mm_processor_kwargs`, Serve's field of that name).

Text that users (or assistants) supply is plain text: `"<|im_end|>"` typed into a message is the
characters `<`, `|`, ... , never the control token, or a user could forge a system turn. Only the
chat template's own markers become control tokens (`chat_template_ids`, `plain_text_ids`; every
model family's prompt builder goes through them).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Collection, Sequence

import numpy as np

from raypipe.errors import InvalidInput
from raypipe.inputs.images import ImageLimits, load_image, shrink_to
from raypipe.inputs.media import DecodedVisual, VisualKind
from raypipe.inputs.video import PlanFrames, VideoLimits, VideoSampling, load_video
from raypipe.models import evs
from raypipe.models.base import VisionAdapter, VisualLayout

# OpenAI / HF content-part type -> the kind of visual item it carries (a new kind adds its types here).
VISUAL_PART_KINDS: dict[str, VisualKind] = {"image": "image", "image_url": "image", "video": "video",
                                            "video_url": "video"}


@dataclasses.dataclass(frozen=True, slots=True)
class VideoOptions:
    """How a request's videos are read: limits, sampling knobs (vLLM's names) and the EVS pruning rate."""

    limits: VideoLimits = VideoLimits()
    sampling: VideoSampling = VideoSampling()
    pruning_rate: float = 0.0  # EVS (`raypipe.models.evs`): 0 keeps every video token

    def __post_init__(self):
        evs.check_rate(self.pruning_rate)


@dataclasses.dataclass(frozen=True, slots=True)
class TemplateOptions:
    """How the chat template renders a conversation (vLLM's request fields of these names): whether it opens
    the assistant's turn after the messages, or leaves the last (assistant) message open to be continued;
    `chat_template` replaces the model's own template for one request (rendered by transformers in the same
    sandboxed jinja environment as the model's)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class LowDetail:
    """An image part sent with OpenAI's `detail: "low"`: read at `ImageLimits.low_detail_pixels` at most."""

    source: object


@dataclasses.dataclass(slots=True)
class PreparedPrompt:
    prompt_token_ids: list[int]
    visuals: list[DecodedVisual]  # in prompt order; the engine needs only their embeddings
    visual_layouts: list[VisualLayout]  # per visual item, in prompt order
    num_image_tokens: int  # placeholder tokens of every visual item (the name RequestOutput reports it under)

    @property
    def visual_grids(self) -> list[tuple[int, ...]]:
        return [layout.grid for layout in self.visual_layouts]

    @property
    def num_prompt_tokens(self) -> int:  # image tokens included, as OpenAI usage counts them
        return len(self.prompt_token_ids)

    def without_pixels(self) -> "PreparedPrompt":
        """What the decode engine needs: the same prompt without the pixel arrays."""
        return dataclasses.replace(self, visuals=[])


def build_prompt(request, tokenizer, vision_adapter: VisionAdapter,
                 image_limits: ImageLimits = ImageLimits(), *, video: VideoOptions = VideoOptions(),
                 max_text_chars: int | None = None, max_video_tokens: int | None = None,
                 resize_images: bool = True, tools: list[dict] | None = None,
                 tile_every_image: bool = False, chat_template_kwargs: dict | None = None,
                 template: TemplateOptions = TemplateOptions()) -> PreparedPrompt:
    """`max_text_chars` (see `max_chars_per_token`) refuses hopelessly long text before tokenizing it;
    `max_video_tokens` (the context length) refuses a video whose planned frames need more tokens
    than that from its header, before any frame is decoded.

    `resize_images=False` keeps images at full resolution (the encoder worker's processor resizes
    them): only for measuring what resizing here saves (`raypipe bench serve-load`). `tools`: OpenAI
    function tools, which the chat template lists (see `chat_template_ids`). `tile_every_image` (or a request
    dict's `"mm_processor_kwargs": {"tile_every_image": ...}`, which wins): see `VisionAdapter.prompt_visuals`.
    `chat_template_kwargs` (or a request dict's field of that name, which wins): the template's switches
    (see `check_template_kwargs`); `template`: how the template renders (see `TemplateOptions`).
    """
    tile_every_image = _tile_every_image(request, tile_every_image)
    loaders = _loaders(vision_adapter, image_limits, video, resize_images, max_video_tokens)
    if isinstance(request, dict) and "prompt_token_ids" in request:
        return _from_token_ids(request, tokenizer, vision_adapter, loaders, video.pruning_rate, tile_every_image)
    messages = request.get("messages") if isinstance(request, dict) else request
    if not isinstance(messages, list) or not messages:
        raise InvalidInput("a request is a non-empty messages list, a dict with 'messages', or a dict with "
                           "'prompt_token_ids'", item="messages", code="invalid_request")
    template_messages, raw_visuals = _split_visuals(messages)
    if max_text_chars is not None:
        check_text_chars(sum(len(text) for text in _texts(template_messages)), max_text_chars)
    visuals = _load_all(raw_visuals, loaders)
    if isinstance(request, dict) and request.get("chat_template_kwargs") is not None:
        chat_template_kwargs = request["chat_template_kwargs"]
    ids = chat_template_ids(tokenizer, template_messages, tools, chat_template_kwargs, template)
    return _expand(ids, visuals, tokenizer, vision_adapter, video.pruning_rate, tile_every_image,
                   allow_expanded=False)


def _tile_every_image(request, given: bool) -> bool:
    """The request dict's `mm_processor_kwargs.tile_every_image`, else `given`."""
    kwargs = request.get("mm_processor_kwargs") if isinstance(request, dict) else None
    if kwargs is not None:
        if not isinstance(kwargs, dict) or set(kwargs) - {"tile_every_image"}:
            raise InvalidInput("mm_processor_kwargs of a request here holds only tile_every_image (video sampling "
                               "is the deployment's)", item="mm_processor_kwargs", code="invalid_mm_processor_kwargs")
        given = kwargs.get("tile_every_image", given)
    if not isinstance(given, bool):
        raise InvalidInput(f"tile_every_image must be true or false, not {given!r}", item="mm_processor_kwargs",
                           code="invalid_mm_processor_kwargs")
    return given


def load_visuals(visuals: Sequence, vision_adapter: VisionAdapter, image_limits: ImageLimits = ImageLimits(), *,
                 video: VideoOptions = VideoOptions()) -> list[DecodedVisual]:
    """Visual items without a prompt (`Pipeline.encode`), decoded as a request's would be: each is an
    image (PIL image, uint8 array, encoded bytes, data: URL) or a content part (`image` / `image_url`,
    `video` / `video_url`: a path, encoded bytes, a data: URL or a list of frames), in input order.
    Items are named per kind (`images[1]`, `videos[0]`)."""
    raw = []
    for i, visual in enumerate(visuals):
        kind = visual.get("type") if isinstance(visual, dict) else None
        raw.append((VISUAL_PART_KINDS[kind], _visual_of(visual, f"visuals[{i}]")) if kind in VISUAL_PART_KINDS
                   else ("image", visual))
    return _load_all(raw, _loaders(vision_adapter, image_limits, video, True, None))


def _loaders(vision_adapter: VisionAdapter, image_limits: ImageLimits, video: VideoOptions, resize_images: bool,
             max_video_tokens: int | None):
    """kind -> `(raw, item) -> DecodedVisual`, each decoded at the size the tower consumes, where it is
    decoded: only those pixels travel to the encoders (a video's frames are resized as they are decoded)."""
    def image(raw, item):
        if isinstance(raw, LowDetail):
            decoded = shrink_to(load_image(raw.source, image_limits, item=item), image_limits.low_detail_pixels)
        else:
            decoded = load_image(raw, image_limits, item=item)
        return vision_adapter.resize_for_tower(decoded) if resize_images else decoded

    def video_(raw, item):
        plan_frames = vision_adapter.plan_frames(video.sampling)
        if max_video_tokens is not None:
            plan_frames = _bounded(plan_frames, vision_adapter, max_video_tokens, video.pruning_rate, item)
        return load_video(raw, video.limits, plan_frames, item=item)

    return {"image": image, "video": video_}


def _bounded(plan_frames: PlanFrames, vision_adapter: VisionAdapter, max_tokens: int, pruning_rate: float,
             item: str) -> PlanFrames:
    """`plan_frames` that refuses a plan whose video needs more than `max_tokens` prompt tokens."""
    def plan(metadata):
        frame_plan = plan_frames(metadata)
        if not frame_plan.indices:  # load_video refuses it, by its own code
            return frame_plan
        # The tokens follow from the frame count and size alone: a zero-stride array stands for the frames.
        shape = (len(frame_plan.indices), frame_plan.height, frame_plan.width, 3)
        try:
            pixels = np.broadcast_to(np.zeros((1, 1, 1, 1), np.uint8), shape)
        except ValueError:  # more pixels than an array can index (a huge requested min_pixels): over any context
            raise InvalidInput(f"the video's sampled frames would be {frame_plan.height}x{frame_plan.width}; this "
                               f"model's context holds {max_tokens} tokens", item=item,
                               code="context_length_exceeded") from None
        planned = DecodedVisual(pixels, "", "video", metadata.fps, metadata.frames_duration_s)
        visual = vision_adapter.make_item(planned)
        layout = vision_adapter.layout(planned, visual, pruning_rate)
        tokens = visual.num_tokens
        if pruning_rate > 0:
            groups = layout.grid[0]
            tokens = evs.retained_count(groups, visual.num_tokens // groups, pruning_rate)
        if tokens > max_tokens:
            raise InvalidInput(f"the video needs {tokens} tokens ({len(frame_plan.indices)} frames of "
                               f"{frame_plan.height}x{frame_plan.width}); this model's context holds {max_tokens}: "
                               "sample fewer frames (mm_processor_kwargs fps / max_frames / max_pixels)", item=item,
                               code="context_length_exceeded")
        return frame_plan

    return plan


def _load_all(raw_visuals: list[tuple[VisualKind, object]], loaders: dict) -> list[DecodedVisual]:
    """Decode each `(kind, raw)` with its kind's loader; items are named per kind (`images[1]`, `videos[0]`)."""
    counts: dict[str, int] = {}
    visuals = []
    for kind, raw in raw_visuals:
        index = counts[kind] = counts.get(kind, -1) + 1
        visuals.append(loaders[kind](raw, f"{kind}s[{index}]"))
    return visuals


def max_chars_per_token(tokenizer) -> int:
    """The most characters one non-control token can stand for (its vocabulary string is at least as long).

    So `len(text) / max_chars_per_token` tokens at least: text longer than that many times the
    context is refused before the (slow, memory-hungry) tokenizer ever sees it.
    """
    added = set(tokenizer.get_added_vocab())
    return max(len(token) for token in tokenizer.get_vocab() if token not in added)


def check_text_chars(num_chars: int, max_text_chars: int) -> None:
    if num_chars > max_text_chars:
        raise InvalidInput(f"the prompt text is {num_chars} characters, more than the model's maximum context "
                           f"length can hold (at most {max_text_chars} characters)", item="messages",
                           code="context_length_exceeded")


def plain_text_ids(tokenizer, text: str) -> list[int]:
    """Token ids of user- or assistant-supplied text: control-token strings in it stay plain text."""
    if not text:
        return []
    return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))


# Chat-template switches whose type is checked (vLLM's `chat_template_kwargs`): a wrong type is a 400.
TEMPLATE_SWITCHES = {"enable_thinking": bool}


def check_template_kwargs(tokenizer, kwargs: dict | None, chat_template: str | None = None) -> dict:
    """`kwargs` for the chat template, or `InvalidInput` for a `TEMPLATE_SWITCHES` key of the wrong type. As in
    vLLM, keys the template does not read are dropped (a model without a thinking switch ignores
    `enable_thinking`), and so are names `apply_chat_template` itself takes (`tokenize`, `tools`, ...)."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise InvalidInput("chat_template_kwargs must be an object", item="chat_template_kwargs",
                           code="invalid_chat_template_kwargs")
    for key, value in kwargs.items():
        kind = TEMPLATE_SWITCHES.get(key)
        if kind is not None and not isinstance(value, kind):
            raise InvalidInput(f"{key} must be a {kind.__name__}, not {value!r}", item=f"chat_template_kwargs.{key}",
                               code="invalid_chat_template_kwargs")
    read = _template_variables(chat_template or tokenizer.chat_template or "")
    return {key: value for key, value in kwargs.items() if key in read and key not in _TEMPLATE_CALL_NAMES}


# `apply_chat_template`'s own arguments and the variables it sets: a request's kwargs never override them.
_TEMPLATE_CALL_NAMES = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                                  "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                                  "truncation", "max_length", "return_tensors", "return_dict",
                                  "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs"})


def _template_variables(template: str) -> frozenset[str]:
    """The variables a chat template reads from its context, parsed in transformers' own environment (its
    extensions: loop controls, `generation` blocks); none for a template that does not parse (rendering it
    reports that)."""
    import jinja2
    import jinja2.meta
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        environment = _compile_jinja_template(template).environment
        return frozenset(jinja2.meta.find_undeclared_variables(environment.parse(template)))
    except jinja2.TemplateError:
        return frozenset()


def chat_template_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                      template_kwargs: dict | None = None, template: TemplateOptions = TemplateOptions()) -> list[int]:
    """Render `messages` with the tokenizer's chat template; only the template's own markers are control tokens.

    Each supplied text is swapped for a unique marker before rendering, so the template's markers
    can be told apart from look-alikes in the text. The rendered string is then cut at the
    template's control tokens, as the tokenizer itself would cut it, and each stretch between them
    (template text and supplied text together, so merges across their boundary are unchanged) is
    tokenized with control-token parsing off. Without look-alikes the ids equal
    `apply_chat_template(..., tokenize=True)`.

    An assistant turn's past `reasoning_content` is supplied text too. So are tools and assistant tool
    calls, which templates write as JSON (`| tojson`): every string in a function's name, description,
    parameters and call arguments (keys included) is marked as its JSON-escaped text; the structure the template reads is kept.
    `template_kwargs`: the template's switches (`check_template_kwargs`), e.g. Qwen3.5's `enable_thinking`;
    `template`: how it renders (`TemplateOptions`).
    """
    if template.continue_final_message and (template.add_generation_prompt or messages[-1].get("role") != "assistant"):
        raise InvalidInput("continue_final_message continues a last assistant message, without add_generation_prompt",
                           item="continue_final_message", code="invalid_value")
    switches = check_template_kwargs(tokenizer, template_kwargs, template.chat_template)
    nonce = uuid.uuid4().hex
    texts: list[str] = []

    def mark(text: str) -> str:
        if not text:  # templates test content for truth (an assistant turn holding only tool calls)
            return text
        texts.append(text)
        return f"\ue000{nonce}{len(texts) - 1}\ue001"

    def mark_json(value):
        if isinstance(value, str):
            return mark(json.dumps(value, ensure_ascii=False)[1:-1])
        if isinstance(value, dict):
            return {mark_json(key): mark_json(item) for key, item in value.items()}
        return [mark_json(item) for item in value] if isinstance(value, list) else value

    def mark_function(function: dict) -> dict:
        return {key: mark_json(value) if key in ("name", "description", "parameters", "arguments") else value
                for key, value in function.items()}

    marked = [{**m, "content": mark(m["content"]) if isinstance(m["content"], str) else
               [{**p, "text": mark(p["text"])} if p.get("type") == "text" else p for p in m["content"]],
               **({"reasoning_content": mark(m["reasoning_content"])} if m.get("reasoning_content") else {}),
               **({"tool_calls": [{**call, "function": mark_function(call["function"])} for call in m["tool_calls"]]}
                  if m.get("tool_calls") else {})}
              for m in messages]
    marked_tools = [{**tool, "function": mark_function(tool["function"])} for tool in tools] if tools else None
    try:
        rendered = tokenizer.apply_chat_template(marked, tools=marked_tools, tokenize=False,
                                                 add_generation_prompt=template.add_generation_prompt,
                                                 continue_final_message=template.continue_final_message,
                                                 chat_template=template.chat_template, **switches)
    except Exception as exc:  # jinja errors on shapes the template does not know
        raise InvalidInput(f"chat template failed: {exc}", item="messages", code="invalid_request") from None
    control = _control_token_pattern(tokenizer)
    ids: list[int] = []
    stretch: list[str] = []  # text since the last control token

    def flush():
        ids.extend(plain_text_ids(tokenizer, "".join(stretch)))
        stretch.clear()

    for k, piece in enumerate(re.split(f"\ue000{nonce}(\\d+)\ue001", rendered)):
        if k % 2:  # a marker: the supplied text it stands for, as plain text
            stretch.append(texts[int(piece)])
            continue
        for j, part in enumerate(control.split(piece)):
            if j % 2:
                flush()
                ids.append(tokenizer.convert_tokens_to_ids(part))
            elif part:
                stretch.append(part)
    flush()
    return ids


def _control_token_pattern(tokenizer) -> re.Pattern:
    tokens = sorted(tokenizer.get_added_vocab(), key=len, reverse=True)  # longest first, like the tokenizer
    return re.compile("(" + "|".join(re.escape(token) for token in tokens) + ")")


def _texts(messages: list[dict]):
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            yield content
        else:
            yield from (part["text"] for part in content if part.get("type") == "text")


def _split_visuals(messages: list) -> tuple[list[dict], list]:
    """Messages the chat template can render (visual parts reduced to their kind) and `(kind, raw)` per visual item."""
    rendered, visuals = [], []
    for m, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidInput("each message must be an object with a string 'role'", item=f"messages[{m}]",
                               code="invalid_request")
        content = message.get("content")
        carried = {key: message[key] for key in ("tool_calls", "tool_call_id", "reasoning_content")
                   if message.get(key) is not None}
        if isinstance(content, str):
            rendered.append({"role": message["role"], "content": content, **carried})
            continue
        if not isinstance(content, list):
            raise InvalidInput("content must be a string or a list of parts", item=f"messages[{m}].content",
                               code="invalid_request")
        parts = []
        for p, part in enumerate(content):
            where = f"messages[{m}].content[{p}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise InvalidInput("text part needs a string 'text'", item=where, code="invalid_request")
                parts.append({"type": "text", "text": part["text"]})
            elif kind in VISUAL_PART_KINDS:
                raw = _visual_of(part, where)
                low = kind == "image_url" and isinstance(part[kind], dict) and part[kind].get("detail") == "low"
                visuals.append((VISUAL_PART_KINDS[kind], LowDetail(raw) if low else raw))
                parts.append({"type": VISUAL_PART_KINDS[kind]})
            else:
                raise InvalidInput(f"unsupported content part type {kind!r}; expected 'text', 'image_url', "
                                   "'image', 'video_url' or 'video'", item=where, code="invalid_request")
        rendered.append({"role": message["role"], "content": parts, **carried})
    return rendered, visuals


def _visual_of(part: dict, where: str):
    kind = part["type"]
    if not kind.endswith("_url"):  # `image` / `video`: the object itself
        if part.get(kind) is None:
            raise InvalidInput(f"{kind} part needs an {kind!r}", item=where, code="invalid_request")
        return part[kind]
    url = part.get(kind)
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str):
        raise InvalidInput(f"{kind} part needs {{'url': 'data:...'}}", item=where, code="invalid_request")
    return url


def _from_token_ids(request: dict, tokenizer, vision_adapter, loaders: dict, pruning_rate: float,
                    tile_every_image: bool) -> PreparedPrompt:
    ids = request["prompt_token_ids"]
    if not isinstance(ids, (list, tuple)) or not ids or not all(isinstance(t, int) and not isinstance(t, bool)
                                                                   for t in ids):
        raise InvalidInput("must be a non-empty list of integers", item="prompt_token_ids", code="invalid_request")
    ids = list(ids)
    per_kind = {"image": request.get("images") or [], "video": request.get("videos") or []}
    visuals = {kind: _load_all([(kind, raw) for raw in raws], loaders) for kind, raws in per_kind.items()}
    # Images and videos come in separate lists: put them in the order their placeholders appear.
    pads = vision_adapter.placeholder_token_ids
    if visuals["video"] and "video" not in pads:
        raise InvalidInput("this model does not take videos", item="videos", code="video_not_supported")
    starts = []
    for kind, decoded in visuals.items():
        runs = token_runs(ids, pads[kind]) if kind in pads else []
        starts += [(runs[i][0] if i < len(runs) else len(ids), kind, i, visual) for i, visual in enumerate(decoded)]
    ordered = [visual for *_, visual in sorted(starts, key=lambda s: s[:3])]
    return _expand(ids, ordered, tokenizer, vision_adapter, pruning_rate, tile_every_image, allow_expanded=True)


def _expand(ids: list[int], images: Sequence[DecodedVisual], tokenizer, vision_adapter, pruning_rate: float,
            tile_every_image: bool, *, allow_expanded: bool) -> PreparedPrompt:
    """Replace each visual item's placeholder with its tokens (`vision_adapter.placeholder_ids`).

    Each item's placeholder is a run of its kind's token (`vision_adapter.placeholder_token_ids`).

    From a chat template, each image token is one image's placeholder (Step3's template puts those
    of consecutive images side by side). In raw token ids, a placeholder is a run of one image
    token or the image's full expansion already in place (with its layout tokens around it).
    A video pruned by EVS (`pruning_rate` > 0) gets the planned number of tokens instead of all.
    """
    pads = vision_adapter.placeholder_token_ids
    images = vision_adapter.prompt_visuals(list(images), tile_every_image)
    items = [vision_adapter.make_item(image) for image in images]
    layouts = [dataclasses.replace(vision_adapter.layout(image, item, pruning_rate if image.kind == "video" else 0.0),
                                   content_hash=image.content_hash) for image, item in zip(images, items)]
    # Items are numbered per kind (MiniCPM-V's `<image_id>` counts images and videos separately).
    kind_index = [sum(1 for prior in items[:i] if prior.kind == item.kind) for i, item in enumerate(items)]
    expansions = [_pruned(vision_adapter.placeholder_ids(item, index, tokenizer), layout, pads.get(item.kind))
                  for item, index, layout in zip(items, kind_index, layouts)]
    out: list[int] = []
    cursor = 0
    for i, (image, item, expansion) in enumerate(zip(images, items, expansions)):
        pad = pads[image.kind]
        start = next((j for j in range(cursor, len(ids)) if ids[j] == pad), None)
        if start is None:
            raise _count_mismatch(ids, pad, len(images))
        lead = expansion.index(pad)  # layout tokens before the image's first image token
        begin = start - lead
        if allow_expanded and begin >= cursor and ids[begin: begin + len(expansion)] == expansion:
            out += ids[cursor: begin + len(expansion)]
            cursor = begin + len(expansion)
            continue
        length = next((j for j in range(start, len(ids)) if ids[j] != pad), len(ids)) - start
        if allow_expanded and length != 1:
            raise InvalidInput(f"placeholder {i} has {length} image tokens; image {i} needs 1 (to expand) or its "
                               f"full expansion ({item.num_tokens} image tokens)", item=f"images[{i}]",
                               code="image_count_mismatch")
        before, after = vision_adapter.replaced_around(image.kind)
        end = start + 1
        if before and after and start - len(before) >= cursor and ids[start - len(before): start] == list(before) \
                and ids[end: end + len(after)] == list(after):
            start, end = start - len(before), end + len(after)
        out += ids[cursor:start] + expansion
        cursor = end
    for kind, pad in pads.items():
        if pad in ids[cursor:]:
            raise _count_mismatch(ids, pad, sum(1 for image in images if image.kind == kind))
    out += ids[cursor:]
    return PreparedPrompt(out, list(images), layouts, sum(expansion.count(pads[item.kind])
                                                          for item, expansion in zip(items, expansions)))


def _pruned(expansion: list[int], layout: VisualLayout, pad: int | None) -> list[int]:
    """A video's placeholder with the token counts EVS plans for its runs of `pad` (`evs.run_counts`; all its
    tokens when not pruned); the tokens around and between the runs (Qwen3-VL's timestamps) stay."""
    if layout.pruning_rate <= 0:
        return expansion
    runs = token_runs(expansion, pad)
    counts = evs.run_counts([length for _, length in runs], layout.grid[0], layout.pruning_rate)
    out, cursor = [], 0
    for (start, length), count in zip(runs, counts):
        out += expansion[cursor:start] + [pad] * count
        cursor = start + length
    return out + expansion[cursor:]


def _count_mismatch(ids: list[int], pad: int, num_images: int) -> InvalidInput:
    return InvalidInput(f"prompt has {len(token_runs(ids, pad))} image placeholders but {num_images} images were "
                        "given", item="images", code="image_count_mismatch")


def token_runs(ids: Sequence[int], token: int | Collection[int]) -> list[tuple[int, int]]:
    """`(start, length)` of each maximal run of `token` (or of any of several placeholder tokens)."""
    tokens = {token} if isinstance(token, int) else set(token)
    runs, i = [], 0
    while i < len(ids):
        if ids[i] in tokens:
            j = i
            while j < len(ids) and ids[j] in tokens:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs
