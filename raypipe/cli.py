"""`raypipe` command line: parses arguments and hands off to the module that does the work."""

from __future__ import annotations

import argparse
import sys

from raypipe.models.registry import PRESETS


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny",
                   help=f"preset name ({', '.join(PRESETS)}), local HF checkpoint folder, or s3://bucket/prefix/ "
                        "(copied once per node)")


def _add_encoders(p: argparse.ArgumentParser, *, autoscale: bool = False, default: int = 2) -> None:
    if autoscale:
        p.add_argument("--num-encoders", type=replica_range, default=(default, default), metavar="N|MIN:MAX",
                       help="vision-encoder actors: a fixed number or an autoscaling range")
    else:
        p.add_argument("--num-encoders", type=int, default=default, help="vision-encoder replicas (Ray actors)")
    p.add_argument("--encoder-gpus", type=float, default=None,
                   help="GPU share per encoder actor (default: 1 if the cluster has GPUs or its autoscaler publishes GPU node types, else 0)")
    p.add_argument("--cost-model", choices=["patches", "attention", "calibrated"], default="patches",
                   help="how the load balancer weighs images (calibrated: fitted from measured encode times)")


def replica_range(text: str) -> tuple[int, int]:
    """`N` or `MIN:MAX` -> (min, max)."""
    low, _, high = text.partition(":")
    try:
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def _add_batch(sub) -> None:
    batch = sub.add_parser("batch", help="offline batch over object storage or folders on Ray Data (resumable)")
    _add_model(batch)
    _add_encoders(batch, autoscale=True, default=1)
    batch.add_argument("--input", required=True,
                       help="s3://bucket/prefix/ or folder (every image file, recursively) or a .parquet/.jsonl manifest")
    batch.add_argument("--output", required=True, help="s3://bucket/prefix/ or folder for the Parquet part files")
    batch.add_argument("--task", choices=["embed", "generate"], default="embed")
    batch.add_argument("--prompt", default="Describe this image.", help="prompt for rows without their own")
    batch.add_argument("--prompt-column", default=None, help="manifest column with a per-row prompt")
    batch.add_argument("--path-column", default="path", help="manifest column with image paths or URIs")
    batch.add_argument("--id-column", default="id", help="manifest column with ids (default: the path)")
    batch.add_argument("--max-tokens", type=int, default=32)
    batch.add_argument("--pooling", choices=["mean", "none"], default="mean",
                       help="embedding per image: the mean over its tokens, or the whole token matrix")
    batch.add_argument("--num-decoders", type=replica_range, default=(1, 1), metavar="N|MIN:MAX",
                       help="decode-engine actors (generate)")
    batch.add_argument("--decode-gpus", type=float, default=None, help="GPU share per decode actor")
    batch.add_argument("--num-scheduler-steps", type=int, default=8, help="decode steps per scheduling round")
    batch.add_argument("--batching", choices=["cost", "count"], default="cost",
                       help="encoder batches by cost budget (default) or by a fixed image count")
    batch.add_argument("--batch-cost", type=float, default=4.0,
                       help="encoder batch budget, in multiples of the model's largest image")
    batch.add_argument("--batch-images", type=int, default=8,
                       help="images per encoder batch with --batching count; the most on average with cost")
    batch.add_argument("--read-batch", type=int, default=32, help="inputs per CPU decode task")
    batch.add_argument("--rows-per-file", type=int, default=256, help="rows per output part file (unit of resume)")
    batch.add_argument("--limit", type=int, default=None, help="process at most N of the missing inputs")
    batch.add_argument("--dry-run", action="store_true", help="say what would be processed; load no model")
    batch.add_argument("--s3-endpoint", default=None, help="S3-compatible endpoint URL (default: AWS_ENDPOINT_URL_S3)")
    batch.add_argument("--s3-region", default=None, help="region (default: AWS_REGION, else us-east-1)")
    batch.add_argument("--json", action="store_true", help="print the summary as JSON")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raypipe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="encode a dozen generated images on 2 workers, check, generate text")
    _add_model(demo)
    _add_encoders(demo)

    encode = sub.add_parser("encode", help="encode image files and write their embeddings")
    _add_model(encode)
    _add_encoders(encode)
    encode.add_argument("images", nargs="+", help="image files")
    encode.add_argument("--out", required=True, help="output file (.safetensors or .npz)")

    generate = sub.add_parser("generate", help="generate text for a prompt with images")
    _add_model(generate)
    _add_encoders(generate)
    generate.add_argument("--image", action="append", default=[], help="image file (repeatable)")
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--max-tokens", type=int, default=32)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--min-p", type=float, default=0.0)
    generate.add_argument("--repetition-penalty", type=float, default=1.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--num-scheduler-steps", type=int, default=8)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible Ray Serve endpoint")
    _add_model(serve)
    _add_encoders(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require this bearer token (or set RAYPIPE_API_KEY)")

    _add_batch(sub)

    bench = sub.add_parser("bench", help="benchmarks that print tables and ratios")
    bench.add_argument("target", choices=["encode", "decode", "detok", "serve", "serve-load", "batch", "cluster", "cluster-batch", "step3"],
                       help="serve-load: large images before/after ingress resizing, /health under load and "
                            "after every encoder worker is killed; cluster / cluster-batch: Serve / a batch "
                            "job autoscaling on a fake multi-node cluster")
    bench.add_argument("--model", default=None, help="checkpoint to benchmark (default: each benchmark's own)")
    bench.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    bench.add_argument("--quick", action="store_true", help="smaller sizes, for smoke runs")
    bench.add_argument("--requests", type=int, default=None,
                       help="serve-load: requests per run (default 100; 20 with --quick)")
    bench.add_argument("--side", type=int, default=None,
                       help="serve-load: image side in pixels (default 4096; 2048 with --quick)")
    bench.add_argument("--out", default="bench-results", help="folder for plots and JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from raypipe.jobs.demo import run_demo

        return run_demo(args)
    if args.command == "encode":
        from raypipe.jobs.encode_files import run_encode

        return run_encode(args)
    if args.command == "generate":
        from raypipe.jobs.generate import run_generate

        return run_generate(args)
    if args.command == "serve":
        from raypipe.serve.run import run_serve

        return run_serve(args)
    if args.command == "batch":
        from raypipe.jobs.batch import run_batch_command

        return run_batch_command(args)
    if args.command == "bench":
        import importlib

        return importlib.import_module(f"raypipe.bench.{args.target.replace('-', '_')}").main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
