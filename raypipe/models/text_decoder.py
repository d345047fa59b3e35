"""A VLM's language model alone: token embeddings, decoder stack, final norm and lm_head on one device.

The decode engine never holds the vision tower. A family's language adapter names transformers'
text-model class and where its tensors sit in the checkpoint; this module builds that class from
`text_config`, loads only those tensors, and drives it with `inputs_embeds` (text embeddings with
visual items' embeddings scattered at the placeholder tokens of every kind), explicit positions, the
engine's cache and one mask per layer type.
"""

from __future__ import annotations

import torch

from raypipe.models import delta_net_prefill
from raypipe.models.checkpoint import load_module_weights, load_tensors, read_config
from raypipe.models.quantized.quant_config import quantization_plan, quantize_linears, weight_bytes

LM_HEAD_PREFIXES = ("lm_head.",)


class TextDecoder(torch.nn.Module):
    # How the whole model names this text model's modules (a LoRA adapter names them so, `lora.py`): the prefixes
    # in front of them, and those of modules that are not the text model's though they start with one.
    key_prefixes: tuple[str, ...] = ()
    key_excluded: tuple[str, ...] = ()
    head_prefixes: tuple[str, ...] = LM_HEAD_PREFIXES  # where the checkpoint keeps lm_head (an untied one)

    def __init__(self, adapter, model: torch.nn.Module, lm_head: torch.nn.Module, device: torch.device,
                 dtype: torch.dtype):
        super().__init__()
        self.model = model
        self.lm_head = lm_head
        if "linear_attention" in (getattr(adapter.text_config, "layer_types", None) or ()):
            delta_net_prefill.install(model)  # one prefill forward hands the cache states inside its chunk
        self.to(device).eval()
        self.device = torch.device(device)
        self.dtype = dtype
        self.quantization: str | None = None  # what the checkpoint's quantized linears hold, when it has any
        # Placeholder tokens of every kind of visual item: the rows visual embeddings replace.
        self.placeholder_ids = torch.tensor(sorted(set(adapter.placeholder_token_ids.values())), device=self.device)

    @classmethod
    def from_checkpoint(cls, adapter, text_model_class, device: torch.device, dtype: torch.dtype, *,
                        prefixes: tuple[str, ...], exclude: tuple[str, ...],
                        head_prefixes: tuple[str, ...] = LM_HEAD_PREFIXES, convert=None, shard=None) -> "TextDecoder":
        """Build `text_model_class` from `text_config` and load only its tensors (and lm_head's); `convert`
        maps the checkpoint's tensors to the module's layout where they differ (Qwen3.5 MoE's experts).

        With `shard` (one rank of a tensor-parallel group, `raypipe.parallel.shards`) the planned
        layers take this rank's shapes first and only their slices are read; the rest (embeddings,
        norms, lm_head) is loaded whole on every rank.

        A quantized checkpoint (`quantization_config`, `raypipe.models.quantized`) gets stored-weight
        layers in place of the linears it quantizes; their tensors are loaded as stored (the other
        tensors are cast to `dtype` by the load); with `shard`, they are swapped first and the shard splits
        them (each on its stored tensors' block, group and packing boundaries, or a `ValueError`)."""
        from transformers.initialization import no_init_weights

        text_config = adapter.text_config
        plan = quantization_plan(read_config(adapter.checkpoint))
        with no_init_weights():  # weights come from the checkpoint; skip the random init
            model = text_model_class._from_config(text_config, dtype=dtype)
            lm_head = torch.nn.Linear(text_config.hidden_size, text_config.vocab_size, bias=False, dtype=dtype)
        if plan is not None:
            quantized = quantize_linears(model, plan, prefixes, dtype)
            quantized_head = plan.layer_for([p.rstrip(".") for p in head_prefixes], lm_head, dtype)
            if quantized_head is not None and not getattr(adapter.config, "tie_word_embeddings", False):
                lm_head, quantized = quantized_head, quantized + 1
        if shard is not None:
            shard.prepare(model)
        load_dtype = dtype if plan is None else None  # quantized tensors keep their dtype; the load casts the rest
        state = load_tensors(adapter.checkpoint, prefixes, dtype=load_dtype, exclude=exclude + head_prefixes, shard=shard)
        if convert is not None:  # with `shard`, over this rank's tensors only
            state = convert(state)
        load_module_weights(model, state, what=f"{adapter.checkpoint} language model")
        if getattr(adapter.config, "tie_word_embeddings", False):
            lm_head.weight = model.embed_tokens.weight
        else:
            head = load_tensors(adapter.checkpoint, head_prefixes, dtype=load_dtype)
            load_module_weights(lm_head, head, what=f"{adapter.checkpoint} lm_head")
        decoder = cls(adapter, model, lm_head, device, dtype)
        decoder.key_prefixes, decoder.key_excluded = prefixes, exclude + head_prefixes
        decoder.head_prefixes = head_prefixes
        if plan is not None:
            decoder.quantization = f"{plan.description}: {quantized} quantized layers (linears, fused experts)"
        return decoder

    def weight_bytes(self) -> int:
        """Bytes the language model's weights hold on its device (quantized layers as stored)."""
        return weight_bytes(self)

    def embed(self, input_ids: torch.Tensor, visual_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Text embeddings with visual rows written over the placeholder tokens, row-major over the batch."""
        embeds = self.model.embed_tokens(input_ids)
        if visual_embeds is not None and visual_embeds.numel():
            mask = torch.isin(input_ids, self.placeholder_ids).unsqueeze(-1).expand_as(embeds)
            embeds = embeds.masked_scatter(mask, visual_embeds.to(embeds.dtype))
        return embeds

    def prefill(self, input_ids: torch.Tensor, visual_embeds: torch.Tensor | None, position_ids: torch.Tensor,
                attention_mask: dict, cache) -> torch.Tensor:
        """Final hidden states of a prefill: `input_ids` embedded with `visual_embeds` scattered at their
        placeholders, then `forward` (families whose visual rows do more override this: Qwen3-VL's deepstack)."""
        return self(self.embed(input_ids, visual_embeds), position_ids, attention_mask, cache)

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, attention_mask: dict, cache) -> torch.Tensor:
        """Final hidden states `(B, L, hidden)`; `attention_mask` maps each layer type to its mask (4-D
        additive for attention), which transformers passes to the layers as-is."""
        out = self.model(inputs_embeds=inputs_embeds, position_ids=position_ids, attention_mask=attention_mask,
                         past_key_values=cache, use_cache=True)
        return out.last_hidden_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
