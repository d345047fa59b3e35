"""`raypipe batch`: CLI arguments -> `BatchOptions` -> `run_batch` -> the summary on stdout."""

from __future__ import annotations

import json
import sys

from raypipe.batch.job import BatchOptions
from raypipe.config import EngineConfig, model_config_from_args
from raypipe.storage import S3Options


def options_from_args(args) -> BatchOptions:
    lo, hi = args.num_encoders
    loras = dict(args.lora or ())
    if len(loras) > 1 and args.lora_column is None:
        raise ValueError(f"{len(loras)} --lora adapters need --lora-column (the manifest column naming each row's)")
    s3 = S3Options(endpoint_url=args.s3_endpoint, region=args.s3_region) if args.s3_endpoint or args.s3_region else None
    return BatchOptions(
        input=args.input, output=args.output, task=args.task,
        model=model_config_from_args(args, num_encoders=lo, max_encoders=hi),
        engine=EngineConfig(num_scheduler_steps=args.num_scheduler_steps, lora_modules=loras),
        lora=next(iter(loras)) if loras and args.lora_column is None else None, lora_column=args.lora_column,
        prompt=args.prompt, prompt_column=args.prompt_column, path_column=args.path_column, id_column=args.id_column,
        max_tokens=args.max_tokens, json_schema=args.json_schema, enable_thinking=args.enable_thinking, pooling=args.pooling, num_decoders=args.num_decoders, batching=args.batching,
        batch_cost=args.batch_cost, batch_images=args.batch_images, read_batch=args.read_batch, rows_per_file=args.rows_per_file,
        limit=args.limit, dry_run=args.dry_run, s3=s3)


def run_batch_command(args) -> int:
    from raypipe.batch import run_batch
    from raypipe.jobs.quiet import quiet_ray_data

    if not args.verbose:
        quiet_ray_data()
    summary = run_batch(options_from_args(args), on_progress=None if args.verbose else _progress_line)
    if not args.verbose and sys.stderr.isatty():
        print(file=sys.stderr)  # end the progress line
    print(json.dumps(summary.as_dict()) if args.json else summary.describe(), flush=True)
    return 0


def _progress_line(written: int, total: int) -> None:
    """One line, rewritten in place on a terminal (Ray Data's own bars are off unless --verbose)."""
    if sys.stderr.isatty():
        print(f"\rraypipe batch: {written}/{total} rows written", end="", file=sys.stderr, flush=True)
