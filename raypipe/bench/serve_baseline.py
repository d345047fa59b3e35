"""The endpoint a user would deploy without raypipe: a plain Serve deployment around `generate()`.

Each replica holds the full transformers model (vision tower and language model) and serves one
request at a time: image processor -> `model.generate(pixel_values=...)`. Prompt building is
raypipe's `build_prompt` (the same chat template and image-token expansion the raypipe endpoint
uses), so both sides produce the same tokens and differ only in how they run the model.
"""

# No `from __future__ import annotations`: FastAPI must see the body annotation as a type.
import torch
from fastapi import FastAPI
from ray import serve

app = FastAPI()


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1)
@serve.ingress(app)
class TransformersBaseline:
    def __init__(self, model: str, num_threads: int = 1):
        from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

        from raypipe.models.registry import resolve_model, vision_adapter

        torch.set_num_threads(num_threads)
        checkpoint = resolve_model(model)
        self.model = Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        self.image_processor = AutoImageProcessor.from_pretrained(checkpoint)
        self.vision = vision_adapter(checkpoint)
        self.eos = self.model.generation_config.eos_token_id

    @app.post("/v1/chat/completions")
    def chat_completions(self, body: dict) -> dict:
        from raypipe.models.prompt import build_prompt

        prompt = build_prompt(body["messages"], self.tokenizer, self.vision)
        ids = torch.tensor([prompt.prompt_token_ids])
        kwargs = {}
        if prompt.visuals:
            processed = self.image_processor(images=[image.pixels for image in prompt.visuals], return_tensors="pt")
            kwargs = dict(pixel_values=processed["pixel_values"], image_grid_thw=processed["image_grid_thw"],
                          mm_token_type_ids=(ids == self.model.config.image_token_id).int())
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=body["max_tokens"],
                                      do_sample=False, **kwargs)
        tokens = out[0, ids.shape[1]:].tolist()
        eos = {self.eos} if isinstance(self.eos, int) else set(self.eos or ())
        stop_at = next((i for i, t in enumerate(tokens) if t in eos), None)
        finish = "stop" if stop_at is not None else "length"
        tokens = tokens if stop_at is None else tokens[:stop_at + 1]
        return {"choices": [{"index": 0, "finish_reason": finish, "message": {
                    "role": "assistant", "content": self.tokenizer.decode(tokens, skip_special_tokens=True)}}],
                "usage": {"prompt_tokens": ids.shape[1], "completion_tokens": len(tokens),
                          "total_tokens": ids.shape[1] + len(tokens)}}
