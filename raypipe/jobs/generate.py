"""`raypipe generate`: one prompt with image and video files, text out (encoders + decode engine on Ray)."""

from __future__ import annotations

import pathlib
import sys

from raypipe import InvalidInput, Pipeline, SamplingParams
from raypipe.config import EngineConfig, model_config_from_args


def run_generate(args) -> int:
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                                seed=args.seed, structured={"json": args.json_schema} if args.json_schema else None)
        images = [pathlib.Path(path).read_bytes() for path in args.image]
        videos = [pathlib.Path(path).read_bytes() for path in args.video]
    except (InvalidInput, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    content = ([{"type": "image", "image": data} for data in images] + [{"type": "video", "video": data}
                                                                        for data in videos]
               + [{"type": "text", "text": args.prompt}])
    with Pipeline.from_config(model_config_from_args(args),
                              engine_config=EngineConfig(num_scheduler_steps=args.num_scheduler_steps)) as pipe:
        try:
            request = {"messages": [{"role": "user", "content": content}]}
            if args.enable_thinking is not None:
                request["chat_template_kwargs"] = {"enable_thinking": args.enable_thinking}
            (out,) = pipe.generate([request], params)
        except InvalidInput as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    print(out.text)
    print(f"[{out.num_prompt_tokens} prompt tokens ({out.num_image_tokens} from {len(images)} images and "
          f"{len(videos)} videos), "
          f"{out.num_output_tokens} generated, finish_reason={out.finish_reason}]", file=sys.stderr)
    return 0
