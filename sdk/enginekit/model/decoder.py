"""The decoder of every architecture (``model/architectures.py``) in plain torch, over a paged KV cache, built from
``layers/``; the config's options (biases, q/k norms, rope type) choose its pieces. Under tensor parallelism
(``comm``: this rank's process group) the projections, the embedding and the LM head are the parallel layers, and
each rank holds its share of the heads and intermediate features."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import msgspec
import torch
from torch import nn

from enginekit.model.config import ModelConfig
from enginekit.model.kernels.native import LayerOps, native_layer_ops
from enginekit.model.kernels.quant_gemm import PATHS, NativeQuantGemm
from enginekit.model.kernels.triton_path import TritonOps
from enginekit.model.layers.attention import Attention
from enginekit.model.layers.embedding import Embedding
from enginekit.model.layers.linear import Linear, LinearKernel
from enginekit.model.layers.mlp import MLP
from enginekit.model.layers.norm import RMSNorm
from enginekit.model.layers.paged_attention import AttentionMetadata
from enginekit.model.layers.parallel_linear import Collectives
from enginekit.model.layers.quant_linear import QuantizedWeight
from enginekit.model.layers.rotary import RotaryEmbedding
from enginekit.model.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding


def layer_ops(
    config: ModelConfig, device: torch.device, dtype: torch.dtype, tensor_parallel_size: int = 1
) -> LayerOps | None:
    """The native layer operations (RMS norm, rotary embedding with the cache write, attention over the
    paged cache in place; ``enginekit.model.kernels.native``) for this model on this device, or ``None``: the model's
    torch code, on other devices and dtypes, where the library is not usable, or for attention shapes past its
    limits."""
    if device.type != "cpu" or dtype != torch.float32:
        return None
    ops = native_layer_ops()
    heads, kv_heads = config.num_heads // tensor_parallel_size, config.num_kv_heads // tensor_parallel_size
    if ops is None or not ops.supports(heads, kv_heads, config.head_dim):
        return None
    return ops


class DecoderLayer(nn.Module):
    triton: TritonOps | None = None  # see Decoder.use_triton

    def __init__(self, config: ModelConfig, layer: int, comm: Collectives | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, config.window_of(layer), comm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, comm)
        self.fused: Callable[..., torch.Tensor] | None = None  # see fuse
        # sandwich norms (Gemma): post_attention_layernorm norms the attention's output, these the MLP's input
        # and output
        self.sandwich = config.sandwich_norms
        if config.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def fuse(self, ops: LayerOps | None) -> bool:
        """Run this layer in one native call (``LayerOps.stored_layer``) at the steps that allow it, if ``ops`` is
        given and the layer is the plain one with its four projections kept as stored, each one weight with a
        native kernel; returns whether it does."""
        attn, mlp = self.self_attn, self.mlp
        weights = [
            _stored(attn.qkv_proj),
            _stored(attn.o_proj),
            _stored(mlp.gate_up_proj),
            _stored(mlp.down_proj),
        ]
        plain = not self.sandwich and attn.q_norm is None and not mlp.gelu_tanh
        if ops is None or not plain or None in weights or attn.o_proj.bias is not None:
            self.fused = None
            return False
        (qkv, o, gate_up, down) = (weight.parts[0] for weight in weights if weight is not None)
        invariant = any(weight.batch_invariant for weight in weights if weight is not None)
        static = {
            "norm1": self.input_layernorm.weight,
            "norm2": self.post_attention_layernorm.weight,
            "eps": self.input_layernorm.eps,
            "w_qkv": qkv.blocks,
            "t_qkv": int(qkv.quant_type),
            "b_qkv": attn.qkv_proj.bias,
            "w_o": o.blocks,
            "t_o": int(o.quant_type),
            "w_gate_up": gate_up.blocks,
            "t_gate_up": int(gate_up.quant_type),
            "w_down": down.blocks,
            "t_down": int(down.quant_type),
            "inter": mlp.intermediate_size,
            "heads": attn.num_heads,
            "scale": attn.scale,
            "window": attn.window,
            "softcap": attn.softcap or 0.0,
            "path": PATHS["invariant" if invariant else "auto"],
        }
        layer = ops.stored_layer

        def fused(hidden, rotary, kv_cache, meta):
            layer(
                hidden,
                cos=rotary[0],
                signed_sin=rotary[1],
                slots=meta.slot_mapping,
                kv_cache=kv_cache,
                block_tables=meta.query_tables,
                table_rows=meta.query_table_rows,
                context_lens=meta.query_lens,
                block_size=meta.block_size,
                **static,
            )
            return hidden

        self.fused = fused
        return True

    def forward(self, hidden, rotary, kv_cache, meta):
        if self.triton is not None and meta.kernel_inputs is not None:  # CUDA: the Triton path
            return self.forward_triton(self.triton, hidden, rotary, kv_cache, meta)
        if self.sandwich:
            attended = self.self_attn(self.input_layernorm(hidden), rotary, kv_cache, meta)
            hidden = hidden + self.post_attention_layernorm(attended)
            return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rotary, kv_cache, meta)
        return hidden.add_(self.mlp(self.post_attention_layernorm(hidden)))

    def forward_triton(self, ops: TritonOps, hidden, rotary, kv_cache, meta):
        """``forward`` with the Triton kernels: each norm fused with the residual add before it (Gemma's sandwich
        norms: the output's norm, the add and the next norm in one launch), the rotation with the cache write,
        attention over the cache in place, the gated activation (see docs/architecture.md)."""
        eps = self.input_layernorm.eps
        attended = self.self_attn(
            ops.rms_norm(hidden, self.input_layernorm.weight, eps), rotary, kv_cache, meta
        )
        if self.sandwich:
            hidden, x = ops.residual_norm(
                attended,
                hidden,
                eps,
                x_weight=self.post_attention_layernorm.weight,
                weight=self.pre_feedforward_layernorm.weight,
            )
            out = self.mlp.forward_triton(x, ops)
            return ops.residual_norm(out, hidden, eps, x_weight=self.post_feedforward_layernorm.weight)[0]
        hidden, x = ops.residual_norm(attended, hidden, eps, weight=self.post_attention_layernorm.weight)
        return hidden.add_(self.mlp.forward_triton(x, ops))

    __call__ = forward  # no nn.Module hook dispatch: see docs/architecture.md, "The decode step's Python"


class Decoder(nn.Module):
    """Decoder over a flat batch of new tokens; returns logits only for the rows asked for (under tensor
    parallelism: on rank 0, and an empty tensor on the others)."""

    def __init__(self, config: ModelConfig, comm: Collectives | None = None) -> None:
        super().__init__()
        self.config = config
        self.comm = comm
        self.tensor_parallel_size = comm.size if comm is not None else 1
        self.embed_tokens: Embedding | VocabParallelEmbedding = (
            Embedding(config.vocab_size, config.hidden_size)
            if comm is None
            else VocabParallelEmbedding(config.vocab_size, config.hidden_size, comm=comm)
        )
        self.layers = nn.ModuleList(DecoderLayer(config, i, comm) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            Linear(config.hidden_size, config.vocab_size, bias=False)
            if comm is None
            else ParallelLMHead(config.hidden_size, config.vocab_size, comm=comm)
        )
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(config)
        # Gemma 3: the sliding layers rotate with their own base and no scaling (same rows, other tables)
        self.rotary_local = (
            RotaryEmbedding(
                msgspec.structs.replace(
                    config, rope_theta=config.rope_local_theta, rope_type="default", rope_parameters={}
                )
            )
            if config.rope_local_theta
            else None
        )
        # per layer, whether it rotates with rotary_local (fixed at build: the step loop only reads it)
        self.local_rope = tuple(
            bool(config.rope_local_theta and config.window_of(i)) for i in range(config.num_layers)
        )
        self.layer_ops: LayerOps | None = None  # see use_layer_ops
        self.fused_layers = 0  # layers run in one native call each (DecoderLayer.fuse)
        self.triton: TritonOps | None = None  # see use_triton
        self.lora_active = False  # this step's rows use LoRA adapters, which the fused layers do not run
        # a row's arithmetic does not depend on the step's other rows (load_model's batch_invariant): every query
        # attends natively, whatever its chunk's length (the runner reads this), and the kernels are the invariant ones
        self.batch_invariant = False

    def _layers(self) -> Sequence[DecoderLayer]:
        return cast("Sequence[DecoderLayer]", self.layers)

    def use_linear_kernel(self, kernel: LinearKernel) -> int:
        """Run every projection (and the LM head) with ``kernel(x, weight, bias)``; returns how many."""
        linears = [module for module in self.modules() if isinstance(module, Linear)]
        for module in linears:
            module.kernel = kernel
        return len(linears)

    def use_layer_ops(self, ops: LayerOps | None) -> int:
        """Run the norms, attention and MLP activations with the native ``ops`` (``None``: the torch code); returns how many
        modules use them."""
        modules = [module for module in self.modules() if isinstance(module, (RMSNorm, Attention, MLP))]
        for module in modules:
            module.ops = ops
            if isinstance(module, MLP):  # torch's GeLU rounds a row's last values by the batch's size
                module.gelu_ops = ops if self.batch_invariant else None
        self.layer_ops = ops
        self.fused_layers = sum(layer.fuse(ops) for layer in self._layers())
        return len(modules) if ops is not None else 0

    def use_triton(self, ops: TritonOps | None) -> None:
        """Run the layers with the Triton kernels ``ops`` (``triton_path.triton_ops``: CUDA only) at every step
        whose metadata carries their inputs (``AttentionMetadata.kernel_inputs``: the runner sets them while
        ``self.triton`` is set); ``None``: the torch code."""
        self.triton = ops
        for layer in self._layers():
            layer.triton = layer.self_attn.triton = ops

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        input_embeds: list[tuple[int, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for row, embeds in input_embeds or ():
            hidden[row : row + embeds.shape[0]] = embeds.to(hidden.dtype)
        if self.config.scale_embeddings:  # by sqrt(hidden) rounded to the model's dtype, as transformers does
            hidden = hidden * torch.tensor(self.config.hidden_size**0.5, dtype=hidden.dtype)
        rotary = self.rotary(positions, hidden.dtype)
        local = self.rotary_local(positions, hidden.dtype) if self.rotary_local is not None else rotary
        # a step whose every query attends natively runs the fused layers in one call each (they update hidden
        # in place: it is this step's own tensor)
        fused = (
            self.fused_layers
            and not self.lora_active
            and meta.query_lens is not None
            and all(c.native for c in meta.prefills)
        )
        if fused:
            hidden = hidden.contiguous()
        for layer, kv_cache, slides in zip(self._layers(), kv_caches, self.local_rope):
            run = (layer.fused or layer) if fused else layer
            hidden = run(hidden, local if slides else rotary, kv_cache, meta)
        hidden = self.norm(hidden[logits_indices])
        logits = self.lm_head(hidden).float()
        if cap := self.config.final_logit_softcap:
            logits = torch.tanh(logits / cap) * cap
        return logits


def _stored(linear: Linear) -> QuantizedWeight | None:
    """The linear layer's stored weight if the fused layer can run it: one weight, of a type with a native kernel."""
    weight = linear.stored
    if weight is None or len(weight.parts) != 1 or weight.exact_top:
        return None
    if not isinstance(weight.gemm, NativeQuantGemm) or not weight.gemm.supports(weight.parts[0].quant_type):
        return None
    return weight
