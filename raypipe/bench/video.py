"""`raypipe bench video`: one long video, decoded on CPU and encoded in units spread over the workers.

Three measurements, side by side in one run (nothing else should run on the machine):

1. CPU decode + sample: a `seconds`-long clip (source 10 fps, 640x360 h264, made here with PyAV)
   read with the model's own frame plan (Qwen2.5-VL: 2 fps, resized as decoded; MiniCPM-V: one main
   frame per second plus per-second canvases of sub-second frames, at source size), kept frames per
   second of wall time -- against
2. the encoders: the same sampled video through the coordinator on 1 and on 2 encoder workers
   (1 torch thread each), its units balanced over them (Qwen: chunks of temporal groups; MiniCPM-V:
   each frame's and canvas's overview and slices). Ratio = 1-worker / 2-worker time (vLLM encodes
   one video on one GPU: its ratio is 1 by construction).
3. EVS at 0.5 / 0.75 against off, for families that support it (Qwen2.5-VL, Qwen3-VL; skipped, saying so,
   otherwise), on a shorter clip at a lower per-frame resolution so that the prompt fits the small
   preset's 4096-token context: video tokens in the prompt, the engine's prefill time and the time
   to first token (`max_tokens=1`, embeddings already encoded).

Default model: `small` (Qwen2.5-VL-shaped, ~70M parameters); `--model small-minicpmv` for MiniCPM-V.
Medians over `repeats` runs.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import numpy as np

from raypipe.bench.common import median_seconds, print_table, write_json

SOURCE_FPS = 10
SOURCE_SIZE = (360, 640)
EVS_FRAME_PIXELS = 64 * 28 * 28  # per sampled frame in the EVS rows


def source_video(seconds: int) -> bytes:
    """A moving gradient (so frames differ, as in real footage), encoded once per run."""
    from raypipe.testing.sample_videos import make_video

    height, width = SOURCE_SIZE
    y, x = np.mgrid[0:height, 0:width]
    frames = (np.stack([(x + 4 * i) % 256, (y + 2 * i) % 256, (x + y + i) % 256], axis=-1).astype(np.uint8)
              for i in range(seconds * SOURCE_FPS))
    return make_video(list(frames), fps=SOURCE_FPS)


def main(args) -> int:
    import ray

    from raypipe.encode.coordinator import Coordinator
    from raypipe.encode.pool import EncoderPool, WorkerOptions
    from raypipe.errors import InvalidInput
    from raypipe.inputs.video import VideoLimits, VideoSampling, load_video
    from raypipe.models.registry import model_for_actors, resolve_model, vision_adapter
    from raypipe.runtime.ray_cluster import connect_ray

    model = getattr(args, "model", None) or "small"
    checkpoint = resolve_model(model)
    adapter = vision_adapter(checkpoint)
    seconds = 60 if args.quick else 300
    repeats = 1 if args.quick else 3
    data = source_video(seconds)
    plan = adapter.plan_frames(VideoSampling())  # the model's own plan
    limits = VideoLimits()
    decode_s = median_seconds(lambda: load_video(data, limits, plan), repeats)
    video = load_video(data, limits, plan)
    item = adapter.make_item(video)
    warmup = load_video(source_video(4), limits, plan)  # a short clip through the same plan

    connect_ray()
    actor_model = model_for_actors(model, checkpoint)
    encode_s = {}
    for workers in (1, 2):
        options = WorkerOptions(actor_model, "auto", num_threads=1, num_gpus=0)
        coordinator = Coordinator(adapter, EncoderPool.start(options, workers))
        coordinator.encode([warmup])  # first forwards allocate; the long video is timed warm
        encode_s[workers] = median_seconds(lambda: coordinator.encode([video]), repeats, warmup=0)
        spread = sum(1 for shard in coordinator.last_report.assignment if shard)
        coordinator.pool.shutdown()
    try:  # EVS is a per-family feature: a family without it refuses a pruning rate when laying a video out
        adapter.layout(video, item, pruning_rate=0.5)
        evs_seconds = 20 if args.quick else 45
        evs = evs_rows(checkpoint, adapter, source_video(evs_seconds), evs_seconds, repeats)
    except InvalidInput as exc:
        evs = {"skipped": exc.reason}
    ray.shutdown()

    frames = video.num_frames
    result = {"model": str(model), "seconds": seconds, "source_frames": seconds * SOURCE_FPS, "kept_frames": frames,
              "frame_size": [video.height, video.width], "video_tokens": item.num_tokens,
              "units": len(adapter.units(item)), "workers_used_by_2": spread,
              "decode_s": decode_s, "decode_frames_per_s": frames / decode_s,
              "encode_s": encode_s, "encode_frames_per_s": {n: frames / s for n, s in encode_s.items()},
              "speedup_2_over_1": encode_s[1] / encode_s[2], "evs": evs}
    write_json(args.out, "video", result)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"model {model}: {seconds} s video, {seconds * SOURCE_FPS} source frames -> {frames} kept at "
          f"{video.height}x{video.width}, {item.num_tokens} video tokens in {result['units']} encoder units")
    print_table("decode + sample (CPU, this process) vs encode (1 torch thread per worker)",
                ["stage", "seconds", "kept frames / s"],
                [["decode + sample + resize", decode_s, frames / decode_s],
                 *[[f"encode, {n} worker(s)", s, frames / s] for n, s in encode_s.items()]])
    print(f"2 workers vs 1: {result['speedup_2_over_1']:.2f}x (units on {spread} workers); decode is "
          f"{(frames / decode_s) / (frames / encode_s[2]):.1f}x faster than 2-worker encoding")
    if isinstance(evs, dict):
        print(f"EVS rows skipped: {evs['skipped']}")
        return 0
    print_table(f"EVS on a {evs[0]['seconds']} s clip ({evs[0]['frame_size'][0]}x{evs[0]['frame_size'][1]} frames)",
                ["pruning rate", "video tokens", "prompt tokens", "prefill s", "TTFT s", "TTFT vs off"],
                [[r["rate"], r["video_tokens"], r["prompt_tokens"], r["prefill_s"], r["ttft_s"],
                  r["ttft_s"] / evs[0]["ttft_s"]] for r in evs])
    return 0


def evs_rows(checkpoint, adapter, data: bytes, seconds: int, repeats: int) -> list[dict]:
    """Prompt size, prefill time and time to first token at EVS rates 0, 0.5 and 0.75 (same embeddings)."""
    import torch

    from raypipe.decode.config import EngineConfig
    from raypipe.decode.engine import LLMEngine
    from raypipe.inputs.sampling import SamplingParams
    from raypipe.inputs.video import VideoLimits, VideoSampling, load_video
    from raypipe.models.prompt import VideoOptions, build_prompt

    # a frame's pixel budget that fits the small presets' 4096-token context
    clip = load_video(data, VideoLimits(), adapter.plan_frames(VideoSampling(fps=2.0, max_pixels=EVS_FRAME_PIXELS)))
    if clip.height * clip.width < EVS_FRAME_PIXELS / 2:  # max_pixels bounded the whole clip (Qwen3-VL)
        sampling = VideoSampling(fps=2.0, max_pixels=EVS_FRAME_PIXELS * clip.num_frames)
        clip = load_video(data, VideoLimits(), adapter.plan_frames(sampling))
    torch.set_num_threads(2)
    tower = adapter.load_tower(torch.device("cpu"), torch.float32)
    embeds = torch.cat(tower.encode(adapter.units(adapter.make_item(clip))))
    engine = LLMEngine(checkpoint, EngineConfig(max_num_seqs=1, num_threads=2))
    messages = [{"role": "user", "content": [{"type": "video", "video": clip},
                                             {"type": "text", "text": "What happens?"}]}]
    rows = []
    try:
        for rate in (0.0, 0.5, 0.75):
            prompt = build_prompt(messages, engine.tokenizer, adapter, video=VideoOptions(pruning_rate=rate))
            ttft, prefill = [], []
            for _ in range(repeats + 1):  # the first run warms up
                before = engine.stats()["prefill_seconds"]
                start = time.perf_counter()
                asyncio.run(engine.generate_output("evs", prompt, [embeds], SamplingParams(max_tokens=1)))
                ttft.append(time.perf_counter() - start)
                prefill.append(engine.stats()["prefill_seconds"] - before)
            rows.append({"rate": rate, "seconds": seconds, "frame_size": [clip.height, clip.width],
                         "video_tokens": prompt.num_image_tokens, "prompt_tokens": prompt.num_prompt_tokens,
                         "prefill_s": statistics.median(prefill[1:]), "ttft_s": statistics.median(ttft[1:])})
    finally:
        engine.shutdown()
    return rows

