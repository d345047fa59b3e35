"""The vLLM side of `raypipe bench peer`: a script run by vLLM's own interpreter, driven over stdin/stdout.

It imports nothing from raypipe (vLLM's virtualenv has its own torch and transformers) and is run as
`VLLM_PYTHON -P peer_vllm.py` (`-P`: this folder's modules must not shadow anything vLLM imports).
vLLM's engine core is a spawned process that re-imports the main module, so all work is under
`if __name__ == "__main__"`.

Protocol: one JSON command per stdin line; each reply is one stdout line starting with `REPLY `
(vLLM logs to stdout too; the driver skips every other line).
  {"op": "start", "model": path, "dtype": ..., "max_num_seqs": N, "max_model_len": N}
      -> {"load_s", "versions"}
  {"op": "run", "requests": [{"prompt_token_ids" | "prompt", "image_png_b64"?, "max_tokens"}]}
      -> {"wall_s", "results": [{"token_ids", "ttft_s", "latency_s", "cached_tokens", "prompt_token_ids"}]}
      every request of a run is submitted at once; times are from the run's start.
  {"op": "gemm", "groups": [[file, [names]], ...], "dtype": ..., "packed_dtype": ..., "rows": [M, ...],
   "repeats": N, "threads": N}
      -> {"rows": [{"rows", "raypipe_ms", "vllm_ms", "max_abs_diff"}]}
      each group's weights concatenated (siblings packed as one GEMM, as both engines pack them); a pass is every
      group's GEMM in order, so weights come from memory as in a forward; passes alternate between the two kernels, which go first by turns.
  {"op": "stop"}
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import sys
import time
import uuid


def reply(payload: dict) -> None:
    sys.stdout.write("REPLY " + json.dumps(payload) + "\n")
    sys.stdout.flush()


def start(command: dict):
    import torch
    import transformers
    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    begin = time.perf_counter()
    args = AsyncEngineArgs(model=command["model"], dtype=command["dtype"], max_num_seqs=command["max_num_seqs"],
                           max_model_len=command["max_model_len"], enable_prefix_caching=True, seed=0,
                           limit_mm_per_prompt={"image": 1, "video": 0},
                           mm_processor_kwargs={"use_fast": False})  # the PIL image processor, as raypipe
    engine = AsyncLLM.from_engine_args(args)
    versions = {"vllm": vllm.__version__, "torch": torch.__version__, "transformers": transformers.__version__}
    return engine, {"load_s": time.perf_counter() - begin, "versions": versions}


def gemm(command: dict) -> dict:
    """raypipe's linear kernel (torch's oneDNN op on a weight packed once, `raypipe/models/packed_linear.py`,
    computing in `packed_dtype`) against vLLM's (`onednn_mm`, its CPU build's dense GEMM), on the same weights."""
    import torch
    from safetensors import safe_open
    from vllm import _custom_ops as ops

    torch.set_num_threads(command["threads"])
    dtype, packed_dtype = getattr(torch, command["dtype"]), getattr(torch, command["packed_dtype"])
    weights = []
    for file, names in command["groups"]:
        with safe_open(file, "pt") as f:
            weights.append(torch.cat([f.get_tensor(name) for name in names]).to(dtype))
    ours = [torch.ops.mkldnn._reorder_linear_weight(w.to(packed_dtype)) for w in weights]
    theirs = [ops.create_onednn_mm(w.t(), 32) for w in weights]

    def ours_pass(inputs):
        return [torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]].to(packed_dtype), p, None, "none", [], "")
                .to(dtype) for w, p in zip(weights, ours)]

    def theirs_pass(inputs):
        return [ops.onednn_mm(h, inputs[w.shape[1]], None) for w, h in zip(weights, theirs)]

    def timed(run, inputs) -> float:
        begin = time.perf_counter()
        run(inputs)
        return (time.perf_counter() - begin) * 1e3

    table = []
    for rows in command["rows"]:
        inputs = {width: torch.randn(rows, width).to(dtype) for width in {w.shape[1] for w in weights}}
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(ours_pass(inputs), theirs_pass(inputs)))
        times = {"raypipe_ms": [], "vllm_ms": []}
        for repeat in range(command["repeats"]):  # the two take turns going first
            pair = [("raypipe_ms", ours_pass), ("vllm_ms", theirs_pass)]
            for name, run in pair if repeat % 2 == 0 else pair[::-1]:
                times[name].append(timed(run, inputs))
        table.append({"rows": rows, "max_abs_diff": diff, **{k: sorted(v)[len(v) // 2] for k, v in times.items()}})
    return {"rows": table}


async def one(engine, request: dict, begin: float) -> dict:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    if "image_png_b64" in request:
        from PIL import Image

        image = Image.open(io.BytesIO(base64.b64decode(request["image_png_b64"]))).convert("RGB")
        prompt = {"prompt": request["prompt"], "multi_modal_data": {"image": image}}
    else:
        prompt = {"prompt_token_ids": request["prompt_token_ids"]}
    params = SamplingParams(max_tokens=request["max_tokens"], temperature=0.0,
                            output_kind=RequestOutputKind.DELTA)
    tokens, first, cached, prompt_ids = [], None, 0, None
    async for out in engine.generate(prompt, params, request_id=uuid.uuid4().hex):
        if first is None and out.outputs and out.outputs[0].token_ids:
            first = time.perf_counter() - begin
        if out.outputs:
            tokens += list(out.outputs[0].token_ids)
        cached = out.num_cached_tokens or cached
        prompt_ids = out.prompt_token_ids if out.prompt_token_ids is not None else prompt_ids
    return {"token_ids": tokens, "ttft_s": first, "latency_s": time.perf_counter() - begin,
            "cached_tokens": cached, "prompt_token_ids": list(prompt_ids or [])}


async def run(engine, command: dict) -> dict:
    begin = time.perf_counter()
    results = await asyncio.gather(*(one(engine, r, begin) for r in command["requests"]))
    return {"wall_s": time.perf_counter() - begin, "results": list(results)}


def main() -> None:
    engine, loop = None, asyncio.new_event_loop()
    for line in sys.stdin:
        command = json.loads(line)
        try:
            if command["op"] == "start":
                engine, info = start(command)
                reply(info)
            elif command["op"] == "run":
                reply(loop.run_until_complete(run(engine, command)))
            elif command["op"] == "gemm":
                reply(gemm(command))
            elif command["op"] == "stop":
                break
        except Exception as exc:  # the driver prints it and stops
            reply({"error": f"{type(exc).__name__}: {exc}"})
    if engine is not None:
        engine.shutdown()
    reply({"stopped": True})


if __name__ == "__main__":
    main()
