"""What one request may ask of the server; each breach is a 4xx naming the limit.

Visual items are counted per kind (`check_visual_count`): images by `max_images_per_request`, each
one bounded by `image_limits`; videos by `max_videos_per_request`, each bounded by `video_limits`
(duration, source resolution and kept frames are checked from the container's header, before any
frame is decoded; the body limit bounds an uploaded video's bytes).
"""

from __future__ import annotations

import dataclasses

from raypipe.errors import InvalidInput
from raypipe.inputs.images import ImageLimits
from raypipe.inputs.media import VisualKind
from raypipe.inputs.video import VideoLimits


@dataclasses.dataclass(frozen=True, slots=True)
class ServeLimits:
    max_body_bytes: int = 32 * 1024 * 1024  # a 4K PNG as a data: URL is ~10-20 MB
    max_images_per_request: int = 8
    max_image_pixels: int = 4096 * 4096
    min_image_side: int = 14  # smaller than one ViT patch carries nothing
    max_videos_per_request: int = 2
    max_video_duration_s: float = 1800.0  # from the header: a 2-hour upload is refused before decoding
    max_video_source_pixels: int = 3840 * 2160  # per frame of the source (4K)
    max_video_frames: int = 768  # frames kept after sampling, per video (transformers' Qwen2-VL max_frames)
    allowed_url_prefixes: tuple[str, ...] = ()  # http(s)/file image and video URLs are refused unless listed here
    default_max_tokens: int = 512  # when the request sets none (capped by the context left)
    max_stored_responses: int = 1024  # /v1/responses conversations kept for previous_response_id (LRU)
    max_stored_response_bytes: int = 256 * 1024 * 1024  # their JSON in all (images travel as data: URLs)
    max_prompts_per_request: int = 32  # a completions request's list of prompts (each one a request of its own)

    def __post_init__(self):
        if min(self.max_body_bytes, self.max_images_per_request, self.max_image_pixels, self.default_max_tokens,
               self.max_video_duration_s, self.max_video_source_pixels, self.max_video_frames,
               self.max_stored_responses, self.max_stored_response_bytes,
               self.max_prompts_per_request) <= 0:
            raise ValueError(f"limits must be positive: {self}")

    @property
    def image_limits(self) -> ImageLimits:
        return ImageLimits(min_side=self.min_image_side, max_pixels=self.max_image_pixels,
                           max_bytes=self.max_body_bytes, allowed_url_prefixes=tuple(self.allowed_url_prefixes))

    @property
    def video_limits(self) -> VideoLimits:
        return VideoLimits(max_bytes=self.max_body_bytes, max_duration_s=self.max_video_duration_s,
                           max_source_pixels=self.max_video_source_pixels, max_frames=self.max_video_frames,
                           allowed_url_prefixes=tuple(self.allowed_url_prefixes))

    def check_visual_count(self, kind: VisualKind, count: int) -> None:
        """At most the limit of visual items of `kind` in one request."""
        limit = {"image": self.max_images_per_request, "video": self.max_videos_per_request}[kind]
        if count > limit:
            raise InvalidInput(f"{count} {kind}s in one request; the limit is {limit}", item="messages",
                               code=f"too_many_{kind}s")

    def check_prompt_count(self, count: int) -> None:
        if count > self.max_prompts_per_request:
            raise InvalidInput(f"{count} prompts in one request; the limit is {self.max_prompts_per_request}",
                               item="prompt", code="too_many_prompts")

    @staticmethod
    def check_fan_out(prompts: int, n: int, decoder_capacity: int) -> None:
        """A request's decoder streams (n per prompt) must fit one Decoder replica's `max_ongoing_requests`: the
        choices of a prompt share its prefix, so prefix-affinity routing sends them all to one replica, and more
        than it takes would wait in Serve's router queue (a "replica at capacity" warning per retry)."""
        if prompts * n > decoder_capacity:
            asked = f"n={n}" + (f" for each of {prompts} prompts" if prompts > 1 else "")
            raise InvalidInput(f"{asked} asks for {prompts * n} choices at once; a decoder replica takes at most "
                               f"{decoder_capacity} (its max_ongoing_requests)", item="n", code="too_many_choices")

    def max_tokens_for(self, requested: int | None, prompt_tokens: int, max_model_len: int) -> int:
        """The request's max_tokens, checked against the context left after its prompt."""
        room = max_model_len - prompt_tokens
        if room < 1:
            raise InvalidInput(f"the prompt is {prompt_tokens} tokens (images included); this model's maximum "
                               f"context length is {max_model_len} tokens", item="messages",
                               code="context_length_exceeded")
        if requested is None:
            return min(self.default_max_tokens, room)
        if requested < 1:
            raise InvalidInput(f"max_tokens must be at least 1, got {requested}", item="max_tokens",
                               code="invalid_value")
        if requested > room:
            raise InvalidInput(f"max_tokens={requested} plus the {prompt_tokens}-token prompt exceeds this model's "
                               f"maximum context length of {max_model_len} tokens", item="max_tokens",
                               code="context_length_exceeded")
        return requested
