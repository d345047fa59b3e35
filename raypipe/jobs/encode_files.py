"""`raypipe encode`: embeddings of image files, written as one tensor per image."""

from __future__ import annotations

import json
import pathlib


def run_encode(args) -> int:
    from raypipe import Pipeline
    from raypipe.config import model_config_from_args

    paths = [pathlib.Path(p) for p in args.images]  # checked by the CLI: files that exist
    out = pathlib.Path(args.out)  # checked by the CLI: .safetensors or .npz
    with Pipeline.from_config(model_config_from_args(args)) as pipe:
        embeddings = pipe.encode([p.read_bytes() for p in paths])
    tensors = {f"image_{i}": emb.contiguous() for i, emb in enumerate(embeddings)}
    sources = json.dumps([str(p) for p in paths])
    if out.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(tensors, str(out), metadata={"sources": sources})
    else:
        import numpy as np

        np.savez(out, sources=np.array(sources), **{k: v.float().numpy() for k, v in tensors.items()})
    for path, emb in zip(paths, embeddings):
        print(f"{path}: {tuple(emb.shape)}")
    print(f"wrote {len(embeddings)} embeddings to {out}")
    return 0
