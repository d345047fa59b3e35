"""The tiny preset is a real HF checkpoint: transformers loads it, and so does raypipe's loader."""

import hashlib

import torch

from raypipe.models.registry import tiny_checkpoint


def test_loads_with_transformers(tiny_ckpt, hf_model):
    vc, tc = hf_model.config.vision_config, hf_model.config.text_config
    assert vc.depth >= 2 and len(vc.fullatt_block_indexes) >= 1 and len(vc.fullatt_block_indexes) < vc.depth
    assert vc.initializer_range == tc.initializer_range == 0.2
    assert vc.out_hidden_size == tc.hidden_size
    for name in ("config.json", "model.safetensors", "tokenizer_config.json", "preprocessor_config.json"):
        assert (tiny_ckpt / name).is_file()


def test_tokenizer_and_chat_template(tiny_ckpt):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "héllo"}]}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|vision_start|><|image_pad|><|vision_end|>héllo" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.decode(tok(text)["input_ids"]) == text  # byte-level: lossless round trip


def test_written_deterministically(tmp_path, tiny_ckpt):
    again = tiny_checkpoint(tmp_path / "again")
    digest = lambda p: hashlib.sha256((p / "model.safetensors").read_bytes()).hexdigest()  # noqa: E731
    assert digest(again) == digest(tiny_ckpt)
    assert tiny_checkpoint(tmp_path / "again") == again  # second call reuses the folder


def test_raypipe_vision_loader_matches_transformers(tiny_ckpt, hf_model):
    from raypipe.models.registry import vision_adapter

    tower = vision_adapter(tiny_ckpt).load_tower(torch.device("cpu"), torch.float32)
    ours = dict(tower.model.state_dict())
    theirs = {k: v for k, v in hf_model.model.visual.state_dict().items()}
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_vision_loader_accepts_nested_key_layout(tmp_path, tiny_ckpt, hf_model):
    """Newer transformers saves `model.visual.*`; the original release has `visual.*`."""
    import shutil

    from safetensors.torch import load_file, save_file

    from raypipe.models.registry import vision_adapter

    nested = tmp_path / "nested"
    shutil.copytree(tiny_ckpt, nested)
    state = load_file(nested / "model.safetensors")
    save_file({("model." + k if k.startswith("visual.") else k): v for k, v in state.items()},
              nested / "model.safetensors", metadata={"format": "pt"})
    tower = vision_adapter(nested).load_tower(torch.device("cpu"), torch.float32)
    assert torch.equal(tower.model.merger.mlp[0].weight, hf_model.model.visual.merger.mlp[0].weight)
