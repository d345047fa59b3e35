"""`raypipe` command line: parses arguments and hands off to the module that does the work."""

from __future__ import annotations

import argparse
import sys

from raypipe.models.presets import PRESETS


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help=f"preset name ({', '.join(PRESETS)}) or local HF checkpoint folder")


def _add_encoders(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-encoders", type=int, default=2, help="vision-encoder replicas (Ray actors)")
    p.add_argument("--encoder-gpus", type=float, default=None,
                   help="GPU share per encoder actor (default: 1 if the cluster has GPUs, else 0)")
    p.add_argument("--cost-model", choices=["patches", "attention"], default="patches",
                   help="how the load balancer weighs images")


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
    generate.add_argument("--num-scheduler-steps", type=int, default=8)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible Ray Serve endpoint")
    _add_model(serve)
    _add_encoders(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require this bearer token (or set RAYPIPE_API_KEY)")

    bench = sub.add_parser("bench", help="benchmarks that print tables and ratios")
    bench.add_argument("target", choices=["encode", "decode", "serve"])
    bench.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    bench.add_argument("--quick", action="store_true", help="smaller sizes, for smoke runs")
    bench.add_argument("--out", default="bench-results", help="folder for plots and JSON")
    bench.add_argument("--model", default=None, help="preset name or local HF checkpoint folder (default: small)")
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
        from deployments.run import run_serve

        return run_serve(args)
    if args.command == "bench":
        import importlib

        return importlib.import_module(f"raypipe.bench.{args.target}").main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
