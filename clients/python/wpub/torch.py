"""Torch-native helpers (optional: needs torch; `import wpub` alone never imports it).

    import wpub, wpub.torch
    pub = wpub.Publisher.from_env()
    # an HF-named model (FSDP / plain HF): every parameter published under its own name
    report = wpub.torch.publish(pub, step, model)
    # a state dict through the trainer's converter: (name, tensor) -> [(hf_name, tensor), ...]
    report = wpub.torch.publish(pub, step, state_dict, converter=my_converter)
    # a Megatron model: per-expert parameters renamed as the policy reads them
    report = pub.publish(step, wpub.torch.megatron_batches(model, megatron_to_hf,
                                                           expert_offset=ep_rank * local))

conversion_batches() groups converted tensors into conversion batches that keep each gate/up
pair together (the daemon quantizes a pair with one shared amax, within one batch). A module
with transformers v5 fused experts (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`
[E, H, I]) is published per expert under the split names the checkpoints and engines use
(`experts.{e}.gate_proj.weight` = gate_up_proj[e, :I], `up_proj` = gate_up_proj[e, I:],
`down_proj` = down_proj[e]): views of the fused tensors, no copy, the same bytes as a
split-form model -- so quantized exactly as one. A state dict holding them needs
fused_experts_converter(hidden_size, moe_intermediate_size): its names alone do not tell the
layout.
LocalGather (wpub/_local_gather.py) hands the shards of several ranks of one node to the
publishing rank over the trainer's own torch.distributed.
"""

import re
from typing import Any, Callable, Iterable, Iterator, List, Mapping, Optional, Tuple

import torch

from ._local_gather import LocalGather, hf_tp_dim
from .tensors import TensorError

__all__ = ["named_tensors", "clean_name", "conversion_batches", "megatron_batches",
           "megatron_expert_name", "fused_experts_converter", "publish", "publish_async",
           "LocalGather", "hf_tp_dim"]

Converter = Callable[[str, Any], Iterable[Tuple[str, Any]]]

# Wrapper modules that torch inserts into parameter names (FSDP, activation checkpointing,
# torch.compile) and DDP's leading "module.": not part of the model's own names.
_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
_GATE_UP = re.compile(r"(.+)\.(gate_proj|up_proj|w1|w3)\.weight$")
_GATE = ("gate_proj", "w1")


def clean_name(name: str) -> str:
    """`name` without torch's wrapper segments (_fsdp_wrapped_module., _checkpoint_wrapped_module.,
    _orig_mod.) and leading DDP "module." prefixes."""
    for seg in _WRAPPER_SEGMENTS:
        name = name.replace(seg, "")
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def named_tensors(source, clean: bool = True) -> Iterator[Tuple[str, Any]]:
    """(name, tensor) pairs of a torch.nn.Module (its named_parameters()), a state dict (any
    Mapping) or an iterable of pairs; names cleaned by clean_name() unless clean=False."""
    if isinstance(source, torch.nn.Module):
        items: Iterable = source.named_parameters()
    elif isinstance(source, Mapping):
        items = source.items()
    else:
        items = source
    for name, t in items:
        yield (clean_name(name) if clean else name), t


_FUSED_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


def _split_fused(name: str, t, inter: int, hidden: int) -> List[Tuple[str, Any]]:
    """The per-expert split-form tensors of one transformers v5 fused expert parameter (views,
    no copy); TensorError naming it when its shape is not the v5 layout for (inter, hidden)."""
    m = _FUSED_EXPERTS.match(name)
    prefix, kind = m.group(1), m.group(2)
    want = (2 * inter, hidden) if kind == "gate_up_proj" else (hidden, inter)
    if t.dim() != 3 or tuple(t.shape[1:]) != want:
        raise TensorError(
            f"{name}: shape {tuple(t.shape)} is not transformers v5's fused layout "
            f"[experts, {want[0]}, {want[1]}] for intermediate {inter} and hidden {hidden} (a "
            "transposed or interleaved layout, e.g. gpt-oss, needs a converter of its own)")
    out = []
    for e in range(t.shape[0]):
        if kind == "gate_up_proj":
            out.append((f"{prefix}.{e}.gate_proj.weight", t[e, :inter]))
            out.append((f"{prefix}.{e}.up_proj.weight", t[e, inter:]))
        else:
            out.append((f"{prefix}.{e}.down_proj.weight", t[e]))
    return out


def fused_experts_converter(hidden_size: int, moe_intermediate_size: int) -> Converter:
    """A converter for state dicts (or (name, tensor) pairs) of transformers v5 models with
    fused experts: every `...experts.gate_up_proj` [E, 2I, H] and `...experts.down_proj`
    [E, H, I] becomes the per-expert split-form tensors (views), every other tensor passes
    as it is. A fused tensor of another shape is a TensorError naming it -- but when
    hidden_size == 2 x moe_intermediate_size a transposed layout has the same shape: use it
    only for models that keep transformers v5's layout (Qwen3-MoE, Mixtral, DeepSeek-V3,
    OLMoE, ...; not gpt-oss)."""
    def convert(name: str, t) -> List[Tuple[str, Any]]:
        if _FUSED_EXPERTS.match(name) and isinstance(t, torch.Tensor):
            return _split_fused(name, t, moe_intermediate_size, hidden_size)
        return [(name, t)]
    return convert


def _fused_layouts(source) -> dict:
    """For a module: {parameter name: (intermediate, hidden)} of its transformers v5 fused
    expert parameters, read from their owning modules (intermediate_dim, hidden_dim)."""
    out = {}
    if not isinstance(source, torch.nn.Module):
        return out
    for mod_name, mod in source.named_modules():
        inter, hidden = getattr(mod, "intermediate_dim", None), getattr(mod, "hidden_dim", None)
        for kind in ("gate_up_proj", "down_proj"):
            p = getattr(mod, kind, None)
            if isinstance(p, torch.nn.Parameter) and isinstance(inter, int) and \
                    isinstance(hidden, int):
                out[clean_name(f"{mod_name}.{kind}" if mod_name else kind)] = (inter, hidden)
    return out


def _pair_key(hf_name: str) -> Optional[Tuple[str, bool]]:
    """(base, is_gate) for a gate/up half (the daemon's suffixes), else None."""
    m = _GATE_UP.match(hf_name)
    return (m.group(1), m.group(2) in _GATE) if m else None


def _prepare(name: str, t, dtype) -> Any:
    if isinstance(t, torch.Tensor):
        t = t.detach()
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
    return t


def conversion_batches(source, converter: Optional[Converter] = None, *,
                       dtype: Optional[torch.dtype] = None, clean: bool = True,
                       rename: Optional[Callable[[str], str]] = None
                       ) -> Iterator[Tuple[str, List[Tuple[str, Any]]]]:
    """Conversion batches for Publisher.publish from a module, a state dict or (name, tensor)
    pairs, converted lazily (one source tensor at a time, under torch.no_grad()).

    converter(name, tensor) returns the HF tensors of one source tensor as (hf_name, tensor)
    pairs (an empty list drops it); None publishes every tensor under its own (cleaned) name,
    for models that already have HF names. dtype: cast floating-point tensors (e.g.
    torch.bfloat16 for fp32 master weights; a copy, kept alive until the report). rename:
    applied to each source name before the converter (see megatron_expert_name).

    A batch is named after its first source tensor and holds that tensor's outputs; while a
    gate (.gate_proj.weight / .w1.weight) or up half waits for its partner, the following
    source tensors join the same batch, so a pair that comes from two parameters (HF models
    hold gate_proj and up_proj apart) is published with one shared amax."""
    pending_name: Optional[str] = None
    pending: List[Tuple[str, Any]] = []
    waiting = {}  # base -> is_gate of the half seen without its partner
    fused = _fused_layouts(source) if converter is None else {}
    with torch.no_grad():
        for name, t in named_tensors(source, clean):
            if rename is not None:
                name = rename(name)
            if converter is not None:
                outs = converter(name, t)
            elif name in fused:
                outs = _split_fused(name, t, *fused[name])
            elif _FUSED_EXPERTS.match(name) and isinstance(t, torch.Tensor) and t.dim() == 3:
                raise TensorError(
                    f"{name}: a fused expert tensor without its module (a state dict): pass "
                    "converter=wpub.torch.fused_experts_converter(hidden_size, "
                    "moe_intermediate_size) so that it is published per expert and quantized")
            else:
                outs = [(name, t)]
            if outs is None:
                raise TensorError(f"converter returned None for {name} (return a list of "
                                  "(hf_name, tensor) pairs; [] drops the tensor)")
            for entry in outs:
                # Checked, not unpacked: a two-row tensor would unpack as a pair.
                if not isinstance(entry, (tuple, list)) or len(entry) != 2 or \
                        not isinstance(entry[0], str):
                    raise TensorError(f"converter output for {name}: expected (hf_name, tensor) "
                                      f"pairs, got {type(entry).__name__}")
                hf_name, out = entry
                pending.append((hf_name, _prepare(hf_name, out, dtype)))
                key = _pair_key(hf_name)
                if key is not None:
                    base, is_gate = key
                    if waiting.get(base) == (not is_gate):
                        del waiting[base]
                    else:
                        waiting[base] = is_gate
            if pending_name is None and pending:
                pending_name = name
            if pending and not waiting:
                yield pending_name, pending
                pending_name, pending = None, []
    if pending:  # a half without its partner: the daemon names it
        yield pending_name, pending


_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_GROUPED_EXPERT = re.compile(r"^(.*\.mlp\.experts\.linear_fc[12]\.weight)(\d+)$")


def megatron_expert_name(name: str, expert_offset: int = 0) -> str:
    """A Megatron parameter name as the policy reads it, with the local expert index made
    global (+ expert_offset, e.g. ep_rank * num_local_experts): SequentialMLP's
    `...mlp.experts.local_experts.E.linear_fc1.weight` and TEGroupedMLP's
    `...mlp.experts.linear_fc1.weightE` both become `...mlp.experts.linear_fc1.weight<E+off>`.
    Other names are returned unchanged."""
    m = _LOCAL_EXPERT.match(name)
    if m:
        return f"{m.group(1)}{m.group(3)}.weight{int(m.group(2)) + expert_offset}"
    m = _GROUPED_EXPERT.match(name)
    if m and expert_offset:
        return f"{m.group(1)}{int(m.group(2)) + expert_offset}"
    return name


def megatron_batches(model, converter: Converter, *, expert_offset: int = 0,
                     dtype: Optional[torch.dtype] = None
                     ) -> Iterator[Tuple[str, List[Tuple[str, Any]]]]:
    """Conversion batches of a Megatron model (module or state dict): one batch per Megatron
    parameter, its name canonicalized by megatron_expert_name (per-expert parameters, global
    expert index) before converter(megatron_name, tensor) -> [(hf_name, tensor), ...]. A fused
    fc1 yields its gate and up in its own batch, as the policy expects."""
    return conversion_batches(model, converter, dtype=dtype,
                              rename=lambda n: megatron_expert_name(n, expert_offset))


def publish(pub, version: int, source, converter: Optional[Converter] = None, *,
            dtype: Optional[torch.dtype] = None, **publish_kwargs):
    """pub.publish(version, conversion_batches(source, converter, dtype=dtype), ...)."""
    return pub.publish(version, conversion_batches(source, converter, dtype=dtype),
                       **publish_kwargs)


def publish_async(pub, version: int, source, converter: Optional[Converter] = None, *,
                  dtype: Optional[torch.dtype] = None, **publish_kwargs):
    """pub.publish_async(version, conversion_batches(...), ...): returns a PublicationFuture.
    The conversion runs in the background thread: do not change the module's weights before
    future.sent (host tensors) / future.released (CUDA tensors) is set."""
    return pub.publish_async(version, conversion_batches(source, converter, dtype=dtype),
                             **publish_kwargs)
