"""Load the MoE layers of GPTQ, AWQ GEMM and compressed-tensors checkpoints from safetensors, one layer at a time.

A checkpoint is a folder with `config.json` and/or `quantize_config.json` and either `model.safetensors` or
shards listed in `model.safetensors.index.json` (see docs/gptq_layout.md and docs/checkpoints.md).

    load_stacked(path, layer, "w13")   -> StackedGptqWeight [E, H*bits/32, 2I] (gate columns first, then up)
    load_stacked(path, layer, "w2")    -> StackedGptqWeight [E, I*bits/32, H]
    load_layer_weights(path, layer)    -> MoELayerWeights (w13, w2, router, shared experts, routing settings)
    load_model_weights(path)           -> {layer: MoELayerWeights} for every MoE layer, with progress on a tty
    inspect_checkpoint(path)           -> dict, from configs and safetensors headers only

`cupy_moe.load_moe_layer` / `cupy_moe.load_moe_model` wrap the two loaders and return callable layers.

Shape letters: E experts, H hidden size, I expert intermediate size, K in-features, N out-features,
G group size, R = ceil(K/G) groups.

Modules, one per concern: `safetensors` (headers, tensors, the shard index), `quant_config` (GPTQ, AWQ and
compressed-tensors configs, per-module overrides, storage formats), `naming` (every tensor naming of each family,
family detection), `routing` (routing settings and each family's transformers defaults), `folder` (an open
checkpoint: configs, layers, modules), `loading` (the loading plan and the loaders), `inspect`.
"""
from .inspect import inspect_checkpoint
from .loading import (MoELayerWeights, SharedExpertWeights, load_layer_weights, load_model_weights,
                      load_stacked)
from .naming import NAMINGS, SCHEMES, NamingScheme

__all__ = [
    "NamingScheme", "NAMINGS", "SCHEMES", "MoELayerWeights", "SharedExpertWeights",
    "load_stacked", "load_layer_weights", "load_model_weights", "inspect_checkpoint",
]
