"""`raypipe generate`: one prompt with image and video files, text out (encoders + decode engine on Ray).

Everything the command line can get wrong is checked before Ray starts: the files (by the CLI), the
sampling parameters, and the chat template's switches against the checkpoint's own template. A
thinking model's reply is split as the endpoint splits it (`raypipe.models.reasoning`): the
reasoning on stderr, labelled, the answer alone on stdout; `--json-schema` constrains the answer
after `</think>`, not the reasoning.
"""

from __future__ import annotations

import pathlib
import sys

from raypipe import Pipeline, SamplingParams
from raypipe.config import EngineConfig, model_config_from_args
from raypipe.inputs.structured import StructuredOutput
from raypipe.errors import InvalidInput
from raypipe.models.prompt import check_template_kwargs
from raypipe.models.reasoning import constrain_answer, split_reasoning
from raypipe.models.registry import family_of, language_adapter, resolve_model


def run_generate(args) -> int:
    checkpoint = resolve_model(args.model)
    template_kwargs = {} if args.enable_thinking is None else {"enable_thinking": args.enable_thinking}
    checked = check_template_kwargs(language_adapter(checkpoint).tokenizer, template_kwargs)
    if checked != template_kwargs:  # the endpoint ignores a switch the template lacks (vLLM); a CLI flag says so
        raise InvalidInput("this model's chat template has no 'enable_thinking' switch", item="--thinking")
    template_kwargs = checked
    thinking = family_of(checkpoint).thinks(template_kwargs)
    structured = StructuredOutput(json=args.json_schema) if args.json_schema else None
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            seed=args.seed, structured=constrain_answer(structured, thinking))
    images = [pathlib.Path(path).read_bytes() for path in args.image]
    videos = [pathlib.Path(path).read_bytes() for path in args.video]
    content = ([{"type": "image", "image": data} for data in images] + [{"type": "video", "video": data}
                                                                        for data in videos]
               + [{"type": "text", "text": args.prompt}])
    request = {"messages": [{"role": "user", "content": content}]}
    if template_kwargs:
        request["chat_template_kwargs"] = template_kwargs
    with Pipeline.from_config(model_config_from_args(args),
                              engine_config=EngineConfig(num_scheduler_steps=args.num_scheduler_steps)) as pipe:
        (out,) = pipe.generate([request], params)
    reasoning, answer = split_reasoning(out.text, thinking)
    if reasoning is not None:
        print(f"reasoning:\n{reasoning.strip()}\nanswer:", file=sys.stderr, flush=True)
    print(answer or "", flush=True)
    print(f"[{out.num_prompt_tokens} prompt tokens ({out.num_image_tokens} from {len(images)} images and "
          f"{len(videos)} videos), "
          f"{out.num_output_tokens} generated, finish_reason={out.finish_reason}]", file=sys.stderr)
    return 0
