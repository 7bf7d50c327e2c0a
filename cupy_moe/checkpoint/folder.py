"""An open checkpoint folder: config.json, quantization config, naming scheme, tensor index; its layers, experts
and modules, all from configs and safetensors headers (no tensor data)."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .naming import NamingScheme, config_value, detect_scheme
from .quant_config import Quant, find_quant_config
from .safetensors import TensorIndex, read_json

__all__ = ["Checkpoint", "Module", "MAX_EXPERTS", "MAX_LAYERS"]

# Limits on the counts config.json or a tensor name may claim: well above any real model (DeepSeek-V3 has 256
# routed experts and 61 layers), low enough that a corrupt value is refused instead of looped over.
MAX_EXPERTS = 4096
MAX_LAYERS = 100_000


class Checkpoint:
    """An open checkpoint folder: configs, naming scheme, tensor index and lazily opened files."""

    def __init__(self, path, scheme: NamingScheme | None = None, lenient: bool = False):
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path: expected a checkpoint folder (str or os.PathLike), got {path!r}")
        folder = Path(path)
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder}: checkpoint folder not found{_hint(path, folder)}")
        self.folder = folder
        cfg_path = folder / "config.json"
        if not cfg_path.exists() and not any(folder.glob("*.safetensors*")):
            raise FileNotFoundError(f"{folder}: not a checkpoint folder: expected config.json and *.safetensors "
                                    f"files, found neither")
        self.config = read_json(cfg_path) if cfg_path.exists() else None
        if self.config is not None and not isinstance(self.config, dict):
            raise ValueError(f"{cfg_path}: expected a JSON object, got {type(self.config).__name__}")
        self.quant = find_quant_config(folder, self.config)
        self.index = TensorIndex(folder, lenient)
        self._experts = None  # {layer: {expert: {proj}}}, built on first use
        self._layers = None  # {layer: first tensor name of that layer}, built on first use
        try:
            self.scheme = scheme if scheme is not None else detect_scheme(self.config, self.index.names(), self.folder)
            if not isinstance(self.scheme, NamingScheme):
                raise TypeError(f"scheme: expected a NamingScheme, got {type(self.scheme).__name__}")
        except BaseException:
            self.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self.index.close()

    # ----------------------------------------------------------- family and sizes
    def cfg(self, key: str, default=None):
        return (self.config or {}).get(key, default)

    def cfg_size(self, key: str) -> tuple:
        """(value, key found) of a size key, its CONFIG_SYNONYMS spellings included; (None, None) if absent or null.
        A value that is not an int (NaN, a string, a bool) raises TypeError; the range is for the caller to check."""
        value, found = config_value(self.config, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"config.json {found}: expected a positive int, got {value!r}")
        return value, found

    def shared_config(self) -> tuple[int, str] | None:
        """(value, key) of the config.json key sizing the shared expert: Qwen2-MoE shared_expert_intermediate_size
        (I_s) or DeepSeek n_shared_experts (experts merged into one, I_s = n * I); None when config.json has
        neither. A value that is not a positive int raises (a layer without shared experts leaves the key out)."""
        for key in ("shared_expert_intermediate_size", "n_shared_experts"):
            value = self.cfg_size(key)[0]
            if value is None:
                continue
            if value < 1:
                raise ValueError(f"config.json {key}={value}: expected a positive int (a model without shared "
                                 f"experts leaves the key out or null)")
            return value, key
        return None

    def num_layers(self) -> int | None:
        """config.json num_hidden_layers (None when absent or not an int); ValueError outside 1..MAX_LAYERS."""
        n = self.cfg("num_hidden_layers")
        if not isinstance(n, int):
            return None
        if not 1 <= n <= MAX_LAYERS:
            raise ValueError(f"config.json num_hidden_layers={n}: expected 1 to {MAX_LAYERS} layers")
        return int(n)

    def layers_found(self) -> dict[int, str]:
        """layer index -> the first tensor name under that layer's block prefix."""
        if self._layers is None:
            rx = re.compile(re.escape(self.scheme.block).replace(r"\{layer\}", r"(\d+)") + r"\.")
            self._layers = {}
            for name in self.index.names():
                if m := rx.match(name):
                    self._layers.setdefault(int(m.group(1)), name)
        return self._layers

    def check_layer(self, layer, arg: str = "layer") -> None:
        """TypeError/ValueError, naming the argument `arg`, unless `layer` is the index of an MoE layer."""
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise TypeError(f"{arg}: expected an int, got {type(layer).__name__}")
        n = self.num_layers()
        if n is not None:
            if not 0 <= layer < n:
                raise ValueError(f"{arg}: layer {layer} does not exist: config.json has num_hidden_layers={n} "
                                 f"(layers 0..{n - 1})")
        else:
            prefix = self.scheme.block.format(layer=layer) + "."
            if layer < 0 or not any(name.startswith(prefix) for name in self.index.names()):
                raise ValueError(f"{arg}: layer {layer} does not exist: no tensor starts with '{prefix}' "
                                 f"(in {self.index.source})")
        reason = self.dense_reason(int(layer))
        if reason:
            raise ValueError(f"{arg}: layer {layer} is dense ({reason}); it has no experts to load")

    def dense_reason(self, layer: int) -> str | None:
        """Why config.json makes `layer` a dense MLP layer, or None when it is an MoE layer."""
        k = self.cfg("first_k_dense_replace")
        if isinstance(k, int) and layer < k:
            return f"first_k_dense_replace={k}"
        freq = self.cfg("moe_layer_freq")
        if isinstance(freq, int) and freq > 1 and layer % freq:
            return f"moe_layer_freq={freq}"
        only = self.cfg("mlp_only_layers")
        if isinstance(only, list) and layer in only:
            return f"mlp_only_layers={only}"
        step = self.cfg("decoder_sparse_step")
        if isinstance(step, int) and step > 1 and (layer + 1) % step:
            return f"decoder_sparse_step={step}"
        return None

    def moe_layers(self) -> list[int]:
        n = self.num_layers()
        if n is None:
            found = self.layers_found()
            n = max(found) + 1 if found else 0
            if n > MAX_LAYERS:
                raise ValueError(f"tensor '{found[n - 1]}' (in {self.index.source}) is of layer {n - 1}, beyond the "
                                 f"limit of {MAX_LAYERS} layers (config.json has no num_hidden_layers)")
        return [i for i in range(n) if self.dense_reason(i) is None]

    def experts_found(self, layer: int) -> dict[int, set]:
        """expert index -> set of proj names present among the tensors of `layer`."""
        if self._experts is None:  # one pass over every name, for all layers
            self._experts = {}
            for m in self.scheme.expert_regex().finditer("\n".join(self.index.names())):
                per_layer = self._experts.setdefault(int(m["layer"]), {})
                per_layer.setdefault(int(m["expert"]), set()).add(m["proj"])
        return {e: set(p) for e, p in self._experts.get(layer, {}).items()}

    def num_experts(self, layer: int) -> int:
        """E from config.json (checked against the tensors), else from the tensors."""
        found = self.experts_found(layer)
        e, key = self.cfg_size(self.scheme.num_experts_key)
        if e is not None:
            if not 1 <= e <= MAX_EXPERTS:
                raise ValueError(f"config.json {key}={e}: expected 1 to {MAX_EXPERTS} experts")
            extra = sorted(i for i in found if i >= e)
            if extra:
                mod = self.scheme.expert_module(layer, extra[0], self.scheme.gate_proj)
                raise ValueError(f"config.json {key}={e}, but the checkpoint has tensors of expert {extra[0]} "
                                 f"(e.g. '{mod}.*' in {self.index.source})")
            return e
        if not found:
            raise ValueError(f"layer {layer}: no routed expert tensors named like "
                             f"'{self.scheme.expert_module(layer, 0, self.scheme.gate_proj)}.*' "
                             f"(in {self.index.source})")
        last = max(found)
        if last >= MAX_EXPERTS:
            mod = self.scheme.expert_module(layer, last, next(iter(found[last])))
            raise ValueError(f"tensor '{mod}.*' (in {self.index.source}) is of expert {last}, beyond the limit of "
                             f"{MAX_EXPERTS} experts")
        return last + 1

    # ----------------------------------------------------------- modules
    def tensor(self, name: str):
        return self.index.get(name)

    def module(self, name: str, layer: int) -> "Module":
        """How module `name` is stored: quantized (GPTQ, AWQ, compressed-tensors) or dense, after the config and
        tensors agree."""
        quant, rule = self.quant.module(name, self.scheme.block.format(layer=layer))
        qname = self.quant.base.storage.tensor(name, "qweight")
        qweight = self.tensor(qname)
        weight = self.tensor(name + ".weight")
        if qweight is not None:
            if quant is None:
                raise ValueError(f"{qweight[0].label}: tensor '{qname}' exists, but {rule} says module "
                                 f"'{name}' is not quantized (the config contradicts the tensors)")
            return Module(name, quant, qweight, rule)
        if weight is not None:
            if quant is not None and rule is not None:
                raise ValueError(f"{weight[0].label}: module '{name}' is stored dense ('{name}.weight'), but {rule} "
                                 f"quantizes it ({quant.describe()}): the config contradicts the tensors")
            return Module(name, None, weight, rule or "only '.weight' in the checkpoint")
        raise ValueError(f"module '{name}': neither '{qname}' (quantized) nor '{name}.weight' (dense) is in "
                         f"the checkpoint ({self.index.source})")


def _hint(path, folder: Path) -> str:
    """What a user who passed the wrong thing probably meant."""
    if folder.is_file():
        return f" ('{folder}' is a file: pass the folder that holds it, '{folder.parent}')"
    text = str(path)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", text) and not text.startswith("."):
        return (f" ('{text}' looks like a Hugging Face repository id: download it first, e.g. "
                f"`hf download {text} --local-dir DIR` or `huggingface-cli download {text} --local-dir DIR`, "
                f"then pass DIR)")
    return ""


@dataclass
class Module:
    name: str
    quant: Quant | None  # None: dense .weight
    main: tuple  # (file, info) of the packed weight (.qweight, .weight_packed) or .weight
    rule: str | None = None  # why it is dense / which dynamic rule quantized it

    @property
    def where(self) -> str:
        return self.main[0].label
