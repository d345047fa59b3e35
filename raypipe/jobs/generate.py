"""`raypipe generate`: one prompt with image files, text out (encoders + decode engine on Ray)."""

from __future__ import annotations

import pathlib
import sys

from raypipe import InvalidInput, Pipeline, SamplingParams


def run_generate(args) -> int:
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                                seed=args.seed)
        images = [pathlib.Path(path).read_bytes() for path in args.image]
    except (InvalidInput, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    content = [{"type": "image", "image": data} for data in images] + [{"type": "text", "text": args.prompt}]
    with Pipeline.from_pretrained(args.model, num_encoders=args.num_encoders, encoder_gpus=args.encoder_gpus,
                                  cost_model=args.cost_model, num_scheduler_steps=args.num_scheduler_steps) as pipe:
        try:
            (out,) = pipe.generate([[{"role": "user", "content": content}]], params)
        except InvalidInput as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    print(out.text)
    print(f"[{out.num_prompt_tokens} prompt tokens ({out.num_image_tokens} from {len(images)} images), "
          f"{out.num_output_tokens} generated, finish_reason={out.finish_reason}]", file=sys.stderr)
    return 0
